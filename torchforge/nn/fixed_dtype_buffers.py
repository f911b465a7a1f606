"""Buffers whose dtype is part of a format: `Module.to(dtype)` / `.half()` must move them, never cast them."""
from torch import nn


class FixedDtypeBuffers(nn.Module):
    """`.to(dtype)` casts every floating buffer, the fp8 block scales and fp32 global scales of NVFP4 too: the
    kernels then refuse them and the cast loses their exact values. The buffers named in `FIXED_DTYPE_BUFFERS` keep
    their dtype and values, following only a device move."""

    FIXED_DTYPE_BUFFERS: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        before = {name: self._buffers[name] for name in self.FIXED_DTYPE_BUFFERS if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:  # cast by fn: the original values on fn's device instead
                self._buffers[name] = old.to(device=new.device)
        return self
