"""The ticket buffer a linear layer on the mma layout keeps for the decode kernel's K slices (see
`torchforge.ops.awq_mma_cuda.mma_tickets`): zero whenever no kernel runs, so it is not state; rebuilt as zeros
after every move, because `to_empty()` would leave garbage (and a non-zero ticket a wrong result)."""
from __future__ import annotations

import torch
from torch import nn

from torchforge.ops.awq_mma_cuda import mma_tickets


def add_mma_tickets(module: nn.Module) -> None:
    """Registers `mma_tickets` (non-persistent: never in a checkpoint) on the device of `module.qweight`, and has
    them follow qweight through `load_state_dict(..., assign=True)`, which moves no buffer (a module switched on the
    meta device would keep meta tickets)."""
    module.register_buffer("mma_tickets", mma_tickets(module.out_features, device=module.qweight.device),
                           persistent=False)
    if not getattr(module, "_mma_tickets_follow_load", False):
        module.register_load_state_dict_post_hook(_tickets_to_qweight_device)
        module._mma_tickets_follow_load = True


def _tickets_to_qweight_device(module: nn.Module, incompatible_keys) -> None:
    t = module._buffers.get("mma_tickets")
    if t is not None and t.device != module.qweight.device:
        add_mma_tickets(module)


def rezero_mma_tickets(module: nn.Module) -> None:
    t = module._buffers.get("mma_tickets")
    if t is not None and t.device.type != "meta":
        # a new tensor, not zero_(): a buffer made under torch.inference_mode cannot be written in place outside it
        module._buffers["mma_tickets"] = torch.zeros_like(t)
