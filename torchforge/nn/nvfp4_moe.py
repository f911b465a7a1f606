"""NVFP4MoE: the foundation's ForgeMoE with NVFP4 routed experts."""
from __future__ import annotations

from torch import nn

from torchforge.nn.moe import ForgeMoE
from torchforge.nn.nvfp4_experts import NVFP4Experts
from torchforge.nn.nvfp4_linear import NVFP4Linear, w4a4_ready


class NVFP4MoE(ForgeMoE):
    """ForgeMoE (HF's router kept exactly, shared experts always computed and added) whose routed experts are
    :class:`NVFP4Experts`. The shared experts stay the module HF built: bf16, or NVFP4 when the recipe
    targets their Linear layers (they are then :class:`NVFP4Linear`).

    ``emulate_w4a4(True)`` switches the routed experts and any NVFP4 shared-expert layers to W4A4 emulation
    (activations NVFP4-quantized as a Blackwell GPU would); the default is weight-only (W4A16) compute.
    """

    def __init__(self, gate: nn.Module, experts: NVFP4Experts, shared: nn.Module | None = None, **kw):
        if not isinstance(experts, NVFP4Experts):
            raise TypeError(f"NVFP4MoE needs NVFP4Experts, got {type(experts).__name__}")
        super().__init__(gate, experts, shared, **kw)

    def emulate_w4a4(self, enabled: bool = True, *, per_expert_input_scales: bool | None = None) -> "NVFP4MoE":
        return emulate_w4a4(self, enabled, per_expert_input_scales=per_expert_input_scales)


def emulate_w4a4(model: nn.Module, enabled: bool = True, *, per_expert_input_scales: bool | None = None) -> nn.Module:
    """Switch every NVFP4 module of ``model`` to W4A4 emulation (or back to weight-only compute). Switching on
    checks the calibrated input scales of all of them first (nothing is switched if one has none), as each module's
    ``w4a4`` setter does: the forward's own check is skipped under torch.compile (it reads tensor data), where an
    uncalibrated scale of 0 would quantize every activation to 0.

    ``per_expert_input_scales``: routed experts emulate with one input scale per layer (False, the default of
    :class:`NVFP4Experts`: the max over experts, as vLLM's FlashInfer NVFP4 MoE backends and its emulation backend
    load them) or each expert's own (True: vLLM's CUTLASS backend); None leaves each module's setting."""
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, (NVFP4Experts, NVFP4Linear))]
    if enabled:
        bad = [n or type(m).__name__ for n, m in mods if not w4a4_ready(m)]
        if bad:
            raise RuntimeError(f"emulate_w4a4: {len(bad)} NVFP4 module(s) have no calibrated input scale (e.g. "
                               f"{bad[0]!r}); quantize with calib_data (W4A4 needs activation amax), or keep "
                               "weight-only compute")
    for _, m in mods:
        m.w4a4 = enabled
        if per_expert_input_scales is not None and isinstance(m, NVFP4Experts):
            m.per_expert_input_scales = bool(per_expert_input_scales)
    return model
