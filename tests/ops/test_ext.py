"""has_cuda_ext(): the compiled extension is used only on the GPUs it is built for."""
import sys
import warnings

import pytest
import torch

import torchforge
from torchforge.ops import _ext


@pytest.fixture
def fresh_cache():
    _ext.has_cuda_ext.cache_clear()
    yield
    _ext.has_cuda_ext.cache_clear()


def test_other_architectures_fall_back_with_a_warning(fresh_cache, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setitem(sys.modules, "torchforge._C", object())  # would load if the check did not stop it
    monkeypatch.delattr(torchforge, "_C", raising=False)
    with pytest.warns(UserWarning, match=r"compute capability \[\(9, 0\)\] only; this GPU is \(8, 0\)"):
        assert _ext.has_cuda_ext() is False


def test_hopper_without_a_build_is_false_and_silent(fresh_cache, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "torchforge._C", None)  # an import of it raises ImportError
    monkeypatch.delattr(torchforge, "_C", raising=False)  # where a real build was already imported (on a GPU)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _ext.has_cuda_ext() is False


def test_no_cuda_is_false(fresh_cache, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _ext.has_cuda_ext() is False
