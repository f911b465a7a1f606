"""The two halves of a W4A16 MoE experts forward as ops, with their epilogues fused on the decode path.

- `torchforge::awq_moe_gate_up_silu(x [T, H], ids [T * k], W_gate_up, ...)` -> `SiLU(gate) * up` `[T * k, I]`;
- `torchforge::awq_moe_down_combine(h [T * k, I], ids, weights [T, k], W_down, ...)` -> `sum_j w[t, j] down[t, j]`
  `[T, H]`.

Each equals `awq_moe_gemm` followed by the PyTorch epilogue of `ForgeAWQExperts` (that is the CPU path and the
large-M CUDA path). On CUDA, when `use_moe_gemv` picks the grouped GEMV (decode), the GEMV's fp32 split-K
partials go to one reduce kernel with the epilogue fused (moe_epilogue_triton.py), which rounds where the
unfused sequence rounds.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from torchforge.ops._check import check_type, check_value
from torchforge.ops._triton import HAS_TRITON, use_triton
from torchforge.ops.awq_moe import _awq_moe_gemm, _check_moe_args, use_moe_gemv
from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv
from torchforge.ops.moe_epilogue_triton import (
    launch_combine_reduce,
    launch_silu_mul_reduce,
)

if HAS_TRITON:
    from torch.library import triton_op as _define
else:
    from torch.library import custom_op as _define

__all__ = ["awq_moe_down_combine", "awq_moe_gate_up_silu"]


def _gemv_path(x: Tensor, expert_ids: Tensor, qweight: Tensor, group_size: int) -> bool:
    return use_triton(x) and group_size % 16 == 0 and use_moe_gemv(expert_ids.shape[0], qweight.shape[0])


def _check_gate_up(x, expert_ids, qweight, scales, qzeros, group_size, top_k):
    _, oc = _check_moe_args(x, expert_ids, qweight, scales, qzeros, group_size, top_k)
    return oc // 2  # gate rows then up rows (OC is a multiple of 8 in the AWQ layout)


def _check_combine(h, expert_ids, weights, qweight, scales, qzeros, group_size):
    _, oc = _check_moe_args(h, expert_ids, qweight, scales, qzeros, group_size, 1)
    check_value(weights.dim() == 2 and weights.shape[0] * weights.shape[1] == expert_ids.shape[0],
                lambda: f"awq_moe_down_combine: weights has shape {tuple(weights.shape)}; expected [T, k] "
                f"with T * k = {expert_ids.shape[0]} routed rows")
    check_type(weights.is_floating_point(),
               lambda: f"awq_moe_down_combine: weights must be floating point, got {weights.dtype}")
    check_value(weights.device == h.device,
                lambda: f"awq_moe_down_combine: weights is on {weights.device} but h is on {h.device}")
    return weights.shape[0], oc


@_define("torchforge::awq_moe_gate_up_silu", mutates_args=())
def _awq_moe_gate_up_silu(x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor,
                          group_size: int, top_k: int) -> Tensor:
    _check_gate_up(x, expert_ids, qweight, scales, qzeros, group_size, top_k)
    if _gemv_path(x, expert_ids, qweight, group_size):
        part = launch_awq_moe_gemv(x, expert_ids, qweight, scales, qzeros, group_size, x_row_div=top_k,
                                   partials=True)
        return launch_silu_mul_reduce(part, x.dtype)
    gate, up = _awq_moe_gemm(x, expert_ids, qweight, scales, qzeros, group_size, top_k).chunk(2, dim=-1)
    return F.silu(gate) * up


@_awq_moe_gate_up_silu.register_fake
def _(x, expert_ids, qweight, scales, qzeros, group_size, top_k):
    inter = _check_gate_up(x, expert_ids, qweight, scales, qzeros, group_size, top_k)
    return x.new_empty((expert_ids.shape[0], inter))


@_define("torchforge::awq_moe_down_combine", mutates_args=())
def _awq_moe_down_combine(h: Tensor, expert_ids: Tensor, weights: Tensor, qweight: Tensor, scales: Tensor,
                          qzeros: Tensor, group_size: int) -> Tensor:
    tokens, oc = _check_combine(h, expert_ids, weights, qweight, scales, qzeros, group_size)
    if _gemv_path(h, expert_ids, qweight, group_size):
        part = launch_awq_moe_gemv(h, expert_ids, qweight, scales, qzeros, group_size, x_row_div=1, partials=True)
        return launch_combine_reduce(part, weights, h.dtype)
    down = _awq_moe_gemm(h, expert_ids, qweight, scales, qzeros, group_size, 1)
    # Weighted sum over the k picks in fp32 (router weights are fp32), then back to the activation dtype.
    out = (down.view(tokens, weights.shape[1], oc).float() * weights.unsqueeze(-1).float()).sum(dim=1)
    return out.to(h.dtype)


@_awq_moe_down_combine.register_fake
def _(h, expert_ids, weights, qweight, scales, qzeros, group_size):
    tokens, oc = _check_combine(h, expert_ids, weights, qweight, scales, qzeros, group_size)
    return h.new_empty((tokens, oc))


def awq_moe_gate_up_silu(x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor,
                         group_size: int = 128, top_k: int = 1) -> Tensor:
    """``SiLU(gate) * up`` of every routed row: ``[len(expert_ids), I]``, row r from ``x[r // top_k]``."""
    return torch.ops.torchforge.awq_moe_gate_up_silu(x, expert_ids, qweight, scales, qzeros, group_size, top_k)


def awq_moe_down_combine(h: Tensor, expert_ids: Tensor, weights: Tensor, qweight: Tensor, scales: Tensor,
                         qzeros: Tensor, group_size: int = 128) -> Tensor:
    """``out[t] = sum_j weights[t, j] * (h[t * k + j] @ dequant(W[expert_ids[t * k + j]]).T)``: ``[T, OC]``."""
    return torch.ops.torchforge.awq_moe_down_combine(h, expert_ids, weights, qweight, scales, qzeros, group_size)
