"""Pure-PyTorch reference of qmeta4 (seed 002 section 5): 4 bytes of quantization metadata per group.

Struct (little endian, as seed 002 section 5.2 / 12.1)::

    struct QMetaPacked {
        int16_t log2_scale_fp;  // bytes 0-1: round(256 * log2(scale)), Q8.8 fixed point
        uint8_t qzero;          // byte 2:    zero point 0..255
        uint8_t flags;          // byte 3:    bit 0 = symmetric, bits 1-7 reserved (0)
    };

torchforge holds a qmeta4 tensor as ``int32`` (one word per group, bits [15:0] log2 scale, [23:16] zero,
[31:24] flags); ``qmeta.view(torch.uint8)`` gives the struct bytes and ``.view(torch.uint32)`` the word.

Groups run along the INPUT dimension. Seed 002 section 5.3 groups the transposed weight ``(C, R)`` along
``R`` (the outputs). No consumer can load that: vLLM (AWQ, GPTQ, Marlin, compressed-tensors), AutoAWQ
and AutoGPTQ all keep one scale per (group of ``G`` input channels, output channel). So here a weight in
nn.Linear layout ``[..., OC, IC]`` has qmeta ``[..., OC, IC // G]``: group ``g`` of row ``o`` covers
``weight[..., o, g*G:(g+1)*G]``.

Exactness (so that a checkpoint decodes to what the solver computed with):

* decode is bit-exact on every device: ``scale = T[f] * 2**e`` with ``code = 256 e + f`` (``0 <= f < 256``),
  ``T[f] = fp32(2 ** (f / 256))`` a 256-entry table and ``2**e`` built exactly (no ``exp2`` whose last
  bit differs between CPU, CUDA and Triton).
* encode is exact and device independent too: ``scale = m * 2**e`` (frexp, exact) and the Q8.8 fraction
  is found by comparing ``m`` against the fp32 rounding boundaries ``2 ** ((f - 0.5) / 256)`` (a table),
  not by rounding an approximate ``log2``. ``encode(decode(c)) == c`` for every code.
* codes are always computed with the *effective* scale ``fp32(decode(qmeta).to(scale_dtype))``, the value
  the export writes (fp16 by default): ``q = clamp(round(w / s) + z, 0, 2**bits - 1)``, true division,
  round half to even, and ``w_hat = (q - z) * s``.

Range build (seed 002 6.2, GPTQ's convention): symmetric ``s = 2 amax / maxq``, ``z = 2**(bits-1)``
(= (maxq + 1) / 2); asymmetric ``s = (xmax - xmin) / maxq`` over the range extended to contain 0, and
``z = clamp(round(-xmin / s_dec), 0, maxq)`` with the decoded scale. An all-zero group gets ``s = 1``,
scales are kept >= 2**-24 (the smallest positive fp16) so the fp16 export never stores 0.

MSE / L^p refine (seed 002 6.3): for each candidate factor ``p_k`` of ``grid`` the candidate is
``encode(decode(base) * p_k)`` (so it is evaluated exactly as it would be stored), zero point kept, loss
``sum |w_hat - w|^norm`` (``norm == 2``: plain sum of squares); the first minimum wins.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor

__all__ = [
    "QMETA4_CODE_MIN",
    "QMETA4_CODE_MAX",
    "FLAG_SYMMETRIC",
    "MIN_SCALE",
    "default_grid",
    "qmeta4_encode_ref",
    "qmeta4_decode_ref",
    "qmeta4_effective_scale",
    "qmeta4_build_ref",
    "qmeta4_mse_refine_ref",
    "quantize_with",
    "scale_tables",
]

FLAG_SYMMETRIC = 1
# Codes are clamped so that decode stays a normal fp32 number (2**-126 .. 2**127.996).
QMETA4_CODE_MIN = -126 * 256
QMETA4_CODE_MAX = 32767
MIN_SCALE = 2.0**-24  # smallest positive fp16 (subnormal): an fp16 export never rounds a scale to 0

_TABLES: Dict[torch.device, Tuple[Tensor, Tensor]] = {}


def _make_tables(device) -> Tuple[Tensor, Tensor]:
    f = torch.arange(256, dtype=torch.float64, device=device)
    return torch.exp2(f / 256).to(torch.float32), torch.exp2((f + 0.5) / 256).to(torch.float32)


def scale_tables(device=None, *, fresh: bool = False) -> Tuple[Tensor, Tensor]:
    """``(T, B)``: ``T[f] = 2 ** (f / 256)`` (256 fp32 values, decode) and ``B[f] = 2 ** ((f + 0.5) / 256)``
    for ``f = 0..255`` (fp32 rounding boundaries of the Q8.8 fraction, encode: the fraction of a mantissa
    ``m`` in [1, 2) is the number of boundaries ``<= m``)."""
    device = torch.device(device if device is not None else "cpu")
    if fresh:  # while traced (fake tensors): built in the graph, a cached real tensor cannot be used
        return _make_tables(device)
    if device not in _TABLES:
        _TABLES[device] = _make_tables(device)
    return _TABLES[device]


def default_grid(max_shrink: float = 0.2, n_grid: int = 100, device=None) -> Tensor:
    """Shrink factors ``1 - max_shrink * k / n_grid`` for ``k = 0 .. n_grid - 1`` (1.0 first, so the refined
    scale is never worse than the range one under the chosen norm)."""
    k = torch.arange(n_grid, dtype=torch.float64)
    return (1.0 - max_shrink * k / n_grid).to(torch.float32).to(device)


def _pow2(e: Tensor) -> Tensor:
    """Exact fp32 ``2 ** e`` for integer ``e`` in [-126, 127] from the IEEE bit pattern."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _encode_codes(scale: Tensor) -> Tensor:
    """fp32 scale > 0 -> int32 Q8.8 code ``round(256 * log2(scale))`` (exact, clamped)."""
    _, bounds = scale_tables(scale.device, fresh=_is_traced(scale))
    m, e = torch.frexp(scale)  # scale = m * 2**e, m in [0.5, 1)
    m2 = (m * 2.0).contiguous()  # [1, 2), exact; contiguous for searchsorted (strided scales)
    f = torch.searchsorted(bounds, m2, right=True)  # 0..256
    code = (e.to(torch.int64) - 1) * 256 + f
    return code.clamp(QMETA4_CODE_MIN, QMETA4_CODE_MAX).to(torch.int32)


def _decode_scale(code: Tensor) -> Tensor:
    """int Q8.8 code (sign-extended int16 value) -> exact fp32 scale ``T[f] * 2**e``."""
    table, _ = scale_tables(code.device, fresh=_is_traced(code))
    code = code.to(torch.int32)
    e = code >> 8  # floor(code / 256), arithmetic shift
    f = (code & 255).to(torch.int64)
    # Two exact power-of-two factors (each within the normal range) cover every int16 code.
    e1 = e.clamp(min=-126)
    return table[f] * _pow2(e1) * _pow2(e - e1)


def _pack(code: Tensor, zero: Tensor, flags: int) -> Tensor:
    word = (code.to(torch.int64) & 0xFFFF) | ((zero.to(torch.int64) & 0xFF) << 16) | (int(flags) << 24)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def _is_traced(*tensors: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or any(is_fake(t) for t in tensors)


def _check_finite(op: str, what: str, t: Tensor) -> None:
    """Eager data check (a host sync); skipped while traced (torch.compile, fake tensors)."""
    if t.numel() == 0 or _is_traced(t):
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"{op}: {what} contains {bad} NaN/Inf values (of {t.numel()})")


def qmeta4_encode_ref(scale: Tensor, zero: Tensor, symmetric: bool) -> Tensor:
    """``scale`` (float, > 0) and ``zero`` (integer values 0..255), broadcast together -> int32 qmeta4."""
    s = scale.to(torch.float32)
    _check_finite("qmeta4_encode", "scale", s)
    traced = _is_traced(scale, zero)
    if s.numel() and not traced and bool((s <= 0).any()):
        raise ValueError(f"qmeta4_encode: scale has {int((s <= 0).sum())} values <= 0; scales must be positive "
                         "(log2 is stored)")
    if zero.is_floating_point():
        _check_finite("qmeta4_encode", "zero", zero)
        if zero.numel() and not traced and not bool((zero == torch.round(zero)).all()):
            raise ValueError("qmeta4_encode: zero has non-integer values; zero points are integers 0..255")
    z = zero.to(torch.int64)
    if z.numel() and not traced and bool(((z < 0) | (z > 255)).any()):
        raise ValueError(f"qmeta4_encode: zero has values outside 0..255 (min {int(z.min())}, max {int(z.max())}); "
                         "the struct stores an uint8 zero point")
    s, z = torch.broadcast_tensors(s, z)
    return _pack(_encode_codes(s), z, FLAG_SYMMETRIC if symmetric else 0)


def qmeta4_decode_ref(qmeta: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """int32 qmeta4 -> ``(scale fp32, zero uint8, flags uint8)``, same shape."""
    w = qmeta.to(torch.int64) & 0xFFFFFFFF
    code = ((w & 0xFFFF) ^ 0x8000) - 0x8000  # sign-extend the int16
    zero = ((w >> 16) & 0xFF).to(torch.uint8)
    flags = ((w >> 24) & 0xFF).to(torch.uint8)
    return _decode_scale(code), zero, flags


def qmeta4_effective_scale(qmeta: Tensor, scale_dtype: torch.dtype = torch.float16) -> Tensor:
    """The fp32 value of the scale as exported: ``decode(qmeta).to(scale_dtype)``."""
    s, _, _ = qmeta4_decode_ref(qmeta)
    return s.to(scale_dtype).to(torch.float32)


def quantize_with(x: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tuple[Tensor, Tensor]:
    """``(q, w_hat)``: ``q = clamp(round(x / s) + z, 0, maxq)`` (fp32, true division, half to even) and
    ``w_hat = (q - z) * s``; ``scale`` / ``zero`` broadcast against ``x``."""
    q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return q, (q - zero) * scale


def _grouped(weight: Tensor, group_size: int) -> Tensor:
    *lead, oc, ic = weight.shape
    return weight.to(torch.float32).reshape(*lead, oc, ic // group_size, group_size)


def qmeta4_build_ref(weight: Tensor, group_size: int, bits: int, symmetric: bool) -> Tensor:
    """Range-based qmeta4 of ``weight [..., OC, IC]`` -> int32 ``[..., OC, IC // group_size]``."""
    x = _grouped(weight, group_size)
    _check_finite("qmeta4_build", "weight", x)
    maxq = 2**bits - 1
    if symmetric:
        s = 2.0 * x.abs().amax(dim=-1) / maxq
    else:
        xmin = x.amin(dim=-1).clamp(max=0.0)
        xmax = x.amax(dim=-1).clamp(min=0.0)
        s = (xmax - xmin) / maxq
    s = torch.where(s == 0, torch.ones_like(s), s.clamp(min=MIN_SCALE))
    code = _encode_codes(s)
    if symmetric:
        zero = torch.full_like(code, 2 ** (bits - 1))
    else:
        zero = torch.clamp(torch.round(-xmin / _decode_scale(code)), 0, maxq)
    return _pack(code, zero, FLAG_SYMMETRIC if symmetric else 0)


def qmeta4_mse_refine_ref(weight: Tensor, qmeta: Tensor, grid: Tensor, group_size: int, bits: int,
                          norm: float = 2.4, scale_dtype: torch.dtype = torch.float16) -> Tensor:
    """Best scale of ``encode(decode(qmeta) * p)`` over the factors ``p`` of ``grid`` (zero point and flags
    kept), by ``sum |w_hat - w|^norm`` per group with the effective (``scale_dtype``-rounded) scale."""
    x = _grouped(weight, group_size)
    _check_finite("qmeta4_mse_refine", "weight", x)
    maxq = 2**bits - 1
    w = qmeta.to(torch.int64) & 0xFFFFFFFF
    base_code = ((w & 0xFFFF) ^ 0x8000) - 0x8000
    zero = ((w >> 16) & 0xFF).to(torch.float32).unsqueeze(-1)
    base = _decode_scale(base_code)
    best_loss = torch.full(base.shape, float("inf"), dtype=torch.float32, device=x.device)
    best_code = base_code.to(torch.int32)
    grid = grid.to(torch.float32)
    for k in range(grid.shape[0]):  # candidates one at a time: [..., G] memory, not [..., n_grid, G]
        code = _encode_codes((base * grid[k]).clamp(min=MIN_SCALE))
        s = _decode_scale(code).to(scale_dtype).to(torch.float32).unsqueeze(-1)
        _, w_hat = quantize_with(x, s, zero, maxq)
        err = (w_hat - x).abs()
        loss = (err * err).sum(-1) if norm == 2.0 else err.pow(norm).sum(-1)
        better = loss < best_loss
        best_loss = torch.where(better, loss, best_loss)
        best_code = torch.where(better, code, best_code)
    return _repack_code(w, best_code)


def _repack_code(word: Tensor, code: Tensor) -> Tensor:
    out = (word & ~0xFFFF & 0xFFFFFFFF) | (code.to(torch.int64) & 0xFFFF)
    out = torch.where(out >= 2**31, out - 2**32, out)
    return out.to(torch.int32)
