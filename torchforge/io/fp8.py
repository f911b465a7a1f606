"""Dequantization of DeepSeek-V3/R1 style block-FP8 weights.

Why the format is what it is
----------------------------
DeepSeek released V3/R1 with their linear weights stored the way they were trained: in FP8
(``float8_e4m3fn``) with *fine-grained* scaling, one float32 scale per 128x128 block of the weight
(DeepSeek-V3 technical report, "fine-grained quantization": activations are grouped in 1x128 tiles,
weights in 128x128 blocks, so an outlier only costs precision inside its own block, and the
128-wide K chunks line up with the FP8 GEMM that applies one scale pair per chunk).

For every quantized ``<module>.weight`` of shape ``[OC, IC]`` the checkpoint holds
``<module>.weight_scale_inv``: float32, shape ``[ceil(OC / 128), ceil(IC / 128)]``. At quantization
time each block is multiplied by ``s = 448 / amax(block)`` to fill e4m3fn's finite range (448 is its
largest finite value); what is stored is the *inverse* ``1 / s = amax / 448`` - hence "scale_inv" -
so that every consumer (DeepSeek's ``inference/kernel.py::weight_dequant``, their FP8 GEMM, vLLM,
transformers' fine-grained FP8 path) only ever multiplies:

    W[i, j] = float(weight[i, j]) * weight_scale_inv[i // 128, j // 128]

Shapes that are not multiples of 128 end in partial edge blocks which still own a full scale entry,
hence the ceil. The block size is recorded in ``config.json`` as
``quantization_config.weight_block_size`` (``[128, 128]`` for every released DeepSeek model).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .checkpoint import CheckpointError

__all__ = ["dequantize_fp8_block", "FP8_DTYPES", "is_fp8_dtype", "expected_scale_shape", "check_scale_inv"]

# float8 formats that hold weights (not float8_e8m0fnu, which is an exponent-only scale format).
FP8_DTYPES = frozenset(
    d
    for d in (
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None),
    )
    if d is not None
)

DEFAULT_BLOCK_SIZE = (128, 128)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def _block_pair(block_size) -> tuple[int, int]:
    if isinstance(block_size, int):
        block_size = (block_size, block_size)
    bm, bn = (int(b) for b in block_size)
    if bm <= 0 or bn <= 0:
        raise ValueError(f"block_size must be positive, got {tuple(block_size)}")
    return bm, bn


def expected_scale_shape(weight_shape: Sequence[int], block_size=DEFAULT_BLOCK_SIZE) -> tuple[int, ...]:
    """Shape of the ``*_scale_inv`` tensor that goes with a weight of ``weight_shape``.

    Leading dimensions (e.g. stacked MoE experts ``[E, OC, IC]``) are carried over unchanged.
    """
    bm, bn = _block_pair(block_size)
    if len(weight_shape) < 2:
        raise ValueError(f"block-FP8 weights are at least 2-D, got shape {list(weight_shape)}")
    *lead, m, n = (int(s) for s in weight_shape)
    return (*lead, math.ceil(m / bm), math.ceil(n / bn))


def check_scale_inv(scale_inv: torch.Tensor) -> None:
    """Raises where ``scale_inv`` cannot be block scales: not floating (e.g. ue8m0 exponents stored as raw uint8
    bytes, which a float() cast would turn into 127.0 instead of 1.0), or NaN/Inf entries (a corrupt shard: every
    weight of such a block would come out NaN/Inf). The scale grid is 1/16384 of the weight: cheap to check."""
    if not scale_inv.is_floating_point() or is_fp8_dtype(scale_inv.dtype):
        raise TypeError(
            "scale_inv must be a floating tensor (float32, or float8_e8m0fnu power-of-two scales), got "
            f"{scale_inv.dtype}"
        )
    bad = ~torch.isfinite(scale_inv.to(torch.float32))
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(
            f"scale_inv has {int(bad.sum())} NaN/Inf entries of {scale_inv.numel()} (the first at block {first}): "
            f"the checkpoint is corrupt; download the shard again"
        )


def dequantize_fp8_block(
    weight_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size=DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Return ``weight_fp8.float() * scale_inv`` expanded over ``block_size`` blocks, cast to ``dtype``.

    ``weight_fp8``: ``[..., M, N]`` float8 tensor; ``scale_inv``: ``[..., ceil(M/bm), ceil(N/bn)]``
    (float32 in DeepSeek-V3/R1; float8_e8m0fnu power-of-two scales are accepted too). Vectorized: the scale grid is expanded with
    ``repeat_interleave`` and cropped to ``[M, N]``, so partial edge blocks take their block's scale.
    The product is computed in float32 on ``weight_fp8``'s device.
    """
    if not is_fp8_dtype(weight_fp8.dtype):
        raise TypeError(f"dequantize_fp8_block expects a float8 weight, got {weight_fp8.dtype}")
    check_scale_inv(scale_inv)
    bm, bn = _block_pair(block_size)
    expected = expected_scale_shape(weight_fp8.shape, (bm, bn))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(
            f"scale_inv of shape {list(scale_inv.shape)} does not match a weight of shape "
            f"{list(weight_fp8.shape)} with {bm}x{bn} blocks: expected {list(expected)} "
            f"(ceil(shape / block)); check weight_block_size in config.json"
        )
    m, n = weight_fp8.shape[-2:]
    scale = scale_inv.to(device=weight_fp8.device, dtype=torch.float32)
    scale = scale.repeat_interleave(bm, dim=-2)[..., :m, :]
    scale = scale.repeat_interleave(bn, dim=-1)[..., :n]
    out = weight_fp8.to(torch.float32)
    out.mul_(scale)
    return out.to(dtype)
