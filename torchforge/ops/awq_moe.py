"""`torchforge::awq_moe_gemm`: the grouped W4A16 GEMM of an MoE layer (AWQ layout).

out[r] = x[r // x_row_div] @ dequant(W[expert_ids[r]]).T. With x the [T, H] hidden states and
expert_ids the flattened [T, k] top-k ids, x_row_div = k computes the gate_up projection of every routed
pair without materialising k copies of x; the down projection uses x_row_div = 1.
CUDA: a grouped GEMV (awq_moe_gemv_triton.py) when the routed rows are few relative to the experts (decode;
`use_moe_gemv`), else the expert-sorted tiled grouped GEMM (awq_moe_triton.py). CPU: the reference.
"""

import torch
from torch import Tensor

from torchforge.ops._routed_rows import check_routed_rows
from torchforge.ops._triton import HAS_TRITON, use_triton
from torchforge.ops.awq import _check_activation, _check_packed_weight, _eager
from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv
from torchforge.ops.awq_moe_triton import launch_awq_moe_gemm
from torchforge.ops.awq_reference import awq_grouped_linear_ref

if HAS_TRITON:
    from torch.library import triton_op as _define
else:
    from torch.library import custom_op as _define

__all__ = ["awq_moe_gemm", "use_moe_gemv"]

# Routed rows up to which the grouped GEMV is used whatever the expert count (see use_moe_gemv).
MOE_GEMV_MAX_ROWS = 16


def use_moe_gemv(num_rows: int, num_experts: int) -> bool:
    """True when awq_moe_gemm should run the grouped GEMV instead of the expert-sorted grouped GEMM.

    Shape-only (R = routed rows = tokens x top_k, E = experts), so no host sync: CUDA-graph capturable and
    traceable. The GEMV reads an expert's weight once per routed row (duplicates likely from L2) with no
    padding; the GEMM reads it once per block of 16+ rows but pads every block to 16 rows for tl.dot and
    sorts the rows first (moe_align). So the GEMV when
      R <= MOE_GEMV_MAX_ROWS (16: at most one tl.dot block of rows in all), or
      R <= E (at most one row per expert on average).
    DeepSeek-V3 (E = 256, top-8): GEMV up to 32 tokens (R = 256), the GEMM from 33 tokens. H100
    (`bench/moe_w4a16.py --gemv-sweep --gemv-m 1,8,16,32`, 2026-11-22): the GEMV beat the GEMM 3.1-3.8x at
    R = 8, 2.5-2.7x at 64, 2.3-2.4x at 128 and still 2.0-2.1x at R = 256 = E; larger R was not measured."""
    return num_rows <= MOE_GEMV_MAX_ROWS or num_rows <= num_experts


def _check_moe_args(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div):
    op = "awq_moe_gemm"
    ic, oc = _check_packed_weight(op, qweight, scales, qzeros, group_size, batched=True)
    _check_activation(op, x, ic, qweight)
    check_routed_rows(op, x, expert_ids, x_row_div)
    return ic, oc


@_define("torchforge::awq_moe_gemm", mutates_args=())
def _awq_moe_gemm(x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor,
                  group_size: int, x_row_div: int) -> Tensor:
    _check_moe_args(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div)
    if use_triton(x) and group_size % 16 == 0:
        if use_moe_gemv(expert_ids.shape[0], qweight.shape[0]):
            return launch_awq_moe_gemv(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div=x_row_div)
        return launch_awq_moe_gemm(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div=x_row_div)
    rows = x.repeat_interleave(x_row_div, dim=0) if x_row_div > 1 else x
    return awq_grouped_linear_ref(rows, expert_ids, qweight, scales, qzeros, group_size, op="awq_moe_gemm")


@_awq_moe_gemm.register_fake
def _(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div):
    _, oc = _check_moe_args(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div)
    return x.new_empty((expert_ids.shape[0], oc))


def awq_moe_gemm(x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor,
                 group_size: int = 128, x_row_div: int = 1) -> Tensor:
    """Grouped MoE GEMM: ``[len(expert_ids), OC]``, row r = ``x[r // x_row_div] @ dequant(W[expert_ids[r]]).T``."""
    if _eager():
        _check_moe_args(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div)
    return torch.ops.torchforge.awq_moe_gemm(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div)
