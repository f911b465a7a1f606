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


CUDA_MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension


def stack_launches(batch: int, per_launch: int) -> list:
    """(start, count) slices of a stack of `batch` matrices, at most `per_launch` a launch. All of them in one slice,
    with no Python range, when they fit: a dynamic batch then stays dynamic under torch.compile."""
    per_launch = max(1, per_launch)
    if batch <= per_launch:
        return [(0, batch)]
    return [(i, min(per_launch, batch - i)) for i in range(0, batch, per_launch)]
