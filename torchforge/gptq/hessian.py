"""GPTQ Hessians from calibration activations (seed 003 section 3.2, issue 3).

For a linear layer ``y = x W^T`` with inputs ``X [N, D]`` the GPTQ objective ``||X (W - Q)^T||^2`` has the
Hessian ``H = X^T X`` (up to the factor 2 and the 1/N normalisation, neither of which changes the GPTQ
solution: damping is relative to ``mean(diag(H))``). torchforge uses ``H = X^T X / N`` in fp32.

``accumulate_hessian`` streams: each activation tensor is folded into a running fp32 sum ``sum_i x_i^T x_i``
and dropped, so all activations are never concatenated. The matmul runs on the device of the first
activation (a CUDA tensor gives the GPU path for large D and T); later activations are moved there.

With ``block_size`` only the diagonal blocks of ``H`` are kept (seed 003's block-diagonal approximation):
``[ceil(D / bs), bs, bs]`` where block ``g`` is ``H[g*bs:(g+1)*bs, g*bs:(g+1)*bs]`` and the last block is
zero padded when ``bs`` does not divide ``D``. Memory is ``D * bs`` floats instead of ``D * D`` (for
DeepSeek-V3's hidden size 7168 and bs 128: 3.7 MB instead of 205 MB per matrix).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple, Union

import torch
from torch import Tensor

from torchforge.gptq.precision import with_ieee_fp32_matmul

__all__ = ["HessianAccumulator", "accumulate_hessian"]


class HessianAccumulator:
    """Running ``sum x^T x`` (fp32) over token rows ``x`` of width ``in_features``.

    ``add(x)`` takes ``[..., D]`` (any leading dims: ``[T, D]``, ``[B, S, D]``) and returns how many rows it
    used (fewer than given once ``max_tokens`` is reached); ``finalize()`` returns ``(H, n_seen)`` with
    ``H = sum / n_seen`` (all zeros when no token was seen).
    """

    def __init__(self, in_features: int, *, block_size: Optional[int] = None, max_tokens: Optional[int] = None,
                 device: Optional[Union[str, torch.device]] = None):
        if not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"accumulate_hessian: in_features must be a positive int, got {in_features!r}")
        if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
            raise ValueError(f"accumulate_hessian: block_size must be a positive int or None, got {block_size!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
            raise ValueError(f"accumulate_hessian: max_tokens must be a positive int or None, got {max_tokens!r}")
        self.in_features = in_features
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.device = torch.device(device) if device is not None else None
        self.n_seen = 0
        self._sum: Optional[Tensor] = None

    @property
    def full(self) -> bool:
        """True once ``max_tokens`` rows were used (further ``add`` calls are no-ops)."""
        return self.max_tokens is not None and self.n_seen >= self.max_tokens

    def _shape(self) -> Tuple[int, ...]:
        d, bs = self.in_features, self.block_size
        return (d, d) if bs is None else (math.ceil(d / bs), bs, bs)

    @torch.no_grad()
    @with_ieee_fp32_matmul  # (see torchforge.gptq.precision)
    def add(self, x: Tensor) -> int:
        d = self.in_features
        if not isinstance(x, Tensor):
            raise TypeError(f"accumulate_hessian: activations must be tensors, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"accumulate_hessian: activations must be floating point, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != d:
            raise ValueError(f"accumulate_hessian: activation has shape {tuple(x.shape)}; its last dim must be "
                             f"in_features={d} ([T, D] or [B, S, D])")
        if self.full:
            return 0
        x = x.reshape(-1, d)
        if self.max_tokens is not None:
            x = x[: self.max_tokens - self.n_seen]
        t = x.shape[0]
        if t == 0:
            return 0
        if self.device is None:
            self.device = x.device
        if self._sum is None:
            self._sum = torch.zeros(self._shape(), dtype=torch.float32, device=self.device)
        xf = x.to(device=self.device, dtype=torch.float32)
        if self.block_size is None:
            self._sum.addmm_(xf.T, xf)
        else:
            nb, bs = self._sum.shape[0], self.block_size
            if nb * bs != d:
                xf = torch.nn.functional.pad(xf, (0, nb * bs - d))
            xb = xf.view(t, nb, bs).transpose(0, 1)  # [nb, T, bs]
            self._sum.baddbmm_(xb.transpose(1, 2), xb)
        self.n_seen += t
        return t

    @torch.no_grad()
    def finalize(self) -> Tuple[Tensor, int]:
        if self._sum is None:
            return torch.zeros(self._shape(), dtype=torch.float32, device=self.device or "cpu"), 0
        h = self._sum / self.n_seen
        if not bool(torch.isfinite(h).all()):
            raise ValueError("accumulate_hessian: the Hessian has NaN/Inf entries: the activations contain "
                             "NaN/Inf (or overflow fp32); check the calibration data and the layers before")
        return h, self.n_seen


@torch.no_grad()
def accumulate_hessian(activations: Union[Tensor, Iterable[Tensor]], in_features: int, *,
                       block_size: Optional[int] = None, max_tokens: Optional[int] = None) -> Tuple[Tensor, int]:
    """``(H, n_seen)``: ``H = X^T X / n_seen`` in fp32 over the rows of every activation tensor.

    ``activations``: an iterable of ``[T, D]`` or ``[B, S, D]`` tensors (or one tensor), ``D = in_features``.
    ``block_size``: keep only the diagonal blocks, ``H`` is ``[ceil(D / bs), bs, bs]`` (last block zero
    padded); ``None`` gives the full ``[D, D]``. ``max_tokens``: use at most this many rows (the first ones);
    the iterable is not consumed further once reached. The result is on the device of the first activation.
    No rows at all gives an all-zero ``H`` on the CPU and ``n_seen = 0``.
    """
    acc = HessianAccumulator(in_features, block_size=block_size, max_tokens=max_tokens)
    if isinstance(activations, Tensor):
        activations = [activations]
    for x in activations:
        acc.add(x)
        if acc.full:
            break
    return acc.finalize()
