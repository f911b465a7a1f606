"""NVFP4 checkpoints: NVIDIA ModelOpt's layout (`format="modelopt-nvfp4"`) and compressed-tensors'
`nvfp4-pack-quantized` (`format="compressed-tensors"`), written so that vLLM loads them as they are, and read
back by `torchforge.load_quantized` into NVFP4MoE / NVFP4Experts / NVFP4Linear with identical outputs.

Per quantized linear `{name}` (per routed expert: `{experts}.{e}.{gate_proj|up_proj|down_proj}`):

| ModelOpt (vLLM `ModelOptNvFp4Config`) | compressed-tensors (vLLM `CompressedTensorsW4A4Fp4`) | dtype, shape          |
|---------------------------------------|-----------------------------------------------------|-----------------------|
| `weight`                              | `weight_packed`                                     | uint8 `[N, K/2]`      |
| `weight_scale`                        | `weight_scale`                                      | F8_E4M3 `[N, K/16]`   |
| `weight_scale_2` (amax / 2688)        | `weight_global_scale` = 1 / weight_scale_2          | F32 `[]` / `[1]`      |
| `input_scale` (amax / 2688)           | `input_global_scale` = 1 / input_scale              | F32 `[]` / `[1]`      |

(compressed-tensors' own ModelOpt converter, `entrypoints/convert/converters/modelopt_nvfp4.py`, maps the
names the same way.) `input_scale` is written only when every NVFP4 layer has a calibrated one (W4A4:
quant_algo `NVFP4` / scheme NVFP4); otherwise the checkpoint is weight-only (`W4A16_NVFP4` / NVFP4A16).

Config: ModelOpt writes `hf_quant_config.json` = `{producer, quantization: {quant_algo, kv_cache_quant_algo,
group_size, exclude_modules}}` and embeds in config.json the compressed-tensors-style form of its exporter
(`convert_hf_quant_config_format`: `config_groups`, `ignore`, `quant_algo`, `quant_method: modelopt`); vLLM
reads config.json's `quantization_config` first and, in that flat form, takes the excluded modules from
`ignore`, so both keys are written (plus `group_size`, `kv_cache_quant_algo`, `exclude_modules`).
vLLM skips a layer when an excluded name is a substring of its prefix; export refuses an exclude list that
would hit a quantized layer.

Gate and up of one expert share `weight_scale_2` (vLLM's fused MoE keeps `w13_weight_scale_2[:, 0]` only).
A checkpoint from elsewhere whose gate and up global scales differ is repaired at load: the projection with
the smaller scale is dequantized exactly and re-quantized under the larger one (its bytes change, the other
projection's do not; both projections keep their values up to that one re-rounding), and a warning says how
many experts were repaired. vLLM itself keeps the gate's scale for both (`w13_weight_scale_2[:, 0]`, with a warning
where they differ), which misreads the up projection of such a checkpoint.

compressed-tensors stores reciprocals, and an fp32 reciprocal does not round-trip for about 1 value in 6, so
`torchforge.json` keeps the exact `weight_scale_2` / `input_scale` of every layer it wrote; the loader uses them
when they are consistent with the stored reciprocal (a foreign checkpoint falls back to 1 / global_scale).
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict

import torch
from torch import nn

from torchforge.export.folder import hf_experts_tensors, keep_fp32
from torchforge.export.naming import (EXPERT_KEY, checkpoint_state, iter_memory_named, per_expert_ignore_pattern,
                                      memory_names,
                                      module_names_for_config, skip_list_clash, vllm_names)
from torchforge.io import CheckpointError, atomic_write_json, save_sharded
from torchforge.matching import is_fused_experts
from torchforge.nn.moe import ForgeMoE
from torchforge.nn.nvfp4_experts import NVFP4Experts
from torchforge.nn.nvfp4_linear import NVFP4Linear
from torchforge.nn.nvfp4_moe import NVFP4MoE
from torchforge.ops import nvfp4_dequantize, nvfp4_quantize

log = logging.getLogger(__name__)

NVFP4_FORMATS = ("modelopt-nvfp4", "compressed-tensors")
CT_FORMAT = "nvfp4-pack-quantized"
EXACT_KEY = "nvfp4_exact_scales"
_PROJ = ("gate_proj", "up_proj", "down_proj")


def has_nvfp4(model: nn.Module) -> bool:
    return any(isinstance(m, (NVFP4Linear, NVFP4Experts)) for m in model.modules())


def _nvfp4_modules(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (NVFP4Linear, NVFP4Experts))]


def _w4a4(model: nn.Module) -> bool:
    return all(m.calibrated for _, m in _nvfp4_modules(model))


# ------------------------------------------------------------------------------------------- tensors
def _linear_tensors(prefix: str, packed, scale, ws2, ins, fmt: str, exact: dict) -> dict:
    """The checkpoint tensors of one NVFP4 linear (ws2, ins: fp32 scalars; ins None = weight-only)."""
    ws2 = ws2.reshape(()).float()
    if fmt == "modelopt-nvfp4":
        out = {f"{prefix}.weight": packed, f"{prefix}.weight_scale": scale, f"{prefix}.weight_scale_2": ws2.clone()}
        if ins is not None:
            out[f"{prefix}.input_scale"] = ins.reshape(()).float().clone()
        return out
    out = {f"{prefix}.weight_packed": packed, f"{prefix}.weight_scale": scale,
           f"{prefix}.weight_global_scale": (1.0 / ws2).reshape(1)}
    exact[f"{prefix}.weight_global_scale"] = float(ws2)
    if ins is not None:
        ins = ins.reshape(()).float()
        out[f"{prefix}.input_global_scale"] = (1.0 / ins).reshape(1)
        exact[f"{prefix}.input_global_scale"] = float(ins)
    return out


@torch.no_grad()
def nvfp4_state_dict(model: nn.Module, fmt: str, dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """(checkpoint tensors, exact scales for torchforge.json)."""
    w4a4 = _w4a4(model)
    out: dict[str, torch.Tensor] = {}
    exact: dict[str, float] = {}
    skip_prefixes = []
    for name, mod in model.named_modules():
        if isinstance(mod, NVFP4Linear):
            skip_prefixes.append(name + ".")
            out.update(_linear_tensors(name, mod.weight, mod.weight_scale, mod.weight_scale_2,
                                       mod.input_scale if w4a4 else None, fmt, exact))
            if mod.bias is not None:
                out[f"{name}.bias"] = mod.bias.to(dtype)
        elif isinstance(mod, NVFP4Experts):
            skip_prefixes.append(name + ".")
            I = mod.intermediate_size
            for e in range(mod.num_experts):
                p = f"{name}.{e}"
                gu_in = mod.gate_up_input_scale[e] if w4a4 else None
                for proj, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
                    out.update(_linear_tensors(f"{p}.{proj}", mod.gate_up_weight[e, rows], mod.gate_up_weight_scale[e, rows],
                                               mod.gate_up_weight_scale_2[e], gu_in, fmt, exact))
                out.update(_linear_tensors(f"{p}.down_proj", mod.down_weight[e], mod.down_weight_scale[e],
                                           mod.down_weight_scale_2[e], mod.down_input_scale[e] if w4a4 else None,
                                           fmt, exact))
        elif is_fused_experts(mod):  # unquantized HF experts: per-expert bf16 weights, as vLLM expects
            skip_prefixes.append(name + ".")
            out.update(hf_experts_tensors(name, mod, dtype))
    fp32_keys = keep_fp32(model)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for key, t in model.state_dict().items():
        if any(key.startswith(p) for p in skip_prefixes) or (tied and key == "lm_head.weight"):
            continue
        if t.is_floating_point():
            t = t.float() if any(k in key for k in fp32_keys) else t.to(dtype)
        out[key] = t
    return {k: v.contiguous() for k, v in out.items()}, exact


# ------------------------------------------------------------------------------------------- config
def exclude_modules(model: nn.Module) -> list[str]:
    """Unquantized Linear layers, MoE routers and unquantized fused experts, by full module name (checkpoint naming,
    as vLLM names its modules)."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) or is_fused_experts(mod):
            out.append(name)
        elif isinstance(mod, ForgeMoE) or (hasattr(mod, "gate") and hasattr(mod, "experts")):
            gate = getattr(mod, "gate", None)
            if isinstance(gate, nn.Module) and not isinstance(gate, nn.Linear):  # transformers 5 routers
                out.append(f"{name}.gate")
    quantized = set()
    for n, m in _nvfp4_modules(model):
        quantized |= vllm_names(n) | ({f"{n}.{e}.{p}" for e in range(m.num_experts) for p in _PROJ}
                                      if isinstance(m, NVFP4Experts) else set())
    clash = skip_list_clash(out, quantized)
    if clash is not None:
        s, hit = clash
        raise ValueError(f"NVFP4 export: unquantized module {s!r} is a substring of quantized {hit!r}; vLLM would "
                         "skip both. Quantize both or neither (fused parts must match).")
    return sorted(set(module_names_for_config(out, model)))


def _weights_args() -> dict:
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
            "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}


def compressed_tensors_config(model: nn.Module) -> dict:
    """config.json `quantization_config` for `nvfp4-pack-quantized` (compressed-tensors' NVFP4 / NVFP4A16 presets)."""
    group = {"targets": ["Linear"], "weights": _weights_args(), "input_activations": None, "output_activations": None,
             "format": CT_FORMAT}
    if _w4a4(model):
        group["input_activations"] = {**_weights_args(), "dynamic": "local", "observer": "static_minmax"}
    return {"config_groups": {"group_0": group}, "quant_method": "compressed-tensors", "kv_cache_scheme": None,
            "format": CT_FORMAT, "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": sorted(set(exclude_modules(model)) | {per_expert_ignore_pattern(n, model)
                                                             for n, m in model.named_modules() if is_fused_experts(m)})}


def modelopt_configs(model: nn.Module) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json `quantization_config`)."""
    from torchforge import __version__

    algo = "NVFP4" if _w4a4(model) else "W4A16_NVFP4"
    exclude = exclude_modules(model)
    producer = {"name": "torchforge", "version": __version__}
    hf_quant = {"producer": producer, "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                                        "group_size": 16, "exclude_modules": exclude}}
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"weights": weights, "targets": ["Linear"]}
    if algo == "NVFP4":
        group = {"input_activations": dict(weights), **group}
    cfg = {"config_groups": {"group_0": group}, "ignore": exclude, "quant_algo": algo, "producer": producer,
           "quant_method": "modelopt", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": exclude}
    return hf_quant, cfg


def _refuse_quantized_head(model: nn.Module) -> None:
    """vLLM's compressed-tensors config quantizes LinearBase layers only (compressed_tensors.py get_quant_method;
    ParallelLMHead is a VocabParallelEmbedding), so it builds a quantized output head unquantized and the load fails on
    its packed tensors. Its ModelOpt config takes ParallelLMHead too (modelopt.py ModelOptQuantConfigBase
    get_quant_method), so modelopt-nvfp4 can hold one."""
    from torchforge.export.gptq_export import output_head_name

    head = output_head_name(model)
    if head is not None and any(n == head for n, _ in _nvfp4_modules(model)):
        raise ValueError(f"save_quantized(compressed-tensors): the output head {head!r} is NVFP4-quantized, and vLLM "
                         f"builds it unquantized from a compressed-tensors checkpoint (the load fails on {head}'s "
                         f"packed tensors). Add {head!r} to the recipe's ignore list (torchforge's default ignore has "
                         "it), or export as 'modelopt-nvfp4', whose vLLM config quantizes the head")


def _note_flashinfer_expert_count(model: nn.Module) -> None:
    """A reroute-pruned NVFP4 checkpoint that vLLM's FlashInfer TRT-LLM MoE kernels (its NVFP4 / FP8 MoE backend on
    Blackwell) would refuse: their launchers want a routed-expert count E that is a multiple of 4, E > top_k, and
    top_k < topk_group * E / n_group, strictly (flashinfer's csrc/fused_moe/trtllm_backend, see
    torchforge/prune/export.py). Pruning can break each of these where the original model met them (DeepSeek-V3 keeping
    2 of 32 experts per group: 4 x 16 / 8 = 8 = top_k). Other MoE backends run such a checkpoint, so this is a
    warning, not an error."""
    from torchforge.prune.export import _expert_count_key, pruned_config_changes

    changes = pruned_config_changes(model)  # {} unless reroute-pruned
    if not changes:
        return
    cfg = model.config
    kept = changes[_expert_count_key(cfg)]
    n_group = changes.get("n_group", getattr(cfg, "n_group", None) or 1)
    topk_group = changes.get("topk_group", getattr(cfg, "topk_group", None) or 1)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    problems = []
    if kept % 4:
        problems.append(f"{kept} routed experts per layer is not a multiple of 4")
    if top_k is not None and kept <= top_k:
        problems.append(f"{kept} routed experts is not more than top_k = {top_k}")
    elif top_k is not None and top_k * n_group >= topk_group * kept:  # top_k < topk_group * E / n_group, in integers
        problems.append(f"top_k = {top_k} is not below topk_group x experts / n_group = {topk_group} x {kept} / "
                        f"{n_group}")
    if problems:
        log.warning("NVFP4 export: vLLM's FlashInfer TRT-LLM MoE kernels (NVFP4 on Blackwell) refuse this "
                    "reroute-pruned checkpoint: %s; serve it with another MoE backend, or keep more experts (a "
                    "multiple of 4)", "; ".join(problems))


def save_nvfp4_checkpoint(model: nn.Module, out_dir: str, format: str, *, tokenizer=None, source_dir=None,
                          max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None) -> str:
    """`save_quantized` for NVFP4 models: tensors, hf_quant_config.json (ModelOpt), torchforge.json, tokenizer
    files, config.json last (a folder with config.json is complete)."""
    from torchforge.export.folder import begin_folder, refuse_source_folder, finish_folder, tokenizer_source
    from torchforge.quantize import RECIPE_ATTR

    if format not in NVFP4_FORMATS:
        raise ValueError(f"save_quantized: the model is NVFP4-quantized; format {format!r} cannot hold it, use one of "
                         f"{NVFP4_FORMATS}")
    if not has_nvfp4(model):
        raise ValueError(f"save_quantized: format {format!r} needs NVFP4 modules; quantize with scheme 'nvfp4' first")
    recipe = getattr(model, RECIPE_ATTR, None)
    if dtype is None:
        dtype = getattr(torch, recipe.dtype) if recipe is not None else torch.bfloat16
    if format == "modelopt-nvfp4":
        hf_quant, qcfg = modelopt_configs(model)
    else:
        _refuse_quantized_head(model)
        hf_quant, qcfg = None, compressed_tensors_config(model)
    from torchforge.prune.export import check_pruned_export, prune_for_save

    check_pruned_export(model)
    _note_flashinfer_expert_count(model)
    refuse_source_folder(model, out_dir)
    begin_folder(out_dir, tokenizer_source(model, source_dir), tokenizer=tokenizer)  # no config.json before the tensors

    state, exact = nvfp4_state_dict(model, format, dtype)
    meta = {"format": format, "recipe": recipe.to_dict() if recipe is not None else None, "w4a4": _w4a4(model)}
    if exact:
        meta[EXACT_KEY] = exact
    state, edit_config = prune_for_save(model, state, out_dir, meta)  # pruned MoE: as for every format
    save_sharded(checkpoint_state(state, model), out_dir, max_shard_bytes=max_shard_bytes,
                 metadata={"format": "pt", "torchforge": format})
    if hf_quant is not None:
        atomic_write_json(os.path.join(out_dir, "hf_quant_config.json"), hf_quant)
    return finish_folder(model, out_dir, qcfg, dtype, meta, tokenizer=tokenizer, source_dir=source_dir,
                         edit_config=edit_config)


# --------------------------------------------------------------------------------------------- load
def is_nvfp4_config(qcfg: dict) -> bool:
    method = str(qcfg.get("quant_method", "")).lower()
    if method.startswith("modelopt"):
        algo = str(qcfg.get("quant_algo") or (qcfg.get("quantization") or {}).get("quant_algo") or "").upper()
        return "NVFP4" in algo
    if method == "compressed-tensors":
        groups = qcfg.get("config_groups") or {}
        return qcfg.get("format") == CT_FORMAT or any(g.get("format") == CT_FORMAT for g in groups.values())
    return False


def _swap_nvfp4_modules(model: nn.Module, names: set[str], ct: bool) -> None:
    marker = "weight_packed" if ct else "weight_scale"
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and f"{name}.{marker}" in names:
            model.set_submodule(name, NVFP4Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                                  device="meta", dtype=mod.weight.dtype))
        elif is_fused_experts(mod) and f"{name}.0.gate_proj.{marker}" in names:
            E, two_i, H = mod.gate_up_proj.shape
            experts = NVFP4Experts(E, H, two_i // 2, act_fn=mod.act_fn, device="meta")
            block_name = name.rsplit(".", 1)[0]
            model.set_submodule(block_name, NVFP4MoE.from_hf(model.get_submodule(block_name), experts))


def _scale(parts: dict, key: str, ct: bool, exact: dict, full_name: str) -> torch.Tensor | None:
    """fp32 scalar weight_scale_2 / input_scale from ModelOpt's value or compressed-tensors' reciprocal."""
    ct_key = {"weight_scale_2": "weight_global_scale", "input_scale": "input_global_scale"}[key]
    if not ct:
        t = parts.get(key)
        return None if t is None else t.float().reshape(())
    t = parts.get(ct_key)
    if t is None:
        return None
    gs = t.float().reshape(())
    v = exact.get(f"{full_name}.{ct_key}")
    if v is not None:
        cand = torch.tensor(v, dtype=torch.float32)
        if torch.equal(1.0 / cand, gs):  # the exact value this reciprocal was written from
            return cand
    return 1.0 / gs


def _linear_parts(parts: dict, ct: bool, exact: dict, full_name: str) -> tuple:
    """(packed, block scales, weight_scale_2) of one NVFP4 linear; a missing tensor is named (it failed as a KeyError
    or a TypeError in torch.equal)."""
    names = ("weight_packed", "weight_scale", "weight_global_scale") if ct else \
        ("weight", "weight_scale", "weight_scale_2")
    missing = [n for n in names if n not in parts]
    if missing:
        raise CheckpointError(f"load_quantized: {full_name} has no {', '.join(missing)} in the checkpoint (an NVFP4 "
                              f"layer needs {', '.join(names)}); the checkpoint is incomplete, export it again")
    return parts[names[0]], parts["weight_scale"], _scale(parts, "weight_scale_2", ct, exact, full_name)


def _shared_gate_up(e: int, gate: tuple, up: tuple, module_name: str, repaired: list) -> tuple:
    """(packed, scales, ws2) of the fused [2I, ...] gate_up of one expert under ONE global scale."""
    (gp, gsc, gg), (up_, usc, ug) = gate, up
    if not torch.equal(gg, ug):
        # Repair: re-quantize the projection with the smaller global scale under the larger one.
        g = torch.maximum(gg, ug)
        if gg < g:
            gp, gsc, _ = nvfp4_quantize(nvfp4_dequantize(gp, gsc, gg), g)
        else:
            up_, usc, _ = nvfp4_quantize(nvfp4_dequantize(up_, usc, ug), g)
        gg = g
        repaired.append(f"{module_name}.{e}")
    return torch.cat([gp, up_], 0), torch.cat([gsc, usc], 0), gg


def load_nvfp4_state(model: nn.Module, path: str, ct: bool, exact: dict) -> dict:
    """The state dict of `model` (NVFP4 modules already swapped in) from the checkpoint tensors."""
    from torchforge.export.load import _stack_experts, check_expert_ids

    nv_linear = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    nv_experts = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Experts)}
    state, per_linear, per_expert, hf_experts = {}, defaultdict(dict), defaultdict(dict), defaultdict(dict)
    for key, t in iter_memory_named(path, model):
        m = EXPERT_KEY.match(key)
        if m and m["module"] in nv_experts:
            per_expert[m["module"]][(int(m["e"]), m["proj"], m["kind"])] = t
            continue
        if m:
            hf_experts[m["module"]][(int(m["e"]), m["proj"], m["kind"])] = t
            continue
        mod_name, _, kind = key.rpartition(".")
        if mod_name in nv_linear and kind != "bias":
            per_linear[mod_name][kind] = t
        else:
            state[key] = t
    for name, parts in per_linear.items():
        packed, scale, ws2 = _linear_parts(parts, ct, exact, name)
        ins = _scale(parts, "input_scale", ct, exact, name)
        state.update({f"{name}.weight": packed, f"{name}.weight_scale": scale, f"{name}.weight_scale_2": ws2,
                      f"{name}.input_scale": torch.zeros(()) if ins is None else ins})
    repaired: list[str] = []
    for name, mod in nv_experts.items():
        parts = per_expert.get(name, {})
        check_expert_ids(name, mod.num_experts, {e for e, *_ in parts})
        cols = defaultdict(list)
        for e in range(mod.num_experts):
            proj = {}
            for p in _PROJ:
                sub = {kind: t for (ee, pp, kind), t in parts.items() if ee == e and pp == p}
                if not sub:
                    raise CheckpointError(f"load_quantized: {name}.{e}.{p} is missing from the checkpoint")
                full = f"{name}.{e}.{p}"
                proj[p] = (*_linear_parts(sub, ct, exact, full), _scale(sub, "input_scale", ct, exact, full))
            gp, gs, gg = _shared_gate_up(e, proj["gate_proj"][:3], proj["up_proj"][:3], name, repaired)
            ins = [proj[p][3] for p in ("gate_proj", "up_proj") if proj[p][3] is not None]
            cols["gate_up_weight"].append(gp)
            cols["gate_up_weight_scale"].append(gs)
            cols["gate_up_weight_scale_2"].append(gg)
            cols["gate_up_input_scale"].append(torch.stack(ins).max() if ins else torch.zeros(()))
            dp, ds, dg, di = proj["down_proj"]
            cols["down_weight"].append(dp)
            cols["down_weight_scale"].append(ds)
            cols["down_weight_scale_2"].append(dg)
            cols["down_input_scale"].append(torch.zeros(()) if di is None else di)
        for buf, ts in cols.items():
            state[f"{name}.{buf}"] = torch.stack(ts)
    if repaired:
        log.warning("load_quantized: %d experts had different gate/up global scales (e.g. %s); re-quantized the "
                    "projection with the smaller one under the larger (one shared weight_scale_2, as vLLM computes)",
                    len(repaired), repaired[0])
    state.update(_stack_experts(model, hf_experts))
    return state


def load_nvfp4(model: nn.Module, path: str, qcfg: dict, device) -> nn.Module:
    """`load_quantized` for NVFP4 checkpoints: `model` is the meta skeleton built from config.json."""
    import json

    from torchforge.export.load import finish_load
    from torchforge.export.folder import TORCHFORGE_META

    ct = str(qcfg.get("quant_method", "")).lower() == "compressed-tensors"
    group_size = qcfg.get("group_size", (qcfg.get("quantization") or {}).get("group_size"))
    if not ct and group_size not in (None, 16):
        raise CheckpointError(f"load_quantized: {path}: NVFP4 with group_size={group_size!r}; the format has blocks "
                              "of 16 only")
    _swap_nvfp4_modules(model, set(memory_names(path, model)), ct)
    exact = {}
    meta_path = os.path.join(path, TORCHFORGE_META)
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            exact = json.load(f).get(EXACT_KEY) or {}
    from torchforge.prune.export import restore_pruned

    model = restore_pruned(model, path)  # drop-pruned checkpoints: PrunedMoE(drop) over the kept experts
    model.to_empty(device=device)
    state = load_nvfp4_state(model, path, ct, exact)
    return finish_load(model, state, device)
