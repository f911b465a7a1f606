"""Triton AWQ dequantization to W^T [IC, OC] in the activation dtype: one read of the int4 weight, one write.

Used by w4a16_linear for large M, where dequantize-then-cuBLAS beats dequantizing every tile in a GEMM
mainloop: the extra pass (OC * IC * 2 bytes written) is amortized over M rows. W^T is what the tile
decoder produces and what `x @ W^T` wants, so no transpose is needed.
"""
import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_awq_dequantize_t"]

if HAS_TRITON:
    from torchforge.ops.awq_triton import _awq_dequant_tile

    @triton.jit
    def _awq_dequant_t_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, NP, GROUP_SIZE: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = pid_k * BLOCK_K
        w = _awq_dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, pid_n, N, NP, GROUP_SIZE, BLOCK_N)
        out = out_ptr + (k0 + offs_k).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])


def launch_awq_dequantize_t(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                            dtype: torch.dtype) -> Tensor:
    """AWQ [IC, OC // 8] -> W^T [IC, OC] in `dtype` ((q - z) * s in fp32, then rounded)."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge dequantize kernel needs triton")
    ic, np_ = qweight.shape
    oc = np_ * 8
    bk = next(b for b in (32, 16, 8, 4, 2, 1) if group_size % b == 0)
    bn = 128
    out = torch.empty((ic, oc), dtype=dtype, device=qweight.device)
    grid = (ic // bk, triton.cdiv(oc, bn))
    torch.library.wrap_triton(_awq_dequant_t_kernel)[grid](
        qweight.contiguous(), scales.contiguous(), qzeros.contiguous(), out, oc, np_,
        GROUP_SIZE=group_size, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out
