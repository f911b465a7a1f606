"""`torchforge::awq_mma_moe_experts`: a whole W4A16 experts forward on the mma layout, as one op.

    out [T, H] = sum_j weights[t, j] * down_e(SiLU(gate_e(x[t])) * up_e(x[t])),  e = expert_ids[t * k + j]

It is `awq_mma_moe_gate_up_silu` followed by `awq_mma_moe_down_combine`, bit for bit, on every path. What the one op
adds: both grouped kernels route the same rows over the same experts, so where the CUDA kernel sorts them into
per-expert blocks (more routed rows than experts: prefill, decode batches past E / k tokens) the sort (`moe_align`)
runs once per layer instead of twice; and an eager call pays one op dispatch instead of two (torch.library's
dispatch is 20-35 us of host time per call, BENCHMARKS.md sixteenth session).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._check import check_value
from torchforge.ops.awq_mma import (_awq_view, _check_shared, _define_kernel_op, _down_combine, _gate_up_silu,
                                    _moe_args)
from torchforge.ops.awq_mma_cuda import moe_align_block_rows, mma_moe_cuda_ok, mma_moe_sorts
from torchforge.ops.zero_points import check_symmetric

__all__ = ["awq_mma_moe_experts"]

OP = "awq_mma_moe_experts"


def _check_experts(x, expert_ids, weights, gu_q, gu_s, gu_z, dn_q, dn_s, dn_z, group_size, top_k,
                   shared_gu, shared_dn) -> tuple[bool, int, int]:
    """The checks of both halves (most messages name the AWQ-layout ops whose checks they share, e.g. awq_moe_gemm)
    and of what ties the halves together; returns (has a shared expert, tokens, output features)."""
    from torchforge.ops.awq_moe_fused import _check_combine, _check_gate_up

    _moe_args(OP, x, expert_ids, gu_q)
    inter = _check_gate_up(x, expert_ids, _awq_view(gu_q), gu_s, gu_z, group_size, top_k)
    check_value(dn_q.dim() == 3 and dn_q.shape[2] == inter * 8,
                lambda: f"{OP}: down_qweight must be [E, OC / 64, I * 8] with the intermediate size I = {inter} of "
                        f"gate_up (gate rows then up rows), got {tuple(dn_q.shape)}")
    check_value(dn_q.shape[0] == gu_q.shape[0],
                lambda: f"{OP}: gate_up holds {gu_q.shape[0]} experts but down holds {dn_q.shape[0]}")
    h = x.new_empty(1).expand(expert_ids.shape[0], inter)  # SiLU(gate) * up's shape for down's checks: one element
    tokens, oc = _check_combine(h, expert_ids, weights, _awq_view(dn_q), dn_s, dn_z, group_size)
    check_value(tokens == x.shape[0],
                lambda: f"{OP}: weights must be [T, top_k] with T = {x.shape[0]} tokens, got {tuple(weights.shape)}")
    check_value(weights.shape[1] == top_k,
                lambda: f"{OP}: weights must be [T, top_k] with top_k = {top_k}, got {tuple(weights.shape)}")
    has_gu = _check_shared(OP, gu_q, gu_s, gu_z, *shared_gu)
    has_dn = _check_shared(OP, dn_q, dn_s, dn_z, *shared_dn)
    check_value(has_gu == has_dn, lambda: f"{OP}: pass the shared expert's gate_up and down tensors together, or "
                                          f"neither")
    return has_gu, tokens, oc


@_define_kernel_op("torchforge::awq_mma_moe_experts", mutates_args=())
def _awq_mma_moe_experts(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up_qweight: Tensor,
                         gate_up_scales: Tensor, gate_up_qzeros: Tensor, down_qweight: Tensor, down_scales: Tensor,
                         down_qzeros: Tensor, group_size: int, top_k: int,
                         shared_gate_up_qweight: Optional[Tensor] = None,
                         shared_gate_up_scales: Optional[Tensor] = None,
                         shared_gate_up_qzeros: Optional[Tensor] = None, shared_down_qweight: Optional[Tensor] = None,
                         shared_down_scales: Optional[Tensor] = None,
                         shared_down_qzeros: Optional[Tensor] = None, symmetric: bool = False) -> Tensor:
    shared_gu = (shared_gate_up_qweight, shared_gate_up_scales, shared_gate_up_qzeros)
    shared_dn = (shared_down_qweight, shared_down_scales, shared_down_qzeros)
    has, _, _ = _check_experts(x, expert_ids, weights, gate_up_qweight, gate_up_scales, gate_up_qzeros,
                                  down_qweight, down_scales, down_qzeros, group_size, top_k, shared_gu, shared_dn)
    shared_gu, shared_dn = (shared_gu, shared_dn) if has else (None, None)
    check_symmetric(OP, symmetric, gate_up_qzeros, down_qzeros, shared_gate_up_qzeros, shared_down_qzeros)
    num_experts, rows = gate_up_qweight.shape[0] + int(has), expert_ids.numel()  # SymInt + bool: sympy error (2.11)
    gu_alignment = dn_alignment = None
    if mma_moe_sorts(rows, num_experts) and mma_moe_cuda_ok(x, gate_up_qweight, gate_up_scales, group_size, shared_gu):
        from torchforge.ops.moe_align import moe_align

        # One sort for both halves where they take the same block size (blocks of 64 or 128 where the wgmma
        # kernel takes the call). Where they do not (one half's scales not 16-byte aligned), the down half sorts for
        # itself, so that each half runs the kernel it would run alone and this op stays bit-identical to the two.
        block = moe_align_block_rows(x, rows, num_experts, gate_up_scales, gate_up_qzeros, group_size, shared_gu)
        gu_alignment = moe_align(expert_ids, num_experts, block)
        if block == moe_align_block_rows(x, rows, num_experts, down_scales, down_qzeros, group_size, shared_dn):
            dn_alignment = gu_alignment
    h = _gate_up_silu(x, expert_ids, gate_up_qweight, gate_up_scales, gate_up_qzeros, group_size, top_k, shared_gu,
                      gu_alignment, symmetric)
    return _down_combine(h, expert_ids, weights, down_qweight, down_scales, down_qzeros, group_size, shared_dn,
                         dn_alignment, symmetric)


@_awq_mma_moe_experts.register_fake
def _(x, expert_ids, weights, gate_up_qweight, gate_up_scales, gate_up_qzeros, down_qweight, down_scales, down_qzeros,
      group_size, top_k, shared_gate_up_qweight=None, shared_gate_up_scales=None, shared_gate_up_qzeros=None,
      shared_down_qweight=None, shared_down_scales=None, shared_down_qzeros=None, symmetric=False):
    _, tokens, oc = _check_experts(
        x, expert_ids, weights, gate_up_qweight, gate_up_scales, gate_up_qzeros, down_qweight, down_scales,
        down_qzeros, group_size, top_k, (shared_gate_up_qweight, shared_gate_up_scales, shared_gate_up_qzeros),
        (shared_down_qweight, shared_down_scales, shared_down_qzeros))
    return x.new_empty((tokens, oc))


def awq_mma_moe_experts(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: tuple[Tensor, Tensor, Tensor],
                        down: tuple[Tensor, Tensor, Tensor], group_size: int = 128, top_k: int = 1,
                        shared: Optional[tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]] = None,
                        symmetric: bool = False) -> Tensor:
    """A MoE experts forward ``[T, OC]`` from x ``[T, H]``, ``expert_ids [T * top_k]`` (row t * k + j is token t's
    j-th pick) and router ``weights [T, top_k]``. `gate_up` / `down`: (qweight_mma, scales, qzeros) of the stacked
    experts, gate rows before up rows. `shared`: (gate_up, down) of a shared expert, addressed as expert id E, as for
    `awq_mma_moe_gate_up_silu`. Equal to that op followed by `awq_mma_moe_down_combine`, with one sort for both.
    `symmetric`: every zero point of both halves (and of the shared expert) is 8, as for `awq_mma_linear`."""
    shared_args = (*shared[0], *shared[1]) if shared is not None else (None,) * 6
    return torch.ops.torchforge.awq_mma_moe_experts(x, expert_ids, weights, *gate_up, *down, group_size, top_k,
                                                    *shared_args, symmetric)
