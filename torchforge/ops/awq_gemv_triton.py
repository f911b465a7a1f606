"""W4A16 GEMV for one activation row (decode at batch 1), AWQ layout, without tensor cores.

At M = 1 the split-K tl.dot kernel pads the row to 16 and routes every dequantized tile through the MMA
operand path; here each thread owns whole packed words (8 output columns) and walks K with plain FMAs, so
the reduction over K stays inside the thread. Per element: one shift, one AND-OR, one FADD, one FFMA:

- the code is not shifted down to bit 0 but masked in place at bit `pos` <= 16 (nibbles 5, 6, 7 are first
  shifted right by 4, 8, 12) and OR-ed into the 23-bit mantissa of 2^23, so `bitcast(bits) - 2^23 = q * 2^pos`
  exactly (the int-to-float conversion, a quarter-rate instruction, is avoided);
- scale and zero are applied once per group and column: sum_k x q s - z s sum_k x, with the 2^-pos undone
  there too.

Partial sums of SPLIT_K slices of K go to fp32 `[SPLIT_K, OC]` and the split-K kernel's reduce step adds them
(deterministic, no atomics), adds the bias and casts.
"""
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_w4a16_gemv", "gemv_config"]

if HAS_TRITON:

    @triton.jit
    def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, part_ptr, N, NP, GROUPS_PER_SPLIT,
                           GROUP_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_w = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # packed words = 8 output columns each
        mask_w = offs_w < NP
        p = tl.arange(0, 8)  # nibble position in the word
        down = tl.where(p >= 5, 4 * p - 16, 0)
        pos = 4 * p - down
        field = tl.full((8,), 0xF, tl.int32) << pos
        undo = tl.exp2(-pos.to(tl.float32))
        col = tl.where(p < 4, 2 * p, 2 * p - 7)  # AWQ order: nibble p holds column 0, 2, 4, 6, 1, 3, 5, 7
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_W, 8), dtype=tl.float32)
        g_begin = pid_k * GROUPS_PER_SPLIT
        for g in range(g_begin, g_begin + GROUPS_PER_SPLIT):
            part = tl.zeros((BLOCK_W, 8), dtype=tl.float32)
            xs = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, GROUP_SIZE, BLOCK_K):
                k = g * GROUP_SIZE + k0 + offs_k
                w = tl.load(qw_ptr + k[:, None] * NP + offs_w[None, :], mask=mask_w[None, :], other=0)
                xv = tl.load(x_ptr + k).to(tl.float32)
                bits = ((w[:, :, None] >> down[None, None, :]) & field[None, None, :]) | 0x4B000000
                q = bits.to(tl.float32, bitcast=True) - 8388608.0  # q * 2^pos, exact
                part += tl.sum(q * xv[:, None, None], axis=0)
                xs += xv
            offs_c = offs_w[:, None] * 8 + col[None, :]
            s = tl.load(s_ptr + g * N + offs_c, mask=mask_w[:, None], other=0.0).to(tl.float32)
            zw = tl.load(z_ptr + g * NP + offs_w, mask=mask_w, other=0)
            z = ((zw[:, None] >> (4 * p)[None, :]) & 0xF).to(tl.float32)
            acc += s * (part * undo[None, :] - z * tl.sum(xs, axis=0))
        out = part_ptr + pid_k * N + offs_w[:, None] * 8 + col[None, :]
        tl.store(out, acc, mask=mask_w[:, None])


def gemv_config(k: int, n: int, group_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_W, BLOCK_K, SPLIT_K, num_warps). From the H100 sweep (`bench/w4a16_linear.py --gemv-sweep`,
    2026-11-22): two groups per K slice was best on both DeepSeek-V3 shapes; 18432 x 7168: BLOCK_W 64, BLOCK_K
    32, 2 warps, 0.043 ms (split-K kernel 0.074, bf16 0.094); 7168 x 7168: BLOCK_W 64, BLOCK_K 16, 4 warps,
    0.022 ms (0.034, 0.040)."""
    groups = k // group_size
    split = groups // 2 if groups % 2 == 0 else groups
    if n // 8 >= 2048:
        return 64, min(32, group_size), split, 2
    return 64, min(16, group_size), split, 4


def launch_w4a16_gemv(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                      bias: Optional[Tensor] = None, *, block_w: Optional[int] = None, block_k: Optional[int] = None,
                      split_k: Optional[int] = None, num_warps: Optional[int] = None) -> Tensor:
    """`x [..., IC]` holding one row, `@ dequant(W).T (+ bias)`; output in x.dtype."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge GEMV kernel needs triton")
    from torchforge.ops.awq_splitk_triton import _splitk_reduce_kernel

    ic, np_ = qweight.shape
    oc = np_ * 8
    if x.numel() != ic:
        raise ValueError(f"launch_w4a16_gemv: x has {x.numel() // ic} rows; this kernel takes exactly one")
    bw, bk, split, warps = gemv_config(ic, oc, group_size)
    bw, bk, split, warps = block_w or bw, block_k or bk, split_k or split, num_warps or warps
    groups = ic // group_size
    if groups % split or group_size % bk:
        raise ValueError(f"launch_w4a16_gemv: split_k={split} must divide the {groups} groups and block_k={bk} "
                         f"must divide group_size={group_size}")
    x1 = x.reshape(ic).contiguous()
    part = torch.empty((split, oc), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(np_, bw), split)
    torch.library.wrap_triton(_w4a16_gemv_kernel)[grid](
        x1, qweight, scales, qzeros, part, oc, np_, groups // split,
        GROUP_SIZE=group_size, BLOCK_W=bw, BLOCK_K=bk, num_warps=warps)
    out = torch.empty((1, oc), dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    block = 1024
    torch.library.wrap_triton(_splitk_reduce_kernel)[(triton.cdiv(oc, block),)](
        part, bias if has_bias else part, out, oc, oc, SPLIT_K=split, HAS_BIAS=has_bias, BLOCK=block)
    return out.reshape(*x.shape[:-1], oc)
