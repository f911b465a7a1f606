"""Triton AWQ dequantization to W^T [IC, OC] in the activation dtype (or to W [OC, IC], the awq_dequantize op's CUDA
path): one read of the int4 weight, one write.

Used by w4a16_linear for large M, where dequantize-then-cuBLAS beats dequantizing every tile in a GEMM
mainloop: the extra pass (OC * IC * 2 bytes written) is amortized over M rows. W^T is what the tile
decoder produces and what `x @ W^T` wants, so no transpose is needed.
"""
import math

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, stack_launches, tl, triton

__all__ = ["launch_awq_dequantize", "launch_awq_dequantize_t"]

# The tile loads index the stacked words of each input in int32: a launch's qweight, scales and qzeros must each stay
# below 2^31 elements (scales hold 8 / group_size of qweight's words: more than qweight for groups below 8).
_MAX_LAUNCH_ELEMS = 2 ** 31 - 1

if HAS_TRITON:
    from torchforge.ops.awq_triton import _awq_dequant_tile

    @triton.jit
    def _awq_dequant_t_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, NP, ROWS, stride_b, stride_k, stride_n,
                              GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Rows k of the stacked weight [B * ROWS, N] (a batch of matrices stacked along IC: AWQ groups never cross
        # them since ROWS % GROUP_SIZE == 0, and a tile of BLOCK_K | GROUP_SIZE rows stays in one) go to
        # out[b, k % ROWS, n] through the strides: (ROWS * N, N, 1) writes W^T, (N * ROWS, 1, ROWS) writes W.
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = pid_k * BLOCK_K
        w = _awq_dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, pid_n, N, NP, GROUP_SIZE, BLOCK_N)
        base = (k0 // ROWS).to(tl.int64) * stride_b + (k0 % ROWS).to(tl.int64) * stride_k
        out = out_ptr + base + offs_k.to(tl.int64)[:, None] * stride_k + offs_n.to(tl.int64)[None, :] * stride_n
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])


def _launch(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int, dtype: torch.dtype,
            transposed: bool, max_block_k: int = 32, num_warps: int = 4) -> Tensor:
    # Tiles of 32 k x 128 columns, 4 warps, for both forms (H100, twenty-eighth session, W form to bf16: 256 experts
    # of 4096x7168 in 9.9 ms; 8 warps 8.5 ms there but 0.35 against 0.19 ms on one 18432x7168; 64 k rows no better).
    if not HAS_TRITON:
        raise RuntimeError("torchforge dequantize kernel needs triton")
    *lead, ic, np_ = qweight.shape
    oc = np_ * 8
    batch = math.prod(lead)
    bk = next(b for b in (128, 64, 32, 16, 8, 4, 2, 1) if b <= max_block_k and group_size % b == 0)
    bn = 128
    out = torch.empty((*lead, ic, oc) if transposed else (*lead, oc, ic), dtype=dtype, device=qweight.device)
    if out.numel() == 0:
        return out
    strides = (ic * oc, oc, 1) if transposed else (oc * ic, 1, ic)
    q, sc, z, o = (t.contiguous().view(batch, *t.shape[len(lead):]) for t in (qweight, scales, qzeros, out))
    # The tile loads index the stacked inputs in int32 (_MAX_LAUNCH_ELEMS): qweight's ic * np_ words a matrix, and
    # scales' (ic // group_size) * oc, which is the larger for group sizes below 8.
    words = max(ic * np_, (ic // group_size) * oc)
    for i, n in stack_launches(batch, _MAX_LAUNCH_ELEMS // words):
        torch.library.wrap_triton(_awq_dequant_t_kernel)[(n * ic // bk, triton.cdiv(oc, bn))](
            q[i:i + n], sc[i:i + n], z[i:i + n], o[i:i + n], oc, np_, ic, *strides,
            GROUP_SIZE=group_size, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps)
    return out


def launch_awq_dequantize_t(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                            dtype: torch.dtype) -> Tensor:
    """AWQ [..., IC, OC // 8] -> W^T [..., IC, OC] in `dtype` ((q - z) * s in fp32, then rounded)."""
    return _launch(qweight, scales, qzeros, group_size, dtype, transposed=True)


def launch_awq_dequantize(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                          dtype: torch.dtype) -> Tensor:
    """AWQ [..., IC, OC // 8] -> W [..., OC, IC] in `dtype`, the bits of awq_dequantize_ref(q, s.float(), z).to(dtype):
    one launch for a stack of experts."""
    return _launch(qweight, scales, qzeros, group_size, dtype, transposed=False)
