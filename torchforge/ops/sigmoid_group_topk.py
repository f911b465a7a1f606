"""`torchforge::sigmoid_group_topk`: DeepSeek-V3's router after the logits, as one Triton kernel.

    weights, ids = sigmoid_group_topk(logits, bias, n_group, topk_group, top_k, norm_topk_prob,
                                      routed_scaling_factor, num_shared)

Semantics are those of HF transformers' `DeepseekV3TopkRouter.forward` after `router_logits` (and of
`torchforge.nn.routing.deepseek_v3_topk` with nothing pruned):

    scores = sigmoid(logits)                                  # fp32 [T, E]
    choice = scores + bias                                    # e_score_correction_bias: the choice only
    group score = sum of the group's top-2 choice scores      # E // n_group experts per group
    keep the topk_group best groups, choice = -inf elsewhere
    ids = top_k of choice;  weights = scores[ids]             # the UNBIASED scores
    if norm_topk_prob: weights /= weights.sum(-1) + 1e-20
    weights *= routed_scaling_factor

`n_group == 1` means no group limit. Then `num_shared` columns are appended: ids `E .. E+num_shared-1`
(shared experts stored after the routed ones) with weight exactly 1.0 (not scaled). The order of the
`top_k` routed picks within a row is unspecified (HF uses `sorted=False`; the kernel returns them in
descending choice order). NaN logits give unspecified picks; ties are broken arbitrarily.

HF spends ~12 launches on this (topk, scatter, masked_fill, gather, ...); the kernel is one program per
token row. Dispatch follows `torchforge.ops.moe_remap`: CUDA tensors run the kernel, CPU tensors the
PyTorch reference; tests launch `launch_sigmoid_group_topk` on CPU under TRITON_INTERPRET=1.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from torchforge.ops._check import check_type, check_value
from torchforge.ops._triton import HAS_TRITON, tl, triton, use_triton

if HAS_TRITON:
    from torch.library import triton_op as _define_kernel_op
else:  # importing torchforge must work without triton
    _define_kernel_op = custom_op

__all__ = ["sigmoid_group_topk", "sigmoid_group_topk_ref", "launch_sigmoid_group_topk"]


def _check_args(logits: Tensor, bias: Optional[Tensor], n_group: int, topk_group: int, top_k: int,
                num_shared: int) -> None:
    op = "sigmoid_group_topk"
    check_type(
        logits.dtype == torch.float32,
        lambda: f"{op}: logits must be float32 (HF computes the router in fp32), got {logits.dtype}; "
        "pass logits.float()",
    )
    check_value(
        logits.dim() == 2,
        lambda: f"{op}: logits must be 2-D [T, E], got shape {tuple(logits.shape)}; reshape to (-1, E)",
    )
    E = logits.shape[1]
    if bias is not None:
        check_type(
            bias.dtype == torch.float32,
            lambda: f"{op}: bias (e_score_correction_bias) must be float32, got {bias.dtype}; pass bias.float()",
        )
        check_value(
            bias.dim() == 1 and bias.shape[0] == E,
            lambda: f"{op}: bias must be [E] = [{E}] (one per routed expert), got shape {tuple(bias.shape)}",
        )
        check_value(
            bias.device == logits.device,
            lambda: f"{op}: bias is on {bias.device} but logits is on {logits.device}; move them to one device",
        )
    check_value(n_group >= 1, lambda: f"{op}: n_group must be >= 1 (1 = no group limit), got {n_group}")
    if n_group > 1:
        check_value(
            E % n_group == 0 and E // n_group >= 2,
            lambda: f"{op}: E={E} experts must split into n_group={n_group} equal groups of at least 2 "
            "(a group scores its top-2); use n_group=1 for no group limit",
        )
    check_value(
        1 <= topk_group <= n_group,
        lambda: f"{op}: topk_group must be in [1, n_group={n_group}], got {topk_group}",
    )
    check_value(
        1 <= top_k <= topk_group * (E // n_group),
        lambda: f"{op}: top_k must be in [1, topk_group * E // n_group = {topk_group * (E // n_group)}] (the "
        f"experts of the chosen groups), got {top_k}",
    )
    check_value(num_shared >= 0, lambda: f"{op}: num_shared must be >= 0, got {num_shared}")


def _append_shared(weights: Tensor, ids: Tensor, E: int, num_shared: int) -> Tuple[Tensor, Tensor]:
    if num_shared == 0:
        return weights, ids
    T = ids.shape[0]
    shared = torch.arange(E, E + num_shared, dtype=ids.dtype, device=ids.device).expand(T, num_shared)
    return (torch.cat([weights, weights.new_ones(T, num_shared)], dim=1), torch.cat([ids, shared], dim=1))


def sigmoid_group_topk_ref(logits: Tensor, bias: Optional[Tensor], n_group: int, topk_group: int, top_k: int,
                           norm_topk_prob: bool, routed_scaling_factor: float, num_shared: int = 0
                           ) -> Tuple[Tensor, Tensor]:
    """Pure PyTorch semantics (no checks), HF's operations in HF's order."""
    T, E = logits.shape
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        M = E // n_group
        group_scores = choice.view(T, n_group, M).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, M).reshape(T, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return _append_shared(weights, ids, E, num_shared)


if HAS_TRITON:

    @triton.jit
    def _sigmoid_group_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride_t, stride_e, stride_o, scale,
                                   N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                                   NUM_SHARED: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                                   BLOCK_E: tl.constexpr, G_P2: tl.constexpr, K_P2: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        emask = offs < E
        x = tl.load(logits_ptr + pid * stride_t + offs * stride_e, mask=emask, other=0.0)
        scores = tl.sigmoid(x)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + offs, mask=emask, other=0.0)
        choice = tl.where(emask, choice, float("-inf"))

        if N_GROUP > 1:
            g = tl.arange(0, G_P2)
            member = ((offs[None, :] // (E // N_GROUP)) == g[:, None]) & emask[None, :]  # [G_P2, BLOCK_E]
            tile = tl.where(member, choice[None, :], float("-inf"))
            # top-2 sum = max + max with ONE occurrence of the argmax removed (equals topk(2).sum with ties)
            first = tl.argmax(tile, axis=1)
            top1 = tl.max(tile, axis=1)
            top2 = tl.max(tl.where(offs[None, :] == first[:, None], float("-inf"), tile), axis=1)
            gscore = tl.where(g < N_GROUP, top1 + top2, float("-inf"))
            chosen = g < 0
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.argmax(gscore, axis=0)
                chosen = chosen | (g == best)
                gscore = tl.where(g == best, float("-inf"), gscore)
            in_groups = tl.max((member & chosen[:, None]).to(tl.int32), axis=0) > 0
            choice = tl.where(in_groups, choice, float("-inf"))

        k = tl.arange(0, K_P2)
        out_ids = tl.zeros([K_P2], dtype=tl.int64)
        out_w = tl.zeros([K_P2], dtype=tl.float32)
        for i in tl.static_range(TOP_K):
            best = tl.argmax(choice, axis=0)
            hit = offs == best
            out_ids = tl.where(k == i, best.to(tl.int64), out_ids)
            out_w = tl.where(k == i, tl.sum(tl.where(hit, scores, 0.0), axis=0), out_w)
            choice = tl.where(hit, float("-inf"), choice)
        if NORM:
            out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
        out_w = out_w * scale
        is_shared = k >= TOP_K
        out_ids = tl.where(is_shared, (E + k - TOP_K).to(tl.int64), out_ids)
        out_w = tl.where(is_shared, 1.0, out_w)
        kmask = k < TOP_K + NUM_SHARED
        tl.store(w_ptr + pid * stride_o + k, out_w, mask=kmask)
        tl.store(ids_ptr + pid * stride_o + k, out_ids, mask=kmask)


def launch_sigmoid_group_topk(logits: Tensor, bias: Optional[Tensor], n_group: int, topk_group: int, top_k: int,
                              norm_topk_prob: bool, routed_scaling_factor: float, num_shared: int = 0
                              ) -> Tuple[Tensor, Tensor]:
    """Runs the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1). Arguments are assumed validated.

    The routed picks come out in descending choice order."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge sigmoid_group_topk Triton kernel needs triton; install it or use CPU tensors")
    T, E = logits.shape
    K = top_k + num_shared
    weights = torch.empty((T, K), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, K), dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    torch.library.wrap_triton(_sigmoid_group_topk_kernel)[(T,)](
        logits, logits if bias is None else bias.contiguous(), weights, ids, E, logits.stride(0), logits.stride(1),
        K, float(routed_scaling_factor), N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        NUM_SHARED=num_shared, HAS_BIAS=bias is not None, NORM=bool(norm_topk_prob),
        BLOCK_E=triton.next_power_of_2(E), G_P2=triton.next_power_of_2(n_group), K_P2=triton.next_power_of_2(K),
        # the row is tiny and the argmax loop serial: one warp reduces with shuffles only, no shared memory round
        # trip per pick (5.8 us per call with the default 4 warps on an H100, E = 64)
        num_warps=1 if E <= 128 else 2)
    return weights, ids


@_define_kernel_op("torchforge::sigmoid_group_topk", mutates_args=())
def _sigmoid_group_topk(logits: Tensor, bias: Optional[Tensor], n_group: int, topk_group: int, top_k: int,
                        norm_topk_prob: bool, routed_scaling_factor: float, num_shared: int = 0
                        ) -> Tuple[Tensor, Tensor]:
    _check_args(logits, bias, n_group, topk_group, top_k, num_shared)
    args = (logits, bias, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor, num_shared)
    if use_triton(logits):
        return launch_sigmoid_group_topk(*args)
    return sigmoid_group_topk_ref(*args)


@_sigmoid_group_topk.register_fake
def _(logits: Tensor, bias: Optional[Tensor], n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
      routed_scaling_factor: float, num_shared: int = 0) -> Tuple[Tensor, Tensor]:
    _check_args(logits, bias, n_group, topk_group, top_k, num_shared)
    shape = (logits.shape[0], top_k + num_shared)
    return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.int64)


def sigmoid_group_topk(logits: Tensor, bias: Optional[Tensor], n_group: int, topk_group: int, top_k: int,
                       norm_topk_prob: bool, routed_scaling_factor: float, num_shared: int = 0
                       ) -> Tuple[Tensor, Tensor]:
    """DeepSeek-V3 routing from router logits, in one kernel launch on CUDA.

    `logits` fp32 `[T, E]`, `bias` fp32 `[E]` (`e_score_correction_bias`; None = zeros). Experts are split
    into `n_group` equal groups (1 = no group limit); a group's score is the sum of its top-2 biased
    scores, the `topk_group` best groups are kept, and the `top_k` experts with the best biased scores
    among them are picked. Their weights are the UNBIASED sigmoid scores, divided by their sum when
    `norm_topk_prob`, times `routed_scaling_factor`. Then `num_shared` columns with ids `E, E+1, ...` and
    weight 1.0 are appended (shared experts stored after the routed ones).

    Returns `(weights fp32 [T, top_k + num_shared], ids int64 [T, top_k + num_shared])`. The order of the
    routed picks within a row is unspecified (as in HF); NaN logits give unspecified picks.
    """
    if not torch.compiler.is_compiling():
        _check_args(logits, bias, n_group, topk_group, top_k, num_shared)
    return torch.ops.torchforge.sigmoid_group_topk(logits, bias, n_group, topk_group, top_k, norm_topk_prob,
                                                   routed_scaling_factor, num_shared)
