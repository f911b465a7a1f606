"""torchforge ops: AWQ W4 format and kernels (see torchforge.ops.awq); MoE expert-id remapping for pruned
models (torchforge.ops.moe_remap)."""
from torchforge.ops.awq import (
    AWQ_NIBBLE_OF_COLUMN,
    AWQ_PACK_ORDER,
    awq_dequantize,
    awq_grouped_linear,
    awq_pack,
    awq_quantize,
    awq_unpack,
    w4a16_linear,
)
from torchforge.ops.awq_moe import awq_moe_gemm
from torchforge.ops.awq_moe_fused import awq_moe_down_combine, awq_moe_gate_up_silu
from torchforge.ops.moe_remap import moe_remap
from torchforge.ops.sigmoid_group_topk import sigmoid_group_topk

# NVFP4 (ModelOpt format; issue 6): see torchforge.ops.nvfp4.
from torchforge.ops.nvfp4 import (  # noqa: E402
    E2M1_VALUES,
    nvfp4_dequantize,
    nvfp4_fake_quantize_activation,
    nvfp4_grouped_linear,
    nvfp4_linear,
    nvfp4_quantize,
    nvfp4_quantize_activation,
    nvfp4_swizzle_scales,
    nvfp4_unswizzle_scales,
)

__all__ = [
    "AWQ_PACK_ORDER",
    "AWQ_NIBBLE_OF_COLUMN",
    "awq_pack",
    "awq_unpack",
    "awq_quantize",
    "awq_dequantize",
    "w4a16_linear",
    "awq_grouped_linear",
    "awq_moe_gemm",
    "awq_moe_gate_up_silu",
    "awq_moe_down_combine",
    "moe_remap",
    "sigmoid_group_topk",
    # NVFP4
    "E2M1_VALUES",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_quantize_activation",
    "nvfp4_fake_quantize_activation",
    "nvfp4_swizzle_scales",
    "nvfp4_unswizzle_scales",
    "nvfp4_linear",
    "nvfp4_grouped_linear",
]

# GPTQ (issue 3): qmeta4 group metadata (torchforge.ops.qmeta4) and the GPTQ W4 layout (torchforge.ops.gptq).
from torchforge.ops.gptq import gptq_dequantize, gptq_pack, gptq_unpack, w4a16_gptq_linear  # noqa: E402
from torchforge.ops.qmeta4 import qmeta4_build, qmeta4_decode, qmeta4_encode, qmeta4_mse_refine  # noqa: E402

__all__ += ["gptq_pack", "gptq_unpack", "gptq_dequantize", "w4a16_gptq_linear", "qmeta4_encode", "qmeta4_decode",
            "qmeta4_build", "qmeta4_mse_refine"]

# The mma layout (run-time re-packing of AWQ / GPTQ codes for the tensor-core kernels of csrc/awq_mma.cu).
from torchforge.ops.awq_mma import awq_mma_linear, awq_mma_moe_down_combine, awq_mma_moe_gate_up_silu  # noqa: E402
from torchforge.ops.awq_mma_layout import awq_to_mma_layout, mma_layout_to_awq  # noqa: E402
from torchforge.ops.awq_mma_moe_experts import awq_mma_moe_experts  # noqa: E402

__all__ += ["awq_mma_linear", "awq_mma_moe_gate_up_silu", "awq_mma_moe_down_combine", "awq_mma_moe_experts",
            "awq_to_mma_layout",
            "mma_layout_to_awq"]

# Input gradients of the quantized linear ops (torchforge.ops.linear_autograd).
from torchforge.ops.linear_autograd import register as _register_linear_autograd  # noqa: E402

_register_linear_autograd()

# Input (and router-weight) gradients of the quantized MoE expert ops (torchforge.ops.moe_autograd).
from torchforge.ops.moe_autograd import register as _register_moe_autograd  # noqa: E402

_register_moe_autograd()
