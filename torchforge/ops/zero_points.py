"""Symmetric zero points: the qzeros word of eight zero points of 8, and the checks behind `symmetric=True`.

Symmetric codes (RTN / GPTQ with `symmetric`, the w4a16-rtn preset) have every zero point 8. The mma-layout decode
kernels then need not read qzeros (csrc/awq_mma.cuh, load_group / fold with SYM: 370 instead of 449 SASS instructions
per item of the one-row loop). The flag is a promise, as act_perm's values are: a module makes it once, after looking
at its zero points (`zeros_are_8`, in use_mma_layout); the ops check it on the CPU only (on CUDA that would be a host
sync per call), and the paths other than those kernels read qzeros anyway. A captured CUDA graph keeps the kernel it
was captured with: after loading other zero points into a captured model in place, capture again (torch.compile
recompiles by itself: the modules' flag is a guarded attribute).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from torchforge.ops.qmeta4_reference import _is_traced

__all__ = ["ZERO8_WORD", "zeros_are_8", "check_symmetric"]

ZERO8_WORD = -0x77777778  # 0x88888888 as int32: eight 4-bit zero points of 8


def zeros_are_8(*qzeros: Optional[Tensor]) -> bool:
    """Whether every zero point in these packed qzeros tensors is 8 (one host read each; False on the meta device or
    for an empty or missing tensor)."""
    for z in qzeros:
        if z is None or z.device.type == "meta" or z.numel() == 0 or not bool((z == ZERO8_WORD).all()):
            return False
    return True


def check_symmetric(op: str, symmetric: bool, *qzeros: Optional[Tensor]) -> None:
    """With symmetric=True, CPU qzeros must all be 8 (CUDA ones are not looked at: no host sync)."""
    if not symmetric:
        return
    for z in qzeros:
        if z is None or z.is_cuda or z.device.type == "meta" or _is_traced(z) or z.numel() == 0:
            continue
        if not bool((z == ZERO8_WORD).all()):
            raise ValueError(f"{op}: symmetric=True promises that every zero point is 8 (qzeros words 0x88888888), "
                             f"but qzeros holds other values; pass symmetric=False (or check with "
                             f"torchforge.ops.zero_points.zeros_are_8)")
