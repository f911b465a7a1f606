from torchforge.nn.awq_experts import ForgeAWQExperts
from torchforge.nn.awq_linear import ForgeAWQLinear
from torchforge.nn.moe import ForgeMoE

# NVFP4 (issue 6)
from torchforge.nn.nvfp4_experts import NVFP4Experts  # noqa: E402
from torchforge.nn.nvfp4_linear import NVFP4Linear  # noqa: E402
from torchforge.nn.nvfp4_moe import NVFP4MoE, emulate_w4a4  # noqa: E402

__all__ = ["ForgeAWQExperts", "ForgeAWQLinear", "ForgeMoE"] + ["NVFP4Experts", "NVFP4Linear", "NVFP4MoE", "emulate_w4a4"]
