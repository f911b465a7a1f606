"""Router re-implementations that can leave pruned experts out (PrunedMoE's `reroute` mode).

One function per router family of HF transformers 5, each returning `(topk_weights, topk_ids)` over the
ORIGINAL expert ids, computed with the same operations in the same order as HF's router module, so with
nothing pruned (`kept=None`, or a `KeptExperts` that keeps every expert) the result equals HF's bit for bit:

* `deepseek_v3_topk`: fp32 logits, sigmoid scores, `e_score_correction_bias` for the choice only,
  group-limited top-k (group score = sum of the group's top-2 choice scores), weights gathered from the
  unbiased scores, `norm_topk_prob`, `routed_scaling_factor`.
* `deepseek_v2_topk`: fp32 logits, softmax, `greedy` or `group_limited_greedy` (group score = max),
  `routed_scaling_factor`.
* `qwen3_moe_topk`: softmax top-k, optional `norm_topk_prob`, weights cast back to the logits dtype.
* `mixtral_topk`: softmax top-k, always renormalized over the picks (weights stay fp32).

Pruned experts (`kept`). Masking a pruned expert's score to -inf before the top-k and deleting its router
row select the same experts; these functions delete (gather the kept rows, in ascending original id), so
the arithmetic is exactly that of the smaller model `torchforge.prune.export` writes: softmax routers
normalize over the kept experts only (the probabilities of the pruned ones are gone, not redistributed
by hand), and a sigmoid router's scores are unchanged.

Group-limited routing with pruned experts (DeepSeek-V3/V2). Groups stay those of the original ids
(`group = original_id // (E // n_group)`). A group's score is computed over its KEPT experts only:
V3 sums the top-2 kept choice scores (a group with a single kept expert scores that expert alone: the
missing second expert counts 0), V2 takes the max kept probability. A group with no kept expert scores
-inf and is never chosen while another group is available. When every group keeps the same number
`m >= 2` of experts this is exactly HF's rule on the smaller model (`n_group` unchanged), which is what
makes the exported checkpoint route identically. If the `topk_group` chosen groups can hold fewer than
`top_k` kept experts (heavy pruning), the remaining picks are the best kept experts of the other groups
(HF's own code would pick arbitrary masked experts there), so every token still gets `top_k` kept
experts with their true scores.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["KeptExperts", "ROUTER_FAMILIES", "router_family", "route_kept", "deepseek_v3_topk", "deepseek_v2_topk",
           "qwen3_moe_topk", "mixtral_topk"]

_NEG_INF = float("-inf")


class KeptExperts(nn.Module):
    """The kept experts of one layer: original ids in ascending order, and their layout in the router's groups.

    Buffers are not persistent (they are derived from the expert map) and follow the module's device.
    """

    def __init__(self, kept: Tensor, n_group: int | None = None):
        super().__init__()
        kept = torch.as_tensor(kept, dtype=torch.bool).flatten().cpu()
        E = kept.numel()
        ids = kept.nonzero().squeeze(1)
        if ids.numel() == 0:
            raise ValueError("KeptExperts: no expert is kept; keep at least one")
        self.num_experts, self.num_kept = E, ids.numel()
        self.all_kept = self.num_kept == E
        self.register_buffer("ids", ids, persistent=False)
        self.n_group = n_group if n_group and n_group > 1 else None
        self.uniform = True
        self.group_counts: list[int] = [self.num_kept]
        if self.n_group:
            if E % self.n_group:
                raise ValueError(f"KeptExperts: {E} experts do not split into n_group={self.n_group} equal groups")
            group_of = ids // (E // self.n_group)
            counts = torch.bincount(group_of, minlength=self.n_group)
            self.group_counts = counts.tolist()
            self.uniform = len(set(self.group_counts)) == 1
            M = max(self.group_counts)
            # [G, M] positions in the kept space; short groups are padded with K (a -inf column appended at use).
            table = torch.full((self.n_group, M), self.num_kept, dtype=torch.long)
            for g in range(self.n_group):
                pos = (group_of == g).nonzero().squeeze(1)
                table[g, : pos.numel()] = pos
            self.register_buffer("group_of", group_of, persistent=False)
            self.register_buffer("group_table", table, persistent=False)
            self.register_buffer("group_empty", counts == 0, persistent=False)

    def min_kept_in(self, topk_group: int) -> int:
        """The fewest kept experts any `topk_group` groups can hold."""
        return sum(sorted(self.group_counts)[:topk_group])

    def extra_repr(self) -> str:
        return f"kept={self.num_kept}/{self.num_experts}, group_counts={self.group_counts}"


def _pruned(kept: KeptExperts | None) -> bool:
    return kept is not None and not kept.all_kept


def _to_original(idx: Tensor, kept: KeptExperts | None) -> Tensor:
    return kept.ids[idx] if _pruned(kept) else idx


def _group_mask(values: Tensor, kept: KeptExperts | None, n_group: int, topk_group: int, reduce: str) -> Tensor:
    """bool [T, K]: the experts of the `topk_group` best groups. `values` [T, K] in the kept space."""
    T, K = values.shape
    uniform = kept is None or kept.uniform
    if uniform:
        M = K // n_group
        grouped = values.view(-1, n_group, M)
    else:
        grouped = F.pad(values, (0, 1), value=_NEG_INF)[:, kept.group_table]  # [T, G, M], pads -inf
        M = grouped.shape[-1]
    if reduce == "top2sum":  # DeepSeek-V3
        top = grouped.topk(min(2, M), dim=-1)[0]
        if uniform:
            group_scores = top.sum(dim=-1)
        else:  # a missing second expert counts 0; a group with none is never chosen
            group_scores = top.masked_fill(top == _NEG_INF, 0.0).sum(dim=-1).masked_fill(kept.group_empty, _NEG_INF)
    else:  # "max", DeepSeek-V2 (pads are -inf, so empty groups score -inf)
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    if uniform:
        return group_mask.unsqueeze(-1).expand(-1, n_group, M).reshape(-1, K).bool()
    return group_mask[:, kept.group_of].bool()


def _topk_with_fill(choice: Tensor, in_groups: Tensor, top_k: int) -> Tensor:
    """Top-k of `choice` inside `in_groups`; picks the chosen groups cannot supply come from the other groups."""
    vals, idx = torch.topk(choice.masked_fill(~in_groups, _NEG_INF), k=top_k, dim=-1, sorted=True)
    missing = vals == _NEG_INF  # sorted: the missing picks are the last ones
    other = torch.topk(choice.masked_fill(in_groups, _NEG_INF), k=top_k, dim=-1, sorted=True)[1]
    rank = (missing.long().cumsum(-1) - 1).clamp(min=0)
    return torch.where(missing, other.gather(1, rank), idx)


def deepseek_v3_topk(x: Tensor, weight: Tensor, e_score_correction_bias: Tensor, *, top_k: int, n_group: int,
                     topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                     kept: KeptExperts | None = None) -> tuple[Tensor, Tensor]:
    """DeepseekV3TopkRouter's math. x [..., H] -> (weights fp32 [T, k], original ids [T, k])."""
    x = x.reshape(-1, weight.shape[-1])
    bias = e_score_correction_bias
    if _pruned(kept):
        weight, bias = weight[kept.ids], bias[kept.ids]
    router_logits = F.linear(x.type(torch.float32), weight.type(torch.float32))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + bias
    in_groups = _group_mask(scores_for_choice, kept, n_group, topk_group, "top2sum")
    if _pruned(kept) and kept.min_kept_in(topk_group) < top_k:
        idx = _topk_with_fill(scores_for_choice, in_groups, top_k)
    else:
        scores_for_choice = scores_for_choice.masked_fill(~in_groups, _NEG_INF)
        idx = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, idx)
    if norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, _to_original(idx, kept)


def deepseek_v2_topk(x: Tensor, weight: Tensor, *, top_k: int, topk_method: str, n_group: int | None,
                     topk_group: int | None, routed_scaling_factor: float, kept: KeptExperts | None = None
                     ) -> tuple[Tensor, Tensor]:
    """DeepseekV2TopkRouter's math (softmax over the kept experts). -> (weights fp32 [T, k], original ids)."""
    x = x.reshape(-1, weight.shape[-1])
    if _pruned(kept):
        weight = weight[kept.ids]
    router_logits = F.linear(x.type(torch.float32), weight.type(torch.float32))
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if topk_method == "greedy":
        topk_weights, idx = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    elif topk_method == "group_limited_greedy":
        in_groups = _group_mask(scores, kept, n_group, topk_group, "max")
        if _pruned(kept) and kept.min_kept_in(topk_group) < top_k:
            idx = _topk_with_fill(scores, in_groups, top_k)
            topk_weights = scores.gather(1, idx)
        else:
            scores = scores.masked_fill(~in_groups, 0.0)
            topk_weights, idx = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    else:
        raise ValueError(f"deepseek_v2_topk: unknown topk_method {topk_method!r} (HF knows 'greedy' and "
                         "'group_limited_greedy')")
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, _to_original(idx, kept)


def qwen3_moe_topk(x: Tensor, weight: Tensor, *, top_k: int, norm_topk_prob: bool,
                   kept: KeptExperts | None = None) -> tuple[Tensor, Tensor]:
    """Qwen3MoeTopKRouter's math. -> (weights in the logits dtype [T, k], original ids [T, k])."""
    x = x.reshape(-1, weight.shape[-1])
    if _pruned(kept):
        weight = weight[kept.ids]
    router_logits = F.linear(x, weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, idx = torch.topk(router_probs, top_k, dim=-1)
    if norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_top_value, _to_original(idx, kept)


def mixtral_topk(x: Tensor, weight: Tensor, *, top_k: int, kept: KeptExperts | None = None
                 ) -> tuple[Tensor, Tensor]:
    """MixtralTopKRouter's math. -> (weights fp32 [T, k] summing to 1, original ids [T, k])."""
    x = x.reshape(-1, weight.shape[-1])
    if _pruned(kept):
        weight = weight[kept.ids]
    router_logits = F.linear(x, weight)
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    router_top_value, idx = torch.topk(router_probs, top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_top_value, _to_original(idx, kept)


# HF router class -> family. Only classes whose forward was checked against these functions are listed.
ROUTER_FAMILIES = {
    "DeepseekV3TopkRouter": "deepseek_v3",
    "DeepseekV2TopkRouter": "deepseek_v2",
    "Qwen3MoeTopKRouter": "qwen3_moe",
    "MixtralTopKRouter": "mixtral",
}


def router_family(gate: nn.Module) -> str | None:
    return ROUTER_FAMILIES.get(type(gate).__name__)


def router_groups(gate: nn.Module) -> tuple[int | None, int | None]:
    """(n_group, topk_group) when the router does group-limited routing, else (None, None)."""
    family = router_family(gate)
    if family == "deepseek_v3" or (family == "deepseek_v2" and gate.topk_method == "group_limited_greedy"):
        return gate.num_group, gate.topk_group
    return None, None


def route_kept(gate: nn.Module, x: Tensor, kept: KeptExperts | None = None) -> tuple[Tensor, Tensor]:
    """Runs `gate`'s routing over the kept experts only. -> (topk_weights, original topk_ids)."""
    family = router_family(gate)
    if family == "deepseek_v3":
        return deepseek_v3_topk(x, gate.weight, gate.e_score_correction_bias, top_k=gate.top_k,
                                n_group=gate.num_group, topk_group=gate.topk_group,
                                norm_topk_prob=gate.norm_topk_prob,
                                routed_scaling_factor=gate.routed_scaling_factor, kept=kept)
    if family == "deepseek_v2":
        return deepseek_v2_topk(x, gate.weight, top_k=gate.top_k, topk_method=gate.topk_method,
                                n_group=gate.num_group, topk_group=gate.topk_group,
                                routed_scaling_factor=gate.routed_scaling_factor, kept=kept)
    if family == "qwen3_moe":
        return qwen3_moe_topk(x, gate.weight, top_k=gate.top_k, norm_topk_prob=gate.norm_topk_prob, kept=kept)
    if family == "mixtral":
        return mixtral_topk(x, gate.weight, top_k=gate.top_k, kept=kept)
    raise TypeError(f"route_kept: no router re-implementation for {type(gate).__name__} (known: "
                    f"{sorted(ROUTER_FAMILIES)}); use mode='drop', or add one in torchforge/nn/routing.py")
