"""NVFP4Linear: a Linear whose weight is stored in NVIDIA ModelOpt's NVFP4 checkpoint layout."""
from __future__ import annotations

import math

import torch
from torch import nn

from torchforge import ops
from torchforge.nn._bias import check_pack_bias
from torchforge.nn.fixed_dtype_buffers import FixedDtypeBuffers

E2M1_E4M3_MAX = 6.0 * 448.0  # ModelOpt: scale = amax / (E2M1_MAX * E4M3_MAX)


def w4a4_ready(m: nn.Module) -> bool:
    """Whether W4A4 emulation may be switched on: calibrated input scales, or buffers on meta (nothing to read yet;
    the eager forward checks them once real)."""
    return any(b.is_meta for b in m.buffers()) or m.calibrated


class W4A4Switch:
    """The ``w4a4`` flag of the NVFP4 modules. Switching it on checks the calibrated input scales right here, by
    hand (``module.w4a4 = True``) as through ``emulate_w4a4``: the forward's own check reads tensor data, so
    torch.compile skips it, and an uncalibrated scale of 0 quantizes every activation to 0 (silent zeros)."""

    _w4a4 = False

    @property
    def w4a4(self) -> bool:
        return self._w4a4

    @w4a4.setter
    def w4a4(self, enabled: bool) -> None:
        enabled = bool(enabled)
        if enabled and not w4a4_ready(self):
            raise RuntimeError(f"{type(self).__name__}: W4A4 emulation needs calibrated input scales (switching it "
                               "on is refused: under torch.compile an input scale of 0 gives zeros); quantize with "
                               "calib_data (torchforge.quantize(model, 'nvfp4', calib_data=...)) or load a W4A4 "
                               "checkpoint")
        self._w4a4 = enabled


class NVFP4Linear(W4A4Switch, FixedDtypeBuffers):
    """y = x @ W.T + b with W in NVFP4 (plain buffers named exactly as ModelOpt's checkpoint tensors):

      weight          uint8          [N, K/2]   two E2M1 codes per byte, even input channel in the low nibble
      weight_scale    float8_e4m3fn  [N, K/16]  block-16 scales
      weight_scale_2  float32        []         global scale amax / (6 * 448)
      input_scale     float32        []         calibrated activation amax / (6 * 448); 0 = not calibrated

    Weight-only (W4A16) by default: the Triton kernel dequantizes FP4 x E4M3 in registers (exact in bf16) and
    applies weight_scale_2 to the fp32 accumulator. With ``w4a4 = True`` the activations are NVFP4-quantized
    first, as a Blackwell GPU would (accuracy studies; switching it on needs a calibrated input_scale).
    Built in two phases (construct on any device, including meta, then `pack_weight`) or with `from_linear`.
    """

    FIXED_DTYPE_BUFFERS = ("weight_scale", "weight_scale_2", "input_scale")  # fp8 / fp32 by the format

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if in_features % 16:
            raise ValueError(f"NVFP4Linear: in_features={in_features} is not divisible by 16 (the NVFP4 block size); "
                             "keep this layer unquantized with the recipe's `ignore`")
        self.in_features, self.out_features = in_features, out_features
        self.w4a4 = False
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // 16, dtype=torch.float8_e4m3fn,
                                                         device=device))
        self.register_buffer("weight_scale_2", torch.empty((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.zeros((), dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @torch.no_grad()
    def pack_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    weight_scale_2: torch.Tensor | None = None, input_amax: float | None = None) -> "NVFP4Linear":
        """Quantize ``weight [N, K]`` (optionally under a given global scale, e.g. shared by q/k/v) and record the
        calibrated activation amax as ``input_scale = amax / (6 * 448)``."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"NVFP4Linear.pack_weight: weight has shape {tuple(weight.shape)}, expected "
                             f"[out_features, in_features] = [{self.out_features}, {self.in_features}]")
        check_pack_bias("NVFP4Linear.pack_weight", self, bias)
        if input_amax is not None and not (math.isfinite(float(input_amax)) and float(input_amax) >= 0):
            raise ValueError(f"NVFP4Linear.pack_weight: input_amax must be a finite amax >= 0 (the calibrated largest "
                             f"|activation|), got {float(input_amax)}; recalibrate, or pass None for weight-only")
        self.weight, self.weight_scale, self.weight_scale_2 = ops.nvfp4_quantize(weight, weight_scale_2)
        # without an amax: not calibrated (0), on the weight's device (a module built on meta kept a meta scale)
        scale = float(input_amax) / E2M1_E4M3_MAX if input_amax is not None else 0.0
        self.input_scale = torch.tensor(scale, dtype=torch.float32, device=self.weight.device)
        if bias is not None:
            self.bias = bias.detach().to(device=self.weight.device, dtype=self.bias.dtype)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_scale_2: torch.Tensor | None = None,
                    input_amax: float | None = None) -> "NVFP4Linear":
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=w.device, dtype=w.dtype)
        return mod.pack_weight(w, linear.bias, weight_scale_2, input_amax)

    @property
    def calibrated(self) -> bool:
        return bool(self.input_scale > 0)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] this layer computes with (W4A16), in `dtype`."""
        return ops.nvfp4_dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w4a4 and not torch.compiler.is_compiling() and not self.calibrated:
            raise RuntimeError("NVFP4Linear: W4A4 emulation needs a calibrated input_scale; quantize with calib_data "
                               "(torchforge.quantize(model, 'nvfp4', calib_data=...)) or load a W4A4 checkpoint")
        input_scale = self.input_scale if self.w4a4 else None
        return ops.nvfp4_linear(x, self.weight, self.weight_scale, self.weight_scale_2, input_scale, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"w4a4={self.w4a4}")
