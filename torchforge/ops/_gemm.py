"""The dense GEMM after a dequantize pass (the large-M fallback of the W4A16 ops)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def matmul_bias(x: Tensor, w_t: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x [..., K] @ w_t [K, N] (+ bias)`` in x's dtype. A bias of x's dtype goes into the GEMM (addmm: added to the
    fp32 sums, one rounding), which is also what the ops compile to: with ``x @ w_t`` rounded and then ``+ bias``
    rounded again, eager and compiled differed in a quarter of the elements (H100, twelfth session). A bias of
    another dtype (fp32 with bf16 x) is added after and the sum cast back: it must not promote the output."""
    if bias is None:
        return torch.matmul(x, w_t)
    if bias.dtype != x.dtype:
        return (torch.matmul(x, w_t) + bias).to(x.dtype)
    out = torch.addmm(bias, x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), w_t)  # -1 fails on K = 0
    return out.reshape(*x.shape[:-1], w_t.shape[1])
