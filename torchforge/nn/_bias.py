"""The bias check the quantized Linear modules run when packing."""
from __future__ import annotations

import torch
from torch import nn


def check_pack_bias(where: str, module: nn.Module, bias: torch.Tensor | None) -> None:
    """The bias a pack call gets must match how the module was built: a bias=True module packed without one kept its
    constructor's uninitialized (or meta) bias and computed garbage."""
    if bias is None:
        if module.bias is not None:
            raise ValueError(f"{where}: the module was built with bias=True but no bias was given; pass the layer's "
                             "bias, or build the module with bias=False")
        return
    if module.bias is None:
        raise ValueError(f"{where}: got a bias but the module was built with bias=False")
    if tuple(bias.shape) != (module.out_features,):
        raise ValueError(f"{where}: bias has shape {tuple(bias.shape)}, expected [out_features] = "
                         f"[{module.out_features}]")
