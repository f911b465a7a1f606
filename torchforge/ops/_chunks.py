"""Work over a stack of expert matrices in bounded chunks, so that the temporaries of a per-matrix transform stay
small whatever the number of experts (all 256 of a DeepSeek-V3 layer at once: tens of GB)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def map_leading_chunks(fn: Callable[..., Tensor], tensors: tuple[Tensor, ...], out_shape: tuple, weights_per_matrix: int,
                       chunk_weights: int, dtype: torch.dtype) -> Tensor:
    """fn(*slices) over the leading dim of `tensors` (all of the same length), at most `chunk_weights` weights a
    call, into one [n, *out_shape] buffer of `dtype`; a single call where everything fits in one chunk."""
    n = tensors[0].shape[0]
    step = max(1, chunk_weights // max(1, weights_per_matrix))
    if n <= step:
        return fn(*tensors)
    out = torch.empty((n, *out_shape), dtype=dtype, device=tensors[0].device)
    for i in range(0, n, step):
        out[i:i + step] = fn(*(t[i:i + step] for t in tensors))
    return out
