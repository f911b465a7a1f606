"""Triton kernels for qmeta4 build (range) and MSE / L^p refinement (seed 002 section 6).

Same math as :mod:`torchforge.ops.qmeta4_reference`, bit for bit: encode by an exact mantissa search
in the boundary table (9 table loads per group, no approximate log2), decode by the 256-entry table
times an exactly built power of two, true division (``div_rn``, not Triton's approximate ``/``) and round
half to even from ``floor`` (exact; libdevice ``rint`` has no interpreter implementation).

Seed 002 section 6 asks for warp reductions and a constant-memory candidate grid: here one program owns
``BLOCK`` groups as a ``[BLOCK, G]`` register tile and reduces each group with ``tl.max`` / ``tl.sum``
(Triton lowers those to warp shuffles); the candidate grid is a small global tensor read once per
candidate by every program (it stays in L1/L2, the role constant memory plays in the seed).
Launch functions assume validated arguments (see :mod:`torchforge.ops.qmeta4`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton
from torchforge.ops.qmeta4_reference import (
    MIN_SCALE,
    QMETA4_CODE_MAX,
    QMETA4_CODE_MIN,
    _is_traced,
    scale_tables,
)

__all__ = ["launch_qmeta4_build", "launch_qmeta4_mse_refine"]

_SCALE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

if HAS_TRITON:

    @triton.jit
    def rne(x):
        """Round half to even, exact for every fp32 (x - floor(x) is exact)."""
        f = tl.floor(x)
        d = x - f
        r = tl.where(d > 0.5, f + 1.0, f)
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        return tl.where((d == 0.5) & odd, f + 1.0, r)

    @triton.jit
    def pow2i(e):
        """Exact fp32 2**e for int32 e in [-126, 127]."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def qmeta4_encode_code(s, bounds_ptr, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr):
        """Normal fp32 s > 0 -> int32 Q8.8 code, exactly like the reference's frexp + searchsorted."""
        bits = s.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127
        m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)  # mantissa in [1, 2)
        f = tl.zeros_like(e)
        # Largest c <= 255 with B[c - 1] <= m, then one more when m >= B[255].
        for k in tl.static_range(8):  # steps 128, 64, ..., 1
            cand = f + (128 >> k)
            b = tl.load(bounds_ptr + cand - 1)
            f = tl.where(m >= b, cand, f)
        f += (m >= tl.load(bounds_ptr + 255)).to(tl.int32)
        code = e * 256 + f
        return tl.minimum(tl.maximum(code, CODE_MIN), CODE_MAX)

    @triton.jit
    def qmeta4_decode_scale(code, table_ptr):
        """Sign-extended int32 Q8.8 code -> exact fp32 scale T[f] * 2**e."""
        e = code >> 8
        t = tl.load(table_ptr + (code & 255))
        e1 = tl.maximum(e, -126)
        return t * pow2i(e1) * pow2i(e - e1)

    @triton.jit
    def to_scale_dtype(s, SCALE_KIND: tl.constexpr):
        """fp32 value of s as stored in the export dtype (0: fp32, 1: fp16, 2: bf16), round to nearest even."""
        if SCALE_KIND == 1:
            s = s.to(tl.float16).to(tl.float32)
        elif SCALE_KIND == 2:
            s = s.to(tl.bfloat16).to(tl.float32)
        return s

    @triton.jit
    def _load_groups(w_ptr, pid, n_groups, G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
        gid = pid * BLOCK + tl.arange(0, BLOCK)
        gmask = gid < n_groups
        offs = tl.arange(0, GP)
        emask = gmask[:, None] & (offs[None, :] < G)
        ptrs = w_ptr + gid.to(tl.int64)[:, None] * G + offs[None, :]
        x = tl.load(ptrs, mask=emask, other=0.0).to(tl.float32)
        return gid, gmask, emask, x

    @triton.jit
    def _qmeta4_build_kernel(w_ptr, out_ptr, bounds_ptr, table_ptr, n_groups, MAXQ: tl.constexpr,
                             SYM: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr,
                             MIN_S: tl.constexpr, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr):
        pid = tl.program_id(0)
        gid, gmask, emask, x = _load_groups(w_ptr, pid, n_groups, G, GP, BLOCK)
        # Masked lanes hold 0, which changes neither max|x| nor the 0-extended range.
        if SYM:
            s = tl.math.div_rn(2.0 * tl.max(tl.abs(x), axis=1), MAXQ * 1.0)
        else:
            xmin = tl.minimum(tl.min(x, axis=1), 0.0)
            xmax = tl.maximum(tl.max(x, axis=1), 0.0)
            s = tl.math.div_rn(xmax - xmin, MAXQ * 1.0)
        s = tl.where(s == 0.0, 1.0, tl.maximum(s, MIN_S))
        code = qmeta4_encode_code(s, bounds_ptr, CODE_MIN, CODE_MAX)
        if SYM:
            zero = tl.full(code.shape, (MAXQ + 1) // 2, tl.int32)
            flags = 1
        else:
            zq = rne(tl.math.div_rn(-xmin, qmeta4_decode_scale(code, table_ptr)))
            zero = tl.minimum(tl.maximum(zq, 0.0), MAXQ * 1.0).to(tl.int32)
            flags = 0
        word = (code & 0xFFFF) | (zero << 16) | (flags << 24)
        tl.store(out_ptr + gid, word, mask=gmask)

    @triton.jit
    def _qmeta4_refine_kernel(w_ptr, q_ptr, out_ptr, grid_ptr, bounds_ptr, table_ptr, n_groups, n_grid, norm,
                              MAXQ: tl.constexpr, L2: tl.constexpr, SCALE_KIND: tl.constexpr, G: tl.constexpr,
                              GP: tl.constexpr, BLOCK: tl.constexpr, MIN_S: tl.constexpr, CODE_MIN: tl.constexpr,
                              CODE_MAX: tl.constexpr):
        pid = tl.program_id(0)
        gid, gmask, emask, x = _load_groups(w_ptr, pid, n_groups, G, GP, BLOCK)
        word = tl.load(q_ptr + gid, mask=gmask, other=0)
        base_code = ((word & 0xFFFF) ^ 0x8000) - 0x8000
        zero = ((word >> 16) & 0xFF).to(tl.float32)
        base = qmeta4_decode_scale(base_code, table_ptr)
        best_loss = tl.full(base.shape, float("inf"), tl.float32)
        best_code = base_code
        for k in range(n_grid):
            p = tl.load(grid_ptr + k)
            code = qmeta4_encode_code(tl.maximum(base * p, MIN_S), bounds_ptr, CODE_MIN, CODE_MAX)
            s = to_scale_dtype(qmeta4_decode_scale(code, table_ptr), SCALE_KIND)
            q = rne(tl.math.div_rn(x, s[:, None])) + zero[:, None]
            q = tl.minimum(tl.maximum(q, 0.0), MAXQ * 1.0)
            err = tl.abs((q - zero[:, None]) * s[:, None] - x)
            if L2:
                e = err * err
            else:
                # No tiny literal here: Triton types a Python float below 2**-126 (e.g. 1e-38) as fp64, which
                # promotes the loss, and best_loss with it, to fp64 (a compile error on the real compiler; the
                # interpreter does not check). log2 of 1.0 on the zero lanes is 0, and they are masked to 0.
                pos = err > 0.0
                e = tl.where(pos, tl.exp2(norm * tl.log2(tl.where(pos, err, 1.0))), 0.0)
            loss = tl.sum(tl.where(emask, e, 0.0), axis=1).to(tl.float32)
            better = loss < best_loss
            best_loss = tl.where(better, loss, best_loss).to(tl.float32)
            best_code = tl.where(better, code, best_code)
        out = (word & ~0xFFFF) | (best_code & 0xFFFF)
        tl.store(out_ptr + gid, out, mask=gmask)


def _require_triton():
    if not HAS_TRITON:
        raise RuntimeError("torchforge qmeta4 Triton kernels need triton; install it or use CPU tensors")


def _launch_params(group_size: int):
    gp = triton.next_power_of_2(group_size)
    block = max(1, min(64, 4096 // gp))
    return gp, block


def launch_qmeta4_build(weight: Tensor, group_size: int, bits: int, symmetric: bool) -> Tensor:
    """Range-based qmeta4 of ``weight [..., OC, IC]`` with the Triton kernel -> int32 ``[..., OC, IC // G]``."""
    _require_triton()
    w = weight.contiguous()
    out = torch.empty((*w.shape[:-1], w.shape[-1] // group_size), dtype=torch.int32, device=w.device)
    n = out.numel()
    if n == 0:
        return out
    table, bounds = scale_tables(w.device, fresh=_is_traced(w))
    gp, block = _launch_params(group_size)
    torch.library.wrap_triton(_qmeta4_build_kernel)[(triton.cdiv(n, block),)](
        w, out, bounds, table, n, MAXQ=2**bits - 1, SYM=bool(symmetric), G=group_size, GP=gp, BLOCK=block,
        MIN_S=MIN_SCALE, CODE_MIN=QMETA4_CODE_MIN, CODE_MAX=QMETA4_CODE_MAX)
    return out


def launch_qmeta4_mse_refine(weight: Tensor, qmeta: Tensor, grid: Tensor, group_size: int, bits: int,
                             norm: float, scale_dtype: torch.dtype) -> Tensor:
    """L^p grid refinement with the Triton kernel (see ``qmeta4_mse_refine_ref``)."""
    _require_triton()
    w = weight.contiguous()
    q = qmeta.contiguous()
    out = torch.empty_like(q)
    n = q.numel()
    if n == 0:
        return out
    table, bounds = scale_tables(w.device, fresh=_is_traced(w))
    gp, block = _launch_params(group_size)
    grid = grid.contiguous()
    torch.library.wrap_triton(_qmeta4_refine_kernel)[(triton.cdiv(n, block),)](
        w, q, out, grid, bounds, table, n, grid.shape[0], float(norm), MAXQ=2**bits - 1, L2=float(norm) == 2.0,
        SCALE_KIND=_SCALE_KIND[scale_dtype], G=group_size, GP=gp, BLOCK=block, MIN_S=MIN_SCALE,
        CODE_MIN=QMETA4_CODE_MIN, CODE_MAX=QMETA4_CODE_MAX)
    return out
