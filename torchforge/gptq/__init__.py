"""GPTQ engine: Hessians from calibration activations (hessian), the GPTQ solver (solver)."""
from torchforge.gptq.hessian import HessianAccumulator, accumulate_hessian

__all__ = ["HessianAccumulator", "accumulate_hessian"]
