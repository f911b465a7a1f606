"""torchforge ops: AWQ W4 format and kernels (see torchforge.ops.awq)."""
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

__all__ = [
    "AWQ_PACK_ORDER",
    "AWQ_NIBBLE_OF_COLUMN",
    "awq_pack",
    "awq_unpack",
    "awq_quantize",
    "awq_dequantize",
    "w4a16_linear",
    "awq_grouped_linear",
]
