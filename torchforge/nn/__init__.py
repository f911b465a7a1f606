from torchforge.nn.awq_experts import ForgeAWQExperts
from torchforge.nn.awq_linear import ForgeAWQLinear
from torchforge.nn.moe import ForgeMoE

__all__ = ["ForgeAWQExperts", "ForgeAWQLinear", "ForgeMoE"]
