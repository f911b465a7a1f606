"""Grouped W4A16 GEMM over expert-sorted blocks (AWQ layout), the MoE building block for many tokens.

The per-row kernel in awq_triton.py re-reads an expert's weight for every routed row: fine for decode,
ruinous at 512 tokens x top-8. Here rows are first sorted into blocks of BLOCK_M rows of one expert
(`moe_align`, on device, no host sync); program (block, OC tile) gathers its rows of x, streams the
expert's dequantized [BLOCK_K, BLOCK_N] tiles through tl.dot, and scatters the results back to the rows'
original positions. Row r of x is read at x[r // X_ROW_DIV], so the gate_up GEMM can read the [T, H]
hidden states of top-k routing directly (X_ROW_DIV = k) instead of a k-times repeated copy.
Decode-sized calls (few routed rows per expert) go to the grouped GEMV in awq_moe_gemv_triton.py instead
(`awq_moe.use_moe_gemv`).
"""
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton
from torchforge.ops.moe_align import moe_align

__all__ = ["launch_awq_moe_gemm", "moe_block_m"]

if HAS_TRITON:
    from torchforge.ops.awq_triton import _awq_dequant_tile

    @triton.jit
    def _awq_moe_gemm_kernel(
        x_ptr, rows_ptr, bexp_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
        R, N, K, NP, E, stride_x, stride_o, X_ROW_DIV,
        GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE_FP32: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(bexp_ptr + pid_b).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(rows_ptr + pid_b * BLOCK_M + offs_m)
        valid = rows < R
        if e >= E:  # moe_align's bucket of out-of-range ids: NaN rows (blocks past the end hold only padding)
            out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
            nan = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + float("nan")
            tl.store(out, nan.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < N)[None, :])
        else:
            offs_k = tl.arange(0, BLOCK_K)
            x_rows = x_ptr + (rows // X_ROW_DIV).to(tl.int64)[:, None] * stride_x
            ng = K // GROUP_SIZE
            qw_e = qw_ptr + e * K * NP
            s_e = s_ptr + e * ng * N
            z_e = z_ptr + e * ng * NP
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=valid[:, None], other=0.0)
                w = _awq_dequant_tile(qw_e, s_e, z_e, k0, offs_k, pid_n, N, NP, GROUP_SIZE, BLOCK_N).to(x.dtype)
                if IEEE_FP32:
                    acc = tl.dot(x, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w, acc)
            out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < N)[None, :])


def moe_block_m(num_rows: int, num_experts: int) -> int:
    """Rows per block: about the mean rows per expert, between 16 (tl.dot's minimum) and 64."""
    mean = num_rows / max(num_experts, 1)
    return 16 if mean <= 16 else (32 if mean <= 32 else 64)


def launch_awq_moe_gemm(x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor,
                        group_size: int, *, x_row_div: int = 1, block_m: Optional[int] = None,
                        block_n: Optional[int] = None, block_k: Optional[int] = None, num_warps: int = 4,
                        num_stages: int = 3) -> Tensor:
    """out[r] = x[r // x_row_div] @ dequant(W[expert_ids[r]]).T for r < R = expert_ids.numel(); [R, OC]."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge MoE GEMM kernel needs triton")
    E, K, NP = qweight.shape
    N = NP * 8
    R = expert_ids.numel()
    out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    if R == 0:
        return out
    bm = block_m or moe_block_m(R, E)
    # Tiles from the H100 sweep (`bench/moe_w4a16.py --sweep`, DeepSeek-V3 experts, 2026-11-22): BLOCK_K 128
    # won at every M (gate_up at M = 8: 0.83 ms against 0.98 with 64); BLOCK_N 64 below 256 routed rows, 128
    # from there (M = 64 x top-8: 3.04 ms against 3.39 with 64); 4 warps, 3 stages.
    bk = block_k or next(b for b in (128, 64, 32, 16) if group_size % b == 0)
    block_n = block_n or (64 if R < 256 else 128)
    rows, block_expert = moe_align(expert_ids, E, bm)
    x = x.contiguous()
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    torch.library.wrap_triton(_awq_moe_gemm_kernel)[grid](
        x, rows, block_expert, qweight.contiguous(), scales.contiguous(), qzeros.contiguous(), out,
        R, N, K, NP, E, x.stride(0), out.stride(0), x_row_div,
        GROUP_SIZE=group_size, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=bk, IEEE_FP32=x.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages)
    return out
