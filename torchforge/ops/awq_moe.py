"""`torchforge::awq_moe_gemm`: the grouped W4A16 GEMM of an MoE layer (AWQ layout).

out[r] = x[r // x_row_div] @ dequant(W[expert_ids[r]]).T. With x the [T, H] hidden states and
expert_ids the flattened [T, k] top-k ids, x_row_div = k computes the gate_up projection of every routed
pair without materialising k copies of x; the down projection uses x_row_div = 1.
CUDA: expert-sorted tiled Triton kernel (awq_moe_triton.py). CPU: the reference.
"""
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._routed_rows import check_routed_rows
from torchforge.ops._triton import HAS_TRITON, use_triton
from torchforge.ops.awq import _check_activation, _check_packed_weight, _eager
from torchforge.ops.awq_moe_triton import launch_awq_moe_gemm
from torchforge.ops.awq_reference import awq_grouped_linear_ref

if HAS_TRITON:
    from torch.library import triton_op as _define
else:
    from torch.library import custom_op as _define

__all__ = ["awq_moe_gemm"]


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
        return launch_awq_moe_gemm(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div=x_row_div)
    rows = x.repeat_interleave(x_row_div, dim=0) if x_row_div > 1 else x
    return awq_grouped_linear_ref(rows, expert_ids, qweight, scales, qzeros, group_size)


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
