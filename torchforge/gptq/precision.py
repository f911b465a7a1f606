"""fp32 matmuls at full precision while GPTQ runs, whatever the process set.

`torch.set_float32_matmul_precision("high")` (common in training scripts and for torch.compile) lets cuBLAS run fp32
matmuls in TF32, with a 10-bit significand. GPTQ's Hessian `X^T X` and its lazy column updates are fp32 sums whose
errors feed the Cholesky factor and every later column's rounding; the reference GPTQ code turns TF32 off for that
reason (`torch.backends.cuda.matmul.allow_tf32 = False` in IST-DASLab/gptq and GPTQModel). torchforge does the same,
for the duration of each call only, and restores the caller's setting.

torch has two APIs for it: the legacy `torch.set_float32_matmul_precision` and the per-backend
`torch.backends.{cuda,mkldnn}.matmul.fp32_precision` (torch >= 2.9). A caller who used the new one (or mixed them)
makes `torch.get_float32_matmul_precision()` raise ("mix of the legacy and new APIs"), so the caller's state is read
from the per-backend values, which always read, and the legacy value only where it reads. Inside the block both APIs
agree on IEEE fp32 (cuBLAS checks that they agree).
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["ieee_fp32_matmul", "with_ieee_fp32_matmul"]


def _matmul_backends() -> list:
    """The per-backend matmul precision settings of this torch (the new API; empty before torch 2.9)."""
    found = []
    for backend in ("cuda", "mkldnn"):
        m = getattr(getattr(torch.backends, backend, None), "matmul", None)
        if m is not None and hasattr(m, "fp32_precision"):
            found.append(m)
    return found


@contextlib.contextmanager
def ieee_fp32_matmul():
    """fp32 matmuls in IEEE fp32 inside the block (torch's "highest" precision), the caller's setting after it."""
    backends = _matmul_backends()
    new_before = [m.fp32_precision for m in backends]
    try:
        legacy_before = torch.get_float32_matmul_precision()
    except RuntimeError:  # the caller set the new API (or mixed both): the legacy value cannot be read
        legacy_before = None
    if legacy_before == "highest" and all(v == "ieee" for v in new_before):
        yield
        return
    torch.set_float32_matmul_precision("highest")  # the legacy value and every backend's at once: they agree
    try:
        yield
    finally:
        if legacy_before is not None:
            torch.set_float32_matmul_precision(legacy_before)
        for m, v in zip(backends, new_before):  # exactly as they were (the legacy setter sets both matmul backends)
            m.fp32_precision = v


def with_ieee_fp32_matmul(fn):
    """`fn` run inside `ieee_fp32_matmul()`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with ieee_fp32_matmul():
            return fn(*args, **kwargs)
    return wrapper
