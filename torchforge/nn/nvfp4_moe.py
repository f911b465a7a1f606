"""NVFP4MoE: the foundation's ForgeMoE with NVFP4 routed experts."""
from __future__ import annotations

from torch import nn

from torchforge.nn.moe import ForgeMoE
from torchforge.nn.nvfp4_experts import NVFP4Experts
from torchforge.nn.nvfp4_linear import NVFP4Linear


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

    def emulate_w4a4(self, enabled: bool = True) -> "NVFP4MoE":
        for m in self.modules():
            if isinstance(m, (NVFP4Experts, NVFP4Linear)):
                m.w4a4 = enabled
        return self


def emulate_w4a4(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch every NVFP4 module of ``model`` to W4A4 emulation (or back to weight-only compute)."""
    for m in model.modules():
        if isinstance(m, (NVFP4Experts, NVFP4Linear)):
            m.w4a4 = enabled
    return model
