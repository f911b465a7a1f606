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


def _state():
    b = torch.backends
    return b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision, b.fp32_precision


@pytest.mark.parametrize("setup", [
    lambda: torch.set_float32_matmul_precision("high"),  # legacy API
    lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),  # legacy flag (mkldnn left at "none")
    lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),  # the new per-backend API (torch >= 2.9)
    lambda: setattr(torch.backends, "fp32_precision", "tf32"),  # the new API's generic setting
], ids=["legacy", "legacy-flag", "new-cuda", "new-generic"])
def test_any_tf32_api_is_turned_off_and_restored_exactly(setup):
    """A caller on torch's new fp32_precision API makes torch.get_float32_matmul_precision() raise ("mix of the legacy
    and new APIs"): GPTQ must neither fail on that nor leave a setting changed (the legacy setter also sets mkldnn)."""
    b = torch.backends
    saved = (torch.get_float32_matmul_precision(), b.fp32_precision, b.cuda.matmul.fp32_precision,
             b.mkldnn.matmul.fp32_precision)
    try:
        setup()
        before = _state()
        with ieee_fp32_matmul():
            assert _state()[:2] == ("ieee", "ieee")
            assert b.cuda.matmul.allow_tf32 is False  # legacy and new agree inside (cuBLAS raises where they don't)
        assert _state() == before
        h = torch.eye(64) + 0.01
        solver.solve_batched(torch.randn(1, 16, 64), h[None], group_size=64, backend="torch")
        assert _state() == before
    finally:
        torch.set_float32_matmul_precision(saved[0])
        b.fp32_precision, b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision = saved[1:]
