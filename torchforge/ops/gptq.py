"""GPTQ-layout W4 ops registered with torch.library (namespace ``torchforge``) and public wrappers.

Format: :mod:`torchforge.ops.gptq_reference` (AutoGPTQ / vLLM ``gptq``, v1 zero points, ``g_idx``).
``w4a16_gptq_linear`` is a ``triton_op``: CUDA tensors run the Triton kernel
(:mod:`torchforge.ops.gptq_triton`), CPU tensors the reference. Pack / unpack / dequantize are
``custom_op`` s whose implementation is the reference (pure torch, runs on CUDA too). Shape / dtype
checks use ``torch._check*`` and are shared by the eager bodies and the fakes; ``g_idx`` values are
range-checked eagerly on CPU only (on CUDA that would be a host sync).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from torchforge.ops._check import check_same_device, check_type, check_value
from torchforge.ops._triton import HAS_TRITON, use_triton
from torchforge.ops.gptq_reference import (
    act_order_perm,
    gptq_dequantize_ref,
    gptq_pack_ref,
    gptq_pack_zeros_ref,
    gptq_unpack_ref,
    gptq_unpack_zeros_ref,
    trivial_g_idx,
    w4a16_gptq_linear_ref,
)
from torchforge.ops.gptq_triton import launch_gptq_dequantize, launch_w4a16_gptq_linear

if HAS_TRITON:
    from torch.library import triton_op as _define_kernel_op
else:  # importing torchforge must work without triton
    _define_kernel_op = custom_op

__all__ = ["gptq_pack", "gptq_unpack", "gptq_pack_zeros", "gptq_unpack_zeros", "gptq_dequantize",
           "w4a16_gptq_linear", "trivial_g_idx", "act_order_perm"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_packed(op: str, qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor) -> Tuple[int, int]:
    """qweight [..., IC // 8, OC], scales [..., NG, OC], qzeros [..., NG, OC // 8], g_idx [IC]; returns (IC, OC)."""
    check_type(qweight.dtype == torch.int32,
               lambda: f"{op}: qweight must be int32 (8 packed 4-bit codes per word), got {qweight.dtype}")
    check_type(qzeros.dtype == torch.int32,
               lambda: f"{op}: qzeros must be int32 (packed GPTQ zero points), got {qzeros.dtype}")
    check_type(scales.dtype in _FLOAT_DTYPES,
               lambda: f"{op}: scales must be float16 (or bfloat16/float32), got {scales.dtype}")
    check_type(g_idx.dtype in (torch.int32, torch.int64),
               lambda: f"{op}: g_idx must be int32 (one group index per input row), got {g_idx.dtype}")
    check_value(qweight.dim() >= 2,
                lambda: f"{op}: qweight must be [..., IC // 8, OC], got shape {tuple(qweight.shape)}")
    lead = tuple(qweight.shape[:-2])
    ic, oc = qweight.shape[-2] * 8, qweight.shape[-1]
    check_value(oc % 8 == 0, lambda: f"{op}: OC={oc} must be divisible by 8 (qzeros packs 8 outputs per word)")
    for name, t in (("scales", scales), ("qzeros", qzeros), ("g_idx", g_idx)):
        check_value(t.device == qweight.device,
                    lambda: f"{op}: {name} is on {t.device} but qweight is on {qweight.device}")
    check_value(scales.dim() == len(lead) + 2 and tuple(scales.shape[:-2]) == lead and scales.shape[-1] == oc,
                lambda: f"{op}: scales has shape {tuple(scales.shape)} but qweight {tuple(qweight.shape)} "
                f"needs [..., NG, OC={oc}]")
    ng = scales.shape[-2]
    want_z = (*lead, ng, oc // 8)
    check_value(qzeros.dim() == len(want_z) and all(a == b for a, b in zip(qzeros.shape, want_z)),
                lambda: f"{op}: qzeros has shape {tuple(qzeros.shape)}, expected {want_z} = [..., NG, OC // 8]")
    check_value(g_idx.dim() == 1 and g_idx.shape[0] == ic,
                lambda: f"{op}: g_idx has shape {tuple(g_idx.shape)}, expected ({ic},) = [IC]")
    return ic, oc


def _check_g_idx_values(g_idx: Tensor, ng: int) -> None:
    from torchforge.ops.qmeta4_reference import _is_traced

    if g_idx.is_cuda or g_idx.numel() == 0 or _is_traced(g_idx):
        return
    bad = (g_idx < 0) | (g_idx >= ng)
    if bool(bad.any()):
        raise ValueError(f"gptq: g_idx has {int(bad.sum())} values outside [0, {ng}) (scales hold {ng} groups)")


def _check_linear(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor,
                  bias: Optional[Tensor]) -> Tuple[int, int]:
    op = "w4a16_gptq_linear"
    check_value(qweight.dim() == 2, lambda: f"{op}: qweight must be [IC // 8, OC], got {tuple(qweight.shape)}")
    ic, oc = _check_packed(op, qweight, scales, qzeros, g_idx)
    check_type(x.dtype in _FLOAT_DTYPES, lambda: f"{op}: x must be float16/bfloat16/float32, got {x.dtype}")
    check_value(x.dim() >= 1 and x.shape[-1] == ic,
                lambda: f"{op}: x has shape {tuple(x.shape)} but qweight {tuple(qweight.shape)} expects IC={ic}")
    check_value(x.device == qweight.device, lambda: f"{op}: x is on {x.device} but qweight on {qweight.device}")
    if bias is not None:
        check_type(bias.dtype in _FLOAT_DTYPES,
                   lambda: f"{op}: bias must be float16/bfloat16/float32, got {bias.dtype}")
        check_value(bias.dim() == 1 and bias.shape[0] == oc,
                    lambda: f"{op}: bias has shape {tuple(bias.shape)}, expected ({oc},) = [OC]")
        check_same_device(op, "bias", bias, x, "x")
    return ic, oc


# -------------------------------------------------------------------------------------------- ops
@custom_op("torchforge::gptq_pack", mutates_args=())
def _gptq_pack(codes: Tensor) -> Tensor:
    _check_pack(codes)
    return gptq_pack_ref(codes)


def _check_pack(codes: Tensor) -> None:
    check_type(codes.dtype == torch.uint8, lambda: f"gptq_pack: codes must be uint8 (0..15), got {codes.dtype}")
    check_value(codes.dim() >= 2 and codes.shape[-2] % 8 == 0,
                lambda: f"gptq_pack: codes must be [..., IC, OC] with IC divisible by 8, got {tuple(codes.shape)}")


@_gptq_pack.register_fake
def _(codes: Tensor) -> Tensor:
    _check_pack(codes)
    return codes.new_empty((*codes.shape[:-2], codes.shape[-2] // 8, codes.shape[-1]), dtype=torch.int32)


@custom_op("torchforge::gptq_unpack", mutates_args=())
def _gptq_unpack(qweight: Tensor) -> Tensor:
    _check_unpack(qweight)
    return gptq_unpack_ref(qweight)


def _check_unpack(qweight: Tensor) -> None:
    check_type(qweight.dtype == torch.int32, lambda: f"gptq_unpack: qweight must be int32, got {qweight.dtype}")
    check_value(qweight.dim() >= 2, lambda: f"gptq_unpack: qweight must be [..., IC // 8, OC], got shape "
                                            f"{tuple(qweight.shape)}")


@_gptq_unpack.register_fake
def _(qweight: Tensor) -> Tensor:
    _check_unpack(qweight)
    return qweight.new_empty((*qweight.shape[:-2], qweight.shape[-2] * 8, qweight.shape[-1]), dtype=torch.uint8)


@_define_kernel_op("torchforge::gptq_dequantize", mutates_args=())
def _gptq_dequantize(qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor) -> Tensor:
    _check_packed("gptq_dequantize", qweight, scales, qzeros, g_idx)
    _check_g_idx_values(g_idx, scales.shape[-2])
    if use_triton(qweight):  # one launch, no temporaries (the GPTQ linear's backward dequantizes on every call)
        return launch_gptq_dequantize(qweight, scales, qzeros, g_idx)
    return gptq_dequantize_ref(qweight, scales, qzeros, g_idx)


@_gptq_dequantize.register_fake
def _(qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor) -> Tensor:
    ic, oc = _check_packed("gptq_dequantize", qweight, scales, qzeros, g_idx)
    return scales.new_empty((*qweight.shape[:-2], oc, ic))


@_define_kernel_op("torchforge::w4a16_gptq_linear", mutates_args=())
def _w4a16_gptq_linear(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor,
                       bias: Optional[Tensor]) -> Tensor:
    _check_linear(x, qweight, scales, qzeros, g_idx, bias)
    if use_triton(x):
        return launch_w4a16_gptq_linear(x, qweight, scales, qzeros, g_idx, bias)
    _check_g_idx_values(g_idx, scales.shape[-2])
    return w4a16_gptq_linear_ref(x, qweight, scales, qzeros, g_idx, bias)


@_w4a16_gptq_linear.register_fake
def _(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor, bias: Optional[Tensor]) -> Tensor:
    _, oc = _check_linear(x, qweight, scales, qzeros, g_idx, bias)
    return x.new_empty((*x.shape[:-1], oc))


# -------------------------------------------------------------------------------- public wrappers
def _eager() -> bool:
    return not torch.compiler.is_compiling()


def gptq_pack(codes: Tensor) -> Tensor:
    """uint8 codes ``[..., IC, OC]`` -> GPTQ int32 ``[..., IC // 8, OC]`` (8 input rows per word, sequential)."""
    if _eager():
        _check_pack(codes)
    return torch.ops.torchforge.gptq_pack(codes)


def gptq_unpack(qweight: Tensor) -> Tensor:
    """Exact inverse of :func:`gptq_pack`."""
    return torch.ops.torchforge.gptq_unpack(qweight)


def gptq_pack_zeros(zeros: Tensor) -> Tensor:
    """True zero points ``[..., NG, OC]`` (1..15) -> v1 ``qzeros`` int32 ``[..., NG, OC // 8]`` (``z - 1``)."""
    check_value(zeros.dim() >= 2 and zeros.shape[-1] % 8 == 0,
                lambda: f"gptq_pack_zeros: zeros must be [..., NG, OC] with OC divisible by 8 (8 zero points per "
                        f"int32), got shape {tuple(zeros.shape)}")
    return gptq_pack_zeros_ref(zeros)


def gptq_unpack_zeros(qzeros: Tensor) -> Tensor:
    """v1 ``qzeros`` -> true zero points uint8 ``[..., NG, OC]``."""
    return gptq_unpack_zeros_ref(qzeros)


def gptq_dequantize(qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor) -> Tensor:
    """GPTQ tensors -> ``W [..., OC, IC]`` in ``scales.dtype`` (``(q - z) * s`` in fp32)."""
    if _eager():
        _check_packed("gptq_dequantize", qweight, scales, qzeros, g_idx)
    return torch.ops.torchforge.gptq_dequantize(qweight, scales, qzeros, g_idx)


def w4a16_gptq_linear(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor,
                      bias: Optional[Tensor] = None) -> Tensor:
    """``x [..., IC] @ dequant(W).T (+ bias) -> [..., OC]`` in ``x.dtype`` for a GPTQ-layout weight
    (Triton kernel on CUDA, reference on CPU; weight rounded to ``x.dtype``, fp32 accumulation)."""
    if _eager():
        _check_linear(x, qweight, scales, qzeros, g_idx, bias)
    return torch.ops.torchforge.w4a16_gptq_linear(x, qweight, scales, qzeros, g_idx, bias)
