"""Exporting pruned models.

`reroute` models are written as a STANDARD, smaller HF / vLLM checkpoint that stock transformers and vLLM
load with no patch:

* config.json: the routed-expert count (`n_routed_experts` / `num_experts` / `num_local_experts`, as the
  architecture names it) becomes the kept count k (the same in every layer: HF configs have one count);
* the router's rows (`gate.weight`) and DeepSeek-V3's `e_score_correction_bias` are sliced to the kept
  experts;
* the kept experts are numbered 0..k-1 in ASCENDING ORIGINAL ID order, not in the expert map's compact
  (hit) order: this keeps the experts of one routing group contiguous, which is what lets group-limited
  routing survive (below). PrunedMoE(reroute) already stores its experts in this order, so the per-expert
  tensors `export_state_dict` writes need no renaming.

Group-limited routing (DeepSeek-V3 `n_group` / `topk_group`, DeepSeek-V2 `group_limited_greedy`). HF views
the scores as `[n_group, E / n_group]`, so the smaller model keeps `n_group` only when every group keeps the
same number m of experts. `n_group` is kept unchanged when, in every layer, all groups keep the same m,
with m >= 2 for DeepSeek-V3 (its group score is the sum of the group's top-2) and m * topk_group >= top_k
(the chosen groups can always supply top_k experts). Then the exported router computes exactly what
PrunedMoE(reroute) computes (torchforge.nn.routing: group score over the kept experts of a group) and the
checkpoint reproduces the pruned model's logits. Otherwise the export sets `n_group = 1, topk_group = 1`
(plain top-k over the kept experts): a valid standard config, but routing then differs from the
in-memory PrunedMoE(reroute), which still limits tokens to `topk_group` groups. A warning says so and
torchforge.json records it (`prune.group_routing`). We do not try to pick a different `n_group` that
divides k: a group of the new config would mix experts of different original groups (devices/nodes),
which is not the original routing either, and is no closer to it than plain top-k.

What vLLM runs for these configs (read in vllm-project/vllm: models/deepseek_v2.py and
layers/fused_moe/config.py @ 002d6073, fused_moe/router/router_factory.py @ 033da35c,
fused_moe/router/grouped_topk_router.py @ 055e47c2, csrc/moe/grouped_topk_kernels.cu @ e35e4874). Both configs the
export writes run correctly, the n_group = 1 fallback for any kept count k >= 2; tests/prune/test_export.py pins
the fallback for 200 kept experts (one group of 200):

* `DeepseekV2MoE` (V2 and V3) always builds FusedMoE with `use_grouped_topk=True`, `num_expert_group=n_group`,
  `topk_group=topk_group`. `create_fused_moe_router` keeps `GroupedTopKRouter` when `get_routing_method_type`
  names the layer (sigmoid + `e_score_correction_bias` + renormalize -> DeepSeekV3: `num_expert_group` 1 > 0) or
  when n_group / topk_group > 1, else it falls back to `FusedTopKBiasRouter` / `FusedTopKRouter` (plain top-k).
* `GroupedTopKRouter._compute_routing`: `valid_grouping()` (E > n_group, E % n_group == 0) holds for k >= 2, so
  `grouped_topk` runs. On CUDA with a correction bias (`VLLM_USE_FUSED_MOE_GROUPED_TOPK`, n_group <= 32,
  top_k <= 32) that is the fused `ops.grouped_topk`, else the torch code (group score = top-2 sum over
  `view(T, n_group, -1)`, top `topk_group` groups, mask, top-k): any group size >= 2, and with one group the mask
  keeps every expert, i.e. plain top-k.
* The fused kernel (`grouped_topk` in grouped_topk_kernels.cu) checks only E % n_group == 0, n_group <= 32 and
  top_k <= 32. It has no limit on experts per group: `topk_with_k2` walks a group with a lane stride of 32 keeping
  a per-lane top-2 and reduces over the warp, and `group_idx_and_topk_idx_kernel` streams every expert of the
  chosen groups through a `WarpSelect` of capacity 32 (a bound on top_k, not on the group). One group of k experts
  is chosen whenever its score is finite and the kernel returns the top-k biased scores: plain top-k.
* "<= 32 experts per group" limits exist elsewhere and do not bite here. vLLM PR #34206 (description read) sends
  small configs (one group with E <= 512, or several with E <= 256) to `grouped_topk_fused_small_expert_count_kernel`
  and the rest to the kernel above: a dispatch, not an error. FlashInfer's TRT-LLM-gen DeepSeek routing (vLLM's
  monolithic FP8 / NVFP4 MoE on Blackwell; flashinfer csrc/fused_moe/trtllm_backend/
  trtllm_fused_moe_routing_deepseek.cu, `run`) refuses more than 32 experts per group only when n_group > 1: a
  kept n_group has m <= E / n_group of the original model, so the export adds no violation the original did not
  have, and one group takes the kernel's non-grouped top-k path.
* Not about groups, for deployment: FlashInfer's TRT-LLM MoE launchers also want E % 4 == 0, E > top_k and
  top_k < topk_group * E / n_group (strict: a kept n_group with m * topk_group == top_k, exact in transformers and
  vLLM's grouped_topk, is refused there), and ROCm AITER's `moe_fused_gate` refuses more than 32 experts per group
  at large token counts (as for stock one-group models such as GLM-5; ROCm/aiter#2369). Pick k accordingly, or
  another MoE backend, when serving on those.

`drop` models keep the original router and config; the compact experts are written with their compact
ids and `expert_map.pt` goes beside the checkpoint (`torchforge.load_quantized` restores PrunedMoE(drop)).
"""
from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

from torchforge.export.naming import checkpoint_state
from torchforge.nn.pruned_moe import PrunedMoE
from torchforge.nn.routing import router_family, router_groups
from torchforge.prune.apply import moe_blocks, pruned_blocks
from torchforge.prune.expert_map import EXPERT_MAP_FILE, load_expert_map, save_expert_map

log = logging.getLogger(__name__)

__all__ = ["pruned_config_changes", "apply_pruned_config", "pruned_state_dict", "export_pruned", "save_pruned",
           "restore_pruned"]

_EXPERT_COUNT_NAMES = ("num_local_experts", "num_experts", "n_routed_experts")


def _mode(model: nn.Module) -> str | None:
    blocks = pruned_blocks(model)
    if not blocks:
        return None
    modes = {b.mode for _, b in blocks}
    if len(modes) != 1:
        raise ValueError(f"pruned export: the model mixes PrunedMoE modes {sorted(modes)}; prune it with one mode")
    if len(blocks) != len(moe_blocks(model)):
        raise ValueError("pruned export: some MoE blocks are pruned and others are not; prune all of them with "
                         "torchforge.prune_experts (an identity row keeps every expert)")
    return modes.pop()


def _expert_count_key(config) -> str:
    attribute_map = getattr(type(config), "attribute_map", {}) or {}
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for name in _EXPERT_COUNT_NAMES:
        key = attribute_map.get(name, name)
        if d.get(key) is not None:
            return key
    raise ValueError(f"pruned export: {type(config).__name__} has none of {_EXPERT_COUNT_NAMES}; cannot write the "
                     "expert count")


def _group_plan(blocks: list[tuple[str, PrunedMoE]]) -> tuple[bool, str]:
    """(keep n_group?, reason) for group-limited routers; see the module docstring."""
    gate = blocks[0][1].gate
    n_group, topk_group = router_groups(gate)
    top_k, v3 = gate.top_k, router_family(gate) == "deepseek_v3"
    counts = {tuple(b.kept.group_counts) for _, b in blocks}
    ms = {m for c in counts for m in c}
    if len(ms) != 1:
        return False, (f"groups keep unequal expert counts {sorted(counts)[:4]}; n_group {n_group} -> 1, topk_group "
                       f"{topk_group} -> 1 (routing is no longer group-limited)")
    m = ms.pop()
    if v3 and m < 2:
        return False, (f"each group keeps {m} expert, DeepSeek-V3 scores a group by its top-2; n_group {n_group} -> 1, "
                       f"topk_group {topk_group} -> 1")
    if m * topk_group < top_k:
        return False, (f"topk_group={topk_group} groups of {m} kept experts cannot supply top_k={top_k}; n_group "
                       f"{n_group} -> 1, topk_group {topk_group} -> 1")
    return True, f"preserved: n_group={n_group}, topk_group={topk_group}, {m} experts per group"


def pruned_config_changes(model: nn.Module) -> dict:
    """Config keys a reroute-pruned model's export changes ({} for an unpruned or drop model)."""
    if _mode(model) != "reroute":
        return {}
    blocks = pruned_blocks(model)
    ks = {b.num_kept for _, b in blocks}
    if len(ks) != 1:
        raise ValueError(f"pruned export: layers keep different expert counts {sorted(ks)} but an HF config has one "
                         "routed-expert count; build the map with one keep_k for every layer, or use mode='drop' "
                         "(expert_map.pt at run time)")
    kept = ks.pop()
    if kept < 2 and router_family(blocks[0][1].gate) == "deepseek_v3":
        # HF's and vLLM's DeepSeek-V3 routers take topk(2) per group even with n_group = 1: one expert cannot run
        raise ValueError("pruned export: every layer keeps 1 routed expert, but DeepSeek-V3's router scores a group "
                         "by its top-2 experts, so the exported checkpoint could not run in transformers or vLLM; "
                         "keep at least 2 experts per layer, or use mode='drop' (expert_map.pt at run time)")
    changes = {_expert_count_key(model.config): kept}
    n_group, _ = router_groups(blocks[0][1].gate)
    if n_group and n_group > 1:
        keep, _ = _group_plan(blocks)
        if not keep:
            changes.update(n_group=1, topk_group=1)
    return changes


def check_pruned_export(model: nn.Module) -> None:
    """Raises, before an export writes anything, where a pruned model's checkpoint cannot be written (layers keeping
    different expert counts in reroute mode, ...): every save path calls it ahead of `begin_folder`, which removes
    the folder's config.json, so a refused export leaves an earlier checkpoint there intact."""
    pruned_config_changes(model)


def apply_pruned_config(cfg, model: nn.Module):
    """Applies `pruned_config_changes(model)` to a config dict (or config object); returns it."""
    changes = pruned_config_changes(model)
    if changes.get("n_group") == 1:
        _, reason = _group_plan(pruned_blocks(model))
        log.warning("pruned export: group-limited routing changed: %s. The checkpoint routes differently from the "
                    "in-memory PrunedMoE(reroute); keep the same number (>= 2) of experts in every group to avoid it",
                    reason)
    for key, value in changes.items():
        if isinstance(cfg, dict):
            cfg[key] = value
        else:
            setattr(cfg, key, value)
    return cfg


@torch.no_grad()
def pruned_state_dict(model: nn.Module, state: dict) -> dict:
    """Checkpoint tensors of a reroute model in the standard smaller layout: router rows and
    `e_score_correction_bias` sliced to the kept experts (ascending original id, the order PrunedMoE(reroute)
    stores its experts in, so the expert tensors need no change). Drop and unpruned models: `state` unchanged.
    Takes `export_state_dict`'s output or a plain state dict."""
    if _mode(model) != "reroute":
        return state
    state = dict(state)
    for name, block in pruned_blocks(model):
        p = f"{name}." if name else ""
        kept_original = block.kept_original_ids()  # ascending
        E = block.num_original_experts
        for key in [k_ for k_ in state if k_.startswith(f"{p}gate.")]:
            t = state[key]
            if t.dim() >= 1 and t.shape[0] == E:  # router rows, e_score_correction_bias
                state[key] = t.index_select(0, kept_original.to(t.device)).contiguous()
    return state


def _prune_meta(model: nn.Module) -> dict | None:
    mode = _mode(model)
    if mode is None:
        return None
    blocks = pruned_blocks(model)
    b0 = blocks[0][1]
    meta = {"mode": mode, "num_original_experts": b0.num_original_experts,
            "num_kept": [b.num_kept for _, b in blocks]}
    if mode == "drop":
        meta["renormalize"] = b0.renormalize
        meta["expert_map"] = EXPERT_MAP_FILE
    else:
        # exported expert j of layer l = original expert kept_original_ids[l][j]
        meta["kept_original_ids"] = [b.kept_original_ids().tolist() for _, b in blocks]
        n_group, _ = router_groups(b0.gate)
        if n_group and n_group > 1:
            meta["group_routing"] = _group_plan(blocks)[1]
    return meta


def _expert_map(model: nn.Module) -> torch.Tensor:
    return torch.stack([b._row_host for _, b in pruned_blocks(model)])


def export_pruned(model: nn.Module, state: dict, out_dir: str) -> tuple[dict, dict | None]:
    """The pruning step of an export (called by `save_quantized`): returns (state for the checkpoint, metadata
    for torchforge.json or None). Writes `expert_map.pt` into `out_dir` for drop models. The caller applies
    `apply_pruned_config` to config.json."""
    meta = _prune_meta(model)
    if meta is None:
        return state, None
    if meta["mode"] == "drop":
        save_expert_map(_expert_map(model), out_dir)
    return pruned_state_dict(model, state), meta


def prune_for_save(model: nn.Module, state: dict, out_dir: str, meta: dict):
    """The pruning step every `save_quantized` format shares: returns (checkpoint state, config.json editor) and
    records the pruning in `meta` (torchforge.json). No-op for unpruned models."""
    state, prune_meta = export_pruned(model, state, out_dir)
    if prune_meta is not None:
        meta["prune"] = prune_meta
    return state, lambda cfg: apply_pruned_config(cfg, model)


def save_pruned(model: nn.Module, out_dir: str, *, dtype: torch.dtype | None = None,
                max_shard_bytes: int = 5 * 2**30, tokenizer=None, source_dir=None) -> str:
    """Writes an UNQUANTIZED reroute-pruned model as a standard HF checkpoint folder (per-expert tensor names,
    smaller config, tokenizer files and generation_config.json as save_quantized writes them) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads. Quantized models: use `torchforge.save_quantized`.
    `dtype`: the floating dtype written (default: the model's)."""
    from torchforge.export.folder import begin_folder, refuse_source_folder, tokenizer_source, write_side_files
    from torchforge.export.vllm_awq import _quantized_modules, export_state_dict
    from torchforge.io import atomic_write_json, save_sharded

    mode = _mode(model)
    if mode != "reroute":
        raise ValueError(f"save_pruned: writes reroute-pruned models (this one is {mode or 'not pruned'}); drop models "
                         "need the expert map at run time: quantize them and use torchforge.save_quantized")
    if _quantized_modules(model):
        raise ValueError("save_pruned: the model has quantized modules; use torchforge.save_quantized")
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    check_pruned_export(model)
    state, meta = export_pruned(model, export_state_dict(model, dtype), out_dir)
    refuse_source_folder(model, out_dir)
    begin_folder(out_dir, tokenizer_source(model, source_dir), tokenizer=tokenizer)  # no config.json before the tensors
    save_sharded(checkpoint_state(state, model), out_dir, max_shard_bytes=max_shard_bytes, metadata={"torchforge": "pruned"})
    cfg = apply_pruned_config(model.config.to_dict(), model)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    # generation_config.json too: begin_folder removed an earlier one, and from_pretrained reads it (eos, sampling)
    write_side_files(model, out_dir, {"format": "hf", "prune": meta}, tokenizer=tokenizer, source_dir=source_dir)
    atomic_write_json(os.path.join(out_dir, "config.json"), cfg)  # last: a folder with config.json is complete
    return out_dir


def restore_pruned(model: nn.Module, path: str) -> nn.Module:
    """For `load_quantized`: when `path` holds a drop-pruned checkpoint (expert_map.pt + torchforge.json
    prune.mode == "drop"), swaps the skeleton's MoE blocks (meta tensors are fine) for PrunedMoE(drop)."""
    map_path = os.path.join(path, EXPERT_MAP_FILE)
    meta_path = os.path.join(path, "torchforge.json")
    if not os.path.isfile(map_path):
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                prune = json.load(f).get("prune") or {}
            if prune.get("mode") == "drop":  # else its compact experts load as experts 0..k-1 of the full router
                from torchforge.io import CheckpointError

                raise CheckpointError(f"load_quantized: {path}/torchforge.json describes a drop-pruned checkpoint but "
                                      f"{EXPERT_MAP_FILE} is missing beside it; copy it back from the export (it maps "
                                      "the router's experts onto the checkpoint's kept ones)")
        return model
    meta = {"mode": "drop"}  # a bare expert_map.pt (no torchforge.json) is a drop checkpoint
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f).get("prune") or {}
    if meta.get("mode") != "drop":
        log.warning("load: ignoring %s: torchforge.json does not describe a drop-pruned checkpoint", map_path)
        return model
    from torchforge.prune.apply import prune_experts

    return prune_experts(model, load_expert_map(path), mode="drop", renormalize=bool(meta.get("renormalize", False)))
