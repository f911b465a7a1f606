import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import safetensors
import safetensors.torch
import torch

from torchforge.io import CheckpointError, check_checkpoint_files, iter_checkpoint, load_state_dict, save_sharded
from torchforge.io.save import atomic_write_json, atomic_write_text


def _sd(n=6, numel=256, offset=0.0):
    return {f"model.layers.{i}.weight": torch.full((numel,), i + offset) for i in range(n)}


def _equal_dicts(a, b):
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _listing(path):
    return sorted(os.listdir(path))


def test_sharded_layout_index_and_metadata(tmp_path):
    sd = _sd(n=5, numel=256)  # 1 KiB each
    sd["tiny"] = torch.zeros(3, dtype=torch.int32)
    paths = save_sharded(sd, tmp_path, max_shard_bytes=2048, metadata={"producer": "torchforge", "format": "pt"})
    shard_names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert paths == [str(tmp_path / n) for n in shard_names] + [str(tmp_path / "model.safetensors.index.json")]
    assert _listing(tmp_path) == shard_names + ["model.safetensors.index.json"]

    text = (tmp_path / "model.safetensors.index.json").read_text()
    index = json.loads(text)
    assert index == {
        "metadata": {"total_size": 5 * 1024 + 12},
        "weight_map": {
            "model.layers.0.weight": shard_names[0],
            "model.layers.1.weight": shard_names[0],
            "model.layers.2.weight": shard_names[1],
            "model.layers.3.weight": shard_names[1],
            "model.layers.4.weight": shard_names[2],
            "tiny": shard_names[2],
        },
    }
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"  # same bytes as save_pretrained
    for name in shard_names:
        with safetensors.safe_open(str(tmp_path / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt", "producer": "torchforge"}
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == name)
    assert _equal_dicts(load_state_dict(tmp_path), sd)


def test_single_shard_is_model_safetensors_without_index(tmp_path):
    sd = _sd(n=3)
    assert save_sharded(sd, tmp_path) == [str(tmp_path / "model.safetensors")]
    assert _listing(tmp_path) == ["model.safetensors"]
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert _equal_dicts(safetensors.torch.load_file(str(tmp_path / "model.safetensors")), sd)


def test_oversized_tensor_gets_its_own_shard(tmp_path):
    sd = {"a": torch.zeros(10), "big": torch.zeros(1000), "c": torch.zeros(10), "d": torch.zeros(10)}
    save_sharded(sd, tmp_path, max_shard_bytes=100)
    wm = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    groups = {}
    for k, f in wm.items():
        groups.setdefault(f, set()).add(k)
    assert sorted(groups.values(), key=sorted) == [{"a", "c"}, {"big"}, {"d"}]
    for f, keys in groups.items():
        if keys != {"big"}:
            assert os.path.getsize(tmp_path / f) < 100 + 512  # data within the limit (+ header)
    assert _equal_dicts(load_state_dict(tmp_path), sd)


def test_tied_weights_in_one_shard(tmp_path):
    emb = torch.randn(32, 16)
    sd = {"embed.weight": emb, "lm_head.weight": emb, "half.weight": emb[:16], "other": emb[16:]}
    save_sharded(sd, tmp_path)
    got = load_state_dict(tmp_path)
    assert _equal_dicts(got, {k: v.contiguous() for k, v in sd.items()})
    # the caller's tensors were not modified or replaced
    assert sd["lm_head.weight"] is emb


def test_crash_on_second_shard_leaves_no_index_and_no_final_files(tmp_path, monkeypatch):
    real = safetensors.torch.save_file
    calls = []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            with open(filename, "wb") as f:  # half a file, then the "crash"
                f.write(b"\x00" * 10)
            raise OSError("disk full")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        save_sharded(_sd(), tmp_path, max_shard_bytes=2048)
    assert len(calls) == 2
    # nothing under a final name, temporary files cleaned up
    assert _listing(tmp_path) == []


def test_crash_keeps_previous_checkpoint_intact(tmp_path, monkeypatch):
    old = _sd(offset=0.5)
    save_sharded(old, tmp_path, max_shard_bytes=2048)
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    assert len(before) == 4  # 3 shards + index

    real = safetensors.torch.save_file
    calls = []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(RuntimeError, match="killed"):
        save_sharded(_sd(offset=100.0), tmp_path, max_shard_bytes=2048)  # same shard names as the old save
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before
    assert _equal_dicts(load_state_dict(tmp_path), old)


def test_crash_while_renaming_never_leaves_a_lying_index(tmp_path, monkeypatch):
    save_sharded(_sd(offset=0.5), tmp_path, max_shard_bytes=2048)
    real_replace = os.replace
    calls = []

    def failing(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the first new shard has replaced an old one of the same name
            raise OSError("power cut")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="power cut"):
        save_sharded(_sd(offset=100.0), tmp_path, max_shard_bytes=2048)
    monkeypatch.setattr(os, "replace", real_replace)
    # The old index would now describe a mix of old and new shards: it must be gone, so that readers
    # refuse the folder instead of loading a blend of two checkpoints.
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert all(not f.startswith(".") for f in os.listdir(tmp_path))  # temporaries cleaned up
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        iter_checkpoint(tmp_path)


def test_resave_replaces_previous_layout_after_the_commit(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "extra.safetensors.bak").write_text("keep me")
    save_sharded(_sd(n=6), tmp_path, max_shard_bytes=2048)  # 3 shards
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) == 3

    events = []
    real_replace, real_unlink = os.replace, os.unlink
    monkeypatch.setattr(os, "replace", lambda s, d: (events.append(("replace", os.path.basename(d))), real_replace(s, d))[1])
    monkeypatch.setattr(os, "unlink", lambda p: (events.append(("unlink", os.path.basename(p))), real_unlink(p))[1])
    new = _sd(n=4, offset=7.0)
    save_sharded(new, tmp_path, max_shard_bytes=2048)  # 2 shards, other names
    assert _listing(tmp_path) == [
        "config.json",
        "extra.safetensors.bak",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert _equal_dicts(load_state_dict(tmp_path), new)
    commit = events.index(("replace", "model.safetensors.index.json"))
    stale = [i for i, e in enumerate(events) if e[0] == "unlink" and "-of-00003" in e[1]]
    assert len(stale) == 3 and min(stale) > commit  # old shards removed only after the new index

    events.clear()
    single = _sd(n=2, offset=3.0)
    save_sharded(single, tmp_path)  # back to one file: index and shards go
    assert _listing(tmp_path) == ["config.json", "extra.safetensors.bak", "model.safetensors"]
    assert _equal_dicts(load_state_dict(tmp_path), single)
    assert events.index(("replace", "model.safetensors")) < events.index(("unlink", "model.safetensors.index.json"))

    save_sharded(_sd(n=6), tmp_path, max_shard_bytes=2048)  # and sharded again: model.safetensors goes
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert _equal_dicts(load_state_dict(tmp_path), _sd(n=6))


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="entry 'x' is a list"):
        save_sharded({"x": [1, 2]}, tmp_path)
    with pytest.raises(TypeError, match="metadata must map str to str"):
        save_sharded({"x": torch.zeros(1)}, tmp_path, metadata={"n": 1})
    with pytest.raises(ValueError, match="meta device"):
        save_sharded({"x": torch.empty(2, device="meta")}, tmp_path)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_sharded({"x": torch.zeros(1)}, tmp_path, max_shard_bytes=0)
    assert _listing(tmp_path) == []


def test_atomic_write_text_and_json(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    old_umask = os.umask(0o022)
    try:
        atomic_write_json(path, {"b": 1, "a": [1, 2], "name": "é"})
    finally:
        os.umask(old_umask)
    assert path.read_text(encoding="utf-8") == '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ],\n  "name": "é"\n}\n'
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # not mkstemp's 0600
    atomic_write_json(path, {"b": 1, "a": 2}, sort_keys=True)
    assert json.loads(path.read_text()) == {"a": 2, "b": 1} and path.read_text().index('"a"') < path.read_text().index('"b"')

    def crash(src, dst):
        raise OSError("crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="crash before rename"):
        atomic_write_text(path, "new content")
    assert json.loads(path.read_text()) == {"a": 2, "b": 1}
    assert _listing(tmp_path) == ["config.json"]


def test_atomic_torch_save_and_bytes_leave_nothing_on_a_failed_write(tmp_path, monkeypatch):
    from torchforge.calibration.router_stats import RouterStats
    from torchforge.io.save import atomic_torch_save, atomic_write_bytes

    atomic_torch_save({"a": torch.ones(3)}, tmp_path / "x.pt")
    atomic_write_bytes(tmp_path / "x.png", b"\x89PNG")
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["a"], torch.ones(3))
    assert (tmp_path / "x.png").read_bytes() == b"\x89PNG"

    real_save = torch.save

    def full_disk(obj, f):  # torch.save's writer fails as a RuntimeError after writing a part
        real_save(obj, f)
        raise RuntimeError("PytorchStreamWriter failed writing file")

    monkeypatch.setattr(torch, "save", full_disk)
    stats = RouterStats(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="failed writing"):
        stats.save(str(tmp_path / "hits.pt"))
    with pytest.raises(RuntimeError, match="failed writing"):
        atomic_torch_save({"b": torch.zeros(1)}, tmp_path / "x.pt")
    assert sorted(os.listdir(tmp_path)) == ["x.png", "x.pt"]  # no temporaries, the old x.pt kept
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["a"], torch.ones(3))


def test_shard_writer_names_what_is_in_the_way(tmp_path):
    import pytest
    import torch

    from torchforge.io.shard_writer import ShardWriter

    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")  # an export that died before its config.json
    with pytest.raises(FileExistsError, match="holds .safetensors files but no config.json \\(an unfinished export"):
        ShardWriter(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        ShardWriter(tmp_path)
    w = ShardWriter(tmp_path / "empty")
    w.add("a", torch.ones(2))
    w.close()
    assert (tmp_path / "empty" / "model.safetensors").exists()


def test_shard_writer_removes_the_temporaries_of_a_killed_run(tmp_path):
    """A stream killed mid-way (abort() never ran) left hidden .shard-NNNNN.safetensors.partial files (up to a
    shard each) that no later run removed."""
    import torch

    from torchforge.io.shard_writer import ShardWriter

    stale = [".shard-00001.safetensors.partial", ".shard-00007.safetensors.partial",
             ".model.safetensors.index.json.tmp.123.abcd1234"]
    for name in stale:
        (tmp_path / name).write_bytes(b"x" * 64)
    (tmp_path / ".shard-notes.txt").write_text("not ours")  # other hidden files stay
    w = ShardWriter(tmp_path, max_shard_bytes=8)
    w.add("a", torch.ones(2))
    w.add("b", torch.ones(2))
    w.close()
    assert sorted(os.listdir(tmp_path)) == [".shard-notes.txt", "model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


def test_shard_writer_refuses_a_second_writer_into_the_same_folder(tmp_path):
    """Two writers into one folder share the .shard-NNNNN names: the second removed the first's shards as stale and
    the first then committed the second's shard under its own index (a folder that looks complete, but mismatched)."""
    from torchforge.io.shard_writer import ShardWriter

    first = ShardWriter(tmp_path, max_shard_bytes=1000)
    for i in range(3):
        first.add(f"a{i}", torch.full((200,), float(i)))  # 800 bytes each: two shards written so far
    with pytest.raises(FileExistsError, match="another writer .* is writing a checkpoint into it"):
        ShardWriter(tmp_path)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".partial")]) == 2  # the first writer's shards stay
    first.close()
    assert _equal_dicts(load_state_dict(tmp_path), {f"a{i}": torch.full((200,), float(i)) for i in range(3)})
    aborted = ShardWriter(tmp_path / "other")  # the lock goes with close() and abort()
    aborted.abort()
    ShardWriter(tmp_path / "other").close()
    dropped = ShardWriter(tmp_path / "third")
    del dropped  # neither closed nor aborted: garbage collection unlocks
    ShardWriter(tmp_path / "third").abort()


def test_shard_writer_abort_after_a_failed_commit_leaves_no_index_temporary(tmp_path, monkeypatch):
    from torchforge.io.shard_writer import ShardWriter

    w = ShardWriter(tmp_path, max_shard_bytes=8)
    w.add("a", torch.ones(2))
    w.add("b", torch.ones(2))
    real = os.replace

    def fail_on_index(src, dst):
        if str(dst).endswith("index.json"):
            raise OSError("disk gone")
        real(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_index)
    with pytest.raises(OSError, match="disk gone"):
        w.close()
    w.abort()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no .model.safetensors.index.json.tmp.*


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torchforge").__file__)))


def _child(code, *args, **kw):
    """A Python process running `code` with this checkout importable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


# A writer SIGKILLed (as the OOM killer does: no except/finally runs) before its renames, after its first rename,
# or (a stream) with two shards written: 6 tensors of 1 KiB, 2 per shard.
_KILLED_WRITER = """
import os, signal, sys, torch
from torchforge.io import save_sharded
from torchforge.io.shard_writer import ShardWriter
out, when = sys.argv[1:3]
sd = {f"old.{i}": torch.full((256,), float(i)) for i in range(6)}
real, renamed = os.replace, []
def replace(src, dst):
    if len(renamed) == (when == "mid-commit"):
        os.kill(os.getpid(), signal.SIGKILL)
    renamed.append(dst)
    real(src, dst)
if when == "stream":
    w = ShardWriter(out, max_shard_bytes=2048)
    for k, v in sd.items():
        w.add(k, v)
    os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
save_sharded(sd, out, max_shard_bytes=2048)
"""

# Not temporaries of torchforge's checkpoint writers (another file's atomic_write temporary, names that only look
# alike): a save never removes them.
_NOT_OURS = [".config.json.tmp.123.abcd1234", ".model.safetensors.tmp.notes", "model.safetensors.tmp.1.abcd1234",
             ".model-00001-of-00003.safetensors.tmp.1.ABCD1234", ".shard-notes.partial", ".shard-1.safetensors.partial"]


@pytest.mark.parametrize("killed, then", [("before-commit", "save"), ("mid-commit", "save"), ("stream", "save"),
                                          ("before-commit", "stream"), ("stream", "stream")])
def test_a_save_removes_the_temporaries_of_a_killed_writer(tmp_path, killed, then):
    """save_sharded's temporaries (`.model-XXXXX-of-YYYYY.safetensors.tmp.<pid>.<hex>`, up to a shard each) stayed
    forever after a SIGKILL mid-save: no later save into the folder removed them."""
    from torchforge.io.shard_writer import ShardWriter

    for name in _NOT_OURS:
        (tmp_path / name).write_text("user file")
    p = _child(_KILLED_WRITER, tmp_path, killed)
    assert p.wait(timeout=120) == -signal.SIGKILL, p.stderr.read().decode()
    stale = sorted(set(_listing(tmp_path)) - set(_NOT_OURS) - {"model-00001-of-00003.safetensors"})
    assert len(stale) == {"before-commit": 4, "mid-commit": 3, "stream": 2}[killed] and all(
        n.startswith(".") for n in stale), stale
    new = _sd(4, offset=10.0)
    if then == "save":
        save_sharded(new, tmp_path, max_shard_bytes=2048)
    else:
        w = ShardWriter(tmp_path, max_shard_bytes=2048)
        for k, v in new.items():
            w.add(k, v)
        w.close()
    committed = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert _listing(tmp_path) == sorted(_NOT_OURS + committed)
    assert all((tmp_path / n).read_text() == "user file" for n in _NOT_OURS)
    check_checkpoint_files(tmp_path)
    assert _equal_dicts(load_state_dict(tmp_path), new)


# A save that stops before its renames until the file `go` exists (after creating `ready`).
_PAUSED_SAVE = """
import os, sys, time, torch
from torchforge.io import save_sharded
out, ready, go = sys.argv[1:4]
real = os.replace
def replace(src, dst):
    if not os.path.exists(go):
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.01)
    real(src, dst)
os.replace = replace
save_sharded({f"live.{i}": torch.full((256,), float(i)) for i in range(4)}, out, max_shard_bytes=2048)
"""


def test_a_live_writers_temporaries_are_never_removed(tmp_path):
    """Stale temporaries are removed under the folder's flock only: a writer that is still running holds it, and a
    second save (or stream) into its folder is refused before it touches anything."""
    from torchforge.io.shard_writer import ShardWriter

    out, ready, go = tmp_path / "out", tmp_path / "ready", tmp_path / "go"
    out.mkdir()
    p = _child(_PAUSED_SAVE, out, ready, go)
    try:
        while not ready.exists():
            assert p.poll() is None, p.stderr.read().decode()
            time.sleep(0.01)
        live = {n: (out / n).read_bytes() for n in _listing(out)}
        assert len(live) == 3 and all(n.startswith(".") and ".tmp." in n for n in live)  # 2 shards, the index
        with pytest.raises(FileExistsError, match="another writer .* is writing a checkpoint into it"):
            save_sharded(_sd(), out)
        with pytest.raises(FileExistsError, match="another writer .* is writing a checkpoint into it"):
            ShardWriter(out)
        assert {n: (out / n).read_bytes() for n in _listing(out)} == live
    finally:
        go.touch()
        rc = p.wait(timeout=120)
    assert rc == 0, p.stderr.read().decode()
    assert _equal_dicts(load_state_dict(out), {f"live.{i}": torch.full((256,), float(i)) for i in range(4)})

    w = ShardWriter(tmp_path / "stream", max_shard_bytes=2048)  # a live stream in this process
    for k, v in _sd(4).items():
        w.add(k, v)
    partials = _listing(tmp_path / "stream")
    assert partials == [".shard-00001.safetensors.partial"]
    with pytest.raises(FileExistsError, match="another writer"):
        save_sharded(_sd(), tmp_path / "stream")
    assert _listing(tmp_path / "stream") == partials
    w.close()
    assert _equal_dicts(load_state_dict(tmp_path / "stream"), _sd(4))
    save_sharded(_sd(2), tmp_path / "stream")  # the lock went with close()
