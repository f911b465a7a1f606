"""GPTQ's fp32 matmuls run at full precision (no TF32) whatever the caller set, and the caller's setting comes back
(torchforge.gptq.precision)."""
import pytest
import torch

from torchforge.gptq import solver
from torchforge.gptq.hessian import HessianAccumulator
from torchforge.gptq.precision import ieee_fp32_matmul


@pytest.fixture
def tf32_allowed():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # what a training script or a torch.compile user often sets
    yield
    torch.set_float32_matmul_precision(before)


def test_context_sets_highest_and_restores_even_on_error(tf32_allowed):
    with ieee_fp32_matmul():
        assert torch.get_float32_matmul_precision() == "highest"
    assert torch.get_float32_matmul_precision() == "high"
    with pytest.raises(RuntimeError, match="boom"):
        with ieee_fp32_matmul():
            raise RuntimeError("boom")
    assert torch.get_float32_matmul_precision() == "high"


def test_hessian_and_solver_matmuls_run_without_tf32(tf32_allowed, monkeypatch):
    seen = []
    real_addmm, real_factor = torch.Tensor.addmm_, solver._factor_batched

    def addmm(self, *a, **kw):
        seen.append(("hessian", torch.get_float32_matmul_precision()))
        return real_addmm(self, *a, **kw)

    def factor(*a, **kw):
        seen.append(("solver", torch.get_float32_matmul_precision()))
        return real_factor(*a, **kw)

    monkeypatch.setattr(torch.Tensor, "addmm_", addmm)
    monkeypatch.setattr(solver, "_factor_batched", factor)
    acc = HessianAccumulator(128)
    acc.add(torch.randn(64, 128))
    h, _ = acc.finalize()
    h += 0.1 * torch.eye(128)
    solver.solve_batched(torch.randn(1, 32, 128), h[None], group_size=128, backend="torch")
    assert seen == [("hessian", "highest"), ("solver", "highest")]
    assert torch.get_float32_matmul_precision() == "high"
