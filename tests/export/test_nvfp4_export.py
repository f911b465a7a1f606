"""NVFP4 exports: ModelOpt (`modelopt-nvfp4`) and compressed-tensors (`nvfp4-pack-quantized`) names, dtypes,
shapes and configs as vLLM's loaders read them; compressed-tensors' own converter and decompressor agree with
the files; load_quantized reproduces the saved model's logits exactly; gate/up scale repair."""
import json
import logging
import os

import pytest
import torch
from expecttest import assert_expected_inline
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import torchforge
from tests import models
from torchforge.nn import NVFP4Experts, NVFP4Linear, NVFP4MoE, emulate_w4a4
from torchforge.ops import nvfp4_dequantize, nvfp4_quantize


def _quantized(arch, calibrate=True, dtype=torch.bfloat16, recipe="nvfp4"):
    model = models.build(arch, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 96, (2, 12), generator=g) for _ in range(2)] if calibrate else None
    return torchforge.quantize(model, recipe, calib_data=calib)


def _tensors(path):
    out = {}
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for k in f.keys():
            out[k] = (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
    return out


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "compressed-tensors"])
@pytest.mark.parametrize("arch,calibrate", [("deepseek_v3", True), ("deepseek_v3", False),
                                            pytest.param("qwen3_moe", True, marks=pytest.mark.slow)])
def test_round_trip_logits_equal(fmt, arch, calibrate, tmp_path):
    model = _quantized(arch, calibrate)
    torchforge.save_quantized(model, str(tmp_path), format=fmt)
    reloaded = torchforge.load_quantized(str(tmp_path))
    assert any(isinstance(m, NVFP4MoE) for m in reloaded.modules())
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
        if calibrate:  # the input scales come back too: W4A4 emulation is identical as well
            emulate_w4a4(model)
            emulate_w4a4(reloaded)
            assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_modelopt_layout_and_config(tmp_path):
    model = _quantized("deepseek_v3")
    torchforge.save_quantized(model, str(tmp_path), format="modelopt-nvfp4")
    t = _tensors(tmp_path)
    for p in ("model.layers.1.mlp.experts.3.gate_proj", "model.layers.1.mlp.experts.3.up_proj"):
        assert t[f"{p}.weight"] == ("U8", (32, 32)) and t[f"{p}.weight_scale"] == ("F8_E4M3", (32, 4))
        assert t[f"{p}.weight_scale_2"] == ("F32", ()) and t[f"{p}.input_scale"] == ("F32", ())
    assert t["model.layers.1.mlp.experts.3.down_proj.weight"] == ("U8", (64, 16))
    assert t["model.layers.1.mlp.shared_experts.down_proj.weight_scale"] == ("F8_E4M3", (64, 2))
    assert t["model.layers.1.self_attn.kv_b_proj.weight"][0] == "BF16"
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"
    hf = json.load(open(tmp_path / "hf_quant_config.json"))
    assert hf["producer"]["name"] == "torchforge"
    assert_expected_inline(json.dumps(hf["quantization"]), """\
{"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": ["lm_head", "model.layers.0.self_attn.kv_b_proj", "model.layers.1.mlp.gate", "model.layers.1.self_attn.kv_b_proj"]}""")
    qcfg = json.load(open(tmp_path / "config.json"))["quantization_config"]
    qcfg.pop("producer")
    assert_expected_inline(json.dumps(qcfg), """\
{"config_groups": {"group_0": {"input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16}, "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16}, "targets": ["Linear"]}}, "ignore": ["lm_head", "model.layers.0.self_attn.kv_b_proj", "model.layers.1.mlp.gate", "model.layers.1.self_attn.kv_b_proj"], "quant_algo": "NVFP4", "quant_method": "modelopt", "group_size": 16, "kv_cache_quant_algo": null, "exclude_modules": ["lm_head", "model.layers.0.self_attn.kv_b_proj", "model.layers.1.mlp.gate", "model.layers.1.self_attn.kv_b_proj"]}""")
    # gate and up of one expert carry the same global and input scale (vLLM reads one of each)
    sd = load_file(str(tmp_path / "model.safetensors"))
    for e in range(8):
        p = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(sd[f"{p}.gate_proj.weight_scale_2"], sd[f"{p}.up_proj.weight_scale_2"])
        assert torch.equal(sd[f"{p}.gate_proj.input_scale"], sd[f"{p}.up_proj.input_scale"])


def test_uncalibrated_exports_weight_only(tmp_path):
    model = _quantized("deepseek_v3", calibrate=False)
    torchforge.save_quantized(model, str(tmp_path / "mo"), format="modelopt-nvfp4")
    assert json.load(open(tmp_path / "mo" / "hf_quant_config.json"))["quantization"]["quant_algo"] == "W4A16_NVFP4"
    assert not any(k.endswith("input_scale") for k in _tensors(tmp_path / "mo"))
    torchforge.save_quantized(model, str(tmp_path / "ct"), format="compressed-tensors")
    qcfg = json.load(open(tmp_path / "ct" / "config.json"))["quantization_config"]
    assert qcfg["config_groups"]["group_0"]["input_activations"] is None
    assert not any(k.endswith("input_global_scale") for k in _tensors(tmp_path / "ct"))


def test_compressed_tensors_reads_our_files(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationConfig

    model = _quantized("deepseek_v3")
    torchforge.save_quantized(model, str(tmp_path / "mo"), format="modelopt-nvfp4")
    torchforge.save_quantized(model, str(tmp_path / "ct"), format="compressed-tensors")
    qcfg = QuantizationConfig.model_validate(json.load(open(tmp_path / "ct" / "config.json"))["quantization_config"])
    assert qcfg.format == "nvfp4-pack-quantized" and qcfg.config_groups["group_0"].input_activations.dynamic == "local"
    mo, ours = load_file(str(tmp_path / "mo" / "model.safetensors")), load_file(str(tmp_path / "ct" / "model.safetensors"))
    # compressed-tensors' ModelOpt converter turns our ModelOpt file into our compressed-tensors file
    ignore = ["lm_head", "re:.*kv_b_proj$", "re:.*mlp\\.gate$"]
    conv = ModelOptNvfp4Converter(ignore=ignore, targets=["Linear"]).process(dict(mo))
    assert sorted(conv) == sorted(ours)
    for k, v in ours.items():
        assert torch.equal(conv[k].reshape(v.shape).view(torch.uint8) if v.dtype == torch.float8_e4m3fn else
                           conv[k].reshape(v.shape), v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v), k
    # and its decompressor dequantizes our expert weights to our values (up to the reciprocal's rounding)
    scheme = qcfg.config_groups["group_0"]
    p = "model.layers.1.mlp.experts.5.up_proj"
    dec = NVFP4PackedCompressor.decompress({k: ours[f"{p}.{k}"] for k in ("weight_packed", "weight_scale",
                                                                          "weight_global_scale")}, scheme)
    mine = nvfp4_dequantize(mo[f"{p}.weight"], mo[f"{p}.weight_scale"], mo[f"{p}.weight_scale_2"])
    torch.testing.assert_close(dec["weight"].float(), mine, rtol=1e-2, atol=0)


def test_gate_up_scale_mismatch_is_repaired(tmp_path, caplog):
    model = _quantized("deepseek_v3", calibrate=False, dtype=torch.float32)
    torchforge.save_quantized(model, str(tmp_path), format="modelopt-nvfp4")
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    # re-quantize expert 2's gate under its own (smaller) scale, as a foreign exporter that did not unify would
    p = "model.layers.1.mlp.experts.2.gate_proj"
    w = nvfp4_dequantize(sd[f"{p}.weight"], sd[f"{p}.weight_scale"], sd[f"{p}.weight_scale_2"]) * 0.25
    sd[f"{p}.weight"], sd[f"{p}.weight_scale"], sd[f"{p}.weight_scale_2"] = nvfp4_quantize(w)
    up_g = sd["model.layers.1.mlp.experts.2.up_proj.weight_scale_2"]
    assert float(sd[f"{p}.weight_scale_2"]) < float(up_g)
    save_file(sd, str(path), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        reloaded = torchforge.load_quantized(str(tmp_path))
    assert "1 experts had different gate/up global scales" in caplog.text
    experts = reloaded.model.layers[1].mlp.experts
    assert float(experts.gate_up_weight_scale_2[2]) == float(up_g)
    gu, _ = experts.dequantized_weights()
    rel = (gu[2, :32] - w).norm() / w.norm()
    assert rel < 0.1, rel  # the repaired gate is a re-rounding of the same weights, not garbage


def test_bad_format_and_foreign_ct_checkpoint(tmp_path):
    model = _quantized("qwen3_moe")
    with pytest.raises(ValueError, match="NVFP4-quantized; format 'vllm-awq' cannot hold it"):
        torchforge.save_quantized(model, str(tmp_path / "x"), format="vllm-awq")
    torchforge.save_quantized(model, str(tmp_path / "ct"), format="compressed-tensors")
    os.remove(tmp_path / "ct" / "torchforge.json")  # a checkpoint from elsewhere: scales from 1 / global_scale
    reloaded = torchforge.load_quantized(str(tmp_path / "ct"))
    assert isinstance(reloaded.model.layers[0].self_attn.q_proj, NVFP4Linear)
    assert isinstance(reloaded.model.layers[0].mlp.experts, NVFP4Experts)
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch,fmt,kw", [("llama", "modelopt-nvfp4", {}),
                                         ("deepseek_v3", "compressed-tensors", {"quantize_experts": False})])
def test_dense_and_bf16_experts_round_trip(arch, fmt, kw, tmp_path):
    model = _quantized(arch, calibrate=False, recipe=torchforge.Recipe.from_preset("nvfp4").replace(**kw))
    torchforge.save_quantized(model, str(tmp_path), format=fmt)
    qcfg = json.load(open(tmp_path / "config.json"))["quantization_config"]
    if kw:  # unquantized routed experts: per-expert bf16 weights, excluded by module name
        assert "model.layers.1.mlp.experts" in qcfg["ignore"]
        assert _tensors(tmp_path)["model.layers.1.mlp.experts.0.gate_proj.weight"] == ("BF16", (32, 64))
    reloaded = torchforge.load_quantized(str(tmp_path))
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("preset,quant_method", [("nvfp4", "modelopt"), ("nvfp4-ct", "compressed-tensors")])
def test_save_without_format_writes_the_recipes(preset, quant_method, tmp_path):
    """save_quantized(model, out) writes the recipe's export_format (was vllm-awq, which refused NVFP4 models);
    a reloaded model, which carries no recipe, gets NVFP4's own format."""
    model = _quantized("llama", calibrate=False, recipe=preset)
    torchforge.save_quantized(model, str(tmp_path / "a"))
    with open(tmp_path / "a" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == quant_method
    torchforge.save_quantized(torchforge.load_quantized(str(tmp_path / "a")), str(tmp_path / "b"))
    with open(tmp_path / "b" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "modelopt"


@pytest.mark.parametrize("fmt,drop", [
    ("modelopt-nvfp4", "model.layers.1.mlp.experts.3.up_proj.weight_scale_2"),
    ("modelopt-nvfp4", "model.layers.1.mlp.experts.3.down_proj.weight"),
    ("compressed-tensors", "model.layers.1.mlp.experts.0.gate_proj.weight_global_scale"),
    ("compressed-tensors", "model.layers.0.self_attn.o_proj.weight_global_scale"),
])
def test_incomplete_checkpoint_names_the_missing_tensor(fmt, drop, tmp_path):
    """A tensor missing from an NVFP4 layer failed as a TypeError in torch.equal or a KeyError 'weight'."""
    from torchforge.io import CheckpointError

    torchforge.save_quantized(_quantized("qwen3_moe", calibrate=False), str(tmp_path), format=fmt)
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    del sd[drop]
    save_file(sd, str(path), metadata={"format": "pt"})
    module, _, kind = drop.rpartition(".")
    with pytest.raises(CheckpointError, match=f"{module} has no {kind} in the checkpoint"):
        torchforge.load_quantized(str(tmp_path))


def _modelopt_sidecar_only(model, out):
    """`out` as ModelOpt <= 0.29 leaves it (vllm/transformers_utils/config.py reads hf_quant_config.json where
    config.json has no quantization_config): ModelOpt's tensors and `{producer, quantization}` file
    (modelopt/torch/export/quant_utils.py get_quant_config), nothing of torchforge's."""
    torchforge.save_quantized(model, str(out), format="modelopt-nvfp4")
    cfg = json.load(open(out / "config.json"))
    qcfg = cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    os.remove(out / "torchforge.json")
    hf = {"producer": {"name": "modelopt", "version": "0.29.0"},
          "quantization": {"quant_algo": qcfg["quant_algo"], "kv_cache_quant_algo": None, "group_size": 16,
                           "exclude_modules": qcfg["exclude_modules"]}}
    (out / "hf_quant_config.json").write_text(json.dumps(hf, indent=4))
    return cfg, hf


@pytest.mark.parametrize("calibrate", [True, False])
def test_modelopt_checkpoint_with_only_hf_quant_config(calibrate, tmp_path):
    """load_quantized read config.json's quantization_config only: such a folder failed as an unquantized 'awq'."""
    model = _quantized("deepseek_v3", calibrate)
    _, hf = _modelopt_sidecar_only(model, tmp_path)
    assert hf["quantization"]["quant_algo"] == ("NVFP4" if calibrate else "W4A16_NVFP4")
    reloaded = torchforge.load_quantized(str(tmp_path))
    assert isinstance(reloaded.model.layers[1].mlp.experts, NVFP4Experts)
    mine, theirs = model.state_dict(), reloaded.state_dict()
    assert mine.keys() == theirs.keys()
    for k, v in mine.items():  # every tensor bit-exact, input scales included (fp8 compared as bytes)
        assert v.dtype == theirs[k].dtype and torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v,
                                                          theirs[k].view(torch.uint8) if v.element_size() == 1
                                                          else theirs[k]), k
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
        if calibrate:
            emulate_w4a4(model)
            emulate_w4a4(reloaded)
            assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_hf_quant_config_that_disagrees_with_config_json_is_refused(tmp_path):
    from torchforge.io import CheckpointError

    model = _quantized("deepseek_v3", calibrate=False)
    cfg, hf = _modelopt_sidecar_only(model, tmp_path)
    exclude = hf["quantization"]["exclude_modules"]
    conflicts = [
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": exclude},
         r"quant_algo='NVFP4' vs 'W4A16_NVFP4'"),
        ({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "ignore": exclude[1:]},
         r"exclude_modules=\[.*\] vs \['lm_head'"),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
         r"quant_method='compressed-tensors' vs a ModelOpt W4A16_NVFP4 checkpoint"),
    ]
    for qcfg, why in conflicts:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
        with pytest.raises(CheckpointError, match=r"config\.json's quantization_config and hf_quant_config\.json "
                                                  rf"disagree \({why}.*vLLM would use config\.json's"):
            torchforge.load_quantized(str(tmp_path))
    # the same description in both (torchforge's own export; ModelOpt >= 0.31 writes `ignore` only) loads
    same = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "ignore": exclude[::-1]}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": same}))
    assert isinstance(torchforge.load_quantized(str(tmp_path)).model.layers[1].mlp.experts, NVFP4Experts)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for bad, why in ((dict(hf, quantization={**hf["quantization"], "group_size": 32}), "group_size=32; the format "
                      "has blocks of 16 only"), ({"producer": hf["producer"]}, "has no quantization.quant_algo")):
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=why):
            torchforge.load_quantized(str(tmp_path))


def test_a_quantized_head_is_refused_for_compressed_tensors(tmp_path):
    """vLLM's compressed-tensors config quantizes LinearBase layers only, so a quantized lm_head loads as an
    unquantized one and fails; its ModelOpt config quantizes the head, so modelopt-nvfp4 writes it."""
    model = models.build("llama", dtype=torch.bfloat16)
    recipe = {"scheme": "nvfp4", "ignore": []}  # the default ignore (lm_head, routers) replaced: the head quantized
    torchforge.quantize(model, recipe)
    assert isinstance(model.lm_head, NVFP4Linear)
    with pytest.raises(ValueError, match=r"output head 'lm_head' is NVFP4-quantized.*'modelopt-nvfp4'"):
        torchforge.save_quantized(model, str(tmp_path / "ct"), format="compressed-tensors")
    assert not os.path.exists(tmp_path / "ct" / "config.json")
    torchforge.save_quantized(model, str(tmp_path / "mo"), format="modelopt-nvfp4")
    loaded = torchforge.load_quantized(str(tmp_path / "mo"))
    assert isinstance(loaded.lm_head, NVFP4Linear)
