"""fp32 matmuls at full precision while GPTQ runs, whatever the process set.

`torch.set_float32_matmul_precision("high")` (common in training scripts and for torch.compile) lets cuBLAS run fp32
matmuls in TF32, with a 10-bit significand. GPTQ's Hessian `X^T X` and its lazy column updates are fp32 sums whose
errors feed the Cholesky factor and every later column's rounding; the reference GPTQ code turns TF32 off for that
reason (`torch.backends.cuda.matmul.allow_tf32 = False` in IST-DASLab/gptq and GPTQModel). torchforge does the same,
for the duration of each call only, and restores the caller's setting.
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["ieee_fp32_matmul", "with_ieee_fp32_matmul"]


@contextlib.contextmanager
def ieee_fp32_matmul():
    """fp32 matmuls in IEEE fp32 inside the block (torch's "highest" precision), the caller's setting after it."""
    before = torch.get_float32_matmul_precision()
    if before == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def with_ieee_fp32_matmul(fn):
    """`fn` run inside `ieee_fp32_matmul()`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with ieee_fp32_matmul():
            return fn(*args, **kwargs)
    return wrapper
