"""Atomic writing of sharded safetensors checkpoints (Hugging Face layout) and of small text files.

Crash safety of :func:`save_sharded`:

1. every shard (and the index) is first written under a hidden temporary name in the target folder
   (``.<final name>.tmp.<pid>.<random>``, which no checkpoint reader picks up) and fsynced; a failure
   here deletes the temporary files and leaves the folder as it was;
2. the shards are then renamed to their final names with ``os.replace``, and the index is renamed last:
   that rename is the commit point, so an index never points at missing or half-written shards. When
   a new shard takes the name of a shard that a previous index in the folder still lists, that old
   index is removed before the renames, so that it cannot describe a mix of old and new files;
3. only after the commit are the files of a previous save that the new checkpoint does not use
   removed (shards named ``model-XXXXX-of-YYYYY.safetensors`` or listed by the old index, and
   ``model.safetensors`` / the old index when the layout changed).

A save holds an exclusive ``flock`` on the folder (as :class:`~torchforge.io.shard_writer.ShardWriter`
does), so a second writer into it is refused, and temporaries found under the lock are a killed
writer's (SIGKILL, OOM): the save removes them first (only names of that form, see ``_STALE_TEMP_RE``).
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
from collections.abc import Mapping

import safetensors.torch
import torch

from .checkpoint import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = ["save_sharded", "atomic_write_text", "atomic_write_json"]

_HF_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# The temporaries of torchforge's checkpoint writers, all made under the folder's flock: save_sharded's and
# make_checkpoint's `_temp_path` names of the weights and the index, and ShardWriter's hidden shards. Nothing
# else is removed as stale (another file's `.x.tmp.<pid>.<hex>` may belong to an unlocked atomic_write_*).
_STALE_TEMP_RE = re.compile(
    r"\.(?:model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)"
    r"\.tmp\.\d+\.[0-9a-f]{8}"
    r"|\.shard-\d{5}\.safetensors\.partial"
)


def _temp_path(path: str) -> str:
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.tmp.{os.getpid()}.{secrets.token_hex(4)}")


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _lock_folder(out_dir: str) -> int | None:
    """An exclusive flock on `out_dir` itself (no lock file left behind; the kernel drops it when the process dies),
    held by every checkpoint writer (save_sharded, ShardWriter): two writers into one folder would commit a mix of
    each other's shards, or remove the other's temporaries as stale. None where flock is unavailable."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(out_dir, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise FileExistsError(f"{out_dir}: another writer (a torchforge save or quantize --stream, in this "
                                  "process or another) is writing a checkpoint into it; wait for it to finish or "
                                  "write into another folder") from None
        return None  # a file system without flock (some network mounts): unlocked, as before
    return fd


def _unlock_folder(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def _remove_stale_temps(out_dir: str) -> list[str]:
    """Removes what killed writers left in `out_dir` (temporaries of up to a shard each); returns their names.
    Call only with the folder's lock held: a live writer's temporaries look the same."""
    removed = []
    with os.scandir(out_dir) as it:
        for e in it:
            if _STALE_TEMP_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                _unlink_quiet(e.path)
                removed.append(e.name)
    return sorted(removed)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    """Make renames in ``path`` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_temp_text(path: str, text: str, encoding: str = "utf-8") -> str:
    """Write ``text`` to a fresh temporary file next to ``path``, fsynced; return its name."""
    tmp = _temp_path(path)
    try:
        # 0o666 filtered by the umask, like open(path, "w") would create the final file
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding=encoding, newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return tmp


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically: readers see the old file or the new one, never a part."""
    path = os.path.abspath(os.fspath(path))
    tmp = _write_temp_text(path, text, encoding)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a fresh temporary file, fsynced, renamed into place)."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    _atomic_write(path, write)


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` atomically: a failed write (a full disk fails inside torch.save as RuntimeError)
    leaves neither a partial file under ``path`` nor a temporary one."""
    _atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _atomic_write(path: str | os.PathLike, write) -> None:
    path = os.path.abspath(os.fspath(path))
    tmp = _temp_path(path)
    try:
        write(tmp)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def atomic_write_json(path: str | os.PathLike, obj, *, indent: int = 2, sort_keys: bool = False) -> None:
    """:func:`atomic_write_text` of ``json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\\n"``."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in state-dict order (as Hugging Face does); an oversized tensor gets its own shard."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes.items():
        if size > max_shard_bytes:
            shards.append([name])
            continue
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current or not shards:
        shards.append(current)
    return shards


def _untie(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clone tensors whose memory overlaps another tensor of the shard (tied weights, overlapping
    views): safetensors refuses to write those, and a file needs each tensor's bytes anyway."""
    groups: dict[tuple, list[str]] = {}
    for name, t in shard.items():
        if t.numel() == 0:
            continue
        groups.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(name)
    for names in groups.values():
        if len(names) < 2:
            continue
        spans = sorted(
            (shard[n].data_ptr(), shard[n].data_ptr() + _nbytes(shard[n]), n) for n in names
        )
        stop = spans[0][1]
        for start, end, name in spans[1:]:
            if start < stop:
                shard[name] = shard[name].clone()
            else:
                stop = end
    return shard


def _previous_save(out_dir: str) -> tuple[set[str], set[str]]:
    """(files listed by an existing index, every weights file a previous save may have left)."""
    listed: set[str] = set()
    index_path = os.path.join(out_dir, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                wm = json.load(f).get("weight_map", {})
            listed = {v for v in wm.values() if isinstance(v, str) and os.path.basename(v) == v}
        except (OSError, ValueError, AttributeError):
            listed = set()
    leftovers = {
        e for e in os.listdir(out_dir)
        if (_HF_SHARD_RE.fullmatch(e) or e == SAFE_WEIGHTS_NAME or e in listed)
        and os.path.isfile(os.path.join(out_dir, e))
    }
    return listed, leftovers


def save_sharded(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    max_shard_bytes: int = 5 * 2**30,
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Write ``state_dict`` to ``out_dir`` as Hugging Face safetensors shards, atomically.

    Tensors are split greedily in order into shards of at most ``max_shard_bytes`` (a bigger tensor
    gets a shard of its own). One shard is written as ``model.safetensors`` with no index, like
    ``save_pretrained``; several as ``model-00001-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``).
    Each shard's header metadata is ``{"format": "pt", **metadata}``. Tensors are made contiguous;
    tensors sharing memory (tied weights) are cloned. See the module docstring for crash safety; a
    ``FileExistsError`` says that another torchforge writer is writing into ``out_dir``.

    Returns the paths written: the weight files in order, then the index if there is one.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    header_meta = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        header_meta[k] = v
    sizes: dict[str, int] = {}
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"state dict keys must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if t.device.type == "meta":
            raise ValueError(f"tensor {name!r} is on the meta device and has no data to save")
        sizes[name] = _nbytes(t)

    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    lock = _lock_folder(out_dir)
    try:
        if lock is not None:  # unlocked (no flock), temporaries may be a live writer's: they stay
            _remove_stale_temps(out_dir)
        return _save_locked(state_dict, out_dir, sizes, max_shard_bytes, header_meta)
    finally:
        _unlock_folder(lock)


def _save_locked(state_dict, out_dir: str, sizes: dict[str, int], max_shard_bytes: int, header_meta) -> list[str]:
    plan = _plan_shards(sizes, max_shard_bytes)
    sharded = len(plan) > 1
    names = (
        [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        if sharded
        else [SAFE_WEIGHTS_NAME]
    )
    finals = [os.path.join(out_dir, n) for n in names]
    index_path = os.path.join(out_dir, SAFE_WEIGHTS_INDEX_NAME)

    # 1. write everything under temporary names
    temps: list[str] = []
    try:
        for final, tensor_names in zip(finals, plan):
            shard = {n: state_dict[n].detach().contiguous() for n in tensor_names}
            tmp = _temp_path(final)
            temps.append(tmp)
            safetensors.torch.save_file(_untie(shard), tmp, metadata=header_meta)
            del shard
            _fsync_file(tmp)
        if sharded:
            weight_map = {n: name for name, tensor_names in zip(names, plan) for n in tensor_names}
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            temps.append(_write_temp_text(index_path, json.dumps(index, indent=2, sort_keys=True) + "\n"))
    except BaseException:
        for tmp in temps:
            _unlink_quiet(tmp)
        raise

    # 2. commit: shards first, the index last
    listed_before, leftovers = _previous_save(out_dir)
    done = 0
    try:
        if os.path.exists(index_path) and listed_before & set(names):
            os.unlink(index_path)  # it would describe a mix of its shards and ours
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
            done += 1
        if sharded:
            os.replace(temps[-1], index_path)
            done += 1
        elif os.path.exists(index_path):
            os.unlink(index_path)  # readers prefer an index: the new model.safetensors counts from here
    except BaseException:
        for tmp in temps[done:]:
            _unlink_quiet(tmp)
        raise
    _fsync_dir(out_dir)

    # 3. only now drop what a previous save left and the new checkpoint does not use
    for stale in sorted(leftovers - set(names)):
        _unlink_quiet(os.path.join(out_dir, stale))
    _fsync_dir(out_dir)
    return finals + ([index_path] if sharded else [])
