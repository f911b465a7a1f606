"""make_checkpoint: HF's on-disk names, shapes and dtypes; sharding; DeepSeek FP8 layout and its round trip."""
import json
import math
import os

import pytest
import torch

from torchforge.io import checkpoint_tensor_names, iter_checkpoint, load_state_dict
from torchforge.io.checkpoint import read_safetensors_header
from torchforge.testing import make_checkpoint

TINY = dict(num_layers=2, hidden_size=64, n_routed_experts=8, moe_intermediate_size=32, vocab_size=96)


def _headers(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update({n: (i.dtype, i.shape, f) for n, i in read_safetensors_header(os.path.join(path, f))[0].items()})
    return out


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral", "olmoe", "deepseek_v2"])
def test_names_shapes_dtypes_are_what_transformers_saves_and_loads(tmp_path, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "ck", arch, shard_size_bytes=64 * 1024, **TINY)
    # what transformers itself writes for this config
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    # as from_pretrained keeps them (DeepSeek's e_score_correction_bias)
    for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
        if any(k in name for k in getattr(hf, "_keep_in_fp32_modules_strict", None) or ()):
            t.data = t.data.float()
    hf.save_pretrained(tmp_path / "hf")
    ours, theirs = _headers(path), _headers(tmp_path / "hf")
    assert {n: v[:2] for n, v in ours.items()} == {n: v[:2] for n, v in theirs.items()}
    # and transformers loads ours with nothing missing or unexpected, into its in-memory names
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert set(model.state_dict()) == set(hf.state_dict())
    if arch == "deepseek_v3":
        assert ours["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"


def test_sharded_layout_and_determinism(tmp_path):
    a = make_checkpoint(tmp_path / "a", "qwen3_moe", shard_size_bytes=50_000, seed=3, **TINY)
    files = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(os.listdir(a)) == sorted(files + ["config.json", "model.safetensors.index.json"])  # no temp files
    index = json.load(open(os.path.join(a, "model.safetensors.index.json")))
    headers = _headers(a)
    assert index["weight_map"] == {n: v[2] for n, v in headers.items()}
    assert index["metadata"]["total_size"] == sum(os.path.getsize(os.path.join(a, f)) for f in files) - sum(
        8 + int.from_bytes(open(os.path.join(a, f), "rb").read(8), "little") for f in files)
    for f in files:
        sizes = [math.prod(s) * 2 for d, s, g in headers.values() if g == f]
        assert sum(sizes) <= 50_000 or len(sizes) == 1
    # values depend on the seed and the name only, not on the sharding
    b = make_checkpoint(tmp_path / "b", "qwen3_moe", shard_size_bytes=10**9, seed=3, **TINY)
    c = make_checkpoint(tmp_path / "c", "qwen3_moe", seed=4, **TINY)
    sa, sb, sc = load_state_dict(a), load_state_dict(b), load_state_dict(c)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.gate.weight"], sc["model.layers.0.mlp.gate.weight"])


def test_fp8_layout_round_trips_within_fp8_error(tmp_path):
    kw = dict(TINY, hidden_size=256, moe_intermediate_size=192)  # several and partial 128x128 blocks
    q = make_checkpoint(tmp_path / "q", "deepseek_v3", fp8=True, shard_size_bytes=200_000, **kw)
    ref = load_state_dict(make_checkpoint(tmp_path / "r", "deepseek_v3", dtype=torch.float32, **kw))
    cfg = json.load(open(os.path.join(q, "config.json")))
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    headers = _headers(q)
    fp8 = [n for n, (d, _, _) in headers.items() if d == "F8_E4M3"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in fp8
    assert "model.layers.0.self_attn.kv_b_proj.weight" in fp8 and "model.layers.0.mlp.gate_proj.weight" in fp8
    for n in fp8:
        dtype, shape, shard = headers[n + "_scale_inv"]
        assert dtype == "F32" and shape == tuple(math.ceil(s / 128) for s in headers[n][1]) and shard == headers[n][2]
    kept = {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.input_layernorm.weight"}
    # the router weight in the dtype transformers saves it in: BF16, or F32 where the model keeps it in fp32
    # (DeepSeek-V3's _keep_in_fp32_modules_strict has "gate.weight" from transformers 5.24)
    from transformers import DeepseekV3ForCausalLM

    gate_fp32 = any(k in "model.layers.1.mlp.gate.weight"
                    for k in getattr(DeepseekV3ForCausalLM, "_keep_in_fp32_modules_strict", None) or ())
    assert not kept & set(fp8) and headers["model.layers.1.mlp.gate.weight"][0] == ("F32" if gate_fp32 else "BF16")
    # dequantized through iter_checkpoint: within e4m3's error (3 mantissa bits) of the unquantized values
    deq = dict(iter_checkpoint(q, dequantize_fp8=True, dtype=torch.float32))
    assert deq.keys() == ref.keys()
    for n in fp8:
        err, w = (deq[n] - ref[n]).abs(), ref[n].abs()
        assert (err <= w / 16 + w.max() / 448 * 2**-6).all(), n
        assert err.max() > 0
    gate = ref["model.layers.1.mlp.gate.weight"]
    assert torch.equal(deq["model.layers.1.mlp.gate.weight"], gate if gate_fp32 else gate.bfloat16().float())


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'llama4'.*known"):
        make_checkpoint(tmp_path / "x", "llama4")
    make_checkpoint(tmp_path / "y", "mixtral", **TINY)
    with pytest.raises(FileExistsError, match="not empty"):
        make_checkpoint(tmp_path / "y", "mixtral", **TINY)
    assert set(checkpoint_tensor_names(tmp_path / "y")) >= {"model.layers.1.block_sparse_moe.experts.3.w2.weight"}
