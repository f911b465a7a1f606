"""Export to an HF-style folder that vLLM's AWQ loader reads as is (`format="vllm-awq"`)."""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from torchforge.export.folder import (begin_folder, finish_folder, hf_experts_tensors, keep_fp32,
                                      refuse_source_folder, tokenizer_source)
from torchforge.export.naming import checkpoint_state, module_names_for_config, skip_list_clash, vllm_names
from torchforge.io import save_sharded
from torchforge.matching import is_fused_experts
from torchforge.nn.awq_experts import ForgeAWQExperts
from torchforge.nn.awq_linear import ForgeAWQLinear

FORMATS = ("vllm-awq",)


def _quantized_modules(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (ForgeAWQLinear, ForgeAWQExperts))]


@torch.no_grad()
def export_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16,
                      fp16_scales: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint tensors: AWQ buffers as stored, per-expert names, everything else in `dtype`. `fp16_scales`:
    AWQ's fp16 scales (exact, else refused); False keeps their dtype (for a caller that writes its own)."""
    out: dict[str, torch.Tensor] = {}
    expert_prefixes = []
    for name, mod in model.named_modules():
        if isinstance(mod, ForgeAWQExperts):
            expert_prefixes.append(name + ".")
            I8, I = mod.intermediate_size // 8, mod.intermediate_size
            gate_up_qweight, down_qweight = mod.awq_qweights()  # AWQ layout even when the module runs on mma
            for e in range(mod.num_experts):
                p = f"{name}.{e}"
                # gate = output columns [0, I), up = [I, 2I): an exact split of the packed words (I % 8 == 0).
                out[f"{p}.gate_proj.qweight"] = gate_up_qweight[e, :, :I8]
                out[f"{p}.up_proj.qweight"] = gate_up_qweight[e, :, I8:]
                out[f"{p}.gate_proj.qzeros"] = mod.gate_up_qzeros[e, :, :I8]
                out[f"{p}.up_proj.qzeros"] = mod.gate_up_qzeros[e, :, I8:]
                out[f"{p}.gate_proj.scales"] = mod.gate_up_scales[e, :, :I]
                out[f"{p}.up_proj.scales"] = mod.gate_up_scales[e, :, I:]
                out[f"{p}.down_proj.qweight"] = down_qweight[e]
                out[f"{p}.down_proj.qzeros"] = mod.down_qzeros[e]
                out[f"{p}.down_proj.scales"] = mod.down_scales[e]
        elif is_fused_experts(mod):  # unquantized HF experts: back to the per-expert names vLLM expects
            expert_prefixes.append(name + ".")
            out.update(hf_experts_tensors(name, mod, dtype))
    fp32_keys = keep_fp32(model)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for key, t in model.state_dict().items():
        if any(key.startswith(p) for p in expert_prefixes):
            continue
        if tied and key == "lm_head.weight":
            continue  # tied to embed_tokens; HF and vLLM re-tie at load
        if t.is_floating_point() and not key.endswith(".scales"):
            t = t.float() if any(k in key for k in fp32_keys) else t.to(dtype)
        out[key] = t
    # AWQ's scales are fp16 whatever the model's dtype (after model.to(bf16) they are held in bf16, for the bf16
    # kernels); a value fp16 cannot hold is refused, not written as inf
    from torchforge.export.gptq_export import fp16_scales as to_fp16

    return {k: (to_fp16(f"vllm-awq export: {k}", v) if fp16_scales and k.endswith(".scales") else v).contiguous()
            for k, v in out.items()}


def unquantized_names(model: nn.Module) -> list[str]:
    """In-memory names of the modules left unquantized (nn.Linear layers and HF fused experts), in module order: the
    skip lists of the W4 configs (vllm-awq, vllm-gptq, compressed-tensors)."""
    return [n for n, m in model.named_modules()
            if (isinstance(m, nn.Linear) and not isinstance(m, ForgeAWQLinear)) or is_fused_experts(m)]


def vllm_awq_quantization_config(model: nn.Module, mods=None) -> dict:
    """config.json `quantization_config` of a vllm-awq checkpoint. `mods`: the (name, module) pairs written quantized;
    None, the model's AWQ modules (torchforge.export.gptq_export passes all its W4 modules, GPTQ ones included)."""
    from torchforge.export.gptq_export import per_channel, refuse_quantized_head

    quantized = _quantized_modules(model) if mods is None else mods
    if not quantized:
        raise ValueError("save_quantized: the model has no torchforge quantized modules; call torchforge.quantize first")
    refuse_quantized_head(model, quantized, "vllm-awq")
    group_sizes = {m.group_size for _, m in quantized}
    if len(group_sizes) != 1:
        if per_channel(quantized):  # gptq_export's group_size -1
            raise ValueError("save_quantized(vllm-awq): per-channel (group_size -1) W4 models are written as "
                             "vllm-gptq or compressed-tensors; torchforge's AWQ loader reads one positive group size")
        raise ValueError(f"vllm-awq holds one group_size per checkpoint; the model mixes {sorted(group_sizes)}")
    skip = unquantized_names(model)
    # vLLM skips a layer when any entry is a SUBSTRING of its prefix (is_layer_skipped_awq), so the list holds
    # full module names only, and none of them may be a substring of a quantized module's vLLM name.
    qnames = set()
    for n, m in quantized:
        qnames |= vllm_names(n) | ({f"{n}.{i}" for i in range(m.num_experts)} if isinstance(m, ForgeAWQExperts) else set())
    clash = skip_list_clash(skip, qnames)
    if clash is not None:
        s, hit = clash
        raise ValueError(f"vllm-awq export: unquantized module {s!r} is a substring of quantized {hit!r}; vLLM "
                         "would skip both. Quantize both or neither (fused parts must match).")
    return {"quant_method": "awq", "bits": 4, "group_size": group_sizes.pop(), "zero_point": True,
            "version": "gemm", "modules_to_not_convert": module_names_for_config(skip, model)}


def default_format(model: nn.Module) -> str:
    """The format `save_quantized` writes without one: the export_format of the recipe `torchforge.quantize`
    recorded on the model; for a model without one (load_quantized) its scheme's own: modelopt-nvfp4 for NVFP4,
    vllm-awq for W4A16."""
    from torchforge.export.nvfp4 import has_nvfp4
    from torchforge.quantize import RECIPE_ATTR

    recipe = getattr(model, RECIPE_ATTR, None)
    if recipe is not None:
        return recipe.export_format
    return "modelopt-nvfp4" if has_nvfp4(model) else "vllm-awq"


def save_quantized(model: nn.Module, out_dir: str, format: str | None = None, *, tokenizer=None, source_dir=None,
                   max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None) -> str:
    """Writes an HF-style checkpoint folder that vLLM loads as is. Returns `out_dir`. `format`: "vllm-awq" (below),
    "vllm-gptq" or "compressed-tensors" (W4A16, torchforge.export.gptq_export; compressed-tensors' NVFP4 for NVFP4
    models) or "modelopt-nvfp4" (torchforge.export.nvfp4); README "Formats" has each layout. None (the default):
    the recipe's `export_format` (see `default_format`).

    vllm-awq: config.json carries `quantization_config = {quant_method: awq, bits: 4, group_size, zero_point: true,
    version: gemm, modules_to_not_convert}`; routed experts are written one by one
    (`...mlp.experts.{e}.{gate,up,down}_proj.{qweight,qzeros,scales}`), unquantized tensors in bf16.
    """
    if format is None:
        format = default_format(model)
    # GPTQ (issue 3): vllm-gptq, W4A16 compressed-tensors and GPTQ modules in the AWQ layout are written by
    # torchforge.export.gptq_export.
    from torchforge.export import gptq_export

    if gptq_export.handles(model, format):
        return gptq_export.save_w4(model, out_dir, format, tokenizer=tokenizer, source_dir=source_dir,
                                   max_shard_bytes=max_shard_bytes, dtype=dtype)
    # NVFP4 (issue 6): ModelOpt / compressed-tensors checkpoints are written by torchforge.export.nvfp4.
    from torchforge.export.nvfp4 import NVFP4_FORMATS, has_nvfp4, save_nvfp4_checkpoint

    if format in NVFP4_FORMATS or has_nvfp4(model):
        return save_nvfp4_checkpoint(model, out_dir, format, tokenizer=tokenizer, source_dir=source_dir,
                                     max_shard_bytes=max_shard_bytes, dtype=dtype)
    if format not in FORMATS:
        from torchforge.recipe import EXPORT_FORMATS

        raise ValueError(f"save_quantized: unknown format {format!r}; choose one of {EXPORT_FORMATS}")
    from torchforge.quantize import RECIPE_ATTR

    recipe = getattr(model, RECIPE_ATTR, None)
    if dtype is None:
        dtype = getattr(torch, recipe.dtype) if recipe is not None else torch.bfloat16
    qcfg = vllm_awq_quantization_config(model)
    from torchforge.export.gptq_export import _w4_modules, check_vllm_kernels
    from torchforge.prune.export import check_pruned_export, prune_for_save

    check_vllm_kernels(_w4_modules(model), format)

    check_pruned_export(model)
    # before begin_folder, as save_w4 does: it refuses scales fp16 cannot hold, and a refused export must leave an
    # earlier checkpoint in out_dir intact (begin_folder removes its config.json)
    state = export_state_dict(model, dtype)
    refuse_source_folder(model, out_dir)
    begin_folder(out_dir, tokenizer_source(model, source_dir), tokenizer=tokenizer)  # no config.json before the tensors
    meta = {"format": format, "recipe": recipe.to_dict() if recipe is not None else None,
            "symmetric": sorted({m.symmetric for _, m in _quantized_modules(model)})}
    # MoE expert pruning (no-op without PrunedMoE): reroute -> a standard smaller checkpoint (router rows sliced,
    # fewer routed experts in config.json); drop -> expert_map.pt written beside the checkpoint.
    state, edit_config = prune_for_save(model, state, out_dir, meta)
    save_sharded(checkpoint_state(state, model), out_dir, max_shard_bytes=max_shard_bytes,
                 metadata={"format": "pt", "torchforge": format})
    return finish_folder(model, out_dir, qcfg, dtype, meta, tokenizer=tokenizer, source_dir=source_dir,
                         edit_config=edit_config)


def read_quantization_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("quantization_config") or {}
