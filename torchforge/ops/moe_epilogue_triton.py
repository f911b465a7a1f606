"""Split-K reduce kernels with the MoE epilogues fused in, for the decode (grouped GEMV) path.

The grouped GEMVs write fp32 partial sums `[SPLIT_K, R, N]`; instead of a plain reduce followed by separate
chunk / SiLU / multiply (gate_up) or view / multiply by router weights / sum (down) kernels, one reduce does it:

- `_silu_mul_reduce_kernel`: h[r, i] = SiLU(gate) * up with gate = sum_s part[s, r, i], up = part[s, r, I + i];
- `_combine_reduce_kernel`: out[t, n] = sum_j w[t, j] * sum_s part[s, t * k + j, n].

Both round where the unfused PyTorch sequence rounds (the GEMM output to the activation dtype; SiLU's result;
the product; the weighted sum, accumulated in fp32), so the fused path returns what the unfused one would, up
to the last bit of `exp` and the order of the fp32 sum over the k picks. At M = 1 this removes five small
launches per MoE layer, which is a large share of a 0.1 ms layer.
"""
import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_combine_reduce", "launch_silu_mul_reduce"]

if HAS_TRITON:

    @triton.jit
    def _silu_mul_reduce_kernel(part_ptr, out_ptr, R, I, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < R * I
        r = offs // I
        i = offs % I
        g_ptrs = part_ptr + r.to(tl.int64) * (2 * I) + i
        gate = tl.zeros((BLOCK,), dtype=tl.float32)
        up = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):  # step the 64-bit pointer slab by slab: no int32 product of s * R * 2I
            gate += tl.load(g_ptrs, mask=mask, other=0.0)
            up += tl.load(g_ptrs + I, mask=mask, other=0.0)
            g_ptrs += R * 2 * I
        dt = out_ptr.dtype.element_ty
        gate = gate.to(dt).to(tl.float32)  # the GEMM output in the activation dtype, as unfused
        up = up.to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu: fp32 math, one rounding
        tl.store(out_ptr + offs, (act * up).to(dt), mask=mask)

    @triton.jit
    def _combine_reduce_kernel(part_ptr, w_ptr, out_ptr, T, N, TOP_K, stride_wt, SPLIT_K: tl.constexpr,
                               BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < T * N
        t = offs // N
        n = offs % N
        dt = out_ptr.dtype.element_ty
        R = T * TOP_K
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(TOP_K):
            row = t * TOP_K + j
            d = tl.zeros((BLOCK,), dtype=tl.float32)
            for s in range(SPLIT_K):
                d += tl.load(part_ptr + (s * R + row).to(tl.int64) * N + n, mask=mask, other=0.0)
            w = tl.load(w_ptr + t * stride_wt + j, mask=mask, other=0.0).to(tl.float32)
            acc += d.to(dt).to(tl.float32) * w
        tl.store(out_ptr + offs, acc.to(dt), mask=mask)


def launch_silu_mul_reduce(part: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 partials `[S, R, 2I]` of the gate_up GEMV -> `SiLU(gate) * up` `[R, I]` in `dtype`."""
    split, rows, two_i = part.shape
    inter = two_i // 2
    out = torch.empty((rows, inter), dtype=dtype, device=part.device)
    if out.numel():
        block = 1024
        torch.library.wrap_triton(_silu_mul_reduce_kernel)[(triton.cdiv(rows * inter, block),)](
            part, out, rows, inter, SPLIT_K=split, BLOCK=block)
    return out


def launch_combine_reduce(part: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 partials `[S, T * k, N]` of the down GEMV and router weights `[T, k]` -> `[T, N]` in `dtype`."""
    split, _, n = part.shape
    tokens, top_k = weights.shape
    weights = weights.contiguous()
    out = torch.empty((tokens, n), dtype=dtype, device=part.device)
    if out.numel():
        block = 1024
        torch.library.wrap_triton(_combine_reduce_kernel)[(triton.cdiv(tokens * n, block),)](
            part, weights, out, tokens, n, top_k, weights.stride(0), SPLIT_K=split, BLOCK=block)
    return out
