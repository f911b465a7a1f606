import os

import torch

# Triton decides at decoration time whether a kernel is interpreted: without a GPU, interpret them
# so the tests can launch the real kernels on CPU tensors (small shapes only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (runs in bench/gpu_suite.sh)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
