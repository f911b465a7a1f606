"""Writing a checkpoint whose tensors arrive one at a time (streamed quantization of models larger than host
memory): at most one shard is held in memory.

Shards are written under temporary names as they fill; `close()` renames them to `model-0000i-of-0000N` (or
`model.safetensors` when there is one) and writes the index last, so an interrupted run leaves only temporary
files, never a folder that looks complete.
"""
from __future__ import annotations

import json
import os

import safetensors.torch
import torch

from torchforge.io.checkpoint import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from torchforge.io.save import (_fsync_dir, _fsync_file, _lock_folder, _nbytes, _remove_stale_temps,
                                _unlink_quiet, _unlock_folder, _write_temp_text)


class ShardWriter:
    """`add(name, tensor)` one tensor at a time, then `close()`; `abort()` removes what was written."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30, metadata: dict | None = None):
        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        os.makedirs(self.out_dir, exist_ok=True)
        self._lock = _lock_folder(self.out_dir)  # held until close()/abort(): the temporaries below are then stale
        try:
            present = os.listdir(self.out_dir)
            if "config.json" in present:
                raise FileExistsError(f"{self.out_dir} already holds a checkpoint; write into an empty folder")
            # an export that died after its shards, before config.json
            if any(f.endswith(".safetensors") for f in present):
                raise FileExistsError(f"{self.out_dir} holds .safetensors files but no config.json (an unfinished "
                                      "export, or not a checkpoint): remove them or write into an empty folder")
            if self._lock is not None:  # unlocked, temporaries may be a live writer's: they stay
                _remove_stale_temps(self.out_dir)  # a killed run's (abort() never ran), up to a shard each
        except BaseException:
            _unlock_folder(self._lock)
            self._lock = None  # else __del__ would close the descriptor number again
            raise
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._temps: list[str] = []
        self._shard_of: dict[str, int] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._shard_of or name in self._buffer:
            raise ValueError(f"tensor {name!r} was already written")
        n = _nbytes(tensor)
        if self._buffer and self._buffer_bytes + n > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().to("cpu").contiguous()
        self._buffer_bytes += n
        self.total_bytes += n

    def _flush(self) -> None:
        path = os.path.join(self.out_dir, f".shard-{len(self._temps) + 1:05d}.safetensors.partial")
        self._temps.append(path)
        safetensors.torch.save_file(self._buffer, path, metadata=self.metadata)
        _fsync_file(path)
        for name in self._buffer:
            self._shard_of[name] = len(self._temps) - 1
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[str]:
        """Commits: shards renamed to their final names, then the index. Returns the paths written."""
        if self._buffer or not self._temps:
            self._flush()
        n = len(self._temps)
        names = [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        finals = [os.path.join(self.out_dir, name) for name in names]
        index_tmp = None
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {t: names[i] for t, i in sorted(self._shard_of.items())}}
            index_tmp = _write_temp_text(os.path.join(self.out_dir, SAFE_WEIGHTS_INDEX_NAME),
                                         json.dumps(index, indent=2, sort_keys=True) + "\n")
            self._temps.append(index_tmp)  # abort() removes it too where a rename below fails
        for tmp, final in zip(self._temps, finals):
            os.replace(tmp, final)
        if index_tmp is not None:
            os.replace(index_tmp, os.path.join(self.out_dir, SAFE_WEIGHTS_INDEX_NAME))
            finals.append(os.path.join(self.out_dir, SAFE_WEIGHTS_INDEX_NAME))
        _fsync_dir(self.out_dir)
        self._temps = []
        _unlock_folder(self._lock)
        self._lock = None
        return finals

    def __del__(self):  # a writer dropped without close()/abort() must not keep the folder locked
        _unlock_folder(getattr(self, "_lock", None))
        self._lock = None

    def abort(self) -> None:
        for tmp in self._temps:
            _unlink_quiet(tmp)
        self._temps, self._buffer = [], {}
        _unlock_folder(self._lock)
        self._lock = None


__all__ = ["ShardWriter"]
