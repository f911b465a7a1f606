"""torchforge.prune_experts: swap every MoE block of a model for a PrunedMoE following an expert map."""
from __future__ import annotations

import torch
from torch import nn

from torchforge.hf_save_guard import hf_save_refused, refuse_hf_save
from torchforge.nn.moe import ForgeMoE
from torchforge.nn.pruned_moe import MODES, PrunedMoE, num_experts_of
from torchforge.prune.expert_map import validate_expert_map

__all__ = ["prune_experts", "moe_blocks", "num_routed_experts", "pruned_blocks"]


def _is_moe_block(module: nn.Module) -> bool:
    if isinstance(module, ForgeMoE):
        return True
    experts = getattr(module, "experts", None)
    if getattr(module, "gate", None) is None or not isinstance(experts, nn.Module):
        return False
    try:
        num_experts_of(experts)
    except TypeError:
        return False
    return True


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE blocks (HF sparse-MoE blocks with a `gate` and fused `experts`, or ForgeMoE) in named_modules()
    order: this order is the row order of hit maps and expert maps."""
    return [(n, m) for n, m in model.named_modules() if _is_moe_block(m)]


def pruned_blocks(model: nn.Module) -> list[tuple[str, PrunedMoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, PrunedMoE)]


def num_routed_experts(block: nn.Module) -> int:
    """Original routed-expert count of a MoE block (what the router scores)."""
    if isinstance(block, PrunedMoE):
        return block.num_original_experts
    gate = block.gate
    n = getattr(gate, "num_experts", None)
    if isinstance(n, int):
        return n
    w = getattr(gate, "weight", None)
    if isinstance(w, torch.Tensor):
        return w.shape[0]
    return num_experts_of(block.experts)


def prune_experts(model: nn.Module, expert_map, mode: str = "reroute", renormalize: bool = False) -> nn.Module:
    """Replaces every MoE block of `model` (in place) by a `PrunedMoE` holding the kept experts; returns `model`.

    `expert_map`: int32 `[L, E]` from `torchforge.prune.build_expert_map`, row l for the l-th MoE block in
    `model.named_modules()` order. Blocks may be HF sparse-MoE blocks or ForgeMoE (so pruning works after
    `torchforge.quantize`: pruning and quantizing compose in either order). Shared experts and the
    router are kept. `mode`: "reroute" (pruned experts removed before top-k; exports as a standard smaller
    checkpoint) or "drop" (seed 000: pruned picks get weight 0; `renormalize` rescales the kept weights).
    """
    if mode not in MODES:
        raise ValueError(f"prune_experts: mode={mode!r}; choose one of {MODES}")
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"prune_experts: {type(model).__name__} has no MoE blocks (modules with a `gate` router and "
                         "fused `experts`)")
    already = [n for n, b in blocks if isinstance(b, PrunedMoE)]
    if already:
        raise ValueError(f"prune_experts: the model is already pruned ({already[0]} is a PrunedMoE); prune the "
                         "original model once with the final expert map")
    if not isinstance(expert_map, torch.Tensor):
        expert_map = torch.as_tensor(expert_map)
    counts = [num_routed_experts(b) for _, b in blocks]
    shape = tuple(expert_map.shape)
    if expert_map.dim() != 2 or shape[0] != len(blocks) or any(c != shape[1] for c in counts):
        want = (len(blocks), counts[0]) if len(set(counts)) == 1 else f"({len(blocks)}, per-layer {counts})"
        raise ValueError(f"prune_experts: expert_map has shape {shape} but the model has {len(blocks)} MoE blocks "
                         f"({blocks[0][0]}, ...) with {counts[0]} routed experts: expected {want}. Build the map "
                         "from a hit map of this model (one row per MoE block in named_modules() order)")
    expert_map = validate_expert_map(expert_map)
    # Every block is checked before the first is replaced: a row a block cannot take (reroute with fewer than top_k
    # kept, a router without a re-implementation) leaves the model unpruned, not half pruned. The kept experts are
    # copied one block at a time after that, as before (building every block first would hold two copies).
    for (name, block), row in zip(blocks, expert_map):
        try:
            PrunedMoE.check_block(block, row, mode=mode, renormalize=renormalize)
        except (TypeError, ValueError) as e:
            raise type(e)(f"prune_experts: cannot prune {name or 'the model'} (expert-map row "
                          f"{blocks.index((name, block))}): {e}; the model is unchanged") from e
    for (name, block), row in zip(blocks, expert_map):
        pruned = PrunedMoE.from_block(block, row, mode=mode, renormalize=renormalize)
        if name == "":
            return pruned  # the model is itself one MoE block
        model.set_submodule(name, pruned)
    _refuse_hf_save(model, mode)
    return model


_SAVE_INSTEAD = {
    "reroute": "use torchforge.prune.save_pruned(model, out_dir) (a standard smaller HF checkpoint), or "
               "torchforge.save_quantized(model, out_dir) after torchforge.quantize",
    "drop": "a drop model needs expert_map.pt at run time: quantize it (torchforge.quantize) and use "
            "torchforge.save_quantized(model, out_dir), or prune with mode='reroute' and use "
            "torchforge.prune.save_pruned",
}


def _refuse_hf_save(model: nn.Module, mode: str) -> None:
    """transformers' save_pretrained would write the original routed-expert count beside fewer experts per layer:
    refused like a quantized model's (a quantized model keeps its own message: save_quantized handles both)."""
    if hasattr(model, "save_pretrained") and not hf_save_refused(model):
        refuse_hf_save(model, "save_pretrained / push_to_hub would write config.json with the original routed-expert "
                              "count beside the pruned experts (from_pretrained fails, or loads random experts): "
                              + _SAVE_INSTEAD[mode])
