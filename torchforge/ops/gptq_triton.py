"""Triton W4A16 matmul for the GPTQ layout (structure of ``awq_triton._w4a16_linear_kernel``).

The ``[BLOCK_K, BLOCK_N]`` weight tile is dequantized in registers: input row ``k`` of output column ``n``
is nibble ``k % 8`` of word ``qweight[k // 8, n]``; its group is ``g_idx[k]`` (so act-order checkpoints
work too), scale ``scales[g, n]`` and zero ``((qzeros[g, n // 8] >> 4 (n % 8)) & 0xF) + 1`` (v1).
``w = (q - z) * s`` in fp32, rounded to the activation dtype (like the reference), fp32 accumulation.
Scales and zeros are gathered per K row through ``g_idx``; without act-order consecutive rows hit the
same cache lines. Arguments are assumed validated by :mod:`torchforge.ops.gptq`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._triton import CUDA_MAX_GRID_Z, HAS_TRITON, stack_launches, tl, triton
from torchforge.ops.awq_mma_cuda import _sm_count
from torchforge.ops.awq_wgmma_cost import H100_SMS

__all__ = ["launch_gptq_dequantize", "launch_w4a16_gptq_linear"]

if HAS_TRITON:

    @triton.jit
    def _w4a16_gptq_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr,
        M, N, K, NP, K_PER_SPLIT,
        stride_xm, stride_xk, stride_om,
        HAS_BIAS: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # K slices (grid dimension 2): program (.., .., s) sums k in [s K_PER_SPLIT, (s + 1) K_PER_SPLIT) into fp32
        # partials out[s, m, n], which the launcher adds; one slice: the whole K, bias and the output dtype here
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        zshift = (offs_n % 8) * 4
        kshift = (offs_k % 8) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = pid_k * K_PER_SPLIT
        k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < k_hi
            x = tl.load(x_rows + kk[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            wmask = mask_k[:, None] & mask_n[None, :]
            qw = tl.load(qw_ptr + (kk // 8).to(tl.int64)[:, None] * N + offs_n[None, :], mask=wmask, other=0)
            g = tl.load(g_ptr + kk, mask=mask_k, other=0).to(tl.int64)
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=wmask, other=0.0).to(tl.float32)
            zw = tl.load(z_ptr + g[:, None] * NP + (offs_n // 8)[None, :], mask=wmask, other=0)
            # `>>` is arithmetic on int32: the 0xF mask drops the sign extension of negative words.
            q = (qw >> kshift[:, None]) & 0xF
            z = ((zw >> zshift[None, :]) & 0xF) + 1
            w = ((q - z).to(tl.float32) * s).to(x.dtype)
            if IEEE_FP32:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        out_ptrs = out_ptr + pid_k.to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _gptq_dequant_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, NP, NG,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[b, n, k] = (q - (z + 1)) * s in fp32 for group g_idx[k], rounded to out's dtype: the GEMM kernel's tile,
        stored as W (k contiguous). A k whose g_idx lies outside [0, NG) gives NaN (no read past scales: on CUDA the
        op does not check g_idx, which would need a host sync)."""
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_k = offs_k < K
        mask_n = offs_n < N
        g = tl.load(g_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)
        ok_g = (g >= 0) & (g < NG)
        wmask = (mask_k & ok_g)[:, None] & mask_n[None, :]
        qw = tl.load(qw_ptr + b * (K // 8) * N + (offs_k // 8).to(tl.int64)[:, None] * N + offs_n[None, :],
                     mask=wmask, other=0)
        s = tl.load(s_ptr + b * NG * N + g[:, None] * N + offs_n[None, :], mask=wmask, other=0.0).to(tl.float32)
        zw = tl.load(z_ptr + b * NG * NP + g[:, None] * NP + (offs_n // 8)[None, :], mask=wmask, other=0)
        q = (qw >> ((offs_k % 8) * 4)[:, None]) & 0xF
        z = ((zw >> ((offs_n % 8) * 4)[None, :]) & 0xF) + 1
        w = tl.where(ok_g[:, None], (q - z).to(tl.float32) * s, float("nan"))
        out = out_ptr + b * N * K + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


_MAX_GRID_Z = CUDA_MAX_GRID_Z  # the matrices of a stack go on grid dimension 2


def launch_gptq_dequantize(qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor) -> Tensor:
    """GPTQ [..., IC // 8, OC] -> W [..., OC, IC] in scales' dtype, the bits of gptq_dequantize_ref: one launch for a
    stack of matrices (the reference's temporaries are several fp32 tensors of the weight's size)."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge GPTQ Triton kernels need triton; install it or use CPU tensors")
    *lead, kp, oc = qweight.shape
    ic, ng, np_ = kp * 8, scales.shape[-2], qzeros.shape[-1]
    batch = math.prod(lead)
    out = torch.empty((*lead, oc, ic), dtype=scales.dtype, device=qweight.device)
    if out.numel() == 0:
        return out
    q, s, z, o = (t.contiguous().view(batch, *t.shape[len(lead):]) for t in (qweight, scales, qzeros, out))
    bk, bn = 64, 64
    for i, nb in stack_launches(batch, _MAX_GRID_Z):
        torch.library.wrap_triton(_gptq_dequant_kernel)[(triton.cdiv(ic, bk), triton.cdiv(oc, bn), nb)](
            q[i:i + nb], s[i:i + nb], z[i:i + nb], g_idx.contiguous(), o[i:i + nb], oc, ic, np_, ng,
            BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out


def gptq_tile_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by rows M, from `bench/gptq_act_order.py --kernel-sweep`
    (H100, twenty-ninth session, 18432x7168 and 7168x7168 at 1-256 rows, act-order and not). One stage: Triton's
    software pipelining of the per-row scale and zero gathers made every config with 2 or 4 stages 4-17x slower
    (18432x7168 at one row: 3.15 ms with the AWQ kernel's (16, 64, 64, 4 warps, 4 stages), 0.185 with one stage
    and 8 K slices)."""
    if m <= 16:
        return (16, 64, 64, 4, 1)
    if m <= 64:
        return (64, 64, 64, 4, 1)
    return (128, 64, 64, 8, 1)


def gptq_split_k(m: int, k: int, n: int, block_m: int, block_n: int, block_k: int, sms: int = H100_SMS) -> int:
    """K slices for the GPTQ-layout kernel where the output tiles alone leave SMs idle, each slice at least 8 steps of
    block_k: up to 16 programs an SM and 8 slices for decode tiles (block_m 16: 18432x7168 at one row, 288 tiles of
    64 columns, ran 0.185 ms in 8 slices, 0.20 in 4, 0.27 in 2), about 4 an SM for larger tiles (as swept)."""
    tiles = -(-m // block_m) * -(-n // block_n)
    steps = -(-k // block_k)
    per_sm, cap = (16, 8) if block_m <= 16 else (4, steps)
    return max(1, min(-(-per_sm * sms // tiles), cap, steps // 8))


def launch_w4a16_gptq_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor, bias: Optional[Tensor] = None, *,
    block_m: Optional[int] = None, block_n: Optional[int] = None, block_k: Optional[int] = None,
    num_warps: Optional[int] = None, num_stages: Optional[int] = None, split_k: Optional[int] = None,
) -> Tensor:
    """``x [..., IC] @ dequant(W).T (+ bias)`` with the Triton kernel; output ``[..., OC]`` in ``x.dtype``.
    ``split_k`` (None: gptq_split_k): K slices summed in fp32, in slice order (deterministic)."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge GPTQ Triton kernels need triton; install it or use CPU tensors")
    ic = qweight.shape[-2] * 8
    oc = qweight.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), ic)  # not -1: IC = 0 leaves the row count ambiguous
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, oc))
    cfg = gptq_tile_config(m)
    bm, bn, bk = block_m or cfg[0], block_n or cfg[1], block_k or cfg[2]
    assert bk >= 16 and bk % 8 == 0 and bn >= 16, "BLOCK_K must be a multiple of 8 >= 16, BLOCK_N >= 16"
    qweight, scales, qzeros, g_idx = qweight.contiguous(), scales.contiguous(), qzeros.contiguous(), g_idx.contiguous()
    splits = split_k or gptq_split_k(m, ic, oc, bm, bn, bk, _sm_count(x.device.index) if x.is_cuda else H100_SMS)
    k_per = triton.cdiv(triton.cdiv(ic, bk), splits) * bk  # whole block_k steps per slice
    splits = triton.cdiv(ic, k_per) if ic else 1
    has_bias = bias is not None and splits == 1
    b = bias.contiguous() if has_bias else scales
    dest = torch.empty((splits, m, oc) if splits > 1 else (m, oc), dtype=torch.float32 if splits > 1 else x.dtype,
                       device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(oc, bn), splits)
    torch.library.wrap_triton(_w4a16_gptq_kernel)[grid](
        x2, qweight, scales, qzeros, g_idx, b, dest,
        m, oc, ic, qzeros.shape[-1], k_per,
        x2.stride(0), x2.stride(1), oc,
        HAS_BIAS=has_bias, IEEE_FP32=x.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=num_warps or cfg[3], num_stages=num_stages or cfg[4],
    )
    out = dest
    if splits > 1:  # torch's sum over the slices: deterministic (no atomics)
        acc = dest.sum(0)
        out = (acc if bias is None else acc + bias.float()).to(x.dtype)
    return out.reshape(*lead, oc)
