"""Router statistics of an in-memory HF MoE model ("exact mode": every layer runs in full).

hit_map[L, E] is the sum over tokens of the router's per-expert probabilities: sigmoid for DeepSeek-V3
style routers, never converted to a softmax (seed 000 section 1.3.2: sigmoid gates are independent, several
experts can be strongly "on" at once); softmax routers (DeepSeek-V2, Qwen3-MoE, Mixtral) use their softmax.
Also kept: how often each expert is picked (top-k counts) and the routed weight it receives, with the token
count. Hooks read the router's input and output, so the model's own routing is what is counted; a pruned
model (PrunedMoE blocks) is refused: its routing over the kept experts is not the router's output (collect the
statistics on the unpruned model, which is what `build_expert_map` ranks). Padding (attention_mask == 0) is not
counted: neither its probability mass, its picks, its routed weight nor its tokens.
`router_sums` / `add_sums` are shared with the layer-by-layer streamer (`torchforge.calibration.streamer`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

# model_type -> (attribute path of the router inside a decoder layer, probability function)
ROUTERS: dict[str, tuple[str, str]] = {
    "deepseek_v3": ("mlp.gate", "sigmoid"),
    "deepseek_v2": ("mlp.gate", "softmax"),
    "qwen3_moe": ("mlp.gate", "softmax"),
    "qwen2_moe": ("mlp.gate", "softmax"),
    "mixtral": ("mlp.gate", "softmax"),
    "olmoe": ("mlp.gate", "softmax"),
}


@dataclass
class RouterStats:
    hit_map: torch.Tensor          # [L, E] float32: summed router probabilities
    topk_counts: torch.Tensor      # [L, E] int64: times each expert was picked
    routed_weight: torch.Tensor    # [L, E] float32: summed routing weights it received
    tokens: int = 0
    layers: list[str] = field(default_factory=list)  # module names of the routers, in layer order
    settings: dict = field(default_factory=dict)

    def save(self, path: str) -> str:
        """torch.save of a plain dict (loadable with weights_only=True), written atomically."""
        from torchforge.io.save import atomic_torch_save

        atomic_torch_save({"hit_map": self.hit_map, "topk_counts": self.topk_counts,
                           "routed_weight": self.routed_weight, "tokens": self.tokens, "layers": self.layers,
                           "settings": self.settings}, path)
        return path

    @classmethod
    def load(cls, path: str) -> "RouterStats":
        return cls(**torch.load(path, map_location="cpu", weights_only=True))


def find_routers(model: nn.Module, router_attr: str | None = None, prob: str | None = None):
    """[(name, router module)] in layer order, and the probability function name."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if router_attr is None:
        if mt not in ROUTERS:
            raise ValueError(f"router stats: no router registered for model_type {mt!r} (known: {sorted(ROUTERS)}); "
                             "pass router_attr='mlp.gate' (path inside a decoder layer) and prob='sigmoid'|'softmax'")
        router_attr, default_prob = ROUTERS[mt]
        prob = prob or default_prob
    if prob not in ("sigmoid", "softmax"):
        raise ValueError(f"router stats: prob must be 'sigmoid' or 'softmax', got {prob!r}")
    found = []
    for name, mod in model.named_modules():
        if name.endswith("." + router_attr) or name == router_attr:
            found.append((name, mod))
    if not found:
        raise ValueError(f"router stats: no module named '*.{router_attr}' in {type(model).__name__}")
    _refuse_pruned(model, found)
    return found, prob


def _refuse_pruned(model: nn.Module, routers) -> None:
    """PrunedMoE keeps HF's full router and calls it only to fire its hooks: a hook there sees picks of experts the
    block no longer has (reroute) or gives weight 0 (drop), not what the model computes."""
    from torchforge.nn.pruned_moe import PrunedMoE

    for name, _ in routers:
        parent = model.get_submodule(name.rpartition(".")[0])
        if isinstance(parent, PrunedMoE):
            raise ValueError(f"router stats: {name.rpartition('.')[0] or 'the model'} is a PrunedMoE ({parent.mode}, "
                             f"{parent.num_kept}/{parent.num_original_experts} experts kept): its router scores all "
                             "original experts but the block routes over the kept ones, so the counts would not be "
                             "the model's routing. Collect router statistics on the unpruned model")


def new_stats(num_layers: int, num_experts: int, layers: list[str], settings: dict) -> RouterStats:
    return RouterStats(torch.zeros(num_layers, num_experts), torch.zeros(num_layers, num_experts, dtype=torch.int64),
                       torch.zeros(num_layers, num_experts), layers=list(layers), settings=dict(settings))


def router_sums(router: nn.Module, x: torch.Tensor, output, prob: str, keep: torch.Tensor | None = None):
    """One router call's contribution, on the router's device: (probability mass [E] float32, top-k counts [E]
    int64, routed weight [E] float32). `x` is the router's input, `output` its (logits, weights, ids); `keep`
    ([T] bool, False at padding, in the router's token order) leaves tokens out (None: every token counts)."""
    E, H = router.weight.shape
    x = x.reshape(-1, H)
    _, weights, ids = output
    if keep is not None:
        if keep.numel() != x.shape[0]:
            raise ValueError(f"router stats: the attention mask covers {keep.numel()} tokens but the router saw "
                             f"{x.shape[0]}; cannot tell padding apart")
        x = x[keep.to(x.device)]
        keep = keep.to(ids.device)
        ids, weights = ids.reshape(keep.numel(), -1)[keep], weights.reshape(keep.numel(), -1)[keep]
    logits = x.float() @ router.weight.float().T
    p = logits.sigmoid() if prob == "sigmoid" else logits.softmax(dim=-1)
    ids = ids.reshape(-1)
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    mass = torch.zeros(E, device=ids.device).scatter_add_(0, ids, weights.reshape(-1).float())
    return p.sum(0), counts, mass


def add_sums(stats: RouterStats, idx: int, sums) -> None:
    hit, counts, mass = (t.cpu() for t in sums)
    if not (bool(torch.isfinite(hit).all()) and bool(torch.isfinite(mass).all())):
        # said now, naming the router: a NaN row would be kept and saved, and refused only by a later prune
        raise ValueError(f"router stats: the router {stats.layers[idx]} got NaN/Inf inputs or routing weights (the "
                         "model overflows or yields NaN on these batches in its dtype); run it in bfloat16 or "
                         "float32, or check the batches")
    stats.hit_map[idx] += hit
    stats.topk_counts[idx] += counts
    stats.routed_weight[idx] += mass


def _batch(item, who: str = "collect_router_stats") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids [B, S], attention_mask [B, S] or None) of one batch: an input_ids tensor, or a mapping (a
    tokenizer's BatchEncoding) with input_ids and an optional attention_mask of 0 (padding) and 1 (real token),
    at least one real token a row. A mask without padding is None, so unpadded batches run exactly as bare
    input_ids. `who` starts the error messages (the whole-model function or the layer-by-layer streamer)."""
    ids, mask = item, None
    if isinstance(item, Mapping):
        if "input_ids" not in item:
            raise TypeError(f"{who}: a batch mapping needs 'input_ids' (keys: {sorted(item)})")
        ids, mask = item["input_ids"], item.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise TypeError(f"{who}: batches must yield integer input_ids tensors [B, S] (or mappings with "
                        f"input_ids and attention_mask), got {type(ids).__name__}"
                        f"{f' {ids.dim()}-D {ids.dtype}' if isinstance(ids, torch.Tensor) else ''}")
    if mask is not None:
        mask = torch.as_tensor(mask)
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(f"{who}: attention_mask has shape {tuple(mask.shape)}, input_ids "
                             f"{tuple(ids.shape)}")
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{who}: attention_mask must hold 0 (padding) and 1 (real token) only, got values "
                             f"{sorted(set(mask.unique().tolist()))[:8]}")
        empty = (mask == 0).all(dim=-1).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"{who}: attention_mask rows {empty[:8]} have no real token (all 0); drop them")
        if bool((mask != 0).all()):
            mask = None
        else:
            mask = mask.long()
    return ids, mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] positions of a padded batch as generate() numbers them (the first real token is 0, padding is
    clamped to 0), so a left-padded row routes like the same row unpadded."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def collect_router_stats(model: nn.Module, batches, *, router_attr: str | None = None, prob: str | None = None,
                         max_tokens: int | None = None) -> RouterStats:
    """Runs `model` on `batches` and accumulates RouterStats.

    Each batch is an integer input_ids tensor [B, S], or a mapping with `input_ids` and an optional
    `attention_mask` [B, S] (a tokenizer's BatchEncoding; other keys are ignored). Padded positions (mask 0,
    left or right) are passed to the model as a mask and left out of every statistic and of `tokens`
    (`max_tokens` counts real tokens too). A model with PrunedMoE blocks is refused (see the module docstring)."""
    routers, prob = find_routers(model, router_attr, prob)
    stats = new_stats(len(routers), routers[0][1].weight.shape[0], [n for n, _ in routers],
                      {"prob": prob, "mode": "exact"})
    keep: list = [None]  # the current batch's [B * S] real-token mask (None: no padding)

    def hook(idx):
        def fn(module, inputs, output):
            add_sums(stats, idx, router_sums(module, inputs[0], output, prob, keep[0]))
        return fn

    handles = [mod.register_forward_hook(hook(i)) for i, (_, mod) in enumerate(routers)]
    device = next(model.parameters()).device
    try:
        for item in batches:
            if max_tokens is not None and stats.tokens >= max_tokens:
                break
            ids, mask = _batch(item)
            # only the routers' inputs matter: no KV cache, and logits for one position instead of [B, S, vocab]
            kwargs = dict(input_ids=ids.to(device), use_cache=False, logits_to_keep=1)
            if mask is not None:
                kwargs.update(attention_mask=mask.to(device), position_ids=position_ids(mask).to(device))
                keep[0] = mask.reshape(-1) != 0
            model(**kwargs)
            stats.tokens += ids.numel() if mask is None else int(keep[0].sum())
            keep[0] = None
    finally:
        for h in handles:
            h.remove()
    if stats.tokens == 0:  # all-zero statistics would rank the experts by id alone
        raise ValueError(f"collect_router_stats: no calibration token was run (batches empty or without tokens, "
                         f"max_tokens={max_tokens}); pass at least one batch of input_ids")
    return stats
