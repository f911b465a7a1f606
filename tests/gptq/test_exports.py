"""GPTQ exports: vllm-gptq, compressed-tensors (pack-quantized) and vllm-awq round trips through
load_quantized with identical logits, pinned configs / tensor layouts, compressed-tensors' own decompressor
as an independent decoder, and the errors."""
import json
import os
import re

import pytest
import torch
from expecttest import assert_expected_inline

import torchforge
from tests import models
from torchforge.io import CheckpointError, iter_checkpoint
from torchforge.nn import ForgeAWQExperts, ForgeAWQLinear
from torchforge.nn.gptq_linear import ForgeGPTQLinear
from torchforge.ops.awq import awq_pack, awq_unpack

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


def test_act_order_checkpoint_runs_on_the_mma_layout_and_saves_unchanged(tmp_path):
    """A vllm-gptq checkpoint with act-order layers (permuted g_idx, as GPTQModel writes with desc_act): loaded, switched
    to the mma layout (rows sorted by group), it computes what the GPTQ layout computes and saves the same tensors."""
    model = models.build("llama")
    torchforge.quantize(model, {**RECIPE, "group_size": 64}, calib_data=_ids())  # the mma layout's least group
    for layer in model.model.layers:  # every group's rows spread over the matrix: act-order (IC 128, two groups)
        lin = layer.mlp.down_proj
        lin.g_idx = lin.g_idx[torch.randperm(128, generator=torch.Generator().manual_seed(1))].contiguous()
    torchforge.save_quantized(model, str(tmp_path / "a"), format="vllm-gptq")
    loaded = torchforge.load_quantized(str(tmp_path / "a"), dtype=torch.float32)
    ids = _ids(2, 9, seed=5)
    ref = _logits(loaded, ids)
    act = [m for m in loaded.modules() if isinstance(m, ForgeGPTQLinear) and m.has_act_order()]
    assert len(act) == len(model.model.layers)
    assert torchforge.use_mma_layout(loaded) > 0
    assert all(m.weight_layout == "mma" and m.act_perm is not None for m in act)
    torch.testing.assert_close(_logits(loaded, ids), ref, rtol=1e-4, atol=1e-4)  # sums in another order
    torchforge.save_quantized(loaded, str(tmp_path / "b"), format="vllm-gptq")
    first, second = _tensors(str(tmp_path / "a")), _tensors(str(tmp_path / "b"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


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
    from torchforge.export.gptq_export import _w4_linear

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
    lin = _w4_linear("compressed-tensors", t, True, gs, torch.nn.Linear(ic, oc, bias=False, device="meta"), "x")
    assert isinstance(lin, ForgeGPTQLinear)
    ref = (codes.float() - 8) * scale.float()[:, g_idx.long()]
    assert torch.equal(lin.dequantized_weight(), ref)


def _head_quantized(scheme):
    model = models.build("llama")
    recipe = {"scheme": scheme, "group_size": 32, "ignore": [r"re:.*embed_tokens$"]}
    torchforge.quantize(model, recipe, **({"calib_data": _ids()} if scheme == "w4a16-gptq" else {}))
    assert type(model.lm_head).__name__ == ("ForgeGPTQLinear" if scheme == "w4a16-gptq" else "ForgeAWQLinear")
    return model


@pytest.mark.parametrize("scheme", ["w4a16-gptq", "w4a16-rtn"])
@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm-awq"])
def test_quantized_lm_head_refused_where_vllm_builds_the_head_unquantized(tmp_path, scheme, fmt):
    # compressed_tensors.py and awq.py get_quant_method quantize LinearBase only; ParallelLMHead is not one, so vLLM
    # expects lm_head.weight and the checkpoint's lm_head.weight_packed / lm_head.qweight fail the load
    model = _head_quantized(scheme)
    with pytest.raises(ValueError, match=rf"save_quantized\({fmt}\): the output head 'lm_head' is quantized.*"
                                         "ignore list.*'vllm-gptq', which sets lm_head: true"):
        torchforge.save_quantized(model, str(tmp_path / "x"), format=fmt)
    assert not (tmp_path / "x").exists()
    torchforge.save_quantized(model, str(tmp_path / "g"), format="vllm-gptq")
    assert json.load(open(tmp_path / "g" / "config.json"))["quantization_config"]["lm_head"] is True


def test_streamed_quantization_refuses_a_quantized_lm_head(tmp_path):
    from torchforge.export.stream_quantize import quantize_checkpoint

    models.build("llama").save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match=r"output head 'lm_head' is quantized"):
        quantize_checkpoint(str(tmp_path / "src"), str(tmp_path / "q"),
                            {"scheme": "w4a16-rtn", "group_size": 32, "ignore": [r"re:.*embed_tokens$"]}, device="cpu")
    assert not (tmp_path / "q").exists()


def test_bf16_solver_scales_are_kept_and_fp16_formats_refuse_what_fp16_cannot_hold(tmp_path):
    model = models.build("llama")
    torchforge.quantize(model, RECIPE, calib_data=_ids())
    name = "model.layers.0.mlp.down_proj"
    old = model.get_submodule(name)
    big = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        big.weight.copy_(torch.randn(big.weight.shape, generator=torch.Generator().manual_seed(1)))
        big.weight[:5, :32] *= 2e5  # group scales ~ 1e5: inf in fp16, fine in bf16
    new = ForgeGPTQLinear.from_linear(big, group_size=32, scale_dtype=torch.bfloat16)
    # pack_result keeps the solver's dtype (it was cast to fp16: those scales became inf)
    assert new.scales.dtype == torch.bfloat16 and bool(new.scales.isfinite().all())
    assert float(new.scales.max()) > 65504
    model.set_submodule(name, new)
    for fmt in ("vllm-gptq", "vllm-awq"):
        with pytest.raises(ValueError, match=rf"save_quantized\({fmt}\): {re.escape(name)}\.scales: \d+ bfloat16 "
                                             r"scales are not float16 values \(\d+ above float16's maximum 65504"):
            torchforge.save_quantized(model, str(tmp_path / fmt), format=fmt)
        assert not (tmp_path / fmt).exists()
    # compressed-tensors keeps the dtype (vLLM casts weight_scale to the model dtype at load)
    torchforge.save_quantized(model, str(tmp_path / "ct"), format="compressed-tensors", dtype=torch.float32)
    ws = _tensors(str(tmp_path / "ct"))[f"{name}.weight_scale"]
    assert ws.dtype == torch.bfloat16 and torch.equal(ws.T, new.scales)
    loaded = torchforge.load_quantized(str(tmp_path / "ct"), dtype=torch.float32)
    assert torch.equal(loaded.get_submodule(name).dequantized_weight(), new.dequantized_weight())
    ids = _ids(2, 7)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    # bf16 scales inside fp16's range are written as fp16, exactly
    fits = ForgeGPTQLinear.from_linear(torch.nn.Linear(128, 64, bias=False), group_size=32, scale_dtype=torch.bfloat16)
    assert fits.scales.dtype == torch.bfloat16
    model.set_submodule(name, fits)
    torchforge.save_quantized(model, str(tmp_path / "g"), format="vllm-gptq", dtype=torch.float32)
    s = _tensors(str(tmp_path / "g"))[f"{name}.scales"]
    assert s.dtype == torch.float16 and torch.equal(s.to(torch.bfloat16), fits.scales)


def test_vllm_awq_refuses_awq_scales_fp16_cannot_hold(tmp_path):
    model = models.build("llama")
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 32})
    lin = model.model.layers[1].self_attn.o_proj
    lin.scales = (lin.scales.float() * 2**30).to(torch.bfloat16)  # as a loaded bf16 checkpoint could hold
    with pytest.raises(ValueError, match=r"vllm-awq export: model\.layers\.1\.self_attn\.o_proj\.scales: \d+ bfloat16 "
                                         r"scales are not float16 values"):
        torchforge.save_quantized(model, str(tmp_path / "a"), format="vllm-awq")
    torchforge.save_quantized(model, str(tmp_path / "ct"), format="compressed-tensors", dtype=torch.float32)
    loaded = torchforge.load_quantized(str(tmp_path / "ct"), dtype=torch.float32)
    assert torch.equal(loaded.model.layers[1].self_attn.o_proj.dequantized_weight(), lin.dequantized_weight())


def _per_channel_llama(symmetric=True):
    """Every Linear but the head quantized with one group spanning its K (q_proj K = 64, down_proj K = 128)."""
    model = models.build("llama")
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            model.set_submodule(name, ForgeGPTQLinear.from_linear(mod, group_size=mod.in_features, symmetric=symmetric))
    return model


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_channel_group_size_minus_one_round_trips(tmp_path, symmetric):
    model = _per_channel_llama(symmetric)
    ids = _ids(2, 7)
    ref = _logits(model, ids)
    for fmt in ("vllm-gptq", "compressed-tensors"):
        out = tmp_path / fmt
        torchforge.save_quantized(model, str(out), format=fmt, dtype=torch.float32)
        qcfg = json.load(open(out / "config.json"))["quantization_config"]
        t = _tensors(str(out))
        if fmt == "vllm-gptq":  # AutoGPTQ / vLLM: group_size -1, one scale row, g_idx all 0
            assert qcfg["group_size"] == -1
            assert tuple(t["model.layers.0.mlp.down_proj.scales"].shape) == (1, 64)
            assert torch.equal(t["model.layers.0.mlp.down_proj.g_idx"], torch.zeros(128, dtype=torch.int32))
        else:  # compressed-tensors: strategy "channel", weight_scale [OC, 1]
            w = qcfg["config_groups"]["group_0"]["weights"]
            assert (w["strategy"], w["group_size"]) == ("channel", None)
            assert tuple(t["model.layers.0.mlp.down_proj.weight_scale"].shape) == (64, 1)
        loaded = torchforge.load_quantized(str(out), dtype=torch.float32)
        for name, mod in model.named_modules():
            if isinstance(mod, ForgeGPTQLinear):
                got = loaded.get_submodule(name)
                assert isinstance(got, ForgeGPTQLinear) and got.group_size == got.in_features, name
                assert torch.equal(got.qweight, mod.qweight) and torch.equal(got.qzeros, mod.qzeros), name
                assert torch.equal(got.dequantized_weight(), mod.dequantized_weight()), name
        assert torch.equal(_logits(loaded, ids), ref), fmt
        torchforge.save_quantized(loaded, str(tmp_path / f"{fmt}-again"), format=fmt, dtype=torch.float32)
        again = _tensors(str(tmp_path / f"{fmt}-again"))
        assert sorted(again) == sorted(t) and all(torch.equal(again[k], t[k]) for k in t), fmt
        assert json.load(open(tmp_path / f"{fmt}-again" / "config.json"))["quantization_config"] == qcfg
    with pytest.raises(ValueError, match=r"per-channel \(group_size -1\) W4 models are written as vllm-gptq"):
        torchforge.save_quantized(model, str(tmp_path / "awq"), format="vllm-awq")


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_channel_compressed_tensors_decoded_by_compressed_tensors(tmp_path, symmetric):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model = _per_channel_llama(symmetric)
    torchforge.save_quantized(model, str(tmp_path), format="compressed-tensors", dtype=torch.float32)
    scheme = QuantizationConfig.model_validate(
        json.load(open(tmp_path / "config.json"))["quantization_config"]).config_groups["group_0"]
    assert scheme.weights.strategy == "channel"
    t = _tensors(str(tmp_path))
    for p in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"):
        local = {k[len(p) + 1:]: v for k, v in t.items() if k.startswith(p + ".")}
        out = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert torch.equal(out, model.get_submodule(p).dequantized_weight().half()), p


def test_per_channel_routed_experts_load(tmp_path):
    # mixtral: hidden 64 == intermediate 64, so group 64 is per-channel everywhere; its checkpoint read as -1
    model = models.build("mixtral")
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 64})
    ids = _ids(2, 7)
    for fmt in ("vllm-gptq", "compressed-tensors"):
        out = tmp_path / fmt
        torchforge.save_quantized(model, str(out), format=fmt, dtype=torch.float32)
        cfg = json.load(open(out / "config.json"))
        if fmt == "vllm-gptq":
            cfg["quantization_config"]["group_size"] = -1
        else:
            weights = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
            weights.update(strategy="channel", group_size=None)
        json.dump(cfg, open(out / "config.json", "w"))
        loaded = torchforge.load_quantized(str(out), dtype=torch.float32)
        assert torch.equal(_logits(loaded, ids), _logits(model, ids)), fmt
    moe = models.build("qwen3_moe")  # hidden 64, expert intermediate 32: no single group size spans both
    torchforge.quantize(moe, {"scheme": "w4a16-rtn", "group_size": 32})
    torchforge.save_quantized(moe, str(tmp_path / "q"), format="vllm-gptq")
    cfg = json.load(open(tmp_path / "q" / "config.json"))
    cfg["quantization_config"]["group_size"] = -1
    json.dump(cfg, open(tmp_path / "q" / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"per-channel \(group_size -1\) routed experts need hidden_size == "
                                              r"intermediate_size \(64 != 32\)"):
        torchforge.load_quantized(str(tmp_path / "q"))


def test_compressed_tensors_zero_points_0_to_15_round_trip(tmp_path):
    # GPTQ v1 qzeros store z - 1, so a zero point of 0 cannot be a ForgeGPTQLinear: the loader refused the checkpoint
    # (gptq_pack_zeros); such layers load as ForgeAWQLinear, which holds true zero points
    model = models.build("llama")
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 32, "symmetric": False})
    name = "model.layers.0.mlp.down_proj"
    lin = model.get_submodule(name)
    ng, oc = lin.scales.shape
    zeros = (torch.arange(ng * oc) % 16).reshape(ng, oc).to(torch.uint8)  # every zero point 0..15
    lin.qzeros = awq_pack(zeros)
    ids = _ids(2, 7)
    ref = _logits(model, ids)
    torchforge.save_quantized(model, str(tmp_path / "a"), format="compressed-tensors", dtype=torch.float32)
    loaded = torchforge.load_quantized(str(tmp_path / "a"), dtype=torch.float32)
    got = loaded.get_submodule(name)
    assert isinstance(got, ForgeAWQLinear) and not got.symmetric
    assert torch.equal(awq_unpack(got.qzeros), zeros) and torch.equal(got.qweight, lin.qweight)
    assert torch.equal(got.dequantized_weight(), lin.dequantized_weight())
    assert torch.equal(_logits(loaded, ids), ref)
    assert isinstance(loaded.model.layers[1].mlp.down_proj, ForgeGPTQLinear)  # no zero point of 0 there
    torchforge.save_quantized(loaded, str(tmp_path / "b"), format="compressed-tensors", dtype=torch.float32)
    a, b = _tensors(str(tmp_path / "a")), _tensors(str(tmp_path / "b"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=rf"vllm-gptq\): {re.escape(name)}: gptq_pack_zeros: \d+ zero points are 0"):
        torchforge.save_quantized(loaded, str(tmp_path / "g"), format="vllm-gptq")


def test_compressed_tensors_zero_point_0_with_act_order_is_refused():
    from torchforge.export.gptq_export import _pack_along_oc, _w4_linear

    oc, ic, gs = 16, 64, 16
    t = {"weight_packed": torch.zeros(oc, ic // 8, dtype=torch.int32), "weight_scale": torch.ones(oc, ic // gs).half(),
         "weight_shape": torch.tensor([oc, ic]), "weight_zero_point": _pack_along_oc(torch.zeros(ic // gs, oc)).T,
         "weight_g_idx": (torch.arange(ic) // gs).flip(0).to(torch.int32)}
    with pytest.raises(CheckpointError, match=r"x\.proj: act-order \(a permuted weight_g_idx\) with a zero point of 0"):
        _w4_linear("compressed-tensors", t, False, gs, torch.nn.Linear(ic, oc, bias=False, device="meta"), "x.proj")


def test_a_gptq_zero_point_of_16_is_not_written_as_compressed_tensors(tmp_path):
    # GPTQ v1 stores z - 1, so nibble 15 is a zero point of 16; packed along OC it carried into the next output's
    # nibble and the checkpoint decoded other weights
    model = models.build("llama")
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 32, "symmetric": False})
    torchforge.save_quantized(model, str(tmp_path / "g"), format="vllm-gptq", dtype=torch.float32)
    loaded = torchforge.load_quantized(str(tmp_path / "g"), dtype=torch.float32)
    lin = loaded.model.layers[0].mlp.down_proj
    qz = lin.qzeros.clone()
    qz[0, 0] |= 0xF
    lin.qzeros = qz
    with pytest.raises(ValueError, match=r"compressed-tensors\): model\.layers\.0\.mlp\.down_proj: a stored zero point "
                                         "of 16"):
        torchforge.save_quantized(loaded, str(tmp_path / "ct"), format="compressed-tensors")
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("bad", [-1, "groups"])
def test_a_g_idx_outside_the_groups_is_refused_at_load(gptq_v3, tmp_path, bad):
    """The CUDA kernels gather scales by g_idx without a bounds check: a corrupt g_idx is refused when loading,
    naming the tensor, instead of reading out of bounds on the GPU."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torchforge.save_quantized(gptq_v3, str(tmp_path), format="vllm-gptq")
    shard = next(os.path.join(tmp_path, f) for f in sorted(os.listdir(tmp_path)) if f.endswith(".safetensors"))
    with safe_open(shard, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k in tensors if k.endswith(".g_idx"))
    groups = tensors[key.replace(".g_idx", ".scales")].shape[0]
    tensors[key][3] = groups if bad == "groups" else bad
    os.remove(shard)
    save_file(tensors, shard, metadata=meta)
    with pytest.raises(CheckpointError, match=re.escape(key) + r" has groups in .* outside \[0, " + str(groups)):
        torchforge.load_quantized(str(tmp_path))
