"""`torch._check`, `torch._check_type` and `torch._check_value` with a fast path for conditions that are plain
`True`: the ops' argument checks run on every eager call, and torch's functions cost about 1.5 us each there (an
import and `expect_true` per call; 17 checks made `awq_mma_linear`'s argument check 28 us a call on a 2-core host).
Anything else, a `False` or a `SymBool` while tracing (which torch turns into a guard or a runtime assert), goes to
torch's function unchanged, so errors and tracing behave as before."""
from __future__ import annotations

import torch

__all__ = ["check", "check_type", "check_value"]


def check(cond, message=None) -> None:
    if cond is True:
        return
    torch._check(cond, message)


def check_type(cond, message) -> None:
    if cond is True:
        return
    torch._check_type(cond, message)


def check_value(cond, message) -> None:
    if cond is True:
        return
    torch._check_value(cond, message)
