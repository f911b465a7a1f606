"""GPTQ engine: Hessians from calibration activations (hessian), the GPTQ solver (solver)."""
from torchforge.gptq.hessian import HessianAccumulator, accumulate_hessian
from torchforge.gptq.solver import GPTQResult, inverse_hessian_factor, solve, solve_batched

__all__ = ["GPTQResult", "HessianAccumulator", "accumulate_hessian", "inverse_hessian_factor", "solve",
           "solve_batched"]
