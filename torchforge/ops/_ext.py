"""Optional compiled extension (csrc/). Never imported unconditionally elsewhere: use `has_cuda_ext()`."""
import functools


@functools.lru_cache(maxsize=None)
def has_cuda_ext() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        from torchforge import _C  # noqa: F401  (registers torchforge:: ops via TORCH_LIBRARY_FRAGMENT)
    except Exception:
        return False
    from torchforge.ops.awq_gemv_cuda import register_fake as register_gemv_fake
    from torchforge.ops.awq_mma_cuda import register_fake as register_mma_fake

    # the C++ ops that torch.compile traces through need a shape function (skipped by builds without the op)
    register_gemv_fake()
    register_mma_fake()
    return True
