"""Triton dequantization of the mma layout (`torchforge.ops.awq_mma_layout`) to W^T [IC, OC] in the activation
dtype, for `awq_mma_linear` at large M (dequantize once, then cuBLAS), as `awq_dequant_triton` does for AWQ.

One program per 64-k chunk of a 64-column block (inside one quantization group: groups of 64 or more rows). It
writes its [64, 64] tile of W^T row by row, each element gathering its nibble from the chunk's 2 KB of words: the
first version scattered every nibble to its place and ran 3x slower than the AWQ kernel (0.5 ms on 18432x7168).
"""
import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_awq_mma_dequantize_t"]

if HAS_TRITON:

    @triton.jit
    def _awq_mma_dequant_t_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, GROUP_SIZE: tl.constexpr):
        cb = tl.program_id(0)
        c = tl.program_id(1)
        # Output tile [64 rows of k, 64 columns], written row by row (coalesced). Each element gathers its word
        # from the chunk's 2 KB (cache hits): row 16t + 4s + 2e + hi and column 16T + g + 8h are nibble
        # 4hi + 2e + h of word ((s * 32 + 4g + t) * 4 + T).
        kk = tl.arange(0, 64)[:, None]
        cc = tl.arange(0, 64)[None, :]
        word = ((((kk // 4) % 4) * 32 + 4 * (cc % 8) + kk // 16) * 4 + cc // 16)
        nibble = 4 * (kk % 2) + 2 * ((kk // 2) % 2) + (cc // 8) % 2
        words = tl.load(qw_ptr + cb.to(tl.int64) * (K * 8) + c * 512 + word)
        # `>>` is arithmetic on int32: the 0xF mask drops the sign extension of negative words.
        q = (words >> (4 * nibble)) & 0xF
        col = 64 * cb + cc
        g = (64 * c) // GROUP_SIZE
        s = tl.load(s_ptr + g * N + col).to(tl.float32)
        zw = tl.load(z_ptr + g * (N // 8) + col // 8)
        z = (zw >> ((((col % 8) // 2) + 4 * (col % 2)) * 4)) & 0xF  # AWQ order of the zero words
        w = (q - z).to(tl.float32) * s
        tl.store(out_ptr + (64 * c + kk).to(tl.int64) * N + col, w.to(out_ptr.dtype.element_ty))


def launch_awq_mma_dequantize_t(qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                                dtype: torch.dtype) -> Tensor:
    """mma layout [OC // 64, IC * 8] -> W^T [IC, OC] in `dtype` ((q - z) * s in fp32, then rounded)."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge dequantize kernel needs triton")
    if group_size % 64:
        raise ValueError(f"launch_awq_mma_dequantize_t: group_size={group_size} must be a multiple of 64")
    nb, k8 = qweight_mma.shape
    ic, oc = k8 // 8, nb * 64
    out = torch.empty((ic, oc), dtype=dtype, device=qweight_mma.device)
    torch.library.wrap_triton(_awq_mma_dequant_t_kernel)[(nb, ic // 64)](
        qweight_mma.contiguous(), scales.contiguous(), qzeros.contiguous(), out, oc, ic, GROUP_SIZE=group_size,
        num_warps=4)
    return out
