"""Triton kernel for the inner (per-column) loop of one GPTQ block, for many matrices at once.

One program owns one (matrix ``b``, tile of ``BLOCK_R`` output rows) and the block's ``KB <= BLOCK_K``
columns as a ``[BLOCK_R, BLOCK_K]`` fp32 register tile. For each column ``i`` of the block it:

1. extracts the column (``sum(where(cols == i, W, 0))``: registers cannot be indexed dynamically),
2. quantizes it with the group's effective scale / zero point (``q = clamp(rne(w / s) + z, 0, maxq)``,
   true division, round half to even: the reference's formula),
3. ``err = (w - (q - z) * s) / U[i, i]`` and stores code and error (strided column stores),
4. loads row ``i`` of the block's Cholesky factor ``U`` (``U[i, i+1:]``) and updates the later columns of
   the tile in registers: ``W[:, i+1:] -= err * U[i, i+1:]``.

The Python side (``torchforge.gptq.solver.solve_batched``) loops over blocks only: qmeta for the block's
group, this kernel, then the lazy update of every later column as one batched matmul. All arguments are
strided views (no copies of ``W`` / ``U`` slices). Rounding uses ``floor`` (exact) because libdevice
``rint`` has no interpreter implementation; the tests launch the kernel on CPU under TRITON_INTERPRET=1.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_gptq_block"]

if HAS_TRITON:
    from torchforge.ops.qmeta4_triton import rne

    @triton.jit
    def _gptq_block_kernel(
        w_ptr, u_ptr, s_ptr, z_ptr, codes_ptr, err_ptr,
        OC, KB,
        s_wb, s_wr, s_wc,
        s_ub, s_ur, s_uc,
        s_sb, s_sr,
        s_cb, s_cr, s_cc,
        s_eb, s_er, s_ec,
        MAXQ: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_K)
        rmask = rows < OC
        cmask = cols < KB
        rows64 = rows.to(tl.int64)
        w_tile = w_ptr + b * s_wb + rows64[:, None] * s_wr + cols[None, :] * s_wc
        W = tl.load(w_tile, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        s = tl.load(s_ptr + b * s_sb + rows64 * s_sr, mask=rmask, other=1.0)
        z = tl.load(z_ptr + b * s_sb + rows64 * s_sr, mask=rmask, other=0.0)
        u_base = u_ptr + b * s_ub
        c_base = codes_ptr + b * s_cb + rows64 * s_cr
        e_base = err_ptr + b * s_eb + rows64 * s_er
        for i in range(KB):
            w = tl.sum(tl.where(cols[None, :] == i, W, 0.0), axis=1)
            q = tl.minimum(tl.maximum(rne(tl.math.div_rn(w, s)) + z, 0.0), MAXQ * 1.0)
            d = tl.load(u_base + i * s_ur + i * s_uc)
            err = tl.math.div_rn(w - (q - z) * s, d)
            tl.store(c_base + i * s_cc, q.to(tl.uint8), mask=rmask)
            tl.store(e_base + i * s_ec, err, mask=rmask)
            u_row = tl.load(u_base + i * s_ur + cols * s_uc, mask=cmask & (cols > i), other=0.0)
            W = W - err[:, None] * u_row[None, :]


def _require_triton():
    if not HAS_TRITON:
        raise RuntimeError("torchforge's GPTQ block kernel needs triton; use backend='torch' or install triton")


def launch_gptq_block(w: Tensor, u: Tensor, scale: Tensor, zero: Tensor, codes: Tensor, err: Tensor, maxq: int,
                      *, block_r: Optional[int] = None, num_warps: Optional[int] = None) -> None:
    """One GPTQ block for ``B`` matrices, in place.

    ``w [B, OC, KB]`` fp32 (the block's columns, read only), ``u [B, KB, KB]`` fp32 (the block's diagonal
    block of the upper Cholesky factor of ``H^-1``), ``scale`` / ``zero`` ``[B, OC]`` fp32 (the group's
    effective scale and zero point), outputs ``codes [B, OC, KB]`` uint8 and ``err [B, OC, KB]`` fp32
    (``(w - w_hat) / U[i, i]``, what the lazy update multiplies). Any strides.
    """
    _require_triton()
    nb, oc, kb = w.shape
    if nb == 0 or oc == 0 or kb == 0:
        return
    block_k = max(16, triton.next_power_of_2(kb))
    br = block_r or max(16, min(64, 4096 // block_k))
    nw = num_warps or (4 if block_k <= 128 else 8)
    grid = (nb, triton.cdiv(oc, br))
    _gptq_block_kernel[grid](
        w, u, scale, zero, codes, err, oc, kb,
        w.stride(0), w.stride(1), w.stride(2),
        u.stride(0), u.stride(1), u.stride(2),
        scale.stride(0), scale.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2),
        err.stride(0), err.stride(1), err.stride(2),
        MAXQ=maxq, BLOCK_R=br, BLOCK_K=block_k, num_warps=nw,
    )
