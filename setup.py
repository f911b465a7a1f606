"""Build script. The CUDA extension in csrc/ is compiled only where both a CUDA toolchain
(nvcc / CUDA_HOME) and a CUDA build of torch are present; elsewhere the package is pure Python
and every op falls back to its Triton or reference implementation."""
import glob
import os

from setuptools import setup


def _cuda_extensions():
    if os.environ.get("TORCHFORGE_NO_CUDA_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:
        return [], {}
    sources = sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/*.cpp"))
    if not sources or torch.version.cuda is None or CUDA_HOME is None:
        return [], {}
    # csrc/'s wgmma / setmaxnreg kernels need sm_90a; torchforge/ops/_ext.py (EXT_CAPABILITIES) uses the build on
    # compute capability 9.0 only. TORCHFORGE_CUDA_ARCH replaces the nvcc -gencode flags.
    arch = os.environ.get("TORCHFORGE_CUDA_ARCH", "-gencode=arch=compute_90a,code=sm_90a")
    ext = CUDAExtension(
        name="torchforge._C",
        sources=sources,
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-std=c++17", *arch.split()]},
        py_limited_api=False,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
