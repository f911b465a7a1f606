"""GPTQ exports: vllm-gptq, compressed-tensors (pack-quantized) and vllm-awq round trips through
load_quantized with identical logits, pinned configs / tensor layouts, compressed-tensors' own decompressor
as an independent decoder, and the errors."""
import json
import os

import pytest
import torch
from expecttest import assert_expected_inline

import torchforge
from tests import models
from torchforge.io import iter_checkpoint
from torchforge.nn import ForgeAWQExperts, ForgeAWQLinear
from torchforge.nn.gptq_linear import ForgeGPTQLinear

RECIPE = {"scheme": "w4a16-gptq", "group_size": 32}


def _ids(n=4, s=16, seed=0):
    return torch.randint(0, 96, (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gptq_v3():
    model = models.build("deepseek_v3")
    torchforge.quantize(model, RECIPE, calib_data=_ids())
    return model


def _tensors(path):
    return dict(iter_checkpoint(path))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("fmt", ["vllm-gptq", "compressed-tensors", "vllm-awq"])
def test_round_trip_identical_logits(gptq_v3, tmp_path, fmt):
    ids = _ids(2, 9, seed=5)
    ref = _logits(gptq_v3, ids)
    torchforge.save_quantized(gptq_v3, str(tmp_path), format=fmt, dtype=torch.float32)
    loaded = torchforge.load_quantized(str(tmp_path), dtype=torch.float32)
    kinds = {type(m).__name__ for m in loaded.modules()}
    assert "ForgeAWQExperts" in kinds and ("ForgeAWQLinear" if fmt == "vllm-awq" else "ForgeGPTQLinear") in kinds
    assert torch.equal(_logits(loaded, ids), ref)
    for name, mod in gptq_v3.named_modules():  # every quantized weight decodes to the solver's W_hat
        if isinstance(mod, ForgeGPTQLinear):
            assert torch.equal(loaded.get_submodule(name).dequantized_weight(), mod.dequantized_weight())


def test_vllm_gptq_config_and_layout_pinned(gptq_v3, tmp_path):
    torchforge.save_quantized(gptq_v3, str(tmp_path), format="vllm-gptq")
    with open(os.path.join(tmp_path, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    qcfg["modules_in_block_to_quantize"] = qcfg["modules_in_block_to_quantize"][:3] + ["..."]
    assert_expected_inline(json.dumps(qcfg, indent=1), """\
{
 "quant_method": "gptq",
 "bits": 4,
 "group_size": 32,
 "desc_act": false,
 "sym": true,
 "lm_head": false,
 "static_groups": false,
 "true_sequential": true,
 "checkpoint_format": "gptq",
 "modules_in_block_to_quantize": [
  "model.layers.0.self_attn.q_a_proj",
  "model.layers.0.self_attn.q_b_proj",
  "model.layers.0.self_attn.kv_a_proj_with_mqa",
  "..."
 ],
 "dynamic": {
  "-:^model\\\\.layers\\\\.0\\\\.self_attn\\\\.kv_b_proj$": {},
  "-:^model\\\\.layers\\\\.1\\\\.self_attn\\\\.kv_b_proj$": {},
  "-:^lm_head$": {}
 }
}""")
    t = _tensors(str(tmp_path))
    layout = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in t.items()
              if k.startswith("model.layers.1.self_attn.o_proj.") or k.startswith("model.layers.1.mlp.experts.3.up_proj.")}
    assert_expected_inline(json.dumps(layout, sort_keys=True), """{"model.layers.1.mlp.experts.3.up_proj.g_idx": [[64], "int32"], "model.layers.1.mlp.experts.3.up_proj.qweight": [[8, 32], "int32"], "model.layers.1.mlp.experts.3.up_proj.qzeros": [[2, 4], "int32"], "model.layers.1.mlp.experts.3.up_proj.scales": [[2, 32], "float16"], "model.layers.1.self_attn.o_proj.g_idx": [[32], "int32"], "model.layers.1.self_attn.o_proj.qweight": [[4, 64], "int32"], "model.layers.1.self_attn.o_proj.qzeros": [[1, 8], "int32"], "model.layers.1.self_attn.o_proj.scales": [[1, 64], "float16"]}""")
    assert (t["model.layers.1.self_attn.o_proj.qzeros"] == 0x77777777).all()  # v1: zero point 8 stored as 7


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_decoded_by_compressed_tensors(tmp_path, symmetric):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model = models.build("qwen3_moe")
    torchforge.quantize(model, {**RECIPE, "symmetric": symmetric}, calib_data=_ids())
    torchforge.save_quantized(model, str(tmp_path), format="compressed-tensors")
    with open(os.path.join(tmp_path, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    parsed = QuantizationConfig.model_validate(qcfg)  # compressed-tensors accepts our config
    scheme = parsed.config_groups["group_0"]
    assert parsed.format == "pack-quantized" and scheme.weights.group_size == 32
    assert scheme.weights.symmetric is symmetric and "model.layers.0.mlp.gate" not in parsed.ignore
    t = _tensors(str(tmp_path))
    checked = 0
    for name, mod in model.named_modules():
        prefix_w = []
        if isinstance(mod, ForgeGPTQLinear):
            prefix_w = [(name, mod.dequantized_weight())]
        elif isinstance(mod, ForgeAWQExperts):
            gu, dn = mod.dequantized_weights()
            i = mod.intermediate_size
            prefix_w = [(f"{name}.2.gate_proj", gu[2, :i]), (f"{name}.2.up_proj", gu[2, i:]), (f"{name}.5.down_proj", dn[5])]
        for p, w in prefix_w:
            local = {k[len(p) + 1:]: v for k, v in t.items() if k.startswith(p + ".")}
            assert ("weight_zero_point" in local) is not symmetric
            out = PackedQuantizationCompressor.decompress(local, scheme)
            # compressed-tensors dequantizes in the scale dtype (fp16): the exact fp32 product rounded once
            assert out["weight"].dtype == torch.float16 and torch.equal(out["weight"], w.half()), p
            checked += 1
    assert checked > 5 and ct is not None


def _reloaded_w4(model, tmp_path):
    """(format, the model saved in it and loaded back in fp32) for both W4 formats; asserts identical logits."""
    ids = _ids(2, 7)
    ref = _logits(model, ids)
    for fmt in ("vllm-gptq", "compressed-tensors"):
        out = str(tmp_path / fmt)
        torchforge.save_quantized(model, out, format=fmt, dtype=torch.float32)
        loaded = torchforge.load_quantized(out, dtype=torch.float32)
        assert torch.equal(_logits(loaded, ids), ref), fmt
        yield fmt, loaded


def test_rtn_model_exports_to_gptq_and_ct(tmp_path):
    model = models.build("mixtral")
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 32})
    for _, loaded in _reloaded_w4(model, tmp_path):
        assert any(isinstance(m, ForgeGPTQLinear) for m in loaded.modules())
        assert not any(isinstance(m, ForgeAWQLinear) for m in loaded.modules())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_unquantized_experts_reload(tmp_path, arch):
    # quantize_experts=False: the fused experts stay bf16 and are exported per expert; the loader stacks them back
    # (it raised "missing ...experts.gate_up_proj" for both W4 formats)
    model = models.build(arch)
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 32, "quantize_experts": False})
    for fmt, loaded in _reloaded_w4(model, tmp_path):
        assert not any(isinstance(m, ForgeAWQExperts) for m in loaded.modules()), fmt


def test_errors(tmp_path):
    model = models.build("llama")
    torchforge.quantize(model, {**RECIPE, "symmetric": False}, calib_data=_ids())
    lin = model.model.layers[0].mlp.down_proj
    lin.g_idx = lin.g_idx.flip(0).contiguous()  # act-order: representable in GPTQ only
    with pytest.raises(ValueError, match=r"vllm-awq\): model\.layers\.0\.mlp\.down_proj: act-order"):
        torchforge.save_quantized(model, str(tmp_path / "a"), format="vllm-awq")
    torchforge.save_quantized(model, str(tmp_path / "g"), format="vllm-gptq")  # fine: g_idx is written
    # and read: vLLM's GPTQ kernels replace g_idx by k // G unless desc_act is true
    assert json.load(open(tmp_path / "g" / "config.json"))["quantization_config"]["desc_act"] is True
    loaded = torchforge.load_quantized(str(tmp_path / "g"), dtype=torch.float32)
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.dequantized_weight(), lin.dequantized_weight())


def test_quantized_lm_head_sets_lm_head_in_the_gptq_config(tmp_path):
    # vLLM quantizes ParallelLMHead only with lm_head: true; with false it expects lm_head.weight and the load of
    # lm_head.qweight fails
    model = models.build("llama")
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 32, "ignore": [r"re:.*embed_tokens$"]})
    torchforge.save_quantized(model, str(tmp_path), format="vllm-gptq")
    assert json.load(open(tmp_path / "config.json"))["quantization_config"]["lm_head"] is True
    assert "lm_head.qweight" in _tensors(str(tmp_path))
    plain = models.build("llama")
    torchforge.quantize(plain, {"scheme": "w4a16-rtn", "group_size": 32})
    from torchforge.export.gptq_export import vllm_gptq_config
    assert vllm_gptq_config(plain)["lm_head"] is False


def test_compressed_tensors_weight_g_idx_is_read():
    # actorder "group" (llm-compressor): vLLM and compressed-tensors decode column k with group weight_g_idx[k]
    from torchforge.export.gptq_export import _to_gptq_linear

    g = torch.Generator().manual_seed(0)
    oc, ic, gs = 16, 64, 16
    codes = torch.randint(0, 16, (oc, ic), generator=g)
    scale = torch.rand(oc, ic // gs, generator=g).half() + 0.5
    g_idx = (torch.arange(ic) // gs)[torch.randperm(ic, generator=g)].to(torch.int32)
    packed = torch.zeros(oc, ic // 8, dtype=torch.int64)
    for j in range(8):  # compressed-tensors pack_to_int32: column 8r + j in bits 4j
        packed |= codes[:, j::8] << (4 * j)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    t = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([oc, ic]), "weight_g_idx": g_idx}
    lin = ForgeGPTQLinear(ic, oc, group_size=gs)
    lin.qweight, lin.qzeros, lin.scales, lin.g_idx = _to_gptq_linear("compressed-tensors", t, True)
    ref = (codes.float() - 8) * scale.float()[:, g_idx.long()]
    assert torch.equal(lin.dequantized_weight(), ref)
