"""load_quantized(path): rebuild an HF model with torchforge modules from an exported folder."""
from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
from torch import nn

from torchforge.export.folder import restore_fp32
from torchforge.export.naming import EXPERT_KEY, iter_memory_named, memory_names
from torchforge.io import CheckpointError
from torchforge.matching import is_fused_experts
from torchforge.nn.awq_experts import ForgeAWQExperts
from torchforge.nn.awq_linear import ForgeAWQLinear
from torchforge.hf_save_guard import refuse_hf_save
from torchforge.nn.moe import ForgeMoE


def _build_skeleton(path: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    qcfg = getattr(config, "quantization_config", None)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # keep transformers' own quantizers out: torchforge owns these layers
    with torch.device("meta"):
        model = restore_fp32(AutoModelForCausalLM.from_config(config, dtype=dtype))
    if os.path.isfile(os.path.join(path, "generation_config.json")):  # EOS ids, pad token, sampling defaults
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model, qcfg if isinstance(qcfg, dict) else (qcfg.to_dict() if qcfg is not None else {})


HF_QUANT_CONFIG = "hf_quant_config.json"


def _modelopt_sidecar(path: str, qcfg: dict) -> dict:
    """The quantization config: config.json's, or ModelOpt's `hf_quant_config.json` where config.json has none (vLLM
    reads that file only then: `get_config` in vllm/transformers_utils/config.py). The file is ModelOpt's
    `{producer, quantization: {quant_algo, kv_cache_quant_algo, group_size, exclude_modules}}` (`get_quant_config`,
    modelopt/torch/export/quant_utils.py); it comes back in config.json's flat form (`quant_method: modelopt`,
    `quant_algo`, ...; vLLM's ModelOptQuantConfigBase.from_config reads both). Both present must agree."""
    side = os.path.join(path, HF_QUANT_CONFIG)
    if not os.path.isfile(side):
        return qcfg
    try:
        with open(side) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"load_quantized: cannot read {side}: {e}") from None
    q = hf.get("quantization") if isinstance(hf, dict) else None
    if not isinstance(q, dict) or not q.get("quant_algo"):
        raise CheckpointError(f"load_quantized: {side} has no quantization.quant_algo (ModelOpt writes {{producer, "
                              "quantization: {quant_algo, group_size, exclude_modules, ...}})")
    flat = {"quant_method": "modelopt", "quant_algo": str(q["quant_algo"]).upper(), "group_size": q.get("group_size"),
            "kv_cache_quant_algo": q.get("kv_cache_quant_algo"), "exclude_modules": q.get("exclude_modules") or [],
            "producer": hf.get("producer")}
    if not qcfg:
        return flat
    if not str(qcfg.get("quant_method", "")).lower().startswith("modelopt"):
        diff = [f"quant_method={qcfg.get('quant_method')!r} vs a ModelOpt {flat['quant_algo']} checkpoint"]
    else:
        inner = qcfg.get("quantization") if isinstance(qcfg.get("quantization"), dict) else {}
        algo = qcfg.get("quant_algo") or inner.get("quant_algo")
        mine = {"quant_algo": str(algo).upper() if algo else None,
                "group_size": qcfg.get("group_size", inner.get("group_size")),
                "exclude_modules": qcfg.get("exclude_modules", qcfg.get("ignore", inner.get("exclude_modules")))}
        norm = {"exclude_modules": lambda v: sorted(map(str, v))}  # an order of names is no conflict
        diff = [f"{k}={v!r} vs {flat[k]!r}" for k, v in mine.items() if v is not None and flat[k] is not None
                and norm.get(k, str)(v) != norm.get(k, str)(flat[k])]
    if diff:
        raise CheckpointError(f"load_quantized: {path}/config.json's quantization_config and {HF_QUANT_CONFIG} "
                              f"disagree ({'; '.join(diff)}); vLLM would use config.json's and ignore the other. "
                              "Remove the stale one (a file an earlier export left in the folder?)")
    return qcfg


def _swap_quantized_modules(model: nn.Module, names: set[str], group_size: int, symmetric: bool) -> None:
    for name, mod in list(model.named_modules()):
        try:
            _swap_one(model, name, mod, names, group_size, symmetric)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e


def _swap_one(model: nn.Module, name: str, mod: nn.Module, names: set[str], group_size: int, symmetric: bool) -> None:
    """Swaps `mod` for its quantized module (meta device) where `names` holds its quantized tensors."""
    if isinstance(mod, nn.Linear) and f"{name}.qweight" in names:
        new = ForgeAWQLinear(mod.in_features, mod.out_features, bias=mod.bias is not None, group_size=group_size,
                             symmetric=symmetric, device="meta", dtype=mod.weight.dtype)
        model.set_submodule(name, new)
    elif is_fused_experts(mod) and f"{name}.0.gate_proj.qweight" in names:
        E, two_i, H = mod.gate_up_proj.shape
        experts = ForgeAWQExperts(E, H, two_i // 2, group_size=group_size, symmetric=symmetric,
                                  act_fn=mod.act_fn, device="meta")
        block_name = name.rsplit(".", 1)[0]
        model.set_submodule(block_name, ForgeMoE.from_hf(model.get_submodule(block_name), experts))


def check_expert_ids(module_name: str, num_experts: int, ids) -> None:
    """Raises where the checkpoint holds routed experts `module_name` does not have (ids >= `num_experts`): they were
    dropped without a word, so a config.json or expert_map.pt that disagrees with the shards loaded other experts."""
    extra = sorted(e for e in ids if e >= num_experts)
    if extra:
        raise CheckpointError(f"load_quantized: the checkpoint holds {module_name}.{extra[0]} (experts {extra[:8]}) but "
                              f"the model has {num_experts} routed experts there (config.json's expert count, or "
                              "expert_map.pt's kept experts for a drop-pruned checkpoint): the config or expert map "
                              "does not match the shards; export the checkpoint again")


def _stack_experts(model: nn.Module, per_expert: dict) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> the stacked buffers of ForgeAWQExperts / HF fused experts."""
    out = {}
    for module_name, parts in per_expert.items():
        mod = model.get_submodule(module_name)
        E = mod.num_experts if isinstance(mod, ForgeAWQExperts) else mod.gate_up_proj.shape[0]
        check_expert_ids(module_name, E, {e for e, *_ in parts})

        def stack(proj, kind):
            missing = [e for e in range(E) if (e, proj, kind) not in parts]
            if missing:
                raise CheckpointError(f"{module_name}: experts {missing[:8]} have no {proj}.{kind} in the checkpoint")
            return torch.stack([parts[(e, proj, kind)] for e in range(E)])

        if isinstance(mod, ForgeAWQExperts):
            for kind in ("qweight", "qzeros", "scales"):
                out[f"{module_name}.gate_up_{kind}"] = torch.cat([stack("gate_proj", kind), stack("up_proj", kind)], -1)
                out[f"{module_name}.down_{kind}"] = stack("down_proj", kind)
        else:
            out[f"{module_name}.gate_up_proj"] = torch.cat([stack("gate_proj", "weight"), stack("up_proj", "weight")], 1)
            out[f"{module_name}.down_proj"] = stack("down_proj", "weight")
    return out


def _rebuild_rotary(model: nn.Module, device) -> None:
    """Non-persistent buffers (RoPE inv_freq) are not in checkpoints: recompute them on the real device."""
    for name, mod in list(model.named_modules()):
        if "RotaryEmbedding" in type(mod).__name__ and hasattr(mod, "inv_freq"):
            with torch.device(device):  # rotary __init__ signatures differ across models; all take the config
                model.set_submodule(name, type(mod)(mod.config))


def _saved_dtype(path: str) -> torch.dtype:
    """The floating dtype config.json names (save_quantized writes the recipe's), bfloat16 where it names none."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.bfloat16


def load_quantized(path: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Loads a folder written by `torchforge.save_quantized` (any of its formats: vllm-awq, vllm-gptq,
    compressed-tensors W4A16 or NVFP4, modelopt-nvfp4, also a ModelOpt NVFP4 folder whose only quantization config
    is `hf_quant_config.json`) as an HF model with torchforge modules. `dtype`: of the unquantized tensors;
    default: the checkpoint's (config.json `dtype`), as transformers' `dtype="auto"`."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"load_quantized: {path} has no config.json (not a checkpoint folder, or an unfinished save)")
    model, qcfg = _build_skeleton(path, dtype or _saved_dtype(path))
    qcfg = _modelopt_sidecar(path, qcfg)
    from torchforge.export.nvfp4 import is_nvfp4_config, load_nvfp4  # NVFP4 (issue 6): ModelOpt / compressed-tensors

    if is_nvfp4_config(qcfg):
        return load_nvfp4(model, path, qcfg, device)
    from torchforge.export.gptq_export import is_w4_config, load_w4  # GPTQ (issue 3): vllm-gptq, W4A16 compressed-tensors

    if is_w4_config(qcfg):
        return load_w4(model, path, qcfg, device)
    if qcfg.get("quant_method") != "awq":
        raise CheckpointError(f"load_quantized: {path}/config.json has quant_method={qcfg.get('quant_method')!r}; "
                              "this reader handles 'awq' (vllm-awq) checkpoints")
    meta_path = os.path.join(path, "torchforge.json")
    symmetric = True
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            symmetric = json.load(f).get("symmetric", [True]) == [True]
    names = set(memory_names(path, model))
    _swap_quantized_modules(model, names, int(qcfg["group_size"]), symmetric)
    # MoE expert pruning: a drop-pruned checkpoint (expert_map.pt beside it) gets PrunedMoE(drop) blocks holding the
    # kept experts only. Reroute-pruned checkpoints are standard ones and need nothing here.
    from torchforge.prune.export import restore_pruned

    model = restore_pruned(model, path)
    model.to_empty(device=device)
    state, per_expert = {}, defaultdict(dict)
    for key, t in iter_memory_named(path, model):
        m = EXPERT_KEY.match(key)
        if m:
            per_expert[m["module"]][(int(m["e"]), m["proj"], m["kind"])] = t
        else:
            state[key] = t
    state.update(_stack_experts(model, per_expert))
    return finish_load(model, state, device)


def finish_load(model: nn.Module, state: dict, device, ignore_missing=None) -> nn.Module:
    """Loads `state` into a skeleton made by `to_empty`: strict, except for a tied lm_head and keys for which
    `ignore_missing(key)` is true; then recomputes the RoPE tables. Shared by every format's loader."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()
    missing = [k for k in missing if not (tied and k == "lm_head.weight")
               and not (ignore_missing is not None and ignore_missing(k))]
    if missing or unexpected:
        raise CheckpointError(f"load_quantized: checkpoint does not match the model: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    _rebuild_rotary(model, device)
    model.eval()
    refuse_hf_save(model)  # a save_pretrained of it would reload with random weights
    return model
