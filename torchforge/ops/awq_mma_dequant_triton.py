"""Triton dequantization of the mma layout (`torchforge.ops.awq_mma_layout`) to W^T [IC, OC] in the activation
dtype, for `awq_mma_linear` at large M (dequantize once, then cuBLAS), as `awq_dequant_triton` does for AWQ.

One program per 64-k chunk of a 64-column block: its 512 words are read once and every nibble goes to the
(row, column) the layout gives it; the chunk lies inside one quantization group (groups of 64 or more rows).
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
        idx = tl.arange(0, 512)  # word ((s * 32 + lane) * 4 + T) of this chunk
        words = tl.load(qw_ptr + cb.to(tl.int64) * (K * 8) + c * 512 + idx)
        tile = idx % 4
        lane = (idx // 4) % 32
        step = idx // 128
        p = tl.arange(0, 8)
        # `>>` is arithmetic on int32: the 0xF mask drops the sign extension of negative words.
        q = (words[:, None] >> (4 * p)[None, :]) & 0xF
        col = 64 * cb + 16 * tile[:, None] + lane[:, None] // 4 + 8 * (p[None, :] & 1)
        row = 64 * c + 16 * (lane[:, None] % 4) + 4 * step[:, None] + 2 * ((p[None, :] >> 1) & 1) + (p[None, :] >> 2)
        g = (64 * c) // GROUP_SIZE
        s = tl.load(s_ptr + g * N + col).to(tl.float32)
        zw = tl.load(z_ptr + g * (N // 8) + col // 8)
        z = (zw >> ((((col % 8) // 2) + 4 * (col % 2)) * 4)) & 0xF  # AWQ order of the zero words
        w = (q - z).to(tl.float32) * s
        tl.store(out_ptr + row.to(tl.int64) * N + col, w.to(out_ptr.dtype.element_ty))


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
