"""The recipe's `prune` section: build or load the expert map and prune, before quantization."""
from __future__ import annotations

import os

import torch
from torch import nn

from torchforge.nn.pruned_moe import PrunedMoE
from torchforge.nn.routing import router_groups
from torchforge.prune.apply import moe_blocks, prune_experts
from torchforge.prune.expert_map import (
    RANK_BY,
    build_expert_map,
    check_hit_map_matches,
    load_expert_map,
    ranking_statistic,
)


def _load_hit_map(path: str, rank_by: str = "probability") -> torch.Tensor:
    """The [L, E] ranking tensor of a saved file: a tensor or a dict with 'hit_map' (rank_by "probability"), or
    the dict `RouterStats.save` writes (any rank_by: its 'topk_counts' / 'routed_weight' for "count" / "weight")."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"recipe prune.hit_map: {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file fails with pickle, zip, struct, ... errors
        raise ValueError(f"recipe prune.hit_map: {path} cannot be read by torch.load ({type(e).__name__}: {e}); save "
                         "the hit map again (torch.save, or RouterStats.save)") from e
    if rank_by != "probability":
        if not isinstance(obj, dict) or not isinstance(obj.get(RANK_BY[rank_by]), torch.Tensor):
            raise ValueError(f"recipe prune.rank_by={rank_by!r}: {path} must be router statistics saved by "
                             f"RouterStats.save (a dict with a {RANK_BY[rank_by]!r} tensor); it holds "
                             f"{type(obj).__name__}" + (f" with keys {sorted(obj)}" if isinstance(obj, dict) else ""))
        return ranking_statistic(obj, rank_by)
    hit = obj.get("hit_map") if isinstance(obj, dict) else obj
    if not isinstance(hit, torch.Tensor):
        raise ValueError(f"recipe prune.hit_map: {path} holds {type(obj).__name__}, not a tensor or a dict with "
                         "a 'hit_map' tensor")
    return hit


def prune_from_recipe(model: nn.Module, section) -> nn.Module:
    """Applies a `torchforge.recipe.PruneRecipe` to `model` in place (no-op for None)."""
    if section is None:
        return model
    if section.expert_map is not None:
        expert_map = load_expert_map(section.expert_map)
    else:
        hit = _load_hit_map(section.hit_map, section.rank_by)
        check_hit_map_matches(hit, model)
        n_group = None
        if section.balance_groups:
            n_group, _ = router_groups(moe_blocks(model)[0][1].gate)  # None: the router is not group-limited
        expert_map = build_expert_map(hit, keep_k=section.keep_k, keep_ratio=section.keep_ratio, n_group=n_group)
    blocks = moe_blocks(model)
    pruned = [(n, b) for n, b in blocks if isinstance(b, PrunedMoE)]
    if pruned:  # an earlier call (quantize retried, or run twice): fine with the same map, else an error
        same = len(pruned) == len(blocks) == expert_map.shape[0] and all(
            b.mode == section.mode and b.renormalize == section.renormalize
            and torch.equal(b._row_host.to(torch.int32), row.to(torch.int32))
            for (_, b), row in zip(pruned, expert_map))
        if not same:
            raise ValueError(f"recipe prune: the model is already pruned ({pruned[0][0]} is a PrunedMoE, {len(pruned)} "
                             f"of {len(blocks)} MoE blocks) with another expert map or mode than this recipe's; prune "
                             "the original model once with the final map")
        return model
    return prune_experts(model, expert_map, mode=section.mode, renormalize=section.renormalize)
