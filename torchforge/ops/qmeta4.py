"""qmeta4 ops registered with torch.library (namespace ``torchforge``) and their public wrappers.

Format and math: :mod:`torchforge.ops.qmeta4_reference` (seed 002 section 5's 4-byte struct, grouped along
the input dimension). A qmeta4 tensor is ``int32`` ``[..., OC, IC // G]`` for a weight ``[..., OC, IC]``.

Dispatch: ``qmeta4_build`` / ``qmeta4_mse_refine`` run Triton kernels on CUDA tensors when triton imports
(:mod:`torchforge.ops.qmeta4_triton`, checked bit for bit against the reference on CPU under
``TRITON_INTERPRET=1``); everything else, and CPU tensors, run the pure-PyTorch reference (which also runs
on CUDA). Shape / dtype checks use ``torch._check*`` and are shared by the eager bodies and the fake
implementations; checks that need the data (NaN/Inf, scale <= 0, zero out of 0..255) run eagerly in the
reference.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from torchforge.ops._check import check_same_device, check_type, check_value
from torchforge.ops._triton import HAS_TRITON, use_triton
from torchforge.ops.qmeta4_reference import (
    default_grid,
    qmeta4_build_ref,
    qmeta4_decode_ref,
    qmeta4_effective_scale,
    qmeta4_encode_ref,
    qmeta4_mse_refine_ref,
)
from torchforge.ops.qmeta4_triton import launch_qmeta4_build, launch_qmeta4_mse_refine

if HAS_TRITON:
    from torch.library import triton_op as _define_kernel_op
else:  # importing torchforge must work without triton
    _define_kernel_op = custom_op

__all__ = [
    "qmeta4_encode",
    "qmeta4_decode",
    "qmeta4_build",
    "qmeta4_mse_refine",
    "qmeta4_effective_scale",
    "default_grid",
]

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------- checks
def _check_weight(op: str, weight: Tensor, group_size: int, bits: int) -> None:
    check_type(
        weight.dtype in WEIGHT_DTYPES,
        lambda: f"{op}: weight must be float32/float16/bfloat16/float8_e4m3fn, got {weight.dtype}",
    )
    check_value(
        weight.dim() >= 2,
        lambda: f"{op}: weight must be [..., OC, IC] (nn.Linear layout), got shape {tuple(weight.shape)}",
    )
    check_value(
        2 <= bits <= 8, lambda: f"{op}: bits={bits} must be in 2..8 (the zero point is one uint8)"
    )
    check_value(group_size > 0, lambda: f"{op}: group_size={group_size} must be positive")
    ic = weight.shape[-1]
    check_value(
        ic % group_size == 0,
        lambda: f"{op}: weight has IC={ic} input channels (last dim), not divisible by group_size={group_size}; "
        "groups run along the input dim: choose a group size that divides it",
    )


def _check_qmeta(op: str, qmeta: Tensor) -> None:
    check_type(
        qmeta.dtype == torch.int32,
        lambda: f"{op}: qmeta must be int32 (one packed 4-byte struct per group), got {qmeta.dtype}",
    )


def _check_qmeta_for(op: str, qmeta: Tensor, weight: Tensor, group_size: int) -> None:
    _check_qmeta(op, qmeta)
    want = (*weight.shape[:-1], weight.shape[-1] // group_size)
    check_value(
        qmeta.dim() == len(want) and all(a == b for a, b in zip(qmeta.shape, want)),
        lambda: f"{op}: qmeta has shape {tuple(qmeta.shape)} but weight {tuple(weight.shape)} with "
        f"group_size={group_size} needs {want} = [..., OC, IC // G]",
    )
    check_value(
        qmeta.device == weight.device,
        lambda: f"{op}: qmeta is on {qmeta.device} but weight is on {weight.device}; move them to one device",
    )


def _check_encode(scale: Tensor, zero: Tensor) -> None:
    check_type(
        scale.is_floating_point(), lambda: f"qmeta4_encode: scale must be floating point, got {scale.dtype}"
    )
    check_type(
        zero.dtype in (torch.uint8, torch.int16, torch.int32, torch.int64) or zero.is_floating_point(),
        lambda: f"qmeta4_encode: zero must be an integer or float tensor (values 0..255), got {zero.dtype}",
    )
    check_value(
        scale.device == zero.device,
        lambda: f"qmeta4_encode: scale is on {scale.device} but zero is on {zero.device}",
    )


def _check_refine(weight: Tensor, qmeta: Tensor, grid: Tensor, group_size: int, bits: int, norm: float,
                  scale_dtype: torch.dtype) -> None:
    op = "qmeta4_mse_refine"
    _check_weight(op, weight, group_size, bits)
    _check_qmeta_for(op, qmeta, weight, group_size)
    check_type(grid.dtype == torch.float32, lambda: f"{op}: grid must be float32, got {grid.dtype}")
    check_same_device(op, "grid", grid, weight, "weight")
    check_value(
        grid.dim() == 1 and grid.shape[0] >= 1,
        lambda: f"{op}: grid must be a non-empty 1-D tensor of scale factors, got shape {tuple(grid.shape)}",
    )
    check_value(norm > 0, lambda: f"{op}: norm={norm} must be positive (2.4 by default, 2 for MSE)")
    check_type(
        scale_dtype in _SCALE_DTYPES,
        lambda: f"{op}: scale_dtype must be float16/bfloat16/float32 (the exported scale dtype), got {scale_dtype}",
    )


def _out_shape(weight: Tensor, group_size: int) -> Tuple[int, ...]:
    return (*weight.shape[:-1], weight.shape[-1] // group_size)


# -------------------------------------------------------------------------------------------- ops
@custom_op("torchforge::qmeta4_encode", mutates_args=())
def _qmeta4_encode(scale: Tensor, zero: Tensor, symmetric: bool) -> Tensor:
    _check_encode(scale, zero)
    return qmeta4_encode_ref(scale, zero, symmetric).contiguous()  # the fake's layout, whatever the inputs' strides


@_qmeta4_encode.register_fake
def _(scale: Tensor, zero: Tensor, symmetric: bool) -> Tensor:
    _check_encode(scale, zero)
    shape = torch.broadcast_shapes(scale.shape, zero.shape)
    return scale.new_empty(shape, dtype=torch.int32)


@custom_op("torchforge::qmeta4_decode", mutates_args=())
def _qmeta4_decode(qmeta: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    _check_qmeta("qmeta4_decode", qmeta)
    return tuple(t.contiguous() for t in qmeta4_decode_ref(qmeta))


@_qmeta4_decode.register_fake
def _(qmeta: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    _check_qmeta("qmeta4_decode", qmeta)
    return (qmeta.new_empty(qmeta.shape, dtype=torch.float32), qmeta.new_empty(qmeta.shape, dtype=torch.uint8),
            qmeta.new_empty(qmeta.shape, dtype=torch.uint8))


@_define_kernel_op("torchforge::qmeta4_build", mutates_args=())
def _qmeta4_build(weight: Tensor, group_size: int, bits: int, symmetric: bool) -> Tensor:
    _check_weight("qmeta4_build", weight, group_size, bits)
    if use_triton(weight):
        return launch_qmeta4_build(weight, group_size, bits, symmetric)
    return qmeta4_build_ref(weight, group_size, bits, symmetric)


@_qmeta4_build.register_fake
def _(weight: Tensor, group_size: int, bits: int, symmetric: bool) -> Tensor:
    _check_weight("qmeta4_build", weight, group_size, bits)
    return weight.new_empty(_out_shape(weight, group_size), dtype=torch.int32)


@_define_kernel_op("torchforge::qmeta4_mse_refine", mutates_args=())
def _qmeta4_mse_refine(weight: Tensor, qmeta: Tensor, grid: Tensor, group_size: int, bits: int, norm: float,
                       scale_dtype: torch.dtype) -> Tensor:
    _check_refine(weight, qmeta, grid, group_size, bits, norm, scale_dtype)
    if use_triton(weight):
        return launch_qmeta4_mse_refine(weight, qmeta, grid, group_size, bits, norm, scale_dtype)
    return qmeta4_mse_refine_ref(weight, qmeta, grid, group_size, bits, norm, scale_dtype).contiguous()


@_qmeta4_mse_refine.register_fake
def _(weight: Tensor, qmeta: Tensor, grid: Tensor, group_size: int, bits: int, norm: float,
      scale_dtype: torch.dtype) -> Tensor:
    _check_refine(weight, qmeta, grid, group_size, bits, norm, scale_dtype)
    return qmeta.new_empty(qmeta.shape)


# -------------------------------------------------------------------------------- public wrappers
def _eager() -> bool:
    return not torch.compiler.is_compiling()


def qmeta4_encode(scale: Tensor, zero: Tensor, symmetric: bool) -> Tensor:
    """Pack ``scale`` (> 0) and ``zero`` (integers 0..255), broadcast together, into int32 qmeta4 words:
    ``round(256 * log2(scale))`` as int16 in bits [15:0], zero in [23:16], flags (bit 0 = symmetric) in
    [31:24]."""
    if _eager():
        _check_encode(scale, zero)
    return torch.ops.torchforge.qmeta4_encode(scale, zero, symmetric)


def qmeta4_decode(qmeta: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """int32 qmeta4 -> ``(scale fp32, zero uint8, flags uint8)``; ``scale = 2 ** (code / 256)`` bit-exact."""
    if _eager():
        _check_qmeta("qmeta4_decode", qmeta)
    return torch.ops.torchforge.qmeta4_decode(qmeta)


def qmeta4_build(weight: Tensor, group_size: int = 128, bits: int = 4, symmetric: bool = True) -> Tensor:
    """Range-based qmeta4 of ``weight [..., OC, IC]`` (fp32/fp16/bf16/float8_e4m3fn), groups of
    ``group_size`` input channels -> int32 ``[..., OC, IC // group_size]``."""
    if _eager():
        _check_weight("qmeta4_build", weight, group_size, bits)
    return torch.ops.torchforge.qmeta4_build(weight, group_size, bits, symmetric)


def qmeta4_mse_refine(weight: Tensor, qmeta: Tensor, group_size: int = 128, bits: int = 4, *,
                      grid: Optional[Tensor] = None, norm: float = 2.4, max_shrink: float = 0.2,
                      n_grid: int = 100, scale_dtype: torch.dtype = torch.float16) -> Tensor:
    """Refine each group's scale by a grid search minimising ``sum |w_hat - w|^norm`` (L^2.4 by default,
    ``norm=2`` for MSE). ``grid``: the scale factors to try (default: the shrink grid
    ``1 - max_shrink * k / n_grid``, k < n_grid); each candidate is scored as it would be stored (Q8.8, then
    ``scale_dtype``). Zero points and flags are kept."""
    if grid is None:
        grid = default_grid(max_shrink, n_grid, device=weight.device)
    if _eager():
        _check_refine(weight, qmeta, grid, group_size, bits, norm, scale_dtype)
    return torch.ops.torchforge.qmeta4_mse_refine(weight, qmeta, grid, group_size, bits, float(norm), scale_dtype)
