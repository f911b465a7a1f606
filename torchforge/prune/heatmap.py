"""`torchforge plot-hitmap`: hit_map[L, E] as a PNG heatmap, kept experts marked. No plotting dependency:
the PNG (8-bit RGB, one IDAT chunk) is written directly with zlib."""
from __future__ import annotations

import os
import struct
import zlib

import torch

# A short perceptual ramp (dark blue -> teal -> yellow), interpolated linearly.
_RAMP = torch.tensor([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=torch.float32)
MARK = (255, 255, 255)


def _colors(v: torch.Tensor) -> torch.Tensor:
    """v in [0, 1] -> uint8 RGB."""
    x = v.clamp(0, 1) * (len(_RAMP) - 1)
    i = x.floor().long().clamp(max=len(_RAMP) - 2)
    t = (x - i).unsqueeze(-1)
    return (_RAMP[i] * (1 - t) + _RAMP[i + 1] * t).round().to(torch.uint8)


def hitmap_image(hit_map: torch.Tensor, expert_map: torch.Tensor | None = None, cell: int = 8) -> torch.Tensor:
    """uint8 [L * cell, E * cell, 3]: each layer's row scaled to its own max (hit mass differs by layer);
    kept experts (expert_map >= 0) get a white centre mark (the whole cell when `cell` < 3)."""
    if isinstance(cell, bool) or not isinstance(cell, int) or cell < 1:
        raise ValueError(f"plot-hitmap: cell must be an integer >= 1 (pixels per layer and expert), got {cell!r}")
    hit = torch.as_tensor(hit_map, dtype=torch.float32)
    if hit.dim() != 2:
        raise ValueError(f"plot-hitmap: hit_map must be [layers, experts], got shape {tuple(hit.shape)}")
    if not torch.isfinite(hit).all():
        raise ValueError("plot-hitmap: hit_map has NaN/Inf entries")
    L, E = hit.shape
    row_max = hit.amax(dim=1, keepdim=True).clamp(min=1e-30)
    img = _colors(hit / row_max).repeat_interleave(cell, 0).repeat_interleave(cell, 1)
    if expert_map is not None:
        em = torch.as_tensor(expert_map)
        if tuple(em.shape) != (L, E):
            raise ValueError(f"plot-hitmap: expert_map has shape {tuple(em.shape)}, hit_map {(L, E)}")
        lo, hi = _mark_span(cell)
        for l_idx, e_idx in (em >= 0).nonzero().tolist():
            img[l_idx * cell + lo:l_idx * cell + hi, e_idx * cell + lo:e_idx * cell + hi] = torch.tensor(MARK,
                                                                                                     dtype=torch.uint8)
    return img


def _mark_span(cell: int) -> tuple[int, int]:
    """[lo, hi) pixels of a cell's centre mark, inside the cell: a negative lo would wrap the slice into the
    previous cell (or leave it empty), so cells under 3 pixels are marked whole."""
    if cell < 3:
        return 0, cell
    half = max(1, cell // 6)
    return max(0, cell // 2 - half), min(cell, cell // 2 + half)


def png_bytes(img: torch.Tensor) -> bytes:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + bytes(img[r].reshape(-1).tolist()) for r in range(h))  # filter 0 per scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def save_hitmap_png(path: str, hit_map, expert_map=None, cell: int = 8) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # else the error named the atomic write's hidden temporary file
        raise FileNotFoundError(f"save_hitmap_png: the folder {folder} of {path} does not exist; create it first")
    data = png_bytes(hitmap_image(hit_map, expert_map, cell))
    from torchforge.io.save import atomic_write_bytes

    atomic_write_bytes(path, data)  # never a half-written PNG under the final name, nor a stray temporary file
    return path
