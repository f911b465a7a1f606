import json
import math
import os

import pytest
import safetensors
import torch

from torchforge.io import CheckpointError, dequantize_fp8_block, iter_checkpoint, load_state_dict, save_sharded

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def _reference_quantize(w: torch.Tensor, block=(128, 128)):
    """Per-block FP8 quantization written out block by block: scale_inv = amax / 448."""
    bm, bn = block
    m, n = w.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(math.ceil(m / bm), math.ceil(n / bn), dtype=torch.float32)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows, cols = slice(bi * bm, (bi + 1) * bm), slice(bj * bn, (bj + 1) * bn)
            blk = w[rows, cols].float()
            s = blk.abs().max() / FP8_MAX
            scale_inv[bi, bj] = s
            q[rows, cols] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale_inv


def _reference_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)):
    bm, bn = block
    out = torch.empty(q.shape, dtype=torch.float32)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows, cols = slice(bi * bm, (bi + 1) * bm), slice(bj * bn, (bj + 1) * bn)
            out[rows, cols] = q[rows, cols].float() * scale_inv[bi, bj]
    return out


def _weight(m, n, seed):
    """Random weight whose 128x128 blocks have very different magnitudes, so a block mix-up shows."""
    g = torch.Generator().manual_seed(seed)
    rows = 10.0 ** torch.arange(math.ceil(m / 128)).repeat_interleave(128)[:m]
    cols = 3.0 ** torch.arange(math.ceil(n / 128)).repeat_interleave(128)[:n]
    return torch.randn(m, n, generator=g) * rows[:, None] * cols[None, :] * 1e-3


@pytest.fixture(scope="module")
def quantized():
    w = _weight(300, 200, seed=0)  # 3 x 2 blocks, the last row block has 44 rows, the last column block 72
    q, s = _reference_quantize(w)
    assert s.shape == (3, 2)
    return w, q, s, _reference_dequantize(q, s)


def test_dequantize_matches_blockwise_reference(quantized):
    w, q, s, ref = quantized
    out32 = dequantize_fp8_block(q, s, dtype=torch.float32)
    assert out32.dtype == torch.float32 and out32.shape == (300, 200)
    assert torch.equal(out32, ref)
    out = dequantize_fp8_block(q, s)  # bf16 by default
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())
    # and it reconstructs the original weight (e4m3 keeps 3 mantissa bits: ~2-3% rms relative error)
    rel = (out32 - w).norm() / w.norm()
    assert rel < 0.04
    per_block_ok = [
        ((out32 - w)[r : r + 128, c : c + 128].norm() / w[r : r + 128, c : c + 128].norm()).item() < 0.05
        for r in range(0, 300, 128)
        for c in range(0, 200, 128)
    ]
    assert all(per_block_ok)


def test_dequantize_batched_experts_and_other_block_size():
    ws = [_weight(130, 70, seed=s) for s in (1, 2)]
    qs, ss = zip(*(_reference_quantize(w, (64, 32)) for w in ws))
    q, s = torch.stack(qs), torch.stack(ss)
    assert s.shape == (2, 3, 3)
    out = dequantize_fp8_block(q, s, block_size=(64, 32), dtype=torch.float32)
    for e in range(2):
        assert torch.equal(out[e], _reference_dequantize(qs[e], ss[e], (64, 32)))


def test_dequantize_rejects_mismatched_scales(quantized):
    _, q, s, _ = quantized
    with pytest.raises(CheckpointError, match=r"scale_inv of shape \[2, 2\] does not match a weight of shape \[300, 200\].*expected \[3, 2\]"):
        dequantize_fp8_block(q, s[:2])
    with pytest.raises(CheckpointError, match=r"expected \[2, 1\]"):
        dequantize_fp8_block(q, s, block_size=(256, 256))


def _fp8_checkpoint(tmp_path, quantized, *, max_shard_bytes):
    w, q, s, ref = quantized
    w2 = _weight(128, 256, seed=3)
    q2, s2 = _reference_quantize(w2)
    sd = {
        "model.layers.0.mlp.down_proj.weight": q,  # 60000 bytes
        "model.layers.0.mlp.up_proj.weight": q2,  # 32768 bytes
        "model.layers.0.input_layernorm.weight": torch.linspace(-1, 1, 300).bfloat16(),
        "model.embed_tokens.weight": torch.linspace(-2, 2, 64).reshape(8, 8),
        "model.layers.0.mlp.down_proj.weight_scale_inv": s,
        "model.layers.0.mlp.up_proj.weight_scale_inv": s2,
    }
    save_sharded(sd, tmp_path, max_shard_bytes=max_shard_bytes)
    refs = {
        "model.layers.0.mlp.down_proj.weight": ref,
        "model.layers.0.mlp.up_proj.weight": _reference_dequantize(q2, s2),
    }
    return sd, refs


def test_iter_checkpoint_dequantizes_with_scales_in_other_shards(tmp_path, quantized, monkeypatch):
    sd, refs = _fp8_checkpoint(tmp_path, quantized, max_shard_bytes=33000)
    wm = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    for name in refs:  # the setup this test is about
        assert wm[name] != wm[name + "_scale_inv"]

    opened, live, max_live = [], [0], [0]
    real = safetensors.safe_open

    class Spy:
        def __init__(self, path, *a, **kw):
            opened.append(os.path.basename(path))
            self.inner = real(path, *a, **kw)

        def __enter__(self):
            live[0] += 1
            max_live[0] = max(max_live[0], live[0])
            return self.inner.__enter__()

        def __exit__(self, *exc):
            live[0] -= 1
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    got = load_state_dict(tmp_path, dequantize_fp8=True)
    assert max_live[0] == 1  # one shard open at a time
    assert set(got) == {k for k in sd if not k.endswith("_scale_inv")}
    for name, ref in refs.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], ref.bfloat16()), name
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], sd["model.layers.0.input_layernorm.weight"])
    assert torch.equal(got["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])

    got32 = load_state_dict(tmp_path, dequantize_fp8=True, dtype=torch.float32)
    for name, ref in refs.items():
        assert got32[name].dtype == torch.float32 and torch.equal(got32[name], ref), name
    assert got32["model.layers.0.input_layernorm.weight"].dtype == torch.float32

    # prefixes select a weight; its scale comes along from the other shard
    only = load_state_dict(tmp_path, prefixes="model.layers.0.mlp.down_proj.", dequantize_fp8=True)
    assert list(only) == ["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(only["model.layers.0.mlp.down_proj.weight"], refs["model.layers.0.mlp.down_proj.weight"].bfloat16())


def test_without_flag_tensors_come_as_stored(tmp_path, quantized):
    sd, _ = _fp8_checkpoint(tmp_path, quantized, max_shard_bytes=10**9)
    assert os.listdir(tmp_path) == ["model.safetensors"]
    got = load_state_dict(tmp_path)
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    got = load_state_dict(tmp_path, dequantize_fp8=True)
    assert got["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_block_size_from_config(tmp_path):
    w = _weight(100, 90, seed=4)
    q, s = _reference_quantize(w, (64, 64))
    save_sharded({"w.weight": q, "w.weight_scale_inv": s}, tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})
    )
    got = load_state_dict(tmp_path, dequantize_fp8=True, dtype=torch.float32)
    assert torch.equal(got["w.weight"], _reference_dequantize(q, s, (64, 64)))
    os.remove(tmp_path / "config.json")  # default 128x128 does not fit [2, 2] scales
    with pytest.raises(CheckpointError, match=r"'w\.weight_scale_inv' in model\.safetensors has shape \[2, 2\] but 'w\.weight' of shape \[100, 90\] with 128x128 blocks needs \[1, 1\]"):
        iter_checkpoint(tmp_path, dequantize_fp8=True)


def test_fp8_weight_without_scale(tmp_path):
    q = torch.ones(4, 4).to(torch.float8_e4m3fn)
    save_sharded({"a.weight": q, "a.weight_scale": torch.tensor(1.0)}, tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"float8 tensor 'a\.weight' in model\.safetensors has no companion 'a\.weight_scale_inv' .*"
        r"\(it has 'a\.weight_scale' instead: per-tensor/per-channel FP8.*read with dequantize_fp8=False",
    ):
        iter_checkpoint(tmp_path, dequantize_fp8=True)  # raised before iterating
    assert load_state_dict(tmp_path)["a.weight"].dtype == torch.float8_e4m3fn


def test_bin_fp8(tmp_path, quantized):
    _, q, s, ref = quantized
    torch.save({"x.weight": q, "x.weight_scale_inv": s, "y": torch.ones(3)}, tmp_path / "pytorch_model.bin")
    got = load_state_dict(tmp_path, dequantize_fp8=True, dtype=torch.float32)
    assert set(got) == {"x.weight", "y"}
    assert torch.equal(got["x.weight"], ref)


def test_scales_of_a_wrong_dtype_nan_or_a_1d_weight_name_the_tensor(tmp_path, quantized):
    """A TypeError/ValueError naming neither tensor nor file came from deep inside the iteration; NaN/Inf scales
    went through as NaN/Inf weights."""
    _, q, s, _ = quantized
    ue8m0_bytes = torch.full(s.shape, 127, dtype=torch.uint8)  # ue8m0 exponents stored as raw bytes
    save_sharded({"x.weight": q, "x.weight_scale_inv": ue8m0_bytes}, tmp_path / "u8")
    with pytest.raises(CheckpointError, match=r"'x\.weight_scale_inv' in model\.safetensors is uint8, but block-FP8 "
                                              r"scales of 'x\.weight' are float32.*dequantize_fp8=False"):
        iter_checkpoint(tmp_path / "u8", dequantize_fp8=True)  # raised before iterating
    torch.save({"x.weight": q, "x.weight_scale_inv": ue8m0_bytes}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"'x\.weight_scale_inv' does not fit 'x\.weight' in pytorch_model\.bin: "
                                              r"scale_inv must be a floating tensor"):
        load_state_dict(tmp_path, dequantize_fp8=True)

    bad = s.clone()
    bad[2, 1] = float("nan")
    bad[0, 1] = float("inf")
    save_sharded({"x.weight": q, "x.weight_scale_inv": bad}, tmp_path / "nan")
    with pytest.raises(CheckpointError, match=r"'x\.weight_scale_inv' in model\.safetensors cannot dequantize "
                                              r"'x\.weight': scale_inv has 2 NaN/Inf entries of 6 \(the first at "
                                              r"block \[0, 1\]\): the checkpoint is corrupt"):
        load_state_dict(tmp_path / "nan", dequantize_fp8=True)
    with pytest.raises(CheckpointError, match="NaN/Inf"):
        dequantize_fp8_block(q, bad)

    save_sharded({"b": q[0].contiguous(), "b_scale_inv": torch.ones(2)}, tmp_path / "1d")
    with pytest.raises(CheckpointError, match=r"float8 tensor 'b' in model\.safetensors: block-FP8 weights are at "
                                              r"least 2-D, got shape \[200\]"):
        iter_checkpoint(tmp_path / "1d", dequantize_fp8=True)


def _bin_shards_with_remote_scales(tmp_path):
    """3 pickled shards; every FP8 weight's scale lives in the next shard (the last one's in the first)."""
    qs = {k: _reference_quantize(_weight(300, 200, seed=i)) for i, k in enumerate("abc")}
    files = [f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)]
    shards = [{}, {}, {}]
    for i, k in enumerate("abc"):
        q, s = qs[k]
        shards[i][f"{k}.weight"] = q
        shards[(i + 1) % 3][f"{k}.weight_scale_inv"] = s
        shards[i][f"{k}.norm"] = torch.full((4,), float(i))
    for f, sd in zip(files, shards):
        torch.save(sd, tmp_path / f)
    wm = {n: f for f, sd in zip(files, shards) for n in sd}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wm}))
    return files, {k: _reference_dequantize(q, s) for k, (q, s) in qs.items()}


def test_bin_shards_are_loaded_once_each_and_released(tmp_path, monkeypatch):
    """_iter_bin memory-mapped the whole other shard again for every scale (and every scale's weight) found there:
    9 loads of a 3-shard checkpoint whose scales sit in the next shard, and one more for each per-file pass."""
    import gc
    import weakref

    files, refs = _bin_shards_with_remote_scales(tmp_path)
    loads, alive = [], []
    real = torch.load

    class StateDict(dict):  # a dict that a weak reference can watch
        pass

    def spy(path, *a, **kw):
        loads.append(os.path.basename(path))
        sd = StateDict(real(path, *a, **kw))
        alive.append(weakref.ref(sd))
        return sd

    monkeypatch.setattr(torch, "load", spy)
    got = load_state_dict(tmp_path, dequantize_fp8=True, dtype=torch.float32)
    assert sorted(loads) == files
    assert set(got) == {f"{k}.{t}" for k in "abc" for t in ("weight", "norm")}
    for i, k in enumerate("abc"):
        assert torch.equal(got[f"{k}.weight"], refs[k]), k
        assert torch.equal(got[f"{k}.norm"], torch.full((4,), float(i)))
    gc.collect()
    assert not [r for r in alive if r() is not None]  # no shard kept once the iteration is over

    loads.clear()
    it = iter_checkpoint(tmp_path, dequantize_fp8=True)
    next(it)
    assert loads == files[:2]  # a.weight needs its scale from the second shard
    it.close()  # a caller that stops early
    gc.collect()
    assert not [r for r in alive if r() is not None]
