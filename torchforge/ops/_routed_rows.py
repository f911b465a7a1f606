"""Argument checks shared by the grouped MoE ops (awq_moe_gemm, nvfp4_grouped_linear)."""
import torch
from torch import Tensor

from torchforge.ops._check import check_type, check_value


def check_routed_rows(op: str, x: Tensor, expert_ids: Tensor, x_row_div: int) -> None:
    """x [T, K] and expert_ids [T * x_row_div] int32/int64 on x's device: row r reads x[r // x_row_div]."""
    check_value(x.dim() == 2, lambda: f"{op}: x must be [T, K], got shape {tuple(x.shape)}")
    check_type(expert_ids.dtype in (torch.int32, torch.int64),
               lambda: f"{op}: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    check_value(x_row_div >= 1, lambda: f"{op}: x_row_div={x_row_div} must be >= 1 (top-k)")
    check_value(
        expert_ids.dim() == 1 and expert_ids.shape[0] == x.shape[0] * x_row_div,
        lambda: f"{op}: expert_ids has shape {tuple(expert_ids.shape)}, expected ({x.shape[0] * x_row_div},) = "
        f"rows of x ({x.shape[0]}) x x_row_div ({x_row_div})")
    check_value(expert_ids.device == x.device,
                lambda: f"{op}: expert_ids is on {expert_ids.device} but x is on {x.device}")
