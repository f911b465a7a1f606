"""compressed-tensors `ignore` for unquantized routed experts, as vLLM reads it: vLLM asks about a fused-MoE layer
by its per-expert projections (compressed_tensors_moe.py, get_moe_method: `<layer>.0.gate_proj`, ...) and matches an
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
