"""AWQ W4 ops registered with torch.library (namespace `torchforge`) and their public wrappers.

Format: see `torchforge.ops.awq_reference` (vLLM / AutoAWQ layout, packing order 0, 2, 4, 6, 1, 3, 5, 7).

Dispatch:
* `w4a16_linear`, `awq_grouped_linear`: `triton_op` when triton imports (torch.compile sees the
  kernels); CUDA tensors run the Triton kernel, CPU tensors (and group sizes that are not a multiple
  of 16) the pure-PyTorch reference.
* `awq_pack`, `awq_unpack`, `awq_dequantize`, `awq_quantize`: `custom_op` whose implementation is the
  reference (pure torch, so it runs on CUDA as well). `awq_quantize` uses the fused CUDA kernel of the
  optional extension (`torch.ops.torchforge.awq_quantize_cuda`, csrc/) when it is built.

Every op validates shapes/dtypes with `torch._check*` (shared by the eager body and the fake
implementation, so errors are the same under torch.compile). Checks that need the data (NaN/Inf in a
weight, codes > 15, expert ids out of range) run eagerly in the reference; `awq_grouped_linear` does not
range-check expert ids of CUDA tensors (a host sync): the kernel writes NaN rows for them instead.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from torchforge.ops._check import check_same_device, check_type, check_value
from torchforge.ops._ext import has_cuda_ext
from torchforge.ops._gemm import matmul_bias
from torchforge.ops._triton import HAS_TRITON, use_triton
from torchforge.ops.awq_reference import (
    AWQ_NIBBLE_OF_COLUMN,
    AWQ_PACK_ORDER,
    FP16_MAX,
    awq_dequantize_ref,
    awq_grouped_linear_ref,
    awq_pack_ref,
    awq_quantize_ref,
    awq_unpack_ref,
    w4a16_linear_ref,
)
from torchforge.ops.awq_dequant_triton import launch_awq_dequantize, launch_awq_dequantize_t
from torchforge.ops.awq_gemv_cuda import cuda_gemv_ok, launch_awq_gemv_cuda
from torchforge.ops.awq_gemv_triton import launch_w4a16_gemv
from torchforge.ops.awq_mma_triton import launch_w4a16_mma
from torchforge.ops.awq_splitk_triton import launch_w4a16_splitk
from torchforge.ops.awq_triton import launch_awq_grouped_linear, launch_w4a16_linear, pick_block_k

if HAS_TRITON:
    from torch.library import triton_op as _define_kernel_op
else:  # importing torchforge must work without triton
    _define_kernel_op = custom_op

__all__ = [
    "AWQ_PACK_ORDER",
    "AWQ_NIBBLE_OF_COLUMN",
    "awq_pack",
    "awq_unpack",
    "awq_quantize",
    "awq_dequantize",
    "w4a16_linear",
    "awq_grouped_linear",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------- checks
def _check_group_size(op: str, group_size: int) -> None:
    check_value(
        group_size > 0,
        lambda: f"{op}: group_size={group_size} must be positive (typically 32, 64 or 128)",
    )


def _check_pack_args(codes: Tensor) -> None:
    check_type(
        codes.dtype == torch.uint8,
        lambda: f"awq_pack: codes must be uint8 holding values 0..15, got {codes.dtype}; "
        "convert with codes.to(torch.uint8)",
    )
    check_value(
        codes.dim() >= 2,
        lambda: f"awq_pack: codes must be [..., IC, OC], got shape {tuple(codes.shape)}",
    )
    oc = codes.shape[-1]
    check_value(
        oc % 8 == 0,
        lambda: f"awq_pack: codes has OC={oc} output channels (last dim), not divisible by 8; "
        "pad OC to a multiple of 8",
    )


def _check_unpack_args(qweight: Tensor) -> None:
    check_type(
        qweight.dtype == torch.int32,
        lambda: f"awq_unpack: qweight must be int32 (8 packed 4-bit codes per word), got {qweight.dtype}",
    )
    check_value(
        qweight.dim() >= 2,
        lambda: f"awq_unpack: qweight must be [..., IC, OC // 8], got shape {tuple(qweight.shape)}",
    )


def _check_quantize_args(weight: Tensor, group_size: int) -> None:
    check_type(
        weight.dtype in _FLOAT_DTYPES,
        lambda: f"awq_quantize: weight must be float32/float16/bfloat16, got {weight.dtype}",
    )
    check_value(
        weight.dim() in (2, 3),
        lambda: "awq_quantize: weight must be [OC, IC] (nn.Linear layout) or [E, OC, IC] (experts), "
        f"got shape {tuple(weight.shape)}",
    )
    _check_group_size("awq_quantize", group_size)
    oc, ic = weight.shape[-2], weight.shape[-1]
    check_value(
        oc % 8 == 0,
        lambda: f"awq_quantize: weight has OC={oc} output channels (dim -2), not divisible by 8; "
        "pad OC to a multiple of 8",
    )
    check_value(
        ic % group_size == 0,
        lambda: f"awq_quantize: weight has IC={ic} input channels, not divisible by group_size={group_size}; "
        "pad IC or choose a group size that divides it",
    )


def _check_packed_weight(
    op: str, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int, batched: Optional[bool]
) -> Tuple[int, int]:
    """Checks qweight [..., IC, OC//8], scales [..., IC//G, OC], qzeros [..., IC//G, OC//8]; returns (IC, OC).

    batched: True -> exactly one leading (expert) dim, False -> none, None -> any."""
    check_type(
        qweight.dtype == torch.int32,
        lambda: f"{op}: qweight must be int32 (packed AWQ codes), got {qweight.dtype}",
    )
    check_type(
        qzeros.dtype == torch.int32,
        lambda: f"{op}: qzeros must be int32 (packed AWQ zero points), got {qzeros.dtype}",
    )
    check_type(
        scales.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: scales must be float16 (or bfloat16/float32), got {scales.dtype}",
    )
    _check_group_size(op, group_size)
    if batched is None:
        check_value(
            qweight.dim() >= 2,
            lambda: f"{op}: qweight must be [..., IC, OC // 8], got shape {tuple(qweight.shape)}",
        )
    else:
        want = 3 if batched else 2
        layout = "[E, IC, OC // 8]" if batched else "[IC, OC // 8]"
        check_value(
            qweight.dim() == want,
            lambda: f"{op}: qweight must be {layout}, got shape {tuple(qweight.shape)}",
        )
    lead = tuple(qweight.shape[:-2])
    ic, oc = qweight.shape[-2], qweight.shape[-1] * 8
    check_value(
        ic % group_size == 0,
        lambda: f"{op}: qweight has IC={ic} input channels, not divisible by group_size={group_size}; "
        "pass the group size the weight was quantized with",
    )
    for name, t in (("scales", scales), ("qzeros", qzeros)):
        check_value(
            t.device == qweight.device,
            lambda: f"{op}: {name} is on {t.device} but qweight is on {qweight.device}; move them to one device",
        )
    ng = ic // group_size
    want_s = (*lead, ng, oc)
    want_z = (*lead, ng, oc // 8)
    check_value(
        scales.dim() == len(want_s) and all(a == b for a, b in zip(scales.shape, want_s)),
        lambda: f"{op}: scales has shape {tuple(scales.shape)} but qweight {tuple(qweight.shape)} with "
        f"group_size={group_size} needs {want_s} = [..., IC // G, OC]; check group_size and the tensor order",
    )
    check_value(
        qzeros.dim() == len(want_z) and all(a == b for a, b in zip(qzeros.shape, want_z)),
        lambda: f"{op}: qzeros has shape {tuple(qzeros.shape)} but qweight {tuple(qweight.shape)} with "
        f"group_size={group_size} needs {want_z} = [..., IC // G, OC // 8]",
    )
    return ic, oc


def _check_activation(op: str, x: Tensor, ic: int, qweight: Tensor) -> None:
    check_type(
        x.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: x must be float16/bfloat16/float32, got {x.dtype}",
    )
    check_value(x.dim() >= 1, lambda: f"{op}: x must have at least one dim [..., IC], got a scalar")
    check_value(
        x.shape[-1] == ic,
        lambda: f"{op}: x has {x.shape[-1]} features (last dim) but qweight {tuple(qweight.shape)} "
        f"expects IC={ic}",
    )
    check_value(
        x.device == qweight.device,
        lambda: f"{op}: x is on {x.device} but qweight is on {qweight.device}; move them to one device",
    )


def _check_w4a16_args(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int, bias: Optional[Tensor],
    op: str = "w4a16_linear",
) -> Tuple[int, int]:
    ic, oc = _check_packed_weight(op, qweight, scales, qzeros, group_size, batched=False)
    _check_activation(op, x, ic, qweight)
    if bias is not None:
        check_type(
            bias.dtype in _FLOAT_DTYPES,
            lambda: f"{op}: bias must be float16/bfloat16/float32, got {bias.dtype}",
        )
        check_value(
            bias.dim() == 1 and bias.shape[0] == oc,
            lambda: f"{op}: bias has shape {tuple(bias.shape)}, expected ({oc},) = [OC]",
        )
        check_same_device(op, "bias", bias, x, "x")
    return ic, oc


def _check_grouped_args(
    x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int
) -> Tuple[int, int]:
    op = "awq_grouped_linear"
    ic, oc = _check_packed_weight(op, qweight, scales, qzeros, group_size, batched=True)
    _check_activation(op, x, ic, qweight)
    check_value(x.dim() == 2, lambda: f"{op}: x must be [R, IC], got shape {tuple(x.shape)}")
    check_type(
        expert_ids.dtype in (torch.int32, torch.int64),
        lambda: f"{op}: expert_ids must be int32 or int64, got {expert_ids.dtype}",
    )
    check_value(
        expert_ids.device == x.device,
        lambda: f"{op}: expert_ids is on {expert_ids.device} but x is on {x.device}; move them to one device",
    )
    check_value(
        expert_ids.dim() == 1 and expert_ids.shape[0] == x.shape[0],
        lambda: f"{op}: expert_ids has shape {tuple(expert_ids.shape)}, expected ({x.shape[0]},) = one id "
        "per row of x",
    )
    return ic, oc


# Dispatch of w4a16_linear on CUDA by M = rows of x, from bench/w4a16_linear.py on the H100 (BENCHMARKS.md):
# one row: the FMA GEMV; up to MMA_MAX_M rows (bf16/fp16): the tensor-core kernel of awq_mma_triton.py
# (0.189 vs 0.222 ms for dequantize + cuBLAS at M = 128 on 18432x7168, 0.332 vs 0.239 at 256); beyond that
# one dequantize pass and cuBLAS. fp32 activations take the split-K (<= 16 rows) or tiled kernel.
SPLITK_MAX_M = 16
MMA_MAX_M = 128
DEQUANT_CUBLAS_MIN_M = 129


def _kernel_ok(t: Tensor, group_size: int) -> bool:
    return use_triton(t) and pick_block_k(group_size) > 0


# -------------------------------------------------------------------------------------------- ops
@custom_op("torchforge::awq_pack", mutates_args=())
def _awq_pack(codes: Tensor) -> Tensor:
    _check_pack_args(codes)
    return awq_pack_ref(codes)


@_awq_pack.register_fake
def _(codes: Tensor) -> Tensor:
    _check_pack_args(codes)
    return codes.new_empty((*codes.shape[:-1], codes.shape[-1] // 8), dtype=torch.int32)


@custom_op("torchforge::awq_unpack", mutates_args=())
def _awq_unpack(qweight: Tensor) -> Tensor:
    _check_unpack_args(qweight)
    return awq_unpack_ref(qweight)


@_awq_unpack.register_fake
def _(qweight: Tensor) -> Tensor:
    _check_unpack_args(qweight)
    return qweight.new_empty((*qweight.shape[:-1], qweight.shape[-1] * 8), dtype=torch.uint8)


@custom_op("torchforge::awq_quantize", mutates_args=())
def _awq_quantize(weight: Tensor, group_size: int, symmetric: bool) -> Tuple[Tensor, Tensor, Tensor]:
    _check_quantize_args(weight, group_size)
    if weight.is_cuda and has_cuda_ext() and _cuda_quantize_ok(weight, group_size):
        # Fused CUDA kernel of the optional extension (csrc/, registered by torchforge._C as
        # torchforge::awq_quantize_cuda); it must match awq_quantize_ref bit for bit. The weight is finite here (its
        # amax was); NaN / Inf weights take the reference, which names them.
        return torch.ops.torchforge.awq_quantize_cuda(weight, group_size, symmetric)
    return awq_quantize_ref(weight, group_size, symmetric)


def _cuda_quantize_ok(weight: Tensor, group_size: int) -> bool:
    """What csrc/ops.cpp's awq_quantize_cuda takes (else the reference, the same numbers): group sizes 32-256, a
    contiguous 16-byte-aligned weight, dims below 2^30. And no scale can pass fp16's maximum: at |w| <= 7 x 65504
    (s = amax / 7, or (max - min) / 15 <= 2 amax / 15), where the reference raises for a larger scale but the kernel
    would round it to 65504 or inf."""
    oc, ic = weight.shape[-2], weight.shape[-1]
    if not (group_size in (32, 64, 128, 256) and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and oc < 2 ** 30 and ic < 2 ** 30):
        return False
    if weight.numel() == 0:
        return True
    # aminmax reduces without the weight-sized temporary that abs() made: 1.75 GiB for one layer's stacked experts,
    # which ran a 64 GB model out of memory while it was being quantized on an 80 GB GPU (thirty-second session).
    # A NaN propagates to both ends and fails the test, as before.
    lo, hi = weight.detach().aminmax()
    return float(torch.maximum(-lo, hi)) <= 7 * FP16_MAX


@_awq_quantize.register_fake
def _(weight: Tensor, group_size: int, symmetric: bool) -> Tuple[Tensor, Tensor, Tensor]:
    _check_quantize_args(weight, group_size)
    *lead, oc, ic = weight.shape
    ng = ic // group_size
    return (
        weight.new_empty((*lead, ic, oc // 8), dtype=torch.int32),
        weight.new_empty((*lead, ng, oc), dtype=torch.float16),
        weight.new_empty((*lead, ng, oc // 8), dtype=torch.int32),
    )


@_define_kernel_op("torchforge::awq_dequantize", mutates_args=())
def _awq_dequantize(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                    dtype: Optional[torch.dtype] = None) -> Tensor:
    _check_packed_weight("awq_dequantize", qweight, scales, qzeros, group_size, batched=None)
    dtype = scales.dtype if dtype is None else dtype
    if use_triton(qweight):  # one launch for any stack of matrices, no temporaries (the reference holds ~20 B a weight)
        return launch_awq_dequantize(qweight, scales, qzeros, group_size, dtype)
    return awq_dequantize_ref(qweight, scales.float(), qzeros, group_size).to(dtype)


@_awq_dequantize.register_fake
def _(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    ic, oc = _check_packed_weight("awq_dequantize", qweight, scales, qzeros, group_size, batched=None)
    return scales.new_empty((*qweight.shape[:-2], oc, ic), dtype=scales.dtype if dtype is None else dtype)


@_define_kernel_op("torchforge::w4a16_linear", mutates_args=())
def _w4a16_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int, bias: Optional[Tensor]
) -> Tensor:
    ic, oc = _check_w4a16_args(x, qweight, scales, qzeros, group_size, bias)
    if _kernel_ok(x, group_size) and ic > 0:  # IC = 0: an empty sum, the reference's zeros (+ bias)
        m = x.numel() // ic
        # the kernels index these as dense row-major arrays
        qweight, scales, qzeros = qweight.contiguous(), scales.contiguous(), qzeros.contiguous()
        bias = bias.contiguous() if bias is not None else None
        if m == 1 and cuda_gemv_ok(x, qweight, scales, qzeros, group_size, bias):
            return launch_awq_gemv_cuda(x, qweight, scales, qzeros, group_size, bias)  # csrc/awq_gemv.cu
        if m == 1 and group_size % 16 == 0:
            # batch-1 decode: the FMA GEMV (no tensor cores) reads the int4 weight ~1.7x faster than split-K
            return launch_w4a16_gemv(x, qweight, scales, qzeros, group_size, bias)
        if m <= MMA_MAX_M and x.dtype != torch.float32:
            return launch_w4a16_mma(x, qweight, scales, qzeros, group_size, bias)
        if m <= SPLITK_MAX_M:
            return launch_w4a16_splitk(x, qweight, scales, qzeros, group_size, bias)
        if m >= DEQUANT_CUBLAS_MIN_M:
            # Large M is compute bound: one dequantize pass (+OC*IC*2 bytes) then the vendor GEMM beats
            # dequantizing every tile in the mainloop once M amortizes that pass.
            w_t = launch_awq_dequantize_t(qweight, scales, qzeros, group_size, x.dtype)
            return matmul_bias(x, w_t, bias)
        return launch_w4a16_linear(x, qweight, scales, qzeros, group_size, bias)
    return w4a16_linear_ref(x, qweight, scales, qzeros, group_size, bias)


@_w4a16_linear.register_fake
def _(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int, bias: Optional[Tensor]
) -> Tensor:
    _, oc = _check_w4a16_args(x, qweight, scales, qzeros, group_size, bias)
    return x.new_empty((*x.shape[:-1], oc))


@_define_kernel_op("torchforge::awq_grouped_linear", mutates_args=())
def _awq_grouped_linear(
    x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int
) -> Tensor:
    _check_grouped_args(x, expert_ids, qweight, scales, qzeros, group_size)
    if _kernel_ok(x, group_size):
        return launch_awq_grouped_linear(x, expert_ids, qweight, scales, qzeros, group_size)
    return awq_grouped_linear_ref(x, expert_ids, qweight, scales, qzeros, group_size)


@_awq_grouped_linear.register_fake
def _(x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int) -> Tensor:
    _, oc = _check_grouped_args(x, expert_ids, qweight, scales, qzeros, group_size)
    return x.new_empty((x.shape[0], oc))


# -------------------------------------------------------------------------------- public wrappers
# The wrappers validate eagerly so errors point at the caller. Under torch.compile they skip it (dynamo
# cannot trace the message closures); the ops' fake implementations run the same checks there.
def _eager() -> bool:
    return not torch.compiler.is_compiling()


def awq_pack(codes: Tensor) -> Tensor:
    """Pack uint8 codes ``[..., IC, OC]`` (0..15) into AWQ int32 words ``[..., IC, OC // 8]``.

    Nibble ``k`` of each word holds column ``AWQ_PACK_ORDER[k]`` of its 8 columns (0, 2, 4, 6, 1, 3, 5, 7).
    """
    if _eager():
        _check_pack_args(codes)
    return torch.ops.torchforge.awq_pack(codes)


def awq_unpack(qweight: Tensor) -> Tensor:
    """Exact inverse of :func:`awq_pack`: int32 ``[..., IC, OC // 8]`` -> uint8 ``[..., IC, OC]``."""
    if _eager():
        _check_unpack_args(qweight)
    return torch.ops.torchforge.awq_unpack(qweight)


def awq_quantize(weight: Tensor, group_size: int = 128, symmetric: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest AWQ W4 quantization of an nn.Linear weight ``[OC, IC]`` (or ``[E, OC, IC]``).

    Returns ``(qweight int32 [IC, OC // 8], scales fp16 [IC // G, OC], qzeros int32 [IC // G, OC // 8])``
    (with a leading ``E`` when batched). ``symmetric=True`` stores zero point 8; ``False`` is AutoAWQ's
    ``zero_point=True`` min/max scheme. See :func:`torchforge.ops.awq_reference.awq_quantize_ref`.
    Raises on NaN/Inf weights and on scales that overflow fp16.
    """
    if _eager():
        _check_quantize_args(weight, group_size)
    return torch.ops.torchforge.awq_quantize(weight, group_size, symmetric)


def awq_dequantize(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int = 128,
                   dtype: Optional[torch.dtype] = None) -> Tensor:
    """AWQ tensors -> float weight ``[..., OC, IC]`` (nn.Linear layout) in ``dtype`` (default ``scales.dtype``):
    ``W[oc, ic] = (q - z) * s`` computed in fp32, rounded once. CUDA: one Triton launch for any stack of experts."""
    if _eager():
        _check_packed_weight("awq_dequantize", qweight, scales, qzeros, group_size, batched=None)
    return torch.ops.torchforge.awq_dequantize(qweight, scales, qzeros, group_size, dtype)


def w4a16_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    qzeros: Tensor,
    group_size: int = 128,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``x [..., IC] @ dequant(W).T (+ bias) -> [..., OC]`` in ``x.dtype`` (fp16/bf16/fp32).

    CUDA: Triton kernel (weight dequantized in registers, fp32 accumulation). CPU: the reference, which
    rounds the dequantized weight to ``x.dtype`` and multiplies in fp32.
    """
    if _eager():
        _check_w4a16_args(x, qweight, scales, qzeros, group_size, bias)
    return torch.ops.torchforge.w4a16_linear(x, qweight, scales, qzeros, group_size, bias)


def awq_grouped_linear(
    x: Tensor,
    expert_ids: Tensor,
    qweight: Tensor,
    scales: Tensor,
    qzeros: Tensor,
    group_size: int = 128,
) -> Tensor:
    """Per-row expert matmul for MoE: ``out[r] = x[r] @ dequant(W[expert_ids[r]]).T``.

    ``x [R, IC]``, ``expert_ids [R]`` int32/int64 in ``[0, E)``, ``qweight [E, IC, OC // 8]``,
    ``scales [E, IC // G, OC]``, ``qzeros [E, IC // G, OC // 8]`` -> ``[R, OC]`` in ``x.dtype``.
    Expert ids are range-checked on CPU (ValueError); on CUDA they are not (no host sync) and rows
    with an out-of-range id come out as NaN.
    """
    if _eager():
        _check_grouped_args(x, expert_ids, qweight, scales, qzeros, group_size)
    return torch.ops.torchforge.awq_grouped_linear(x, expert_ids, qweight, scales, qzeros, group_size)
