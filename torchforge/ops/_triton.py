"""Triton availability.

Kernels are defined only when triton imports. Ops run them on CUDA tensors and their pure-PyTorch
reference on CPU tensors. Triton reads TRITON_INTERPRET when a kernel is decorated, so tests set it
before importing torchforge (tests/conftest.py) and then call the `launch_*` functions directly on CPU
tensors: CI checks the kernel logic, not only the reference."""
import os

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t) -> bool:
    """True when an op should dispatch tensor `t` to its Triton kernel (CUDA only)."""
    return HAS_TRITON and t.device.type == "cuda"


def can_launch(t) -> bool:
    """True when a Triton kernel can be launched on `t`: CUDA, or CPU under the interpreter."""
    return HAS_TRITON and (t.device.type == "cuda" or (t.device.type == "cpu" and interpret_mode()))
