"""Optional compiled extension (csrc/). Never imported unconditionally elsewhere: use `has_cuda_ext()`."""
import functools
import warnings

# setup.py builds csrc/ for sm_90a only (`-gencode=arch=compute_90a,code=sm_90a`: wgmma, setmaxnreg), so its kernels
# have no image for any other GPU and would fail at their first launch ("no kernel image is available"). On other
# devices the ops' Triton and reference paths run instead. A build for other architectures (TORCHFORGE_CUDA_ARCH)
# must list their capabilities here too.
EXT_CAPABILITIES = frozenset({(9, 0)})


@functools.lru_cache(maxsize=None)
def has_cuda_ext() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        capability = tuple(torch.cuda.get_device_capability())
        if capability not in EXT_CAPABILITIES:
            warnings.warn(f"torchforge: the compiled extension is built for compute capability "
                          f"{sorted(EXT_CAPABILITIES)} only; this GPU is {capability}, so torchforge runs its "
                          "Triton kernels instead (see torchforge/ops/_ext.py)", stacklevel=2)
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



def set_pdl(level: int) -> int:
    """When the compiled CUDA kernels launch with programmatic dependent launch (csrc/pdl.cuh: a kernel may start
    while the one before it drains, its first weights prefetched into L2): 0 never; 1 (the default) within an op only
    (the wgmma kernel after its x image kernel); 2 on every launch, the first kernel of each op too (decode, wgmma and
    MoE decode kernels after whatever ran before). `TORCHFORGE_PDL=0/1/2` in the environment sets it, read once at
    the first launch or call here (any other value: 1). Returns the previous level (0, and nothing changes, without the extension). CUDA graphs keep the
    level they were captured with."""
    if not has_cuda_ext():
        return 0
    import torch

    return int(torch.ops.torchforge.set_pdl(int(level)))


def set_start_prefetch(mode: int = -1) -> int:
    """How the decode kernel (csrc/awq_mma.cu) asks for its first weights into L2 at its start, ahead of its warps'
    own loads: -1 (the default) by its launcher's rule (two rounds of items with one row block and whole K per block,
    else none), or 0, 1 or 2 rounds on every launch, for benchmarks that time them. Returns the previous mode (0
    without the extension)."""
    if not has_cuda_ext():
        return 0
    import torch

    return int(torch.ops.torchforge.set_start_prefetch(int(mode)))
