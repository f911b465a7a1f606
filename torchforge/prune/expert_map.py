"""Expert maps (seed 000 section 4.2): which routed experts each MoE layer keeps, and their compact ids.

An expert map is an int32 tensor `[L, E]`: one row per MoE block of the model (in `named_modules()`
order), one column per ORIGINAL routed expert. A kept expert holds its compact id, a pruned one `-1`.
Invariants (checked by `validate_expert_map`): in every row the non-negative entries are exactly
`0..k-1`, each once, with `k >= 1` (so compact id 0 always exists: `moe_remap` sends pruned picks there).
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence

import torch

EXPERT_MAP_FILE = "expert_map.pt"

__all__ = ["EXPERT_MAP_FILE", "RANK_BY", "build_expert_map", "ranking_statistic", "validate_expert_map",
           "save_expert_map", "load_expert_map", "check_hit_map_matches"]

# rank_by -> the RouterStats field (torchforge.calibration) that experts are ranked by:
# - "probability": hit_map, the router's probabilities summed over every token (sigmoid, never a softmax, for
#   DeepSeek-V3); the default. It also credits an expert for tokens that did not pick it.
# - "count": topk_counts, how often the router picked the expert.
# - "weight": routed_weight, the routing weight the expert received when picked: exactly the routed-output
#   mass that `drop` pruning removes (pruned picks get weight 0), so keeping the top-k by weight keeps the
#   most of it on the calibration data. On the trained tiny MoE (examples/prune_tiny_moe.py) it gave the
#   smallest math perplexity increase of the three in all of drop/reroute x exact/approx calibration.
RANK_BY: dict[str, str] = {"probability": "hit_map", "count": "topk_counts", "weight": "routed_weight"}


def _is_stats(obj) -> bool:
    return not isinstance(obj, torch.Tensor) and (isinstance(obj, Mapping) or hasattr(obj, "hit_map"))


def _check_rank_by(rank_by) -> str:
    if not isinstance(rank_by, str) or rank_by not in RANK_BY:
        raise ValueError(f"rank_by={rank_by!r}: choose one of {', '.join(map(repr, RANK_BY))} (router probability "
                         "mass, top-k pick counts, or routed weight received)")
    return rank_by


def ranking_statistic(stats, rank_by: str = "probability") -> torch.Tensor:
    """The `[L, E]` tensor that `rank_by` (a key of `RANK_BY`) ranks experts by, from router statistics: a
    `torchforge.calibration.RouterStats` or the dict `RouterStats.save` writes. Counts come back as float64
    (exact up to 2**53), the float statistics as they are."""
    field = RANK_BY[_check_rank_by(rank_by)]
    value = stats.get(field) if isinstance(stats, Mapping) else getattr(stats, field, None)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"rank_by={rank_by!r} needs the router statistics' {field!r} tensor, which "
                         f"{type(stats).__name__} does not hold; pass a RouterStats (torchforge.calibration) or the "
                         "dict RouterStats.save writes")
    return value if value.is_floating_point() else value.double()


def _check_hit_map(hit_map) -> torch.Tensor:
    if not isinstance(hit_map, torch.Tensor):
        try:
            hit_map = torch.as_tensor(hit_map)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"build_expert_map: hit_map must be a float tensor [L, E], got "
                            f"{type(hit_map).__name__}") from e
    if hit_map.dim() != 2:
        raise ValueError(f"build_expert_map: hit_map must be 2-D [L, E] (MoE layers x routed experts), got shape "
                         f"{tuple(hit_map.shape)}; stack one row per MoE layer")
    if not hit_map.is_floating_point():
        raise TypeError(f"build_expert_map: hit_map must be a float tensor (accumulated router probabilities), got "
                        f"{hit_map.dtype}; convert it with hit_map.float()")
    if hit_map.shape[0] == 0 or hit_map.shape[1] == 0:
        raise ValueError(f"build_expert_map: hit_map has shape {tuple(hit_map.shape)}; it needs at least one layer "
                         "and one expert")
    hit_map = hit_map.detach().to("cpu", torch.float64)
    bad = ~torch.isfinite(hit_map)
    if bad.any():
        layer, expert = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"build_expert_map: hit_map has {int(bad.sum())} NaN/Inf entries (first at layer {layer}, "
                         f"expert {expert}: {hit_map[layer, expert].item()}); the calibration run diverged or "
                         "overflowed, recompute the hit map (accumulate in float32 on the host)")
    return hit_map


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _per_layer_keep(num_layers: int, num_experts: int, keep_k, keep_ratio) -> list[int]:
    if (keep_k is None) == (keep_ratio is None):
        raise ValueError("build_expert_map: pass exactly one of keep_k (experts kept per layer: an int or one int "
                         "per layer) or keep_ratio (a fraction of the routed experts, 0 < ratio <= 1)"
                         + ("; both were given" if keep_k is not None else "; neither was given"))
    if keep_ratio is not None:
        if not isinstance(keep_ratio, numbers.Real) or isinstance(keep_ratio, bool) or not (
                0 < float(keep_ratio) <= 1):
            raise ValueError(f"build_expert_map: keep_ratio={keep_ratio!r} must be a number in (0, 1]; e.g. 0.5 keeps "
                             "half of the routed experts of every layer")
        # half up, not Python's round (half to even, which keeps 2 of 5 experts at 0.5 but 4 of 7); the 1e-9 absorbs
        # float products such as 0.29 * 50 = 14.499999999999998
        return [max(1, math.floor(float(keep_ratio) * num_experts + 0.5 + 1e-9))] * num_layers
    if isinstance(keep_k, torch.Tensor):
        keep_k = keep_k.tolist()
    if _is_int(keep_k):
        ks = [int(keep_k)] * num_layers
    elif isinstance(keep_k, Sequence) and not isinstance(keep_k, str):
        if len(keep_k) != num_layers:
            raise ValueError(f"build_expert_map: keep_k has {len(keep_k)} per-layer budgets but hit_map has "
                             f"{num_layers} layers; give one int per MoE layer (or a single int for all)")
        if not all(_is_int(k) for k in keep_k):
            raise TypeError(f"build_expert_map: keep_k must hold ints, got {list(keep_k)!r}")
        ks = [int(k) for k in keep_k]
    else:
        raise TypeError(f"build_expert_map: keep_k must be an int or a sequence of ints (one per layer), got "
                        f"{type(keep_k).__name__}")
    for layer, k in enumerate(ks):
        if k < 1:
            raise ValueError(f"build_expert_map: keep_k={k} (layer {layer}) is below 1; every layer must keep at "
                             "least one expert (pruned picks are rerouted to compact expert 0)")
        if k > num_experts:
            raise ValueError(f"build_expert_map: keep_k={k} (layer {layer}) is above the number of routed experts "
                             f"E={num_experts}; use 1 <= keep_k <= {num_experts}")
    return ks


def build_expert_map(hit_map, keep_k=None, keep_ratio=None, n_group: int | None = None, *,
                     rank_by: str = "probability") -> torch.Tensor:
    """hit_map `[L, E]` (float: per-expert router mass) -> expert map int32 `[L, E]`.

    `hit_map` may also be router statistics (a `torchforge.calibration.RouterStats` or the dict its `save`
    writes); `rank_by` then picks the statistic the experts are ranked by (see `RANK_BY`): "probability"
    (stats.hit_map, the default), "count" (stats.topk_counts) or "weight" (stats.routed_weight, the routed
    weight that drop pruning removes). A bare tensor is ranked as it is and takes only rank_by="probability"
    (to rank by another statistic pass the statistics, or that tensor itself).

    Per layer, the `keep_k` experts with the largest hits are kept and numbered `0..keep_k-1` in
    descending hit order (ties: the lower original expert id first); the others get `-1`.
    `keep_k`: an int for every layer, or one int per layer. `keep_ratio`: keeps `max(1, ratio * E rounded half up)`
    experts per layer. Exactly one of the two must be given.
    `n_group`: keep the same number, keep_k / n_group, in each of the n_group contiguous expert groups of
    group-limited routing (DeepSeek's `n_group`), the top ones of each group. A reroute export keeps
    group-limited routing valid only then; otherwise it falls back to n_group = 1 (see torchforge.prune.export).
    """
    if _is_stats(hit_map):
        hit_map = ranking_statistic(hit_map, rank_by)
    elif _check_rank_by(rank_by) != "probability":
        raise ValueError(f"build_expert_map: rank_by={rank_by!r} needs the router statistics (a RouterStats or the "
                         "dict RouterStats.save writes), not a bare [L, E] tensor; or pass that statistic's tensor "
                         "itself with the default rank_by")
    hits = _check_hit_map(hit_map)
    num_layers, num_experts = hits.shape
    ks = _per_layer_keep(num_layers, num_experts, keep_k, keep_ratio)
    if n_group is not None:
        _check_groups(num_experts, ks, n_group, keep_ratio)
    out = torch.full((num_layers, num_experts), -1, dtype=torch.int32)
    for layer, k in enumerate(ks):
        # A stable sort of the negated hits: descending, and equal hits keep ascending expert ids.
        order = torch.sort(-hits[layer], stable=True).indices
        if n_group is not None:
            size, per = num_experts // n_group, k // n_group
            rank = torch.empty_like(order)
            rank[order] = torch.arange(num_experts)
            # within each group, the `per` best by overall rank; then all kept ones in overall rank order
            by_group = torch.sort(rank.view(n_group, size), dim=1).values[:, :per].flatten()
            order = order[torch.sort(by_group).values]
        out[layer, order[:k]] = torch.arange(k, dtype=torch.int32)
    return out


def _check_groups(num_experts: int, ks: list[int], n_group: int, keep_ratio=None) -> None:
    if not _is_int(n_group) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"build_expert_map: n_group={n_group!r} must be a positive divisor of the {num_experts} "
                         "routed experts (the router's n_group)")
    bad = [k for k in ks if k % n_group]
    if bad:
        given = f"keep_ratio={keep_ratio} keeps {bad[0]} experts per layer, which" if keep_ratio is not None else \
            f"keep_k={bad[0]}"
        raise ValueError(f"build_expert_map: {given} does not split evenly over n_group={n_group} groups; "
                         f"keep a multiple of {n_group} experts per layer")


def validate_expert_map(expert_map, num_experts: int | None = None) -> torch.Tensor:
    """Checks the invariants; returns the map as a contiguous int32 CPU tensor. Raises ValueError/TypeError."""
    if not isinstance(expert_map, torch.Tensor):
        raise TypeError(f"expert map must be an int32 tensor [L, E], got {type(expert_map).__name__}")
    if expert_map.dtype.is_floating_point or expert_map.dtype.is_complex or expert_map.dtype == torch.bool:
        raise TypeError(f"expert map must be an integer tensor (int32), got {expert_map.dtype}")
    if expert_map.dim() != 2 or expert_map.shape[0] == 0 or expert_map.shape[1] == 0:
        raise ValueError(f"expert map must be 2-D [L, E] with L, E >= 1, got shape {tuple(expert_map.shape)}")
    if num_experts is not None and expert_map.shape[1] != num_experts:
        raise ValueError(f"expert map has {expert_map.shape[1]} columns but the router has {num_experts} experts; "
                         "the map must have one column per original routed expert")
    m = expert_map.detach().to("cpu", torch.int64)
    if (m < -1).any():
        layer = int((m < -1).any(1).nonzero()[0])
        raise ValueError(f"expert map row {layer} holds values below -1 ({m[layer].tolist()}); pruned experts are -1")
    for layer in range(m.shape[0]):
        kept = m[layer][m[layer] >= 0]
        k = kept.numel()
        if k == 0:
            raise ValueError(f"expert map row {layer} keeps no expert; every layer must keep at least one "
                             "(compact expert 0 receives the pruned picks)")
        if not torch.equal(kept.sort().values, torch.arange(k)):
            raise ValueError(f"expert map row {layer} keeps {k} experts but their compact ids are "
                             f"{sorted(kept.tolist())}, not 0..{k - 1} each once; build maps with "
                             "torchforge.prune.build_expert_map")
    return m.to(torch.int32).contiguous()


def save_expert_map(expert_map, directory: str | os.PathLike) -> str:
    """Validates and writes `directory/expert_map.pt` (a plain int32 tensor) atomically; returns its path."""
    from torchforge.io.save import atomic_torch_save

    m = validate_expert_map(expert_map)
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, EXPERT_MAP_FILE)
    atomic_torch_save(m, path)
    return path


def load_expert_map(directory: str | os.PathLike) -> torch.Tensor:
    """Reads `directory/expert_map.pt` (or the file itself when given a path to it) and validates it."""
    path = os.fspath(directory)
    if os.path.isdir(path):
        path = os.path.join(path, EXPERT_MAP_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_expert_map: {path} does not exist; save one with "
                                "torchforge.prune.save_expert_map(expert_map, directory)")
    try:
        m = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file fails with pickle, zip, struct, ... errors
        raise ValueError(f"load_expert_map: {path} cannot be read by torch.load ({type(e).__name__}: {e}); it is "
                         "truncated or not an expert map: save it again with torchforge.prune.save_expert_map") from e
    try:
        return validate_expert_map(m)
    except (TypeError, ValueError) as e:
        raise ValueError(f"load_expert_map: {path}: {e}") from e


def check_hit_map_matches(hit_map, model) -> None:
    """Raises ValueError unless `hit_map` is `[number of MoE blocks of model, routed experts per block]`."""
    from torchforge.prune.apply import moe_blocks, num_routed_experts

    shape = tuple(getattr(hit_map, "shape", ()))
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"hit map: {type(model).__name__} has no MoE blocks (modules with `gate` and `experts`)")
    counts = [num_routed_experts(b) for _, b in blocks]
    names = [n for n, _ in blocks]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    if len(set(counts)) != 1:
        raise ValueError(f"hit map: the model's MoE blocks have different expert counts {counts}; a [L, E] hit map "
                         "cannot describe it")
    want = (len(blocks), counts[0])
    if shape != want:
        raise ValueError(f"hit map has shape {shape} but the model has {want[0]} MoE layers ({shown}) with "
                         f"{want[1]} routed experts each: expected {want}. Collect the hit map on this model "
                         "(one row per MoE block in named_modules() order, dense layers excluded)")
    if math.prod(shape) and not torch.as_tensor(hit_map).is_floating_point():
        raise TypeError(f"hit map must be a float tensor, got {torch.as_tensor(hit_map).dtype}")
