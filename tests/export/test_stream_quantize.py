"""Streamed RTN of a whole checkpoint writes what quantize + save_quantized write, tensor for tensor."""
import json
import os

import pytest
import torch
from safetensors import safe_open

import torchforge
from tests import models
from torchforge.export.stream_quantize import quantize_checkpoint
from torchforge.io import iter_checkpoint
from torchforge.testing import make_checkpoint


def _tensors(path):
    return dict(iter_checkpoint(path))


@pytest.mark.parametrize("arch,device", [("deepseek_v3", "cpu"), ("mixtral", "cpu"), ("llama", "cpu"),
                                         pytest.param("deepseek_v3", "cuda", marks=pytest.mark.cuda)])
def test_streamed_equals_in_memory(tmp_path, arch, device):
    """On CUDA the streamed quantizer runs the csrc kernel (bit-exact to the reference the in-memory path uses)."""
    src = tmp_path / "src"
    models.build(arch, dtype=torch.bfloat16).save_pretrained(src)
    recipe = {"scheme": "w4a16-rtn", "group_size": 32}
    streamed = quantize_checkpoint(str(src), str(tmp_path / "streamed"), recipe, device=device, max_shard_bytes=40_000)
    from transformers import AutoModelForCausalLM

    model = torchforge.quantize(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16), recipe)
    ref = torchforge.save_quantized(model, str(tmp_path / "ref"))
    a, b = _tensors(streamed), _tensors(ref)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    qa = json.load(open(os.path.join(streamed, "config.json")))["quantization_config"]
    qb = json.load(open(os.path.join(ref, "config.json")))["quantization_config"]
    assert qa == qb
    assert os.path.exists(os.path.join(streamed, "model.safetensors.index.json"))  # several shards were written
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        assert torch.equal(torchforge.load_quantized(streamed)(ids).logits, model(ids).logits)


def test_streamed_fp8_source_and_refusals(tmp_path):
    src = make_checkpoint(tmp_path / "fp8", "deepseek_v3", fp8=True, num_layers=2, hidden_size=128,
                          n_routed_experts=4, moe_intermediate_size=128, vocab_size=64)
    out = quantize_checkpoint(str(src), str(tmp_path / "q"), {"scheme": "w4a16-rtn", "group_size": 64},
                              device="cpu")
    names = list(_tensors(out))
    assert any(n.endswith("experts.3.down_proj.qweight") for n in names)
    assert not any("scale_inv" in n for n in names)  # FP8 dequantized before quantizing
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    # a float32 recipe: the unquantized FP8 weights (kv_b_proj) are their exact fp32 dequantization, not bf16-rounded
    out32 = quantize_checkpoint(str(src), str(tmp_path / "q32"), {"scheme": "w4a16-rtn", "group_size": 64,
                                                                  "dtype": "float32"}, device="cpu")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    exact = dict(iter_checkpoint(src, dequantize_fp8=True, dtype=torch.float32))[name]
    assert exact.dtype == torch.float32 and not torch.equal(exact, exact.bfloat16().float())
    assert torch.equal(_tensors(out32)[name], exact)
    with pytest.raises(ValueError, match="round-to-nearest W4A16 only"):
        quantize_checkpoint(str(src), str(tmp_path / "g"), "w4a16-gptq")
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        quantize_checkpoint(str(src), out, {"scheme": "w4a16-rtn", "group_size": 64}, device="cpu")


def test_streamed_source_with_extra_missing_or_bad_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    from torchforge.io.checkpoint import CheckpointError

    src = tmp_path / "src"
    models.build("deepseek_v3", dtype=torch.bfloat16).save_pretrained(src)
    path = src / "model.safetensors"
    sd = load_file(path)
    recipe = {"scheme": "w4a16-rtn", "group_size": 32}

    def stream(tensors, out):
        save_file(tensors, path, metadata={"format": "pt"})
        return quantize_checkpoint(str(src), str(tmp_path / out), recipe, device="cpu")

    # a tensor the model does not hold (DeepSeek-V3's multi-token-prediction layer 61 in real checkpoints):
    # from_pretrained ignores it, so the stream skips it and the output reloads
    extra = {**sd, "model.layers.2.self_attn.o_proj.weight": torch.randn(64, 32).bfloat16()}
    out = stream(extra, "extra")
    assert not any("layers.2" in k for k in _tensors(out))
    torchforge.load_quantized(out)
    # a missing tensor (a lost shard, an index that does not list it): an error before config.json is written
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert name in sd
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors of the model, e\.g\. "
                                              r"\('model\.layers\.1\.mlp\.experts', 3, 'down_proj'\)"):
        stream({k: v for k, v in sd.items() if k != name}, "missing")
    assert not os.path.exists(tmp_path / "missing" / "config.json")
    with pytest.raises(CheckpointError, match="lacks 1 tensors of the model, e.g. model.norm.weight"):
        stream({k: v for k, v in sd.items() if k != "model.norm.weight"}, "missing2")
    # a NaN weight names the tensor
    bad = dict(sd)
    bad["model.layers.0.mlp.down_proj.weight"] = bad["model.layers.0.mlp.down_proj.weight"].clone()
    bad["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="cannot quantize model.layers.0.mlp.down_proj.weight .*NaN"):
        stream(bad, "nan")
    # a layer the group size does not divide names the layer
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_a_proj: ForgeAWQLinear: in_features=64 is "
                                         "not divisible by group_size=128"):
        quantize_checkpoint(str(src), str(tmp_path / "g128"), {"scheme": "w4a16-rtn", "group_size": 128}, device="cpu")


def test_streamed_source_whose_index_does_not_list_a_tensor_is_refused(tmp_path):
    """A model tensor its shard holds but the index does not list was read and exported anyway, while the rest of
    torchforge (checkpoint_tensor_names, the calibration streamer) took the index as the list of tensors."""
    from torchforge.io.checkpoint import CheckpointError

    src = tmp_path / "src"
    models.build("llama", dtype=torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = list(index["weight_map"].values())
    name = next(k for k, f in index["weight_map"].items() if "layernorm" in k and shards.count(f) > 1)
    shard = index["weight_map"].pop(name)
    index_path.write_text(json.dumps(index))
    with pytest.warns(UserWarning, match=rf"{shard} holds 1 tensor\(s\) that model\.safetensors\.index\.json does "
                                         rf"not list \('{name}'\)"):
        with pytest.raises(CheckpointError, match=rf"lacks 1 tensors of the model, e\.g\. {name}; the checkpoint is "
                                                  r"incomplete \(a missing shard or an index that does not list it\)"):
            quantize_checkpoint(str(src), str(tmp_path / "q"), {"scheme": "w4a16-rtn", "group_size": 32},
                                device="cpu")


def test_streamed_export_warns_outside_vllms_marlin_kernels(tmp_path, caplog):
    """save_quantized warns that group 16 needs vLLM's --dtype float16; the streamed export of the same recipe
    was silent."""
    import logging

    src = tmp_path / "src"
    models.build("llama", dtype=torch.bfloat16).save_pretrained(src)
    with caplog.at_level(logging.WARNING, logger="torchforge.export.gptq_export"):
        quantize_checkpoint(str(src), str(tmp_path / "g32"), {"scheme": "w4a16-rtn", "group_size": 32}, device="cpu")
        assert not caplog.records
        quantize_checkpoint(str(src), str(tmp_path / "g16"), {"scheme": "w4a16-rtn", "group_size": 16}, device="cpu")
    assert any("group_size 16 is outside vLLM's Marlin kernels" in r.getMessage() and "--dtype float16" in r.getMessage()
               for r in caplog.records)


def test_a_moe_block_forgemoe_cannot_wrap_is_refused_before_any_shard(tmp_path):
    """PhiMoE names its router `router`: the streamed path refuses its experts up front, as torchforge.quantize does,
    instead of failing at the first MoE layer with part of the shards written."""
    src, out = tmp_path / "src", tmp_path / "out"
    models.phimoe().save_pretrained(src)
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.mlp\.experts.*its router is `router`"):
        quantize_checkpoint(str(src), str(out), "w4a16-rtn")
    assert not out.exists() or not any(out.iterdir())


def test_streamed_source_with_experts_its_config_does_not_declare_is_refused(tmp_path):
    """An expert id beyond config.json's count was skipped as "not a tensor of the model", so the streamed checkpoint
    silently lacked an expert of the source; from_pretrained (the in-memory path) refuses such a source."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from torchforge.io.checkpoint import CheckpointError

    src = tmp_path / "src"
    models.build("deepseek_v3", dtype=torch.bfloat16).save_pretrained(src)
    sd = load_file(src / "model.safetensors")
    sd.update({k.replace(".experts.7.", ".experts.8."): v.clone() for k, v in sd.items() if ".experts.7." in k})
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError):  # the reference: transformers does not load it either
        AutoModelForCausalLM.from_pretrained(src)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"holds model\.layers\.1\.mlp\.experts\.8\.\w+_proj\.weight, but its "
                                              r"config\.json gives model\.layers\.1\.mlp\.experts 8 routed experts"):
        quantize_checkpoint(str(src), str(out), {"scheme": "w4a16-rtn", "group_size": 32}, device="cpu")
    assert os.listdir(out) == []  # nothing written, not even a temporary shard


def test_streamed_export_removes_an_earlier_exports_side_files(tmp_path):
    """A folder an export died in before its first shard may hold that export's side files: a stale expert_map.pt
    made load_quantized read the streamed (unpruned) checkpoint as drop-pruned. They go, as with save_quantized; a
    folder with shards is still refused."""
    src = tmp_path / "src"
    models.build("deepseek_v3", dtype=torch.bfloat16).save_pretrained(src)
    recipe = {"scheme": "w4a16-rtn", "group_size": 32}
    ref = quantize_checkpoint(str(src), str(tmp_path / "ref"), recipe, device="cpu")
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        expected = torchforge.load_quantized(ref)(ids).logits
    out = tmp_path / "out"
    out.mkdir()
    torch.save(torch.tensor([[0, 1, -1, -1] * 4] * 2), out / "expert_map.pt")  # a drop-pruned export's map
    (out / "hf_quant_config.json").write_text("{}")
    got = quantize_checkpoint(str(src), str(out), recipe, device="cpu")
    assert not (out / "expert_map.pt").exists() and not (out / "hf_quant_config.json").exists()
    with torch.no_grad():
        assert torch.equal(torchforge.load_quantized(got)(ids).logits, expected)
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        quantize_checkpoint(str(src), str(src), recipe, device="cpu")
