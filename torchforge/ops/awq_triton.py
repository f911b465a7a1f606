"""Triton kernels for AWQ W4 (4-bit weight, 16-bit activation) matmuls.

Kernels exist only when triton imports (`HAS_TRITON`). The `launch_*` functions allocate the output
and launch through `torch.library.wrap_triton`, so they can be called from a `triton_op` body (traced
by torch.compile) and directly on CPU tensors under TRITON_INTERPRET=1 (tests).

Both kernels dequantize a `[BLOCK_K, BLOCK_N]` weight tile in registers: the int32 word of column `n`
is at `k * (OC // 8) + n // 8` and its nibble at bits `4 * ((n % 8) // 2 + 4 * (n % 2))` (AWQ order
0, 2, 4, 6, 1, 3, 5, 7); `w = (q - z) * s` in fp32, rounded to the activation dtype (like the
reference), and the products are accumulated in fp32. BLOCK_K divides group_size, so one K tile uses a
single row of scales / qzeros. Arguments are assumed validated by `torchforge.ops.awq`.
"""
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_w4a16_linear", "launch_awq_grouped_linear", "pick_block_k", "tile_config"]


def tile_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K cap, num_warps, num_stages) of the tiled W4A16 kernels by rows M: untuned
    defaults from one sweep on an H100 (7168 x 7168, bf16, group 128); the GPTQ-layout kernel uses them too."""
    if m <= 16:
        return (16, 64, 64, 4, 4)
    if m <= 64:
        return (64, 128, 64, 4, 4)
    return (128, 128, 32, 4, 4)


def pick_block_k(group_size: int, cap: int = 64) -> int:
    """Largest power of two <= cap dividing group_size (0 if below 16: tl.dot needs K >= 16)."""
    bk = cap
    while bk >= 16:
        if group_size % bk == 0:
            return bk
        bk //= 2
    return 0


if HAS_TRITON:

    @triton.jit
    def _awq_nibbles(words, pid_n, BLOCK_N: tl.constexpr):
        """`[..., BLOCK_N // 8]` packed words -> `[..., BLOCK_N]` int32 codes of output columns
        pid_n * BLOCK_N + arange(BLOCK_N). Each word is loaded once and repeated 8 times along N with three
        interleaves, so column n holds word n // 8 (loading [.., BLOCK_N] words directly would move every
        word 8 times through the memory pipeline); then column n takes its nibble in AWQ order."""
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        shifts = (((offs_n % 8) // 2) + 4 * (offs_n % 2)) * 4
        # `>>` is arithmetic on int32: the 0xF mask drops the sign extension of negative words.
        return (words >> shifts) & 0xF

    @triton.jit
    def _awq_code_tile(qw_ptr, k0, offs_k, pid_n, NP, BLOCK_N: tl.constexpr):
        """int32 `[BLOCK_K, BLOCK_N]` codes of rows k0 + offs_k."""
        offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        qw = tl.load(qw_ptr + (k0 + offs_k)[:, None] * NP + offs_w[None, :], mask=(offs_w < NP)[None, :], other=0)
        return _awq_nibbles(qw, pid_n, BLOCK_N)

    @triton.jit
    def _awq_group_params(s_ptr, z_ptr, k0, pid_n, N, NP, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """(fp32 scale, int32 zero) `[BLOCK_N]` of the group holding row k0."""
        g = k0 // GROUP_SIZE
        offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        z = _awq_nibbles(tl.load(z_ptr + g * NP + offs_w, mask=offs_w < NP, other=0), pid_n, BLOCK_N)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        s = tl.load(s_ptr + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        return s, z

    @triton.jit
    def _awq_dequant_tile(
        qw_ptr, s_ptr, z_ptr, k0, offs_k, pid_n, N, NP, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """fp32 `[BLOCK_K, BLOCK_N]` tile of (q - z) * s for rows k0 + offs_k (one group) and output
        columns pid_n * BLOCK_N + arange(BLOCK_N)."""
        q = _awq_code_tile(qw_ptr, k0, offs_k, pid_n, NP, BLOCK_N)
        s, z = _awq_group_params(s_ptr, z_ptr, k0, pid_n, N, NP, GROUP_SIZE, BLOCK_N)
        return (q - z[None, :]).to(tl.float32) * s[None, :]

    @triton.jit
    def _w4a16_linear_kernel(
        x_ptr,
        qw_ptr,
        s_ptr,
        z_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        NP,
        stride_xm,
        stride_xk,
        stride_om,
        HAS_BIAS: tl.constexpr,
        IEEE_FP32: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(x_rows + kk[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
            w = _awq_dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, pid_n, N, NP, GROUP_SIZE, BLOCK_N)
            w = w.to(x.dtype)
            if IEEE_FP32:
                # fp32 activations: no TF32, to match torch's default fp32 matmul precision.
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _awq_grouped_linear_kernel(
        x_ptr,
        ids_ptr,
        qw_ptr,
        s_ptr,
        z_ptr,
        out_ptr,
        N,
        K,
        NP,
        E,
        stride_xr,
        stride_xk,
        stride_or,
        GROUP_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # One program per (row, OC block): a GEMV against the weight of the row's expert.
        row = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        eid = tl.load(ids_ptr + row).to(tl.int64)
        # Out-of-range ids are not checked on the host (that would sync): the row reads expert 0's
        # weight (in bounds) and is written as NaN, so the error is visible instead of a bad read.
        valid = (eid >= 0) & (eid < E)
        eid = tl.where(valid, eid, 0)
        ng = K // GROUP_SIZE
        qw_e = qw_ptr + eid * K * NP
        s_e = s_ptr + eid * ng * N
        z_e = z_ptr + eid * ng * NP
        x_row = x_ptr + row.to(tl.int64) * stride_xr
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + (k0 + offs_k) * stride_xk)
            w = _awq_dequant_tile(qw_e, s_e, z_e, k0, offs_k, pid_n, N, NP, GROUP_SIZE, BLOCK_N)
            w = w.to(x.dtype).to(tl.float32)
            acc += tl.sum(x.to(tl.float32)[:, None] * w, axis=0)
        acc = tl.where(valid, acc, float("nan"))
        out_ptrs = out_ptr + row.to(tl.int64) * stride_or + offs_n
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _require_triton():
    if not HAS_TRITON:
        raise RuntimeError("torchforge AWQ Triton kernels need triton; install it or use CPU tensors")


def launch_w4a16_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    qzeros: Tensor,
    group_size: int,
    bias: Optional[Tensor] = None,
    *,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> Tensor:
    """`x [..., IC] @ dequant(W).T (+ bias)` with the Triton kernel; output `[..., OC]` in x.dtype.

    Needs `group_size % 16 == 0` (the caller falls back to the reference otherwise).
    """
    _require_triton()
    ic = qweight.shape[-2]
    np_ = qweight.shape[-1]
    oc = np_ * 8
    lead = x.shape[:-1]
    x2 = x.reshape(-1, ic)
    m = x2.shape[0]
    out = torch.empty((m, oc), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, oc)
    cfg = tile_config(m)
    bm = block_m or cfg[0]
    bn = block_n or cfg[1]
    bk = block_k or pick_block_k(group_size, cap=cfg[2])
    num_warps = num_warps or cfg[3]
    num_stages = num_stages or cfg[4]
    assert bk >= 16 and group_size % bk == 0, "BLOCK_K must be >= 16 and divide group_size"
    assert bn >= 16 and bn & (bn - 1) == 0, "BLOCK_N must be a power of two >= 16"
    qweight = qweight.contiguous()
    scales = scales.contiguous()
    qzeros = qzeros.contiguous()
    has_bias = bias is not None
    b = bias.contiguous() if has_bias else scales  # dummy pointer when there is no bias
    grid = (triton.cdiv(m, bm), triton.cdiv(oc, bn))
    torch.library.wrap_triton(_w4a16_linear_kernel)[grid](
        x2,
        qweight,
        scales,
        qzeros,
        b,
        out,
        m,
        oc,
        ic,
        np_,
        x2.stride(0),
        x2.stride(1),
        out.stride(0),
        HAS_BIAS=has_bias,
        IEEE_FP32=x.dtype == torch.float32,
        GROUP_SIZE=group_size,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.reshape(*lead, oc)


def launch_awq_grouped_linear(
    x: Tensor,
    expert_ids: Tensor,
    qweight: Tensor,
    scales: Tensor,
    qzeros: Tensor,
    group_size: int,
    *,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
) -> Tensor:
    """Row `r` of the `[R, OC]` output is `x[r] @ dequant(W[expert_ids[r]]).T`; one program per
    (row, OC block). Rows with an expert id outside `[0, E)` come out as NaN (no host-side check)."""
    _require_triton()
    num_experts, ic, np_ = qweight.shape
    oc = np_ * 8
    r = x.shape[0]
    out = torch.empty((r, oc), dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    if num_experts == 0:  # every id is out of range; the kernel would read "expert 0" from an empty tensor
        return out.fill_(float("nan"))
    bn = block_n or 64
    bk = block_k or pick_block_k(group_size)
    assert bk >= 1 and group_size % bk == 0, "BLOCK_K must divide group_size"
    assert bn >= 16 and bn & (bn - 1) == 0, "BLOCK_N must be a power of two >= 16"
    qweight = qweight.contiguous()
    scales = scales.contiguous()
    qzeros = qzeros.contiguous()
    expert_ids = expert_ids.contiguous()
    grid = (r, triton.cdiv(oc, bn))
    torch.library.wrap_triton(_awq_grouped_linear_kernel)[grid](
        x,
        expert_ids,
        qweight,
        scales,
        qzeros,
        out,
        oc,
        ic,
        np_,
        num_experts,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return out
