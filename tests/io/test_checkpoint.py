import json
import os

import pytest
import safetensors
import safetensors.torch
import torch

from torchforge.io import (
    CheckpointError,
    checkpoint_tensor_names,
    iter_checkpoint,
    load_state_dict,
    save_sharded,
)


def _mixed_state_dict():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).half(),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(32, generator=g),
        "model.layers.0.mlp.qweight": torch.randint(-(2**31), 2**31 - 1, (16, 8), dtype=torch.int32, generator=g),
        "model.layers.1.mlp.codes": torch.randint(0, 256, (40, 7), dtype=torch.uint8, generator=g),
        "model.layers.1.mlp.down_proj.weight": (torch.randn(24, 16, generator=g) * 10).to(torch.float8_e4m3fn),
        "model.layers.1.positions": torch.arange(50, dtype=torch.int64),
        "model.layers.1.mask": torch.rand(9, generator=g) > 0.5,
        "model.norm.weight": torch.randn(32, generator=g).double(),
        "lm_head.weight": torch.randn(64, 32, generator=g).bfloat16(),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _assert_same_dict(got: dict, want: dict):
    assert set(got) == set(want)
    for k in want:
        assert _same(got[k], want[k]), k


class _SafeOpenSpy:
    """Wraps safetensors.safe_open, recording the files opened and the most opened at once."""

    def __init__(self, monkeypatch):
        self.opened: list[str] = []
        self.live = 0
        self.max_live = 0
        real = safetensors.safe_open
        spy = self

        class Handle:
            def __init__(self, path, *a, **kw):
                spy.opened.append(os.path.basename(path))
                self.inner = real(path, *a, **kw)

            def __enter__(self):
                spy.live += 1
                spy.max_live = max(spy.max_live, spy.live)
                return self.inner.__enter__()

            def __exit__(self, *exc):
                spy.live -= 1
                return self.inner.__exit__(*exc)

        monkeypatch.setattr(safetensors, "safe_open", Handle)


def test_roundtrip_several_shards_all_dtypes(tmp_path):
    sd = _mixed_state_dict()
    paths = save_sharded(sd, tmp_path, max_shard_bytes=4096)
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) >= 3
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert paths[-1] == str(tmp_path / "model.safetensors.index.json")

    seen = [name for name, _ in iter_checkpoint(tmp_path)]
    assert sorted(seen) == sorted(sd)  # every tensor exactly once
    _assert_same_dict(load_state_dict(tmp_path), sd)


def test_single_file_roundtrip_and_any_single_safetensors_name(tmp_path):
    sd = _mixed_state_dict()
    assert save_sharded(sd, tmp_path) == [str(tmp_path / "model.safetensors")]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    _assert_same_dict(load_state_dict(tmp_path), sd)

    os.rename(tmp_path / "model.safetensors", tmp_path / "weights.safetensors")
    _assert_same_dict(load_state_dict(tmp_path), sd)
    # the path of a file works too
    _assert_same_dict(load_state_dict(tmp_path / "weights.safetensors"), sd)


def test_single_file_wins_over_a_stale_index_as_in_transformers(tmp_path):
    # save_pretrained(single file) over an earlier sharded save leaves the old index and shards beside the new
    # model.safetensors; transformers loads model.safetensors, so must we (the index's shards are another model)
    old = _mixed_state_dict()
    save_sharded(old, tmp_path, max_shard_bytes=4096)
    new = {k: torch.zeros_like(v) for k, v in old.items()}
    safetensors.torch.save_file(new, str(tmp_path / "model.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _assert_same_dict(load_state_dict(tmp_path), new)
    # the index's shards may be gone altogether
    for f in os.listdir(tmp_path):
        if f.startswith("model-"):
            os.remove(tmp_path / f)
    _assert_same_dict(load_state_dict(tmp_path), new)
    assert set(checkpoint_tensor_names(tmp_path)) == set(new)


def test_single_bin_wins_over_a_stale_bin_index(tmp_path):
    sd = {"a": torch.ones(3), "b": torch.zeros(2)}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a": "pytorch_model-00001-of-00002.bin"}}))
    _assert_same_dict(load_state_dict(tmp_path), sd)


def test_bin_single_and_sharded(tmp_path, monkeypatch):
    sd = _mixed_state_dict()
    single = tmp_path / "single"
    single.mkdir()
    torch.save(sd, single / "pytorch_model.bin")
    (single / "training_args.bin").write_bytes(b"not weights")  # must not be picked up
    _assert_same_dict(load_state_dict(single), sd)
    # the pre-1.6 pickle format cannot be memory-mapped (nor hold float8 with weights_only=True)
    legacy = {k: v for k, v in sd.items() if v.dtype in (torch.float32, torch.float16, torch.int64)}
    torch.save(legacy, single / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    _assert_same_dict(load_state_dict(single), legacy)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = list(sd)
    parts = {"pytorch_model-00001-of-00002.bin": names[:4], "pytorch_model-00002-of-00002.bin": names[4:]}
    for fname, keys in parts.items():
        torch.save({k: sd[k] for k in keys}, sharded / fname)
    weight_map = {k: f for f, keys in parts.items() for k in keys}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same_dict(load_state_dict(sharded), sd)
    assert checkpoint_tensor_names(sharded) == weight_map

    loaded = []
    real_load = torch.load

    def spy_load(path, *a, **kw):
        loaded.append(os.path.basename(path))
        return real_load(path, *a, **kw)

    monkeypatch.setattr(torch, "load", spy_load)
    got = load_state_dict(sharded, prefixes="model.layers.1.")
    assert set(got) == {k for k in names if k.startswith("model.layers.1.")}
    assert loaded == ["pytorch_model-00002-of-00002.bin"]


def test_prefixes_read_only_the_shards_that_hold_them(tmp_path, monkeypatch):
    sd = {f"model.layers.{i}.w{j}": torch.full((64,), float(10 * i + j)) for i in range(4) for j in range(2)}
    sd["lm_head.weight"] = torch.ones(64)
    save_sharded(sd, tmp_path, max_shard_bytes=2 * 64 * 4)  # two tensors per shard
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    wanted_files = {weight_map[k] for k in sd if k.startswith(("model.layers.1.", "lm_head"))}
    assert len(wanted_files) == 2 and len(set(weight_map.values())) == 5
    # Damage every other shard: reading (or even parsing the header of) any of them would raise.
    for f in set(weight_map.values()) - wanted_files:
        (tmp_path / f).write_bytes(b"\xff" * 64)

    spy = _SafeOpenSpy(monkeypatch)
    got = load_state_dict(tmp_path, prefixes=["model.layers.1.", "lm_head"])
    assert set(got) == {"model.layers.1.w0", "model.layers.1.w1", "lm_head.weight"}
    for k, v in got.items():
        assert _same(v, sd[k])
    assert set(spy.opened) == wanted_files and len(spy.opened) == 2
    assert spy.max_live == 1

    # a single string is one prefix, not a set of characters
    assert set(load_state_dict(tmp_path, prefixes="model.layers.1.w1")) == {"model.layers.1.w1"}
    assert load_state_dict(tmp_path, prefixes=[]) == {}


def test_dtype_casts_floating_tensors_only(tmp_path):
    sd = _mixed_state_dict()
    sd["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.tensor([[0.123456789]], dtype=torch.float32)
    save_sharded(sd, tmp_path, max_shard_bytes=4096)
    got = load_state_dict(tmp_path, dtype=torch.float16)
    for k, v in sd.items():
        if k.endswith("_scale_inv") or not v.is_floating_point() or v.dtype == torch.float8_e4m3fn:
            assert _same(got[k], v), k  # ints, bools, fp8 and block scales as stored
        else:
            assert got[k].dtype == torch.float16 and torch.equal(got[k], v.half()), k


def test_tied_and_noncontiguous_tensors_roundtrip(tmp_path):
    emb = torch.randn(16, 8)
    qkv = torch.randn(24, 8)
    sd = {
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied: same tensor object
        "qkv.weight": qkv,
        "q.weight": qkv[:8],  # overlapping view of the same storage
        "k.weight": qkv[8:16],
        "t.weight": torch.randn(8, 5).t(),  # non-contiguous
    }
    with pytest.raises(RuntimeError):  # what the clone avoids
        safetensors.torch.save_file({"a": emb, "b": emb}, str(tmp_path / "plain.safetensors"))
    save_sharded(sd, tmp_path / "out")
    got = load_state_dict(tmp_path / "out")
    _assert_same_dict(got, {k: v.contiguous() for k, v in sd.items()})


def test_checkpoint_tensor_names(tmp_path):
    sd = {"a": torch.zeros(100), "b": torch.zeros(100), "c": torch.zeros(3)}
    save_sharded(sd, tmp_path / "sharded", max_shard_bytes=412)
    assert checkpoint_tensor_names(tmp_path / "sharded") == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    save_sharded(sd, tmp_path / "single")
    assert checkpoint_tensor_names(tmp_path / "single") == dict.fromkeys(sd, "model.safetensors")


# ----------------------------------------------------------------------------------------- errors


def test_missing_folder_and_folder_without_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*nope does not exist"):
        iter_checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "training_args.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"no checkpoint files in .*: expected model.safetensors.index.json"):
        iter_checkpoint(tmp_path)


def test_missing_shard_is_reported_at_call_time(tmp_path):
    save_sharded({f"t{i}": torch.zeros(256) for i in range(3)}, tmp_path, max_shard_bytes=1024)
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    msg = (
        r"shard model-00002-of-00003\.safetensors listed in model\.safetensors\.index\.json is missing "
        rf"from {tmp_path}: the download is incomplete"
    )
    with pytest.raises(CheckpointError, match=msg):
        iter_checkpoint(tmp_path)  # no next(): the check does not wait for iteration
    with pytest.raises(CheckpointError, match=msg):
        checkpoint_tensor_names(tmp_path)


def test_shards_without_index(tmp_path):
    save_sharded({f"t{i}": torch.zeros(256) for i in range(3)}, tmp_path, max_shard_bytes=1024)
    os.remove(tmp_path / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match=r"holds 3 \.safetensors files .* but no model\.safetensors\.index\.json"):
        iter_checkpoint(tmp_path)


def test_index_that_is_not_json_or_disagrees_with_its_shards(tmp_path):
    save_sharded({"a": torch.zeros(256), "b": torch.ones(256)}, tmp_path, max_shard_bytes=1024)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(index_path.read_text()[:20])
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json cannot be read as JSON"):
        iter_checkpoint(tmp_path)
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"maps 'ghost' to model-00001-of-00002\.safetensors, but that shard"):
        iter_checkpoint(tmp_path)


@pytest.mark.parametrize("shard", ["../model-00001-of-00002.safetensors", "/etc/model.safetensors",
                                   "sub/model-00001-of-00002.safetensors", ".."])
def test_index_naming_a_shard_outside_the_folder_is_refused(tmp_path, shard):
    save_sharded({"a": torch.zeros(256), "b": torch.ones(256)}, tmp_path / "ckpt", max_shard_bytes=1024)
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["a"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file of .*: shards must be plain file names"):
        iter_checkpoint(tmp_path / "ckpt")


def test_index_with_an_empty_weight_map_is_refused(tmp_path):
    save_sharded({"a": torch.zeros(256), "b": torch.ones(256)}, tmp_path, max_shard_bytes=1024)
    index_path = tmp_path / "model.safetensors.index.json"
    index_path.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(CheckpointError, match="maps no tensor \\(an empty 'weight_map'\\)"):
        iter_checkpoint(tmp_path)


def test_bin_index_that_disagrees_with_its_shards(tmp_path):
    # as for safetensors: a name the index gives a pickled shard must be in it (the reader dropped it silently)
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.ones(2)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    weight_map = {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert sorted(load_state_dict(tmp_path)) == ["a", "b"]
    weight_map["c"] = "pytorch_model-00002-of-00002.bin"
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"maps 'c' to pytorch_model-00002-of-00002\.bin, but that shard"):
        load_state_dict(tmp_path)


def _write_single(tmp_path):
    save_sharded({"x": torch.arange(1000, dtype=torch.float32)}, tmp_path)
    return tmp_path / "model.safetensors"


def test_truncated_safetensors_file(tmp_path):
    path = _write_single(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        CheckpointError,
        match=r"corrupt or truncated safetensors file .*model\.safetensors: tensor 'x' needs data bytes \[0, 4000\) "
        r"but the file holds only 3900 data bytes",
    ):
        iter_checkpoint(tmp_path)


def test_header_length_bigger_than_file(tmp_path):
    path = _write_single(tmp_path)
    data = bytearray(path.read_bytes())
    data[:8] = (10**9).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: the header length field says 1000000000 bytes but the file has only"
    ):
        iter_checkpoint(tmp_path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=r"the file has 2 bytes, fewer than the 8-byte header length"):
        iter_checkpoint(tmp_path)


def test_header_that_is_not_json(tmp_path):
    path = _write_single(tmp_path)
    junk = b"{not json at all}"
    path.write_bytes(len(junk).to_bytes(8, "little") + junk + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"corrupt or truncated safetensors file .*: its 17-byte JSON header does not parse"):
        iter_checkpoint(tmp_path)


def test_corrupt_bin(tmp_path):
    torch.save({"a": torch.zeros(1000)}, tmp_path / "pytorch_model.bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot load .*pytorch_model\.bin with torch\.load\(weights_only=True\)"):
        load_state_dict(tmp_path)


def test_header_length_over_the_safetensors_limit_is_not_read(tmp_path, monkeypatch):
    """A damaged length field below the file size made the header check read that many bytes (up to a whole 5 GB
    shard) into memory before failing on the JSON; safetensors itself refuses headers over 100 MB."""
    import builtins

    path = tmp_path / "model.safetensors"
    n = 150_000_000
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little") + b"{")
        f.truncate(8 + n + 1000)  # sparse: takes no disk space
    reads = []
    real_open = builtins.open

    class Spy:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, k=-1):
            reads.append(k)
            return self.f.read(k)

    monkeypatch.setattr(builtins, "open", lambda p, *a, **kw: Spy(real_open(p, *a, **kw)) if str(p) == str(path)
                        else real_open(p, *a, **kw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the header length field says 150000000 bytes, "
                                              r"over safetensors' limit of 100000000 bytes"):
        iter_checkpoint(tmp_path)
    assert reads == [8]


def _rewrite_header(path, edit):
    """Rewrites a safetensors file with `edit(header, data) -> (header, data)` applied."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = edit(json.loads(raw[8:8 + n]), raw[8 + n:])
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def _offsets(name, shift):
    def edit(header, data):
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + shift, end + shift]
        return header, data
    return edit


def _cut(keep):
    return lambda p: p.write_bytes(p.read_bytes()[:keep(len(p.read_bytes()))])


_SHARD = "model-00002-of-00003.safetensors"
_BAD_SHARDS = {  # damage to the second of 3 shards (t2, t3: 1 KiB each), what the error says about it
    "missing": (os.remove, r"shard model-00002-of-00003\.safetensors listed in model\.safetensors\.index\.json is "
                           r"missing from "),
    "truncated data": (_cut(lambda n: n - 100), r"model-00002-of-00003\.safetensors: tensor 't3' needs data bytes "
                                                r"\[1024, 2048\) but the file holds only 1948 data bytes"),
    "truncated header": (_cut(lambda n: 40), r"model-00002-of-00003\.safetensors: the header length field says \d+ "
                                             r"bytes but the file has only 40 bytes"),
    "offsets past the end": (lambda p: _rewrite_header(p, _offsets("t3", 64)),
                             r"model-00002-of-00003\.safetensors: tensor 't3' needs data bytes \[1088, 2112\)"),
    "overlapping offsets": (lambda p: _rewrite_header(p, _offsets("t3", -512)),
                            r"model-00002-of-00003\.safetensors: tensor 't3' has data offsets \[512, 1536\] but the "
                            r"tensor before it ends at 1024: the header's offsets overlap or leave a gap"),
    "a gap": (lambda p: _rewrite_header(p, lambda h, d: _offsets("t3", 8)(h, d + b"\0" * 8)),
              r"tensor 't3' has data offsets \[1032, 2056\] but the tensor before it ends at 1024"),
    "bytes the header does not describe": (lambda p: _rewrite_header(p, lambda h, d: (h, d + b"\0" * 64)),
                                           r"model-00002-of-00003\.safetensors: its tensors take 2048 data bytes but "
                                           r"the file holds 2112 after the header"),
}


@pytest.mark.parametrize("damage", list(_BAD_SHARDS))
def test_a_bad_shard_is_named_with_the_fix_before_anything_is_read(tmp_path, damage):
    """A header whose offsets overlap, leave a gap or do not cover the file passed the header check: safe_open
    refused the shard only when the iteration reached it (after every earlier shard was streamed), with
    safetensors' bare 'invalid offset' and no fix; check_checkpoint_files found nothing wrong."""
    from torchforge.io import check_checkpoint_files

    save_sharded({f"t{i}": torch.full((256,), float(i)) for i in range(6)}, tmp_path, max_shard_bytes=2048)
    fn, msg = _BAD_SHARDS[damage]
    fn(tmp_path / _SHARD)
    fix = r".*(download|save) (it|the missing files) again"
    with pytest.raises(CheckpointError, match=msg + fix):
        iter_checkpoint(tmp_path)  # no next(): nothing of the first shard is yielded before the error
    with pytest.raises(CheckpointError, match=msg + fix):
        check_checkpoint_files(tmp_path)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_bad_bin_shard_is_named_with_the_fix(tmp_path, damage):
    """A truncated pickle shard's error named it but gave no fix."""
    files = [f"pytorch_model-0000{i}-of-00002.bin" for i in (1, 2)]
    for i, f in enumerate(files):
        torch.save({f"w{i}": torch.ones(256)}, tmp_path / f)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w0": files[0], "w1": files[1]}}))
    if damage == "missing":
        os.remove(tmp_path / files[1])
        msg = (r"shard pytorch_model-00002-of-00002\.bin listed in pytorch_model\.bin\.index\.json is missing .*"
               r"download the missing files again")
    else:
        _cut(lambda n: n - 100)(tmp_path / files[1])
        msg = (r"cannot load .*pytorch_model-00002-of-00002\.bin with torch\.load.*; the file is corrupt or truncated "
               r"\(delete it and download/save it again\)")
    with pytest.raises(CheckpointError, match=msg):
        load_state_dict(tmp_path)


# ----------------------------------------------------------------------------- the index is the list of tensors


def _shards_with_unlisted_tensors(tmp_path, save, suffix):
    """Two shards holding tensors their index does not list ('x', and 'd' in the other shard) and a copy of 'a' in
    the shard the index does not give it; returns (the tensors the index lists, the index file name)."""
    g = torch.Generator().manual_seed(0)
    t = {k: torch.randn(4, generator=g) for k in ("a", "b", "c", "d", "x", "a_copy")}
    files = [f"model-0000{i}-of-00002.{suffix}" for i in (1, 2)]
    save({"a": t["a"], "b": t["b"], "x": t["x"]}, tmp_path / files[0])
    save({"c": t["c"], "d": t["d"], "a": t["a_copy"]}, tmp_path / files[1])
    index = "model.safetensors.index.json" if suffix == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / index).write_text(json.dumps({"metadata": {}, "weight_map": {"a": files[0], "b": files[0],
                                                                             "c": files[1]}}))
    return {k: t[k] for k in "abc"}, index


@pytest.mark.parametrize("suffix", ["safetensors", "bin"])
def test_tensors_the_index_does_not_list_are_not_read_and_named_once(tmp_path, suffix):
    """A tensor a shard held but its index did not list was yielded anyway, while checkpoint_tensor_names (the
    index) had no such tensor: the calibration streamer and load_quantized, which plan from the names, then met
    tensors they did not expect. transformers' from_pretrained would load it; the index is the list here."""
    import warnings

    if suffix == "safetensors":
        save, shard = (lambda sd, p: safetensors.torch.save_file(sd, str(p))), "model-00001-of-00002.safetensors"
    else:
        save, shard = (lambda sd, p: torch.save(sd, p)), "model-00001-of-00002.bin"
    listed, index = _shards_with_unlisted_tensors(tmp_path, save, suffix)
    more = r" \(and 1 other shard\(s\) hold unlisted tensors too\)" if suffix == "safetensors" else ""
    msg = (rf"{shard} holds 1 tensor\(s\) that {index} does not list \('x'\){more}: they are not read\. The index "
           r"is the checkpoint's list of tensors; if the model needs them, the index is damaged or hand-edited: add "
           r"them to its weight_map or save the checkpoint again")
    with pytest.warns(UserWarning, match=msg):
        got = load_state_dict(tmp_path)
    _assert_same_dict(got, listed)  # no 'x' nor 'd', and 'a' from the shard the index names
    assert set(got) == set(checkpoint_tensor_names(tmp_path))
    with warnings.catch_warnings():  # once per checkpoint: not again for each layer a streamer reads
        warnings.simplefilter("error")
        _assert_same_dict(load_state_dict(tmp_path, prefixes=["a", "x"]), {"a": listed["a"]})


@pytest.mark.parametrize("suffix", ["safetensors", "bin"])
def test_a_partial_read_says_its_unlisted_count_covers_what_it_read(tmp_path, suffix):
    """A read of some prefixes (a streamer's layer) sees only its own names and shards: the once-per-checkpoint warning
    says that its counts may be short, not that the checkpoint has only these unlisted tensors."""
    if suffix == "safetensors":
        save = lambda sd, p: safetensors.torch.save_file(sd, str(p))  # noqa: E731
    else:
        save = lambda sd, p: torch.save(sd, p)  # noqa: E731
    listed, index = _shards_with_unlisted_tensors(tmp_path, save, suffix)
    with pytest.warns(UserWarning, match=rf"holds 1 tensor\(s\) that {index} does not list \('x'\) among the tensors "
                                         r"this partial read looked at \(there may be more\): they are not read"):
        got = load_state_dict(tmp_path, prefixes=["a", "x"])
    _assert_same_dict(got, {"a": listed["a"]})


def test_an_fp8_scale_the_index_does_not_list_is_not_used_from_a_bin_shard(tmp_path):
    # as in safetensors shards, where the scale was already looked up through the index only
    w = (torch.randn(128, 128) * 10).to(torch.float8_e4m3fn)
    torch.save({"w": w, "w_scale_inv": torch.ones(1, 1)}, tmp_path / "pytorch_model-00001-of-00001.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}))
    with pytest.warns(UserWarning, match=r"holds 1 tensor\(s\) .* \('w_scale_inv'\)"):
        with pytest.raises(CheckpointError, match="float8 tensor 'w' in pytorch_model-00001-of-00001.bin has no "
                                                  "companion 'w_scale_inv'"):
            load_state_dict(tmp_path, dequantize_fp8=True)


def test_the_unlisted_tensors_warning_is_once_per_checkpoint_folder_not_per_relative_name(tmp_path, monkeypatch):
    """The once-per-checkpoint key was the folder as passed: a second checkpoint read by the same relative name from
    another working directory was never warned about (and one checkpoint read by two spellings was warned twice)."""
    import warnings

    save = lambda sd, p: safetensors.torch.save_file(sd, str(p))  # noqa: E731
    for run in ("a", "b"):
        (tmp_path / run / "ckpt").mkdir(parents=True)
        _shards_with_unlisted_tensors(tmp_path / run / "ckpt", save, "safetensors")
    monkeypatch.chdir(tmp_path / "a")
    with pytest.warns(UserWarning, match="does not list"):
        load_state_dict("ckpt")
    with warnings.catch_warnings():  # the same checkpoint, by its absolute path: already warned
        warnings.simplefilter("error")
        load_state_dict(tmp_path / "a" / "ckpt")
    monkeypatch.chdir(tmp_path / "b")
    with pytest.warns(UserWarning, match="does not list"):  # another checkpoint
        load_state_dict("ckpt")
