"""`torch._check`, `torch._check_type` and `torch._check_value` with a fast path for conditions that are plain
`True`: the ops' argument checks run on every eager call, and torch's functions cost about 1.5 us each there (an
import and `expect_true` per call; 17 checks made `awq_mma_linear`'s argument check 28 us a call on a 2-core host).
Anything else, a `False` or a `SymBool` while tracing (which torch turns into a guard or a runtime assert), goes to
torch's function unchanged, so errors and tracing behave as before."""
from __future__ import annotations

import torch

__all__ = ["check", "check_type", "check_value", "check_same_device"]


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


def check_same_device(op: str, name: str, t, ref, ref_name: str) -> None:
    """`t` (an optional tensor argument) lives where `ref` does: a CPU bias with CUDA x would hand a kernel a host
    pointer, and a meta one gives garbage on the CPU path."""
    if t is not None:
        check_value(t.device == ref.device, lambda: f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                                                    "move them to one device")
