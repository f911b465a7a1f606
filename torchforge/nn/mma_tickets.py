"""The ticket buffer a linear layer on the mma layout keeps for the decode kernel's K slices (see
`torchforge.ops.awq_mma_cuda.mma_tickets`): zero whenever no kernel runs, so it is not state; rebuilt as zeros
after every move, because `to_empty()` would leave garbage (and a non-zero ticket a wrong result).

One buffer per module: two calls of the same module that overlap on two CUDA streams would count into the same
tickets and give wrong sums. Calls on one stream (eager, torch.compile, CUDA graphs) never overlap. To run one model
on several streams at once, give each stream its own copy of the model, or leave its layers on their checkpoint
layout (no `use_mma_layout()`, no kept tickets)."""
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
    if t is None or t.device.type == "meta":
        return
    if t.is_inference() and not torch.is_inference_mode_enabled():
        # a buffer made under torch.inference_mode cannot be written in place outside it: a new one
        module._buffers["mma_tickets"] = torch.zeros_like(t)
    else:
        # in place: a no-op move or cast (.to(same device), .float()) keeps the buffer, and a CUDA graph captured
        # before it keeps a live address (a replaced buffer is freed, and the graph's kernels would count tickets in
        # whatever memory the allocator hands out next)
        t.zero_()
