"""Batch-1 W4A16 GEMV of the compiled extension (csrc/awq_gemv.cu, op `torchforge::awq_gemv_cuda`).

The Triton GEMV (awq_gemv_triton.py) tops out near 1.6 TB/s of int4 bytes on an H100; this CUDA kernel streams
the weight with 16-byte non-caching loads, 8 loads in flight per thread, and adds the K slices in the same launch
(the last block of a column tile to finish sums them), so there is no second kernel. `w4a16_linear` dispatches
one fp16 / bf16 row to it when the extension is built and the shapes fit (`cuda_gemv_ok`); the reference and the
Triton GEMV remain the fallbacks. The op's fake (for torch.compile) is registered here when the extension loads.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._check import check

__all__ = ["cuda_gemv_config", "cuda_gemv_ok", "launch_awq_gemv_cuda", "register_fake"]

_SMS_H100 = 132
_MAX_SPLITS = 65535  # ops.cpp: the K slices are grid dimension y
_MAX_DIM = 1 << 30  # ops.cpp: K and N must be < 2^30


def cuda_gemv_config(k: int, n: int, group_size: int) -> tuple[int, int]:
    """(splits, rows). From the H100 sweep (`python bench/w4a16_linear.py --cuda-gemv-sweep`, 2026-11-22): best when
    every k-lane of a block gets exactly one item (splits = items / 32), with items of 32 k-rows if that still
    gives two blocks per SM (18432 x 7168: 7 slices, 504 blocks, 0.036 ms), else of 16 (7168 x 7168: 14 slices,
    392 blocks, 0.018 ms); other configurations were 3-25% slower."""
    tiles = -(-n // 256)
    for rows in (32, 16):
        if group_size % rows == 0 and k % rows == 0:
            splits = min(_MAX_SPLITS, max(1, -(-(k // rows) // 32)))  # more slices: the op raises
            if tiles * splits >= 2 * _SMS_H100 or rows == 16:
                return splits, rows
    return min(_MAX_SPLITS, max(1, -(-(k // 16) // 32))), 16


def cuda_gemv_ok(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                 bias: Optional[Tensor]) -> bool:
    """Whether the CUDA GEMV takes this call: one fp16 / bf16 row, N a multiple of 32, groups of 16 or more
    k-rows, 16-byte aligned weight tensors, a bias (if any) in x's dtype, and a matrix large enough for two
    blocks per SM. Smaller ones (MLA's projections at hidden 4096: 48-128 blocks) stay on the Triton GEMV: with
    fewer blocks than SMs this kernel lost end to end (decode at batch 1, 289 against 310 tok/s for bf16)."""
    from torchforge.ops._ext import has_cuda_ext

    k, np_ = qweight.shape
    if group_size % 16 or np_ % 4 or not (k < _MAX_DIM and np_ * 8 < _MAX_DIM):  # the op's limits: else it raises
        return False
    splits, _ = cuda_gemv_config(k, np_ * 8, group_size)
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and has_cuda_ext()
            and hasattr(torch.ops.torchforge, "awq_gemv_cuda")  # an extension built before this op lacks it
            and scales.dtype == torch.float16  # the op reads fp16 scales; bf16 / fp32 ones take the Triton GEMV
            and all(t.is_contiguous() and t.device == x.device for t in (qweight, scales, qzeros))
            and -(-np_ // 32) * splits >= 2 * _SMS_H100
            # allocations are 16-byte aligned; views into them only where their offset is (the storage offset,
            # unlike data_ptr(), exists under torch.compile's fake tensors too)
            and all(t.storage_offset() * t.element_size() % 16 == 0 for t in (qweight, scales, qzeros))
            and (bias is None or (bias.dtype == x.dtype and bias.numel() == np_ * 8 and bias.device == x.device)))


def launch_awq_gemv_cuda(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                         bias: Optional[Tensor] = None, *, splits: Optional[int] = None,
                         rows: Optional[int] = None) -> Tensor:
    """`x [..., K]` holding one row `@ dequant(W).T (+ bias)`, in x.dtype; weight tensors contiguous."""
    k, np_ = qweight.shape
    n = np_ * 8
    if x.numel() != k:
        raise ValueError(f"launch_awq_gemv_cuda: x has {x.numel() // k} rows; this kernel takes exactly one")
    s, r = cuda_gemv_config(k, n, group_size)
    out = torch.ops.torchforge.awq_gemv_cuda(x.reshape(k).contiguous(), qweight, scales, qzeros, group_size, bias,
                                             splits or s, rows or r)
    return out.reshape(*x.shape[:-1], n)


_registered = False


def register_fake() -> None:
    """Shape function of torchforge::awq_gemv_cuda (defined in C++ without one), once the extension is loaded."""
    global _registered
    if _registered or not hasattr(torch.ops.torchforge, "awq_gemv_cuda"):
        return

    @torch.library.register_fake("torchforge::awq_gemv_cuda")
    def _(x, qweight, scales, qzeros, group_size, bias, splits, rows):
        check(x.numel() == qweight.shape[0],
              lambda: f"awq_gemv_cuda: x has {x.numel()} elements, qweight has K = {qweight.shape[0]} rows")
        check(x.dtype in (torch.float16, torch.bfloat16),
              lambda: f"awq_gemv_cuda: x must be float16 or bfloat16, got {x.dtype}")
        return x.new_empty((qweight.shape[1] * 8,))

    _registered = True
