"""Exports as vLLM reads them. compressed-tensors `ignore` for unquantized routed experts: vLLM asks about a
fused-MoE layer by its per-expert projections (compressed_tensors_moe.py, get_moe_method: `<layer>.0.gate_proj`, ...) and matches an
entry only as an exact name or a `re:` pattern (compressed_tensors/utils.py, check_equal_or_regex_match)."""
import json
import re

import pytest
import torch

import torchforge
from tests import models


def _vllm_ignores(name: str, ignore: list[str]) -> bool:
    return any(name == p or (p.startswith("re:") and re.match(p[3:], name)) for p in ignore)


@pytest.mark.parametrize("arch, moe", [("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe")])
@pytest.mark.parametrize("scheme", ["w4a16-rtn", "nvfp4"])
def test_unquantized_experts_are_ignored_by_vllms_rule(arch, moe, scheme, tmp_path):
    recipe = {"scheme": "w4a16-rtn", "group_size": 32} if scheme == "w4a16-rtn" else \
        {"scheme": "nvfp4", "group_size": 16, "export_format": "compressed-tensors"}
    model = torchforge.quantize(models.build(arch, dtype=torch.bfloat16), {**recipe, "quantize_experts": False})
    torchforge.save_quantized(model, str(tmp_path), format="compressed-tensors")
    ignore = json.load(open(tmp_path / "config.json"))["quantization_config"]["ignore"]
    layer = f"model.layers.1.{moe}.experts"
    for e in (0, 3):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert _vllm_ignores(f"{layer}.{e}.{proj}", ignore), (proj, ignore)
    assert layer in ignore  # transformers matches the fused module's own name
    assert not _vllm_ignores("model.layers.1.self_attn.q_proj", ignore)  # the quantized layers are not
    reloaded = torchforge.load_quantized(str(tmp_path))
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_exports_vllm_would_misread_or_run_slowly(tmp_path, caplog):
    """Asymmetric MoE as vllm-gptq: vLLM's GPTQ MoE path (MoeWNA16 with sym=True) drops the zero points. Group sizes
    outside Marlin's 32 / 64 / 128 and asymmetric GPTQ run only on vLLM's float16 kernels: a warning."""
    import logging

    asym = {"scheme": "w4a16-rtn", "group_size": 32, "symmetric": False}
    moe = torchforge.quantize(models.build("qwen3_moe", dtype=torch.bfloat16), asym)
    with pytest.raises(ValueError, match="vLLM's GPTQ path for MoE experts assumes symmetric codes"):
        torchforge.save_quantized(moe, str(tmp_path / "g"), format="vllm-gptq")
    assert not (tmp_path / "g").exists()
    torchforge.save_quantized(moe, str(tmp_path / "ct"), format="compressed-tensors")  # fine there
    fresh = models.build("qwen3_moe", dtype=torch.bfloat16)  # with the format in the recipe: refused before quantizing
    with pytest.raises(ValueError, match="asymmetric recipe with export_format 'vllm-gptq' cannot be exported for "
                                         "MoE experts.*the model is unchanged"):
        torchforge.quantize(fresh, {**asym, "export_format": "vllm-gptq"})
    assert not any("Forge" in type(m).__name__ for m in fresh.modules())
    with caplog.at_level(logging.WARNING, logger="torchforge.export.gptq_export"):
        dense = torchforge.quantize(models.build("llama", dtype=torch.bfloat16), asym)
        torchforge.save_quantized(dense, str(tmp_path / "d"), format="vllm-gptq")
        g16 = torchforge.quantize(models.build("llama", dtype=torch.bfloat16), {"scheme": "w4a16-rtn", "group_size": 16})
        torchforge.save_quantized(g16, str(tmp_path / "a"))
        ok = torchforge.quantize(models.build("llama", dtype=torch.bfloat16), {"scheme": "w4a16-rtn", "group_size": 32})
        torchforge.save_quantized(ok, str(tmp_path / "ok"))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "asymmetric GPTQ is outside vLLM's Marlin kernels" in msgs[0]
    assert "group_size 16 is outside vLLM's Marlin kernels" in msgs[1] and "--dtype float16" in msgs[1]
