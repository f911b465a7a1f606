"""Hidden states of the calibration batches between decoder layers (seed 000 section 1.2.3).

They live in host memory while they fit a byte budget; beyond it each batch's tensor is written to
`offload_dir/torchforge-hs-XXXX/hs_layer_{l}_batch_{b}.pt` (the input of layer `l`; a folder of this store's own,
so that two runs sharing an offload_dir cannot overwrite each other's files) and read back when that layer needs it.
The budget covers the batch in flight too (the one being read back, or just computed and being written):
room for the largest batch is kept free, so held + in-flight bytes stay within it whenever the budget is at
least one batch.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_offload_dir(path) -> None:
    """Creates `path` if needed; raises OSError naming it where it cannot hold spill files."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(f"offload_dir {os.fspath(path)!r} cannot be used for spilled hidden states ({e}); pass a "
                      "writable folder") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(f"offload_dir {os.fspath(path)!r} is not writable; pass a writable folder")


class ActivationStore:
    """Batch index -> hidden states [B, S, H]: `put` replaces, `get` reads back, `close` deletes the spill files."""

    def __init__(self, budget_bytes: int | None = None, offload_dir: str | os.PathLike | None = None):
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.budget = budget_bytes
        self.offload_dir = None if offload_dir is None else os.fspath(offload_dir)
        self._dir_path: str | None = None   # this store's own folder once something was spilled (close() removes it)
        self._made_parent = False           # whether this store created offload_dir (then close() removes it if empty)
        self._mem: dict[int, torch.Tensor] = {}
        self._files: dict[int, str] = {}
        self.held_bytes = 0          # batches kept in host memory now
        self.peak_host_bytes = 0     # peak of held bytes + the batches being read or written
        self.spills = 0              # files written
        self.spilled_bytes = 0
        self.max_chunk_bytes = 0     # largest single batch

    def _dir(self) -> str:
        if self._dir_path is None:
            if self.offload_dir is not None:
                self._made_parent = not os.path.isdir(self.offload_dir)
                check_offload_dir(self.offload_dir)
            self._dir_path = tempfile.mkdtemp(prefix="torchforge-hs-", dir=self.offload_dir)
        return self._dir_path

    def expect(self, nbytes: int) -> None:
        """The largest batch to come, when the caller knows it up front: room for it is kept free from the first
        `put` on (else a larger batch after smaller ones, kept by their own size, would overrun the budget)."""
        self.max_chunk_bytes = max(self.max_chunk_bytes, int(nbytes))

    def _note(self, transient: int) -> None:
        self.peak_host_bytes = max(self.peak_host_bytes, self.held_bytes + transient)

    def put(self, batch: int, t: torch.Tensor, layer: int | str) -> None:
        """Stores `t` (a host tensor) as batch `batch`'s input of layer `layer` (a label in the spill file's name),
        replacing what was there."""
        self.drop(batch)
        n = _nbytes(t)
        self.max_chunk_bytes = max(self.max_chunk_bytes, n)
        if self.budget is None or self.held_bytes + n + self.max_chunk_bytes <= self.budget:
            self._mem[batch] = t
            self.held_bytes += n
            self._note(0)
            return
        self._note(n)
        path = os.path.join(self._dir(), f"hs_layer_{layer}_batch_{batch}.pt")
        tmp = path + ".tmp"
        try:
            torch.save(t, tmp)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:  # a full disk fails inside torch.save's writer as a RuntimeError
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise OSError(f"cannot spill hidden states to {path}: {e}; free space there, pass another offload_dir "
                          "or raise host_budget_bytes") from e
        self._files[batch] = path
        self.spills += 1
        self.spilled_bytes += n

    def get(self, batch: int) -> torch.Tensor:
        if batch in self._mem:
            return self._mem[batch]
        t = torch.load(self._files[batch], map_location="cpu", weights_only=True)
        self._note(_nbytes(t))
        return t

    def drop(self, batch: int) -> None:
        t = self._mem.pop(batch, None)
        if t is not None:
            self.held_bytes -= _nbytes(t)
        path = self._files.pop(batch, None)
        if path is not None:
            os.unlink(path)

    def files(self) -> list[str]:
        return list(self._files.values())

    def close(self) -> None:
        """Drops every batch and deletes the spill files with this store's folder (and offload_dir if this store
        created it and nothing else was put there)."""
        for b in list(self._mem) + list(self._files):
            self.drop(b)
        if self._dir_path is not None:
            shutil.rmtree(self._dir_path, ignore_errors=True)
        if self._made_parent:
            try:
                os.rmdir(self.offload_dir)
            except OSError:  # not empty: another run's files
                pass
        self._dir_path, self._made_parent = None, False
