"""Split-K W4A16 kernel for decode-sized M (AWQ layout).

At M <= 16 a W4A16 matmul is a read of the int4 weight: 0.5 byte per weight against 2 for bf16, so the
ceiling is ~4x over a bf16 GEMV. Getting near it needs many programs in flight: the tiled kernel gives
only OC / BLOCK_N programs (288 for OC = 18432), each walking all of IC. Here IC is also split into
SPLIT_K slices; each program writes fp32 partial sums `[SPLIT_K, M, OC]` and a second small kernel adds
the slices, adds the bias and casts (deterministic, unlike atomics). The dequantized tile is computed by
the tiled kernel's `_awq_dequant_tile`, so both kernels decode the format the same way.
"""
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_w4a16_splitk", "splitk_config"]


if HAS_TRITON:
    from torchforge.ops.awq_triton import _awq_dequant_tile

    @triton.jit
    def _w4a16_splitk_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, part_ptr,
        M, N, K, NP, stride_xm, K_PER_SPLIT,
        GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE_FP32: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = pid_k * K_PER_SPLIT
        for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
            w = _awq_dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, pid_n, N, NP, GROUP_SIZE, BLOCK_N)
            w = w.to(x.dtype)  # round the weight like the reference and the tiled kernel do
            # tl.dot even for M = 1 (rows padded to 16), but M = 1 is dispatched to awq_gemv_triton.py. A variant
            # feeding unscaled codes (magic-number trick) to tl.dot, scale / zero per group, measured 10-20% slower
            # on the H100: this kernel is bound by the tensor-core operand path, not by dequantization arithmetic.
            if IEEE_FP32:  # fp32 activations: no TF32, like torch's default fp32 matmul
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        out = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(out, acc, mask=mask_m[:, None] & (offs_n < N)[None, :])

    @triton.jit
    def _splitk_reduce_kernel(part_ptr, b_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def splitk_config(m: int, k: int, n: int, group_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) for decode sizes. BLOCK_K divides group_size (one scale row
    per tile). From the H100 sweep (`bench/w4a16_linear.py --sweep`, M = 1 and 16, 2026-11-22): BLOCK_N 128,
    BLOCK_K 128, 4 warps; SPLIT_K 8 when OC gives >= 128 column blocks (18432 x 7168: 0.075 ms against 0.081
    with 4) and 4 below (7168 x 7168: 0.034 ms against 0.040 with 16). SPLIT_K falls back to the largest
    power of two whose slice is a whole number of BLOCK_K tiles."""
    bm = 16
    bn = 128
    bk = next(b for b in (128, 64, 32, 16) if group_size % b == 0)
    programs_n = (n + bn - 1) // bn
    split = 1
    for s in (8 if programs_n >= 128 else 4, 4, 2):
        if k % (s * bk) == 0:
            split = s
            break
    return bm, bn, bk, split


def launch_w4a16_splitk(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                        bias: Optional[Tensor] = None, *, block_n: Optional[int] = None,
                        block_k: Optional[int] = None, split_k: Optional[int] = None,
                        num_warps: int = 4, num_stages: int = 3) -> Tensor:
    """`x [..., IC] @ dequant(W).T (+ bias)` for small M (<= 16 rows) with split-K; output in x.dtype."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge split-K kernel needs triton")
    ic, np_ = qweight.shape
    oc = np_ * 8
    lead = x.shape[:-1]
    x2 = x.reshape(-1, ic).contiguous()
    m = x2.shape[0]
    if m > 16:
        raise ValueError(f"launch_w4a16_splitk: M={m} rows; this kernel is for M <= 16")
    bm, bn, bk, split = splitk_config(m, ic, oc, group_size)
    bn, bk, split = block_n or bn, block_k or bk, split_k or split
    if ic % (split * bk) or group_size % bk:
        raise ValueError(f"launch_w4a16_splitk: IC={ic} must be a multiple of split_k*block_k={split * bk} "
                         f"and block_k must divide group_size={group_size}")
    out = torch.empty((m, oc), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, oc)
    part = torch.empty((split, m, oc), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(oc, bn), split)
    torch.library.wrap_triton(_w4a16_splitk_kernel)[grid](
        x2, qweight, scales, qzeros, part, m, oc, ic, np_, x2.stride(0), ic // split,
        GROUP_SIZE=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE_FP32=x.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages)
    has_bias = bias is not None
    block = 1024
    torch.library.wrap_triton(_splitk_reduce_kernel)[(triton.cdiv(m * oc, block),)](
        part, bias if has_bias else part, out, m * oc, oc, SPLIT_K=split, HAS_BIAS=has_bias, BLOCK=block)
    return out.reshape(*lead, oc)
