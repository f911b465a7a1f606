"""MoE expert pruning (seed 000 sections 4.2 and 5): expert maps, PrunedMoE swap-in, and export.

    expert_map = torchforge.prune.build_expert_map(hit_map, keep_ratio=0.5)
    expert_map = torchforge.prune.build_expert_map(router_stats, keep_ratio=0.5, rank_by="weight")  # see RANK_BY
    torchforge.prune_experts(model, expert_map, mode="reroute")   # or mode="drop"
"""
from torchforge.nn.pruned_moe import PrunedMoE, select_experts
from torchforge.prune.apply import moe_blocks, prune_experts
from torchforge.prune.expert_map import (
    EXPERT_MAP_FILE,
    RANK_BY,
    build_expert_map,
    check_hit_map_matches,
    load_expert_map,
    ranking_statistic,
    save_expert_map,
    validate_expert_map,
)
from torchforge.prune.export import apply_pruned_config, pruned_config_changes, pruned_state_dict, save_pruned

__all__ = [
    "EXPERT_MAP_FILE",
    "PrunedMoE",
    "RANK_BY",
    "apply_pruned_config",
    "build_expert_map",
    "check_hit_map_matches",
    "load_expert_map",
    "moe_blocks",
    "prune_experts",
    "pruned_config_changes",
    "pruned_state_dict",
    "ranking_statistic",
    "save_expert_map",
    "save_pruned",
    "select_experts",
    "validate_expert_map",
]
