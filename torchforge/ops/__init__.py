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
from torchforge.ops.moe_remap import moe_remap

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
    "moe_remap",
]
