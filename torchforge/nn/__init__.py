"""Module swaps: plain-buffer modules built in two phases (construct, possibly on meta; then pack)."""
from torchforge.nn.awq_experts import ForgeAWQExperts
from torchforge.nn.awq_linear import ForgeAWQLinear, use_mma_layout
from torchforge.nn.gptq_linear import ForgeGPTQLinear
from torchforge.nn.moe import ForgeMoE
from torchforge.nn.nvfp4_experts import NVFP4Experts
from torchforge.nn.nvfp4_linear import NVFP4Linear
from torchforge.nn.nvfp4_moe import NVFP4MoE, emulate_w4a4
from torchforge.nn.pruned_moe import PrunedMoE

__all__ = ["ForgeAWQExperts", "ForgeAWQLinear", "ForgeGPTQLinear", "ForgeMoE", "NVFP4Experts", "NVFP4Linear",
           "NVFP4MoE", "PrunedMoE", "emulate_w4a4", "use_mma_layout"]
