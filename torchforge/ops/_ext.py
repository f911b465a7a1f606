"""Optional compiled extension (csrc/). Never imported unconditionally elsewhere: use `has_cuda_ext()`."""
import functools


@functools.lru_cache(maxsize=None)
def has_cuda_ext() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        from torchforge import _C  # noqa: F401  (registers torchforge_C:: ops via TORCH_LIBRARY)

        return True
    except Exception:
        return False
