"""NVFP4 ops registered with torch.library (namespace `torchforge`) and their public wrappers.

Format and rounding rules: `torchforge.ops.nvfp4_reference` (NVIDIA ModelOpt's NVFP4 semantics, vLLM's
activation quantization, CUTLASS/FlashInfer 128x4 scale atoms).

Dispatch:
* `nvfp4_grouped_linear`, `nvfp4_linear`: `triton_op` when triton imports; CUDA tensors run Triton kernels
  that dequantize FP4 x E4M3 in registers, CPU tensors the pure-PyTorch reference. Which kernel is a rule on
  shapes only (`_launch_grouped`): few routed rows per expert (decode: ``R <= max(1, E)``,
  `nvfp4_gemv_triton.use_grouped_gemv`) run the grouped GEMV of `torchforge.ops.nvfp4_gemv_triton` (one
  program per routed row and BLOCK_N outputs, fp32 FMAs, no sort); more rows run the on-device expert sort +
  grouped tl.dot GEMM of `torchforge.ops.nvfp4_triton`. Both handle W4A4 emulation and out-of-range ids.
* `nvfp4_quantize`, `nvfp4_dequantize`, `nvfp4_quantize_activation`, `nvfp4_fake_quantize_activation`,
  `nvfp4_swizzle_scales`, `nvfp4_unswizzle_scales`: `custom_op` whose implementation is the reference (pure
  torch, so it runs on CUDA as well; quantization goes one expert at a time to bound memory).

Every op validates shapes/dtypes with `torch._check*` (shared by the eager body and the fake implementation).
Checks that need the data (NaN/Inf weights, non-positive global scales, expert ids out of range on CPU) run
eagerly in the reference; CUDA `nvfp4_grouped_linear` writes NaN rows for out-of-range expert ids instead of
syncing to check them.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from torchforge.ops._check import check_same_device, check_type, check_value
from torchforge.ops._routed_rows import check_routed_rows
from torchforge.ops._triton import HAS_TRITON, use_triton
from torchforge.ops.nvfp4_reference import (
    BLOCK,
    E2M1_VALUES,
    _is_traced,
    check_finite,
    nvfp4_dequantize_ref,
    nvfp4_fake_quantize_activation_ref,
    nvfp4_grouped_linear_ref,
    nvfp4_linear_ref,
    nvfp4_quantize_activation_ref,
    nvfp4_quantize_ref,
    swizzle_scales_ref,
    unswizzle_scales_ref,
)
from torchforge.ops.nvfp4_gemv_triton import launch_nvfp4_grouped_gemv, use_grouped_gemv
from torchforge.ops.nvfp4_triton import launch_nvfp4_dequantize, launch_nvfp4_grouped_linear

if HAS_TRITON:
    from torch.library import triton_op as _define_kernel_op
else:  # importing torchforge must work without triton
    _define_kernel_op = custom_op

__all__ = [
    "E2M1_VALUES",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_quantize_activation",
    "nvfp4_fake_quantize_activation",
    "nvfp4_swizzle_scales",
    "nvfp4_unswizzle_scales",
    "nvfp4_linear",
    "nvfp4_grouped_linear",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------- checks
def _check_k(op: str, k: int, what: str) -> None:
    check_value(
        k % BLOCK == 0,
        lambda: f"{op}: {what} has K={k} input channels (last dim), not divisible by 16 (the NVFP4 block "
        "size); pad K to a multiple of 16 or keep this layer unquantized",
    )


def _check_quantize_args(weight: Tensor, weight_scale_2: Optional[Tensor]) -> None:
    op = "nvfp4_quantize"
    check_type(
        weight.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: weight must be float32/float16/bfloat16, got {weight.dtype}",
    )
    check_value(
        weight.dim() in (2, 3),
        lambda: f"{op}: weight must be [N, K] (nn.Linear layout) or [E, N, K] (experts), got shape "
        f"{tuple(weight.shape)}",
    )
    _check_k(op, weight.shape[-1], "weight")
    if weight_scale_2 is not None:
        want = () if weight.dim() == 2 else (weight.shape[0],)
        check_type(
            weight_scale_2.dtype == torch.float32,
            lambda: f"{op}: weight_scale_2 must be float32, got {weight_scale_2.dtype}",
        )
        check_value(
            tuple(weight_scale_2.shape) == want,
            lambda: f"{op}: weight_scale_2 has shape {tuple(weight_scale_2.shape)}, expected {want} (a scalar "
            "for [N, K], one value per expert for [E, N, K])",
        )


def _check_packed(op: str, packed: Tensor, scales: Tensor, weight_scale_2: Tensor, lead_dims: Optional[int]) -> Tuple[int, int]:
    """packed uint8 [..., N, K/2], scales fp8 [..., N, K/16], weight_scale_2 fp32 [...]; returns (N, K)."""
    check_type(packed.dtype == torch.uint8,
               lambda: f"{op}: packed must be uint8 (two E2M1 codes per byte), got {packed.dtype}")
    check_type(scales.dtype == _FP8,
               lambda: f"{op}: scales must be float8_e4m3fn (block-16 scales), got {scales.dtype}")
    check_type(weight_scale_2.dtype == torch.float32,
               lambda: f"{op}: weight_scale_2 must be float32, got {weight_scale_2.dtype}")
    if lead_dims is None:
        check_value(packed.dim() >= 2,
                    lambda: f"{op}: packed must be [..., N, K/2], got shape {tuple(packed.shape)}")
    else:
        layout = "[E, N, K/2]" if lead_dims else "[N, K/2]"
        check_value(packed.dim() == 2 + lead_dims,
                    lambda: f"{op}: packed must be {layout}, got shape {tuple(packed.shape)}")
    lead = tuple(packed.shape[:-2])
    n, k = packed.shape[-2], packed.shape[-1] * 2
    _check_k(op, k, "packed")
    want_s = (*lead, n, k // BLOCK)
    check_value(
        tuple(scales.shape) == want_s,
        lambda: f"{op}: scales has shape {tuple(scales.shape)} but packed {tuple(packed.shape)} needs {want_s} "
        "= [..., N, K/16] (unswizzle Blackwell-layout scales with nvfp4_unswizzle_scales first)",
    )
    check_value(
        tuple(weight_scale_2.shape) == lead or (not lead and weight_scale_2.numel() == 1),
        lambda: f"{op}: weight_scale_2 has shape {tuple(weight_scale_2.shape)}, expected {lead} (one per "
        "leading index of packed)",
    )
    for name, t in (("scales", scales), ("weight_scale_2", weight_scale_2)):
        check_value(t.device == packed.device,
                    lambda: f"{op}: {name} is on {t.device} but packed is on {packed.device}")
    return n, k


def _check_activation(op: str, x: Tensor, k: int, like: Tensor) -> None:
    check_type(x.dtype in _FLOAT_DTYPES, lambda: f"{op}: x must be float16/bfloat16/float32, got {x.dtype}")
    check_value(x.dim() >= 1, lambda: f"{op}: x must be [..., K], got a scalar")
    check_value(x.shape[-1] == k,
                lambda: f"{op}: x has {x.shape[-1]} features (last dim) but the weight expects K={k}")
    check_value(x.device == like.device,
                lambda: f"{op}: x is on {x.device} but the weight is on {like.device}")


def _check_input_scale(op: str, input_scale: Optional[Tensor], want: tuple, x: Tensor) -> None:
    if input_scale is None:
        return
    check_same_device(op, "input_scale", input_scale, x, "x")
    check_type(input_scale.dtype == torch.float32,
               lambda: f"{op}: input_scale must be float32, got {input_scale.dtype}")
    check_value(
        tuple(input_scale.shape) == want or (not want and input_scale.numel() == 1),
        lambda: f"{op}: input_scale has shape {tuple(input_scale.shape)}, expected {want}",
    )


def _check_act_quant_args(op: str, x: Tensor, input_scale: Tensor) -> None:
    check_type(x.dtype in _FLOAT_DTYPES, lambda: f"{op}: x must be float16/bfloat16/float32, got {x.dtype}")
    check_value(x.dim() >= 1, lambda: f"{op}: x must be [..., K], got a scalar")
    _check_k(op, x.shape[-1], "x")
    check_type(input_scale.dtype == torch.float32,
               lambda: f"{op}: input_scale must be float32, got {input_scale.dtype}")
    check_value(input_scale.numel() == 1,
                lambda: f"{op}: input_scale must be a scalar (static per-tensor scale), got shape "
                f"{tuple(input_scale.shape)}")


def _check_grouped_args(x: Tensor, expert_ids: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
                        input_scale: Optional[Tensor], x_row_div: int) -> Tuple[int, int]:
    op = "nvfp4_grouped_linear"
    n, k = _check_packed(op, packed, scales, weight_scale_2, lead_dims=1)
    _check_activation(op, x, k, packed)
    check_routed_rows(op, x, expert_ids, x_row_div)
    _check_input_scale(op, input_scale, (packed.shape[0],), x)
    return n, k


def _check_linear_args(x: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
                       input_scale: Optional[Tensor], bias: Optional[Tensor]) -> Tuple[int, int]:
    op = "nvfp4_linear"
    n, k = _check_packed(op, packed, scales, weight_scale_2, lead_dims=0)
    _check_activation(op, x, k, packed)
    _check_input_scale(op, input_scale, (), x)
    if bias is not None:
        check_type(bias.dtype in _FLOAT_DTYPES, lambda: f"{op}: bias must be a float tensor, got {bias.dtype}")
        check_value(bias.dim() == 1 and bias.shape[0] == n,
                    lambda: f"{op}: bias has shape {tuple(bias.shape)}, expected ({n},)")
        check_same_device(op, "bias", bias, x, "x")
    return n, k


def _check_positive(op: str, t: Optional[Tensor], what: str) -> None:
    if t is None or t.numel() == 0 or _is_traced(t):  # a data check: eager only
        return
    bad_mask = ~(torch.isfinite(t) & (t > 0))
    bad = int(bad_mask.sum())
    if bad:
        raise ValueError(f"{op}: {what} must be positive and finite; {bad} of {t.numel()} values are not "
                         f"(e.g. {float(t[bad_mask].flatten()[0])})")


# -------------------------------------------------------------------------------------------- ops
def _launch_grouped(x: Tensor, expert_ids: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
                    input_scale: Optional[Tensor], x_row_div: int = 1) -> Tensor:
    """Triton path of the NVFP4 matmuls (arguments validated): the grouped GEMV when the routed rows are few
    for the number of experts (`use_grouped_gemv`: shapes only, no host sync), else the sorted grouped GEMM."""
    if use_grouped_gemv(expert_ids.shape[0], packed.shape[0]):
        return launch_nvfp4_grouped_gemv(x, expert_ids, packed, scales, weight_scale_2, input_scale, x_row_div)
    return launch_nvfp4_grouped_linear(x, expert_ids, packed, scales, weight_scale_2, input_scale, x_row_div)


@custom_op("torchforge::nvfp4_quantize", mutates_args=())
def _nvfp4_quantize(weight: Tensor, weight_scale_2: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    _check_quantize_args(weight, weight_scale_2)
    _check_positive("nvfp4_quantize", weight_scale_2, "weight_scale_2")
    return nvfp4_quantize_ref(weight, weight_scale_2)


@_nvfp4_quantize.register_fake
def _(weight: Tensor, weight_scale_2: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    _check_quantize_args(weight, weight_scale_2)
    *lead, n, k = weight.shape
    return (weight.new_empty((*lead, n, k // 2), dtype=torch.uint8),
            weight.new_empty((*lead, n, k // BLOCK), dtype=_FP8),
            weight.new_empty(tuple(lead), dtype=torch.float32))


@_define_kernel_op("torchforge::nvfp4_dequantize", mutates_args=())
def _nvfp4_dequantize(packed: Tensor, scales: Tensor, weight_scale_2: Tensor, dtype: torch.dtype) -> Tensor:
    _check_packed("nvfp4_dequantize", packed, scales, weight_scale_2, lead_dims=None)
    if use_triton(packed):  # one launch for any stack of experts (the MoE backward dequantizes a layer's at once)
        return launch_nvfp4_dequantize(packed, scales, weight_scale_2, dtype)
    return nvfp4_dequantize_ref(packed, scales, weight_scale_2, dtype)


@_nvfp4_dequantize.register_fake
def _(packed: Tensor, scales: Tensor, weight_scale_2: Tensor, dtype: torch.dtype) -> Tensor:
    n, k = _check_packed("nvfp4_dequantize", packed, scales, weight_scale_2, lead_dims=None)
    return packed.new_empty((*packed.shape[:-2], n, k), dtype=dtype)


@custom_op("torchforge::nvfp4_quantize_activation", mutates_args=())
def _nvfp4_quantize_activation(x: Tensor, input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    _check_act_quant_args("nvfp4_quantize_activation", x, input_scale)
    _check_positive("nvfp4_quantize_activation", input_scale, "input_scale")
    return nvfp4_quantize_activation_ref(x, input_scale.reshape(()))


@_nvfp4_quantize_activation.register_fake
def _(x: Tensor, input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    _check_act_quant_args("nvfp4_quantize_activation", x, input_scale)
    k = x.shape[-1]
    return (x.new_empty((*x.shape[:-1], k // 2), dtype=torch.uint8),
            x.new_empty((*x.shape[:-1], k // BLOCK), dtype=_FP8))


@custom_op("torchforge::nvfp4_fake_quantize_activation", mutates_args=())
def _nvfp4_fake_quantize_activation(x: Tensor, input_scale: Tensor) -> Tensor:
    _check_act_quant_args("nvfp4_fake_quantize_activation", x, input_scale)
    _check_positive("nvfp4_fake_quantize_activation", input_scale, "input_scale")
    return nvfp4_fake_quantize_activation_ref(x, input_scale.reshape(()))


@_nvfp4_fake_quantize_activation.register_fake
def _(x: Tensor, input_scale: Tensor) -> Tensor:
    _check_act_quant_args("nvfp4_fake_quantize_activation", x, input_scale)
    return x.new_empty(x.shape)  # contiguous, as the reference's output for any input strides


def _check_swizzle_args(op: str, scales: Tensor) -> None:
    check_type(scales.dtype == _FP8, lambda: f"{op}: scales must be float8_e4m3fn, got {scales.dtype}")
    check_value(scales.dim() >= 2, lambda: f"{op}: scales must be [..., M, K/16], got {tuple(scales.shape)}")


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


@custom_op("torchforge::nvfp4_swizzle_scales", mutates_args=())
def _nvfp4_swizzle_scales(scales: Tensor) -> Tensor:
    _check_swizzle_args("nvfp4_swizzle_scales", scales)
    return swizzle_scales_ref(scales)


@_nvfp4_swizzle_scales.register_fake
def _(scales: Tensor) -> Tensor:
    _check_swizzle_args("nvfp4_swizzle_scales", scales)
    *lead, m, kb = scales.shape
    return scales.new_empty((*lead, _round_up(m, 128), _round_up(kb, 4)))


def _check_unswizzle_args(swizzled: Tensor, rows: int, cols: int) -> None:
    op = "nvfp4_unswizzle_scales"
    _check_swizzle_args(op, swizzled)
    mp, kp = swizzled.shape[-2], swizzled.shape[-1]
    check_value(mp % 128 == 0 and kp % 4 == 0,
                lambda: f"{op}: swizzled scales must be [..., 128*i, 4*j], got {tuple(swizzled.shape)}")
    check_value(0 <= rows <= mp and 0 <= cols <= kp and mp - rows < 128 and kp - cols < 4,
                lambda: f"{op}: rows={rows}, cols={cols} do not fit the padded shape {(mp, kp)} (rows must "
                "round up to it in multiples of 128, cols in multiples of 4)")


@custom_op("torchforge::nvfp4_unswizzle_scales", mutates_args=())
def _nvfp4_unswizzle_scales(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    _check_unswizzle_args(swizzled, rows, cols)
    out = unswizzle_scales_ref(swizzled, rows, cols)
    # views all the way for an empty tensor (or one already in order): a custom op's output may not alias its input
    return out.clone() if out.untyped_storage().data_ptr() == swizzled.untyped_storage().data_ptr() else out


@_nvfp4_unswizzle_scales.register_fake
def _(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    _check_unswizzle_args(swizzled, rows, cols)
    return swizzled.new_empty((*swizzled.shape[:-2], rows, cols))


@_define_kernel_op("torchforge::nvfp4_grouped_linear", mutates_args=())
def _nvfp4_grouped_linear(x: Tensor, expert_ids: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
                          input_scale: Optional[Tensor], x_row_div: int) -> Tensor:
    _check_grouped_args(x, expert_ids, packed, scales, weight_scale_2, input_scale, x_row_div)
    if use_triton(x):
        return _launch_grouped(x, expert_ids, packed, scales, weight_scale_2, input_scale, x_row_div)
    _check_positive("nvfp4_grouped_linear", input_scale, "input_scale")
    rows = x.repeat_interleave(x_row_div, dim=0) if x_row_div > 1 else x
    return nvfp4_grouped_linear_ref(rows, expert_ids, packed, scales, weight_scale_2, input_scale)


@_nvfp4_grouped_linear.register_fake
def _(x: Tensor, expert_ids: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
      input_scale: Optional[Tensor], x_row_div: int) -> Tensor:
    n, _ = _check_grouped_args(x, expert_ids, packed, scales, weight_scale_2, input_scale, x_row_div)
    return x.new_empty((expert_ids.shape[0], n))


@_define_kernel_op("torchforge::nvfp4_linear", mutates_args=())
def _nvfp4_linear(x: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor, input_scale: Optional[Tensor],
                  bias: Optional[Tensor]) -> Tensor:
    n, k = _check_linear_args(x, packed, scales, weight_scale_2, input_scale, bias)
    if use_triton(x):
        x2 = x.reshape(x.shape[:-1].numel(), k)  # not -1: K = 0 leaves the row count ambiguous
        ids = torch.zeros(x2.shape[0], dtype=torch.int32, device=x.device)
        out = _launch_grouped(x2, ids, packed.unsqueeze(0), scales.unsqueeze(0), weight_scale_2.reshape(1),
                              None if input_scale is None else input_scale.reshape(1))
        if bias is not None:
            out = (out.float() + bias.float()).to(x.dtype)
        return out.reshape(*x.shape[:-1], n)
    _check_positive("nvfp4_linear", input_scale, "input_scale")  # 0 (uncalibrated) quantizes x to 0 / NaN blocks
    return nvfp4_linear_ref(x, packed, scales, weight_scale_2.reshape(()),
                            None if input_scale is None else input_scale.reshape(()), bias)


@_nvfp4_linear.register_fake
def _(x: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor, input_scale: Optional[Tensor],
      bias: Optional[Tensor]) -> Tensor:
    n, _ = _check_linear_args(x, packed, scales, weight_scale_2, input_scale, bias)
    return x.new_empty((*x.shape[:-1], n))


# -------------------------------------------------------------------------------- public wrappers
def _eager() -> bool:
    return not torch.compiler.is_compiling()


def nvfp4_quantize(weight: Tensor, weight_scale_2: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """NVFP4 quantization of ``weight [N, K]`` (or ``[E, N, K]``) with NVIDIA ModelOpt's exact rules.

    Returns ``(packed uint8 [..., N, K/2], scales float8_e4m3fn [..., N, K/16], weight_scale_2 float32 []
    or [E])``: ``weight_scale_2 = amax / (6 * 448)`` per matrix unless given, block scale
    ``fp8(block_amax / (6 * weight_scale_2))`` (1.0 for all-zero blocks, clamped to [2**-9, 448]), E2M1 codes
    of ``W / (scale * weight_scale_2)`` rounded to nearest, ties to even, saturating at 6; bit 3 is the sign,
    the even element is the low nibble. Raises on NaN/Inf and on K not divisible by 16.
    """
    if _eager():
        _check_quantize_args(weight, weight_scale_2)
        check_finite("nvfp4_quantize", weight)
    return torch.ops.torchforge.nvfp4_quantize(weight, weight_scale_2)


def nvfp4_dequantize(packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """``E2M1[code] * fp32(scale) * weight_scale_2`` as ``[..., N, K]`` in ``dtype`` (exact in fp32: one
    rounding of the exact product)."""
    if _eager():
        _check_packed("nvfp4_dequantize", packed, scales, weight_scale_2, lead_dims=None)
    return torch.ops.torchforge.nvfp4_dequantize(packed, scales, weight_scale_2, dtype)


def nvfp4_quantize_activation(x: Tensor, input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-token block-16 NVFP4 quantization of activations ``x [..., K]`` under a static ``input_scale``
    (calibrated ``amax / (6 * 448)``), as vLLM's NVFP4 path computes it. Returns (packed uint8 [..., K/2],
    fp8 block scales [..., K/16])."""
    if _eager():
        _check_act_quant_args("nvfp4_quantize_activation", x, input_scale)
    return torch.ops.torchforge.nvfp4_quantize_activation(x, input_scale)


def nvfp4_fake_quantize_activation(x: Tensor, input_scale: Tensor) -> Tensor:
    """Quantize-dequantize of :func:`nvfp4_quantize_activation`: ``E2M1 * scale * input_scale`` in x.dtype."""
    if _eager():
        _check_act_quant_args("nvfp4_fake_quantize_activation", x, input_scale)
    return torch.ops.torchforge.nvfp4_fake_quantize_activation(x, input_scale)


def nvfp4_swizzle_scales(scales: Tensor) -> Tensor:
    """Linear fp8 block scales ``[..., M, K/16]`` -> the 128x4-atom layout CUTLASS / FlashInfer block-scaled
    GEMMs read, ``[..., round_up(M, 128), round_up(K/16, 4)]`` (zero padded)."""
    if _eager():
        _check_swizzle_args("nvfp4_swizzle_scales", scales)
    return torch.ops.torchforge.nvfp4_swizzle_scales(scales)


def nvfp4_unswizzle_scales(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    """Inverse of :func:`nvfp4_swizzle_scales`, cropped to ``[..., rows, cols]``."""
    if _eager():
        _check_unswizzle_args(swizzled, rows, cols)
    return torch.ops.torchforge.nvfp4_unswizzle_scales(swizzled, rows, cols)


def nvfp4_linear(x: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
                 input_scale: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
    """``x [..., K] @ W.T (+ bias) -> [..., N]`` in ``x.dtype`` with an NVFP4 weight ``packed [N, K/2]``,
    ``scales [N, K/16]``, scalar ``weight_scale_2``. With ``input_scale`` the activations are NVFP4-quantized
    first and the sum is scaled by ``input_scale * weight_scale_2`` (W4A4 emulation of Blackwell)."""
    if _eager():
        _check_linear_args(x, packed, scales, weight_scale_2, input_scale, bias)
    return torch.ops.torchforge.nvfp4_linear(x, packed, scales, weight_scale_2, input_scale, bias)


def nvfp4_grouped_linear(x: Tensor, expert_ids: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
                         input_scale: Optional[Tensor] = None, x_row_div: int = 1) -> Tensor:
    """Per-row expert matmul for MoE: ``out[r] = x[r // x_row_div] @ W[expert_ids[r]].T`` -> ``[R, N]`` in
    ``x.dtype`` (``x_row_div = top_k`` lets the gate_up GEMM read the ``[T, H]`` hidden states directly).

    ``x [R / x_row_div, K]``, ``expert_ids [R]`` in ``[0, E)``, ``packed [E, N, K/2]`` uint8, ``scales [E, N, K/16]`` fp8,
    ``weight_scale_2 [E]`` fp32, optional ``input_scale [E]`` fp32 (W4A4 emulation). CUDA: with few rows per
    expert (``R <= max(1, E)``, decode) one grouped GEMV kernel, one program per routed row; else an
    on-device sort of the rows by expert and one grouped Triton GEMM. Both dequantize the weights in registers,
    accumulate in fp32 and apply ``weight_scale_2`` at the end; out-of-range ids give NaN rows. CPU: the
    reference (out-of-range ids raise ValueError).
    """
    if _eager():
        _check_grouped_args(x, expert_ids, packed, scales, weight_scale_2, input_scale, x_row_div)
    return torch.ops.torchforge.nvfp4_grouped_linear(x, expert_ids, packed, scales, weight_scale_2, input_scale,
                                                     x_row_div)
