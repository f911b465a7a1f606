"""Tensor-core W4A16 for decode batches in CUDA (csrc/awq_mma.cu, op `torchforge::awq_mma_cuda`).

Reads the weight in the mma layout (`torchforge.ops.awq_mma_layout`). Configuration, the dispatch check and the
op's fake (registered when the extension loads) live here; `torchforge.ops.awq_mma.awq_mma_linear` is the op
models call.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["MMA_CUDA_MAX_M", "mma_cuda_splits", "mma_cuda_ok", "launch_awq_mma_cuda", "register_fake"]

_SMS_H100 = 132
# Rows of x the kernel takes: 16 per block along grid.x, each block re-reading its weight tile from L2.
MMA_CUDA_MAX_M = 64
# Request the next group's weight words before computing on this one (double buffer in registers).
MMA_CUDA_PIPE = False


def mma_cuda_splits(m: int, k: int, n: int, group_size: int) -> int:
    """K slices: enough blocks for two per SM, each warp keeping at least one quantization group."""
    tiles = -(-m // 16) * (n // 64)
    groups = k // group_size
    splits = 1
    while tiles * splits < 2 * _SMS_H100 and (splits + 1) * 8 <= groups:
        splits += 1
    return splits


def mma_cuda_ok(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                bias: Optional[Tensor]) -> bool:
    """Whether the CUDA kernel takes this call (else the caller converts to AWQ and uses `w4a16_linear`)."""
    from torchforge.ops._ext import has_cuda_ext

    m = x.numel() // x.shape[-1] if x.dim() else 0
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and group_size in (64, 128)
            and 1 <= m <= MMA_CUDA_MAX_M and has_cuda_ext() and hasattr(torch.ops.torchforge, "awq_mma_cuda")
            and scales.dtype == torch.float16
            and all(t.is_contiguous() and t.device == x.device for t in (qweight_mma, scales, qzeros))
            and qweight_mma.storage_offset() * 4 % 16 == 0
            and (bias is None or (bias.dtype == x.dtype and bias.device == x.device)))


def launch_awq_mma_cuda(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                        bias: Optional[Tensor] = None, *, splits: Optional[int] = None,
                        pipe: Optional[bool] = None) -> Tensor:
    """`x [..., K] @ dequant(W).T (+ bias)` in x.dtype, W in the mma layout `[N / 64, K * 8]`."""
    k = x.shape[-1]
    n = qweight_mma.shape[0] * 64
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.stride(0) != k or x2.storage_offset() * x2.element_size() % 16:
        x2 = x2.contiguous()
    s = splits or mma_cuda_splits(x2.shape[0], k, n, group_size)
    p = MMA_CUDA_PIPE if pipe is None else pipe
    out = torch.ops.torchforge.awq_mma_cuda(x2, qweight_mma, scales, qzeros, group_size, bias, s, p)
    return out.reshape(*x.shape[:-1], n)


_registered = False


def register_fake() -> None:
    """Shape function of torchforge::awq_mma_cuda (defined in C++ without one), once the extension is loaded."""
    global _registered
    if _registered or not hasattr(torch.ops.torchforge, "awq_mma_cuda"):
        return

    @torch.library.register_fake("torchforge::awq_mma_cuda")
    def _(x, qweight, scales, qzeros, group_size, bias, splits, pipe):
        torch._check(x.dim() == 2 and qweight.dim() == 2,
                     lambda: f"awq_mma_cuda: x and qweight must be 2-D, got {tuple(x.shape)} and {tuple(qweight.shape)}")
        torch._check(qweight.shape[1] == x.shape[1] * 8,
                     lambda: f"awq_mma_cuda: qweight must be [N / 64, K * 8] with K = {x.shape[1]}, got "
                             f"{tuple(qweight.shape)}")
        torch._check(x.dtype in (torch.float16, torch.bfloat16),
                     lambda: f"awq_mma_cuda: x must be float16 or bfloat16, got {x.dtype}")
        return x.new_empty((x.shape[0], qweight.shape[0] * 64))

    _registered = True
