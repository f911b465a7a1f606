"""NVFP4Experts: all routed experts of one MoE layer in NVFP4 (ModelOpt semantics), a drop-in for HF's fused
experts."""
from __future__ import annotations

import torch
from torch import nn

from torchforge import ops
from torchforge.nn.awq_experts import check_routing_args
from torchforge.nn.fixed_dtype_buffers import FixedDtypeBuffers
from torchforge.nn.nvfp4_linear import E2M1_E4M3_MAX, W4A4Switch


def _act(name_or_fn):
    if callable(name_or_fn):
        return name_or_fn
    from transformers.activations import ACT2FN

    return ACT2FN[name_or_fn]


class NVFP4Experts(W4A4Switch, FixedDtypeBuffers):
    """Routed experts stacked along dim 0, every projection in NVFP4 (plain buffers, meta-constructible):

      gate_up_weight          uint8  [E, 2I, H/2]   gate rows [0, I), up rows [I, 2I) (HF's fused layout)
      gate_up_weight_scale    fp8    [E, 2I, H/16]
      gate_up_weight_scale_2  fp32   [E]            one global scale per expert, SHARED by gate and up
      gate_up_input_scale     fp32   [E]            calibrated amax of the expert's input / (6 * 448); 0 = none
      down_weight             uint8  [E, H, I/2]
      down_weight_scale       fp8    [E, H, I/16]
      down_weight_scale_2     fp32   [E]
      down_input_scale        fp32   [E]

    Gate and up share weight_scale_2 and input_scale because vLLM keeps one of each for the fused w13 GEMM
    (`w13_weight_scale_2[:, 0]`), and ModelOpt's export unifies them to the max before writing
    (`preprocess_linear_fusion`); quantizing the fused [2I, H] tensor per expert gives exactly that max.
    Export splits the fused tensors into per-expert gate_proj / up_proj rows, an exact split.

    forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) is HF's experts signature. Every routed
    (token, expert) pair is a row of the grouped NVFP4 GEMM (`ops.nvfp4_grouped_linear`: on CUDA an on-device
    sort into expert blocks and one Triton kernel per projection; no host sync, no loop over experts), then
    SiLU(gate) * up, the down GEMM and the routing-weighted sum in fp32. ``w4a4 = True`` quantizes the
    activations of both GEMMs as Blackwell would (per token, block 16, under the calibrated input scales).

    Input scales in W4A4 emulation: by default one per GEMM for the whole layer, the max over the experts' calibrated
    scales, as vLLM computes at load with the NVFP4 MoE backends it prefers on Blackwell (FlashInfer TRT-LLM / CUTLASS
    / CuteDSL: ``a13_scale.max()`` in ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``,
    ``quantization/utils/flashinfer_fp4_moe.py``) and with its emulation backend (``fused_moe/oracle/nvfp4.py``),
    for ModelOpt and compressed-tensors checkpoints alike. ``per_expert_input_scales = True`` uses each expert's own
    scale instead, as vLLM's own CUTLASS backend (``VLLM_CUTLASS``) keeps them. Checkpoints always store the
    per-expert scales; this only selects what the emulation computes with.
    """

    per_expert_input_scales = False

    FIXED_DTYPE_BUFFERS = tuple(f"{p}_{b}" for p in ("gate_up", "down")
                                for b in ("weight_scale", "weight_scale_2", "input_scale"))  # fp8 / fp32 by the format

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, act_fn="silu", device=None):
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        for name, dim in (("hidden_size", H), ("intermediate_size", I)):
            if dim % 16:
                raise ValueError(f"NVFP4Experts: {name}={dim} is not divisible by 16 (the NVFP4 block size); ignore "
                                 "the experts (re:.*mlp\\.experts$) or use another scheme")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.act_fn = _act(act_fn)
        self.w4a4 = False
        f32 = dict(dtype=torch.float32, device=device)
        fp8 = dict(dtype=torch.float8_e4m3fn, device=device)
        self.register_buffer("gate_up_weight", torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device=device))
        self.register_buffer("gate_up_weight_scale", torch.empty(E, 2 * I, H // 16, **fp8))
        self.register_buffer("gate_up_weight_scale_2", torch.empty(E, **f32))
        self.register_buffer("gate_up_input_scale", torch.zeros(E, **f32))
        self.register_buffer("down_weight", torch.empty(E, H, I // 2, dtype=torch.uint8, device=device))
        self.register_buffer("down_weight_scale", torch.empty(E, H, I // 16, **fp8))
        self.register_buffer("down_weight_scale_2", torch.empty(E, **f32))
        self.register_buffer("down_input_scale", torch.zeros(E, **f32))

    @torch.no_grad()
    def pack_weights(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> "NVFP4Experts":
        """Quantize HF's ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (one expert at a time)."""
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        if tuple(gate_up_proj.shape) != (E, 2 * I, H):
            raise ValueError(f"NVFP4Experts: gate_up_proj has shape {tuple(gate_up_proj.shape)}, expected [E, 2I, H] = "
                             f"[{E}, {2 * I}, {H}]")
        if tuple(down_proj.shape) != (E, H, I):
            raise ValueError(f"NVFP4Experts: down_proj has shape {tuple(down_proj.shape)}, expected [E, H, I] = "
                             f"[{E}, {H}, {I}]")
        self.gate_up_weight, self.gate_up_weight_scale, self.gate_up_weight_scale_2 = ops.nvfp4_quantize(gate_up_proj)
        self.down_weight, self.down_weight_scale, self.down_weight_scale_2 = ops.nvfp4_quantize(down_proj)
        # new weights: not calibrated (0) until set_input_amax, on the weights' device (as NVFP4Linear.pack_weight);
        # kept scales would be a meta tensor, to_empty()'s uninitialised memory, or another weight's calibration
        dev = self.gate_up_weight.device
        self.gate_up_input_scale = torch.zeros(E, dtype=torch.float32, device=dev)
        self.down_input_scale = torch.zeros(E, dtype=torch.float32, device=dev)
        return self

    @torch.no_grad()
    def set_input_amax(self, gate_up_amax: torch.Tensor, down_amax: torch.Tensor) -> "NVFP4Experts":
        """Calibrated per-expert activation amax (inputs of gate_up and of down) -> input scales (ModelOpt:
        ``amax / (6 * 448)``)."""
        E = self.num_experts
        for name, amax in (("gate_up_amax", gate_up_amax), ("down_amax", down_amax)):
            if tuple(amax.shape) != (E,):
                raise ValueError(f"NVFP4Experts.set_input_amax: {name} has shape {tuple(amax.shape)}, expected [E] = "
                                 f"[{E}] (one calibrated activation amax per expert)")
            if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
                raise ValueError(f"NVFP4Experts.set_input_amax: {name} holds NaN, Inf or negative values; each must be "
                                 "a finite calibrated amax >= 0 (0: an expert calibration never routed to)")
        dev = self.gate_up_input_scale.device
        # divide by a device tensor: CUDA computes `t / python_float` as t * fp32(1 / float), not the IEEE quotient
        div = torch.full((), E2M1_E4M3_MAX, dtype=torch.float32, device=dev)
        self.gate_up_input_scale = (gate_up_amax.to(dev, torch.float32) / div).contiguous()
        self.down_input_scale = (down_amax.to(dev, torch.float32) / div).contiguous()
        return self

    @classmethod
    def from_hf(cls, experts: nn.Module) -> "NVFP4Experts":
        gu, down = experts.gate_up_proj, experts.down_proj
        return cls.empty_for(experts, device=gu.device).pack_weights(gu, down)

    @classmethod
    def empty_for(cls, experts: nn.Module, device=None) -> "NVFP4Experts":
        """The unpacked module for HF fused `experts` (on `device`, e.g. meta to check that they fit)."""
        if getattr(experts, "is_transposed", False):
            raise ValueError(f"{type(experts).__name__} stores transposed expert weights; not supported yet")
        if getattr(experts, "has_bias", False):
            raise ValueError(f"{type(experts).__name__} has expert biases; not supported yet")
        E, two_i, H = experts.gate_up_proj.shape
        return cls(E, H, two_i // 2, act_fn=experts.act_fn, device=device)

    @property
    def calibrated(self) -> bool:
        return bool((self.gate_up_input_scale > 0).all() and (self.down_input_scale > 0).all())

    def dequantized_weights(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in HF's layout (the W4A16 weights), in `dtype`."""
        return (ops.nvfp4_dequantize(self.gate_up_weight, self.gate_up_weight_scale, self.gate_up_weight_scale_2, dtype),
                ops.nvfp4_dequantize(self.down_weight, self.down_weight_scale, self.down_weight_scale_2, dtype))

    def _input_scales(self):
        if not self.w4a4:
            return None, None
        if not torch.compiler.is_compiling() and not self.calibrated:
            raise RuntimeError("NVFP4Experts: W4A4 emulation needs calibrated input scales; quantize with calib_data "
                               "(torchforge.quantize(model, 'nvfp4', calib_data=...)) or load a W4A4 checkpoint")
        a13, a2 = self.gate_up_input_scale, self.down_input_scale
        if self.per_expert_input_scales:
            return a13, a2
        # one scale per layer (see the class docstring); contiguous: the Triton kernels index it per expert
        return a13.amax().expand_as(a13).contiguous(), a2.amax().expand_as(a2).contiguous()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        check_routing_args("NVFP4Experts", hidden_states, top_k_index, top_k_weights)
        T, k = top_k_index.shape
        flat_ids = top_k_index.reshape(-1)  # row t*k + j is token t's j-th pick
        a13, a2 = self._input_scales()
        gate_up = ops.nvfp4_grouped_linear(hidden_states, flat_ids, self.gate_up_weight, self.gate_up_weight_scale,
                                           self.gate_up_weight_scale_2, a13, x_row_div=k)
        gate, up = gate_up.chunk(2, dim=-1)
        down = ops.nvfp4_grouped_linear(self.act_fn(gate) * up, flat_ids, self.down_weight, self.down_weight_scale,
                                        self.down_weight_scale_2, a2)
        # Weighted sum over the k picks in fp32 (router weights are fp32), then back to the activation dtype.
        out = (down.view(T, k, self.hidden_size).float() * top_k_weights.unsqueeze(-1).float()).sum(dim=1)
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, intermediate_size="
                f"{self.intermediate_size}, w4a4={self.w4a4}"
                + (", per_expert_input_scales=True" if self.per_expert_input_scales else ""))
