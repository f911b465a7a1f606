"""Serving a `drop`-pruned checkpoint in vLLM through FusedMoE's custom routing hook (seed 000 section 5).

vLLM loads the pruned checkpoint as an ordinary model with fewer experts; the router, however, still has a
row per ORIGINAL expert. The routing function below routes over all original experts exactly as the model
does, then maps the picks through the expert map: kept experts get their compact id, pruned ones go to id 0
with weight 0, so vLLM's kernels never see a negative or out-of-range id. vLLM calls it as
`custom_routing_function(hidden_states, gating_output, topk, renormalize)` and expects
`(topk_weights, topk_ids)`; FusedMoE consults it only when `use_grouped_topk` is False, so `install` turns
grouped top-k off and this function does the group-limited selection itself.

Not run against a real vLLM here (it cannot run on these machines): `make_routing_function` is tested against
PrunedMoE(drop); `install` follows FusedMoE's attribute names (`custom_routing_function`, `use_grouped_topk`)
and may need adjusting to the vLLM version at hand. DeepSeek's `routed_scaling_factor` is not applied here:
vLLM's DeepSeek MoE applies it to the experts' output.
"""
from __future__ import annotations

import torch

from torchforge.ops import moe_remap


def make_routing_function(layer_map: torch.Tensor, *, scoring: str = "softmax",
                          e_score_correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                          renormalize_kept: bool = False):
    """A vLLM custom routing function for one layer. `layer_map[E_orig]`: compact id or -1 (expert_map row)."""
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"make_routing_function: scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    slot = layer_map.to(torch.int32)

    def routing(hidden_states, gating_output, topk, renormalize, **_):
        logits = gating_output.float()
        scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + e_score_correction_bias.to(scores) if e_score_correction_bias is not None else scores
        if n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, n_group, E // n_group)
            # DeepSeek-V3 (sigmoid) scores a group by its top-2 sum, DeepSeek-V2 (softmax) by its max
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if scoring == "sigmoid" else grouped.amax(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1.0)
            mask = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E).bool()
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = choice.topk(topk, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        total = weights.sum(dim=-1, keepdim=True)
        new_ids, new_w = moe_remap(ids, weights, slot.to(ids.device))
        if renormalize_kept:  # kept weights scaled back to the total of all picks (PrunedMoE's renormalize)
            kept = new_w.sum(dim=-1, keepdim=True)
            new_w = torch.where(kept > 0, new_w * total / torch.where(kept > 0, kept, 1), 0)
        return new_w, new_ids.to(torch.int32)

    return routing


def install(vllm_model, expert_map: torch.Tensor, *, scoring: str, n_group: int | None = None,
            topk_group: int | None = None, renormalize_kept: bool = False) -> int:
    """Sets a routing function on every FusedMoE of a loaded vLLM model, in layer order. Returns the count.

    `n_group` / `topk_group`: None takes each layer's own group-limited routing (`num_expert_group`, `topk_group`,
    where `use_grouped_topk` is on), which `install` turns off in vLLM and does in the routing function instead;
    silently routing a DeepSeek model without its group limit would pick other experts."""
    layers = [m for m in vllm_model.modules() if hasattr(m, "custom_routing_function") and hasattr(m, "top_k")]
    if len(layers) != expert_map.shape[0]:
        raise ValueError(f"torchforge.runtime.vllm.install: the model has {len(layers)} FusedMoE layers but the "
                         f"expert map has {expert_map.shape[0]} rows")
    for row, layer in zip(expert_map, layers):
        bias = getattr(layer, "e_score_correction_bias", None)
        grouped = bool(getattr(layer, "use_grouped_topk", False))
        ng = n_group if n_group is not None else (getattr(layer, "num_expert_group", None) or 1) if grouped else 1
        tg = topk_group if topk_group is not None else (getattr(layer, "topk_group", None) or 1) if grouped else 1
        # the map on the layer's device once: a host-to-device copy per call would not be CUDA-graph capturable
        param = next(iter(layer.parameters()), None) if hasattr(layer, "parameters") else None
        row = row.to(param.device) if param is not None else row
        layer.custom_routing_function = make_routing_function(
            row, scoring=scoring, e_score_correction_bias=bias, n_group=ng, topk_group=tg,
            renormalize_kept=renormalize_kept)
        layer.use_grouped_topk = False
    return len(layers)
