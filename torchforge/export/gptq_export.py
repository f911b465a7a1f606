"""W4A16 exports of GPTQ (and RTN) models: ``vllm-gptq``, ``compressed-tensors`` (pack-quantized) and GPTQ
results in the AWQ layout (``vllm-awq``), and :func:`load_w4` to read all three back.

Every torchforge W4A16 module holds, per (output channel, group of G input channels), a scale and a zero
point, and per weight a 4-bit code, with ``W = (q - z) * s`` on unsigned codes. The three checkpoint
layouts are exact re-packings of the same numbers (``ForgeGPTQLinear``, ``ForgeAWQLinear``,
``ForgeAWQExperts`` are all converted through the unpacked ``codes [IC, OC]``, ``scales [IC // G, OC]``,
``zeros [IC // G, OC]`` of one matrix), so each checkpoint decodes to what the solver produced:

* ``vllm-gptq`` (AutoGPTQ / vLLM ``quant_method: gptq``): ``qweight [IC // 8, OC]`` packed along IC,
  ``qzeros [IC // G, OC // 8]`` holding ``z - 1`` (v1, see :mod:`torchforge.ops.gptq_reference`),
  ``scales``, ``g_idx``. Config: ``bits, group_size, desc_act`` (true only for a permuted ``g_idx``: vLLM reads
  ``g_idx`` only then), ``sym, lm_head`` (true when the output head is quantized),
  ``checkpoint_format: gptq``, the quantized modules in ``modules_in_block_to_quantize`` (vLLM treats an
  entry as a substring of a layer's name; full module names), and every unquantized Linear as a negative
  ``dynamic`` rule (``"-:^name$"``, vLLM ``re.match`` es it against the layer name).
* ``compressed-tensors`` ``pack-quantized`` (what vLLM's ``CompressedTensorsWNA16`` reads):
  ``weight_packed [OC, IC // 8]`` int32 (8 consecutive input columns per word, column ``8r + j`` in bits
  ``4j``, values ``q_signed + 8`` = our unsigned code), ``weight_scale [OC, IC // G]``, ``weight_shape``
  ``[OC, IC]``, and for asymmetric schemes ``weight_zero_point [OC // 8, IC // G]`` (packed along OC,
  ``z_signed + 8`` = our zero point). Config: one ``config_group`` (int, 4 bits, group strategy; channel for
  per-channel models).
* ``vllm-awq``: ``ForgeGPTQLinear`` converted to AWQ tensors (no act-order: a permuted ``g_idx`` has no
  AWQ equivalent and raises); the rest is what ``torchforge.export.vllm_awq`` writes.

Routed experts are written one by one (``...experts.{e}.{gate,up,down}_proj.<tensor>``) in every format.

Scales: ``compressed-tensors`` writes them in the dtype the modules hold (the solver's ``scale_dtype``: fp16 in
``torchforge.quantize``, bf16 / fp32 through ``solve`` or ``ForgeGPTQLinear.from_linear``; or a loaded
checkpoint's); ``vllm-gptq`` and ``vllm-awq`` always write fp16, the dtype of the AutoGPTQ / AutoAWQ layouts
(vLLM's plain ``gptq`` and ``awq`` kernels run fp16 only), and refuse, naming the tensor, a scale that fp16 cannot
hold exactly (above 65504 it would be written as inf). vLLM creates every scale parameter in the model dtype and
copies the checkpoint's into it (parameter.py ``_assert_and_load``), so a server running bf16 rounds fp16 scales
again; bf16 solver scales (``scale_dtype=torch.bfloat16``) avoid that: they convert to fp16 and back exactly
within fp16's range.

``group_size: -1`` (one group spanning all of K, vLLM / AutoGPTQ; compressed-tensors ``strategy: channel``) is
held as ``group_size == in_features`` per module, and written as -1 / ``channel`` when the modules' K differ.

A quantized output head (``lm_head``) is written only as ``vllm-gptq`` (``lm_head: true``): vLLM's
compressed-tensors and AWQ configs build ``ParallelLMHead`` unquantized (see :func:`refuse_quantized_head`).
"""
from __future__ import annotations

import logging
import re
from collections import defaultdict

import torch
from torch import nn

from torchforge.export.naming import (EXPERT_KEY, checkpoint_state, compressed_tensors_ignore, iter_memory_named,
                                      memory_names,
                                      module_names_for_config)
from torchforge.export.vllm_awq import unquantized_names, vllm_awq_quantization_config
from torchforge.io import CheckpointError, save_sharded
from torchforge.matching import is_fused_experts
from torchforge.nn.awq_experts import ForgeAWQExperts
from torchforge.nn.awq_linear import ForgeAWQLinear
from torchforge.nn.gptq_linear import ForgeGPTQLinear, is_act_order, w4_linear_from_gptq
from torchforge.nn.moe import ForgeMoE
from torchforge.ops.awq import awq_pack, awq_unpack
from torchforge.ops.gptq import gptq_pack, gptq_pack_zeros, gptq_unpack, gptq_unpack_zeros, trivial_g_idx

log = logging.getLogger(__name__)

__all__ = ["W4_FORMATS", "handles", "save_w4", "is_w4_config", "load_w4", "compressed_tensors_config",
           "vllm_gptq_config"]

W4_FORMATS = ("vllm-awq", "vllm-gptq", "compressed-tensors")
_W4_MODULES = (ForgeGPTQLinear, ForgeAWQLinear, ForgeAWQExperts)
_PROJ = ("gate_proj", "up_proj", "down_proj")


def _w4_modules(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _W4_MODULES)]


# vLLM's Marlin kernels (marlin_utils.py MARLIN_SUPPORTED_GROUP_SIZES, -1 = channelwise; gptq_marlin.py TYPE_MAP:
# symmetric only for GPTQ) are what runs bf16 checkpoints; outside them vLLM falls back to its plain awq / gptq
# kernels, float16 only.
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)


def fp16_scales(key: str, scales: torch.Tensor) -> torch.Tensor:
    """``scales`` in float16, the dtype of the AutoGPTQ / AutoAWQ layouts (vllm-gptq, vllm-awq): cast where that is
    exact, else a ValueError naming ``key`` (a bf16 / fp32 scale above 65504 would be written as inf)."""
    if scales.dtype == torch.float16:
        return scales
    half = scales.to(torch.float16)
    bad = half.to(scales.dtype) != scales
    if bool(bad.any()):
        over = int((half.isinf() & scales.isfinite()).sum())
        raise ValueError(f"{key}: {int(bad.sum())} {str(scales.dtype).replace('torch.', '')} scales are not float16 "
                         f"values ({over} above float16's maximum 65504, largest {float(scales.abs().max()):.6g}; any "
                         "other is non-finite or below float16's normal range, where it would be rounded). This "
                         "format stores float16 scales; export as 'compressed-tensors', which keeps the scales' dtype")
    return half


def output_head_name(model: nn.Module) -> str | None:
    """The name of the model's output head (``get_output_embeddings``), None where it has none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if head is not None and m is head), None)


def refuse_quantized_head(model: nn.Module, mods, format: str) -> None:
    """A quantized output head is loadable by vLLM only from vllm-gptq (``lm_head: true``, gptq.py /
    gptq_marlin.py through gptq_utils.get_linear_quant_method). compressed_tensors.py get_quant_method quantizes
    LinearBase layers only (ParallelLMHead is a VocabParallelEmbedding; the config's "Linear" target does not match
    it), and awq.py AWQConfig.get_quant_method likewise (awq_marlin.py reads ``lm_head`` but falls back to AWQConfig
    for a layer Marlin cannot run): the head is built unquantized and its packed tensors fail the load."""
    head = output_head_name(model)
    if head is not None and any(n == head for n, _ in mods):
        raise ValueError(f"save_quantized({format}): the output head {head!r} is quantized, and vLLM builds it "
                         f"unquantized from a {format} checkpoint (the load fails on {head}'s packed tensors). Add "
                         f"{head!r} to the recipe's ignore list (torchforge's default ignore has it), or export as "
                         "'vllm-gptq', which sets lm_head: true (vLLM's gptq and gptq_marlin quantize the head then)")


def check_vllm_kernels(mods, format: str) -> None:
    """Refuses a W4A16 export that vLLM would load wrongly, warns where it would need `--dtype float16`."""
    g = _group_size(mods)
    sym = _symmetric(mods)
    if format == "vllm-gptq" and not sym and any(isinstance(m, ForgeAWQExperts) for _, m in mods):
        # gptq.py's GPTQConfig hands MoE layers to MoeWNA16 with sym hard-coded True: the qzeros are dropped and the
        # experts decode as (q - 8) * s, silently wrong
        raise ValueError("save_quantized: vLLM's GPTQ path for MoE experts assumes symmetric codes and drops zero "
                         "points, so this asymmetric model would load wrongly; export it as 'compressed-tensors' or "
                         "'vllm-awq', or quantize symmetrically")
    if g not in MARLIN_GROUP_SIZES or (format == "vllm-gptq" and not sym):
        why = f"group_size {g}" if g not in MARLIN_GROUP_SIZES else "asymmetric GPTQ"
        log.warning("save_quantized: %s is outside vLLM's Marlin kernels (group sizes %s, symmetric GPTQ); vLLM "
                    "runs this checkpoint only with --dtype float16", why, MARLIN_GROUP_SIZES)


def handles(model: nn.Module, format: str) -> bool:
    """True when this module writes ``format`` for ``model``: vllm-gptq always, compressed-tensors for a
    W4A16 model, vllm-awq when a ForgeGPTQLinear is present (pure AWQ models keep the AWQ exporter)."""
    mods = _w4_modules(model)
    if format == "vllm-gptq":
        return True
    if format == "compressed-tensors":
        return bool(mods)
    return format == "vllm-awq" and any(isinstance(m, ForgeGPTQLinear) for _, m in mods)


# ------------------------------------------------------------------------------------- one matrix
def _unpacked_linear(mod: nn.Module):
    """(codes [IC, OC] uint8, scales [NG, OC], zeros [NG, OC] uint8) of a W4 Linear module."""
    if isinstance(mod, ForgeGPTQLinear):
        if mod.has_act_order():
            raise ValueError("act-order (a permuted g_idx) cannot be re-packed; export this model as vllm-gptq")
        qweight, qzeros = mod.gptq_tensors()
        return gptq_unpack(qweight), mod.scales, gptq_unpack_zeros(qzeros)
    return awq_unpack(mod.awq_qweight()), mod.scales, awq_unpack(mod.qzeros)


def _pack_along_oc(zeros: torch.Tensor) -> torch.Tensor:
    """[NG, OC] values 0..15 -> int32 [NG, OC // 8], output 8c + j in bits 4j (no offset)."""
    if zeros.numel() and int(zeros.max()) > 15:  # a GPTQ v1 zero point of 16 would carry into the next nibble
        raise ValueError("a stored zero point of 16 (GPTQ v1 qzeros can hold it) has no compressed-tensors int4 "
                         "equivalent (zero points are -8..7 there); export this model as vllm-gptq")
    z = zeros.to(torch.int64).reshape(zeros.shape[0], -1, 8) << torch.arange(0, 32, 4, device=zeros.device)
    w = z.sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _unpack_along_oc(words: torch.Tensor) -> torch.Tensor:
    z = (words.unsqueeze(-1) >> torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)) & 0xF
    return z.reshape(words.shape[0], -1).to(torch.uint8)


def _tensors(fmt: str, codes, scales, zeros, symmetric: bool) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (local names) of one matrix in ``fmt``, the scales as held (see :func:`_fp16_scales`)."""
    ic, oc = codes.shape
    if fmt == "vllm-awq":
        return {"qweight": awq_pack(codes), "qzeros": awq_pack(zeros), "scales": scales}
    if fmt == "vllm-gptq":
        g = ic // scales.shape[0]
        return {"qweight": gptq_pack(codes), "qzeros": gptq_pack_zeros(zeros), "scales": scales,
                "g_idx": trivial_g_idx(ic, g, device=codes.device)}
    out = {"weight_packed": gptq_pack(codes).T.contiguous(), "weight_scale": scales.T.contiguous(),
           "weight_shape": torch.tensor([oc, ic], dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = _pack_along_oc(zeros).T.contiguous()
    return out


def _fp16_scales(fmt: str, name: str, tensors: dict) -> dict:
    """``tensors`` of the matrix ``name`` with the scales vllm-gptq / vllm-awq store (fp16, exact or refused);
    compressed-tensors keeps the dtype held (vLLM creates weight_scale in the model dtype and casts it at load)."""
    if fmt == "compressed-tensors":
        return tensors
    return {**tensors, "scales": fp16_scales(f"save_quantized({fmt}): {name}.scales", tensors["scales"])}


# ------------------------------------------------------------------------------------------ configs
def _k_dims(mod: nn.Module) -> set[int]:
    """The input dims (K) a W4 module's groups run along."""
    if isinstance(mod, ForgeAWQExperts):
        return {mod.hidden_size, mod.intermediate_size}
    return {mod.in_features}


def per_channel(mods) -> bool:
    """Whether each of the (name, W4 module) pairs has one group spanning all of its K (group_size -1 in GPTQ
    checkpoints, whatever the Ks)."""
    return all(_k_dims(m) == {m.group_size} for _, m in mods)


def _group_size(mods) -> int:
    """The checkpoint's group_size: the modules' one group size, or -1 (per-channel) where each module's only
    group spans all of its K and the Ks differ."""
    sizes = {m.group_size for _, m in mods}
    if len(sizes) == 1:
        return sizes.pop()
    if per_channel(mods):
        return -1
    raise ValueError(f"a W4 checkpoint holds one group_size; the model mixes {sorted(sizes)}")


def _symmetric(mods) -> bool:
    return all(m.symmetric for _, m in mods)


def vllm_gptq_config(model: nn.Module) -> dict:
    mods = _w4_modules(model)
    quantized = module_names_for_config([n for n, _ in mods], model)
    # desc_act tells vLLM whether to read g_idx at all: with false its GPTQ kernels (exllama, Marlin) replace it by
    # k // group_size, so a permuted g_idx (an act-order checkpoint loaded and re-exported) needs true. A trivial
    # g_idx beside it is read as it is, so one act-order layer sets it for the checkpoint.
    desc_act = any(isinstance(m, ForgeGPTQLinear) and m.has_act_order() for _, m in mods)
    # vLLM builds ParallelLMHead quantized only when lm_head is true (gptq.py / gptq_marlin.py lm_head_quantized);
    # with false it expects lm_head.weight and a quantized head's lm_head.qweight fails the load
    lm_head = output_head_name(model) in {n for n, _ in mods}
    return {"quant_method": "gptq", "bits": 4, "group_size": _group_size(mods), "desc_act": desc_act,
            "sym": _symmetric(mods), "lm_head": lm_head, "static_groups": False, "true_sequential": True,
            "checkpoint_format": "gptq", "modules_in_block_to_quantize": quantized,
            "dynamic": {f"-:^{re.escape(n)}$": {} for n in module_names_for_config(unquantized_names(model), model)}}


def compressed_tensors_config(model: nn.Module) -> dict:
    mods = _w4_modules(model)
    refuse_quantized_head(model, mods, "compressed-tensors")
    sym = _symmetric(mods)
    g = _group_size(mods)
    # compressed-tensors' QuantizationArgs: per-channel is strategy "channel" (a "group" strategy needs group_size > 0)
    strategy = {"strategy": "channel", "group_size": None} if g == -1 else {"strategy": "group", "group_size": g}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, **strategy,
               "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": compressed_tensors_ignore(unquantized_names(model), model), "kv_cache_scheme": None,
            "global_compression_ratio": None}


# ------------------------------------------------------------------------------------------- save
@torch.no_grad()
def w4_state_dict(model: nn.Module, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of ``model`` in ``fmt``: the AWQ exporter's state dict (unquantized tensors in
    ``dtype``, experts per expert) with every quantized matrix re-packed."""
    from torchforge.export.vllm_awq import export_state_dict

    state = export_state_dict(model, dtype, fp16_scales=False)  # the quantized tensors are all replaced below
    for name, mod in _w4_modules(model):
        if isinstance(mod, ForgeAWQExperts):
            i = mod.intermediate_size
            gate_up_qweight, down_qweight = mod.awq_qweights()  # AWQ layout even when the module runs on mma
            for e in range(mod.num_experts):
                z_gu, z_dn = awq_unpack(mod.gate_up_qzeros[e]), awq_unpack(mod.down_qzeros[e])
                c_gu, c_dn = awq_unpack(gate_up_qweight[e]), awq_unpack(down_qweight[e])
                parts = {"gate_proj": (c_gu[:, :i], mod.gate_up_scales[e, :, :i], z_gu[:, :i]),
                         "up_proj": (c_gu[:, i:], mod.gate_up_scales[e, :, i:], z_gu[:, i:]),
                         "down_proj": (c_dn, mod.down_scales[e], z_dn)}
                for proj, (c, s, z) in parts.items():
                    p = f"{name}.{e}.{proj}"
                    for k in ("qweight", "qzeros", "scales"):
                        state.pop(f"{p}.{k}", None)
                    try:
                        tensors = _tensors(fmt, c.contiguous(), s.contiguous(), z.contiguous(), mod.symmetric)
                    except ValueError as err:
                        raise ValueError(f"save_quantized({fmt}): {p}: {err}") from err
                    for k, t in _fp16_scales(fmt, p, tensors).items():
                        state[f"{p}.{k}"] = t
        else:
            for k in ("qweight", "qzeros", "scales", "g_idx"):
                state.pop(f"{name}.{k}", None)
            try:
                if fmt == "vllm-gptq" and isinstance(mod, ForgeGPTQLinear):  # as stored, g_idx included
                    qweight, qzeros = mod.gptq_tensors()
                    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": mod.scales, "g_idx": mod.g_idx}
                else:
                    c, s, z = _unpacked_linear(mod)
                    tensors = _tensors(fmt, c, s, z, mod.symmetric)
            except ValueError as err:
                raise ValueError(f"save_quantized({fmt}): {name}: {err}") from err
            for k, t in _fp16_scales(fmt, name, tensors).items():
                state[f"{name}.{k}"] = t
    return {k: v.contiguous() for k, v in state.items()}


def save_w4(model: nn.Module, out_dir: str, format: str, *, tokenizer=None, source_dir=None,
            max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None) -> str:
    """Writes ``model`` as a ``format`` checkpoint (one of :data:`W4_FORMATS`); config.json last."""
    from torchforge.export.folder import begin_folder, refuse_source_folder, finish_folder, tokenizer_source
    from torchforge.quantize import RECIPE_ATTR

    if format not in W4_FORMATS:
        raise ValueError(f"save_quantized: unknown W4A16 format {format!r}; choose one of {W4_FORMATS}")
    mods = _w4_modules(model)
    if not mods:
        raise ValueError("save_quantized: the model has no torchforge W4A16 modules; call torchforge.quantize first")
    check_vllm_kernels(mods, format)
    recipe = getattr(model, RECIPE_ATTR, None)
    if dtype is None:
        dtype = getattr(torch, recipe.dtype) if recipe is not None else torch.bfloat16
    qcfg = {"vllm-awq": lambda m: vllm_awq_quantization_config(m, mods), "vllm-gptq": vllm_gptq_config,
            "compressed-tensors": compressed_tensors_config}[format](model)
    from torchforge.prune.export import check_pruned_export, prune_for_save

    check_pruned_export(model)
    state = w4_state_dict(model, format, dtype)
    refuse_source_folder(model, out_dir)
    begin_folder(out_dir, tokenizer_source(model, source_dir), tokenizer=tokenizer)  # no config.json before the tensors
    meta = {"format": format, "recipe": recipe.to_dict() if recipe is not None else None,
            "symmetric": sorted({m.symmetric for _, m in mods})}
    state, edit_config = prune_for_save(model, state, out_dir, meta)  # pruned MoE: as for every format
    save_sharded(checkpoint_state(state, model), out_dir, max_shard_bytes=max_shard_bytes,
                 metadata={"format": "pt", "torchforge": format})
    return finish_folder(model, out_dir, qcfg, dtype, meta, tokenizer=tokenizer, source_dir=source_dir,
                         edit_config=edit_config)


# ------------------------------------------------------------------------------------------- load
def _ct_weights(qcfg: dict):
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        return None
    g = next(iter(groups.values()))
    w = g.get("weights") or {}
    fmt = g.get("format") or qcfg.get("format")
    if fmt != "pack-quantized" or w.get("num_bits") != 4 or w.get("type") != "int":
        return None
    if w.get("strategy") not in ("group", "channel") or g.get("input_activations"):
        return None
    return w


def is_w4_config(qcfg: dict) -> bool:
    """A ``gptq`` config, or a compressed-tensors pack-quantized int4 group / channel config (W4A16)."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "gptq":
        return True
    return method == "compressed-tensors" and _ct_weights(qcfg) is not None


def _ct_linear(t: dict, symmetric: bool):
    """compressed-tensors tensors of one Linear -> (qweight [IC // 8, OC] GPTQ-packed, true zero points [NG, OC]
    uint8, scales [NG, OC], g_idx [IC] int32)."""
    oc, ic = (int(v) for v in t["weight_shape"].tolist())
    qweight = t["weight_packed"].T.contiguous()
    scales = t["weight_scale"].T.contiguous()
    zeros = (torch.full(scales.shape, 8, dtype=torch.uint8) if symmetric
             else _unpack_along_oc(t["weight_zero_point"].T.contiguous()))
    # actorder "group" checkpoints (llm-compressor) carry the group of each input column in weight_g_idx, which
    # vLLM's CompressedTensorsWNA16 and compressed-tensors' decompressor read: k // G would decode other weights
    g_idx = t.get("weight_g_idx")
    g_idx = trivial_g_idx(ic, ic // scales.shape[0]) if g_idx is None else g_idx.to(torch.int32)
    return qweight, zeros, scales, g_idx


def _check_g_idx(g_idx: torch.Tensor, in_features: int, groups: int, key: str) -> None:
    """Every input column's group must index the scales: the CUDA kernels gather scales and zero points by g_idx
    without a bounds check, so a corrupt one would read out of bounds on the GPU."""
    if g_idx.dim() != 1 or g_idx.shape[0] != in_features:
        raise CheckpointError(f"load_quantized: {key} has shape {tuple(g_idx.shape)}, expected [{in_features}] (one "
                              "group per input column); the checkpoint is corrupt: export it again")
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise CheckpointError(f"load_quantized: {key} has groups in [{int(g_idx.min())}, {int(g_idx.max())}], outside "
                              f"[0, {groups}) (the scales' groups); the checkpoint is corrupt: export it again")


def _w4_linear(fmt: str, t: dict, symmetric: bool, group_size: int, mod: nn.Linear, name: str) -> nn.Module:
    """The W4 module of the checkpoint Linear ``name`` (``mod``: its meta nn.Linear), buffers as stored (scale dtype
    too): see :func:`torchforge.nn.gptq_linear.w4_linear_from_gptq` (a ForgeAWQLinear where a compressed-tensors zero
    point is 0). ``group_size`` -1 (per-channel): one group of ``in_features``."""
    kw = dict(group_size=mod.in_features if group_size == -1 else group_size, symmetric=symmetric)
    if fmt == "vllm-gptq":
        qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"], t["g_idx"].to(torch.int32)
        _check_g_idx(g_idx, mod.in_features, scales.shape[0], f"{name}.g_idx")
        return w4_linear_from_gptq(mod, qweight, scales, qzeros=qzeros, g_idx=g_idx, **kw)
    qweight, zeros, scales, g_idx = _ct_linear(t, symmetric)
    _check_g_idx(g_idx, mod.in_features, scales.shape[0], f"{name}.weight_g_idx")
    if bool((zeros == 0).any()) and is_act_order(g_idx, g_idx.shape[0], scales.shape[0]):
        raise CheckpointError(f"load_quantized: {name}: act-order (a permuted weight_g_idx) with a zero point "
                              "of 0 is not supported (GPTQ v1 qzeros cannot hold 0, the AWQ layout no g_idx)")
    return w4_linear_from_gptq(mod, qweight, scales, zeros=zeros, g_idx=g_idx, **kw)


def _to_awq_expert(fmt: str, t: dict, symmetric: bool):
    """Checkpoint tensors of one expert projection -> AWQ (qweight, qzeros, scales)."""
    if fmt == "vllm-gptq":
        codes, zeros, scales = gptq_unpack(t["qweight"]), gptq_unpack_zeros(t["qzeros"]), t["scales"]
        if is_act_order(t["g_idx"], codes.shape[0], scales.shape[0]):
            raise CheckpointError("load_quantized: act-order (permuted g_idx) routed experts are not supported")
    else:
        codes = gptq_unpack(t["weight_packed"].T.contiguous())
        scales = t["weight_scale"].T.contiguous()
        g_idx = t.get("weight_g_idx")
        if g_idx is not None and is_act_order(g_idx, codes.shape[0], scales.shape[0]):
            raise CheckpointError("load_quantized: act-order (permuted weight_g_idx) routed experts are not supported")
        zeros = (torch.full(scales.shape, 8, dtype=torch.uint8) if symmetric
                 else _unpack_along_oc(t["weight_zero_point"].T.contiguous()))
    if int(zeros.max()) > 15:
        raise CheckpointError("load_quantized: a zero point of 16 has no 4-bit AWQ-layout equivalent")
    return awq_pack(codes), awq_pack(zeros), scales


@torch.no_grad()
def load_w4(model: nn.Module, path: str, qcfg: dict, device) -> nn.Module:
    """Fills the meta-device skeleton ``model`` from a vllm-gptq or compressed-tensors W4A16 checkpoint:
    Linear layers become ForgeGPTQLinear (any g_idx; ForgeAWQLinear for a zero point of 0, see :func:`_w4_linear`),
    fused experts ForgeAWQExperts in a ForgeMoE."""
    from torchforge.export.load import _stack_experts, finish_load

    if str(qcfg.get("quant_method")).lower() == "gptq":
        fmt, symmetric, group_size = "vllm-gptq", bool(qcfg.get("sym", True)), qcfg["group_size"]
        if int(qcfg.get("bits", 4)) != 4:
            raise CheckpointError(f"load_quantized: {path}: only 4-bit GPTQ checkpoints are supported")
        if qcfg.get("checkpoint_format", "gptq") != "gptq":
            raise CheckpointError(f"load_quantized: {path}: checkpoint_format={qcfg.get('checkpoint_format')!r}; "
                                  "only GPTQ v1 ('gptq') zero points are supported")
        mark = "qweight"
    else:
        w = _ct_weights(qcfg)
        # compressed-tensors' QuantizationArgs: strategy "channel" is one group per row (group_size None or -1)
        group_size = -1 if w["strategy"] == "channel" else w.get("group_size")
        fmt, symmetric = "compressed-tensors", bool(w.get("symmetric", True))
        mark = "weight_packed"
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size > 0 or group_size == -1):
        raise CheckpointError(f"load_quantized: {path}: group_size={group_size!r}; a positive int or -1 (per-channel)")
    names = set(memory_names(path, model))
    linears, experts, hf_experts = {}, {}, set()
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and f"{name}.{mark}" in names:
            linears[name] = mod
        elif is_fused_experts(mod):
            if f"{name}.0.gate_proj.{mark}" in names:
                experts[name] = mod
            else:  # left unquantized (quantize_experts=False, ignore): bf16 per-expert weights to stack
                hf_experts.add(name)
    per_linear, per_expert, state = defaultdict(dict), defaultdict(dict), {}
    stacked_parts = defaultdict(dict)
    for key, t in iter_memory_named(path, model):
        m = EXPERT_KEY.match(key)
        if m and m["module"] in experts:
            per_expert[m["module"]].setdefault((int(m["e"]), m["proj"]), {})[m["kind"]] = t
            continue
        if m and m["module"] in hf_experts and m["kind"] == "weight":
            stacked_parts[m["module"]][(int(m["e"]), m["proj"], "weight")] = t
            continue
        owner, _, leaf = key.rpartition(".")
        if owner in linears and leaf != "bias":
            per_linear[owner][leaf] = t
        else:
            state[key] = t
    for name, mod in linears.items():
        try:
            model.set_submodule(name, _w4_linear(fmt, per_linear[name], symmetric, group_size, mod, name))
        except KeyError as err:
            raise CheckpointError(f"load_quantized: {name} misses tensor {err} in {path}") from err
    for name, mod in experts.items():
        num, two_i, hid = mod.gate_up_proj.shape
        g = group_size
        if g == -1:  # per-channel: gate_up's groups span hidden_size, down's intermediate_size
            if hid != two_i // 2:
                raise CheckpointError(f"load_quantized: {path}: {name}: per-channel (group_size -1) routed experts "
                                      f"need hidden_size == intermediate_size ({hid} != {two_i // 2}): "
                                      "ForgeAWQExperts holds one group size for gate_up and down")
            g = hid
        ex = ForgeAWQExperts(num, hid, two_i // 2, group_size=g, symmetric=symmetric, act_fn=mod.act_fn, device="meta")
        block = name.rsplit(".", 1)[0]
        model.set_submodule(block, ForgeMoE.from_hf(model.get_submodule(block), ex))
        for (e, proj), t in per_expert[name].items():
            qw, qz, s = _to_awq_expert(fmt, t, symmetric)
            stacked_parts[name].update({(e, proj, "qweight"): qw, (e, proj, "qzeros"): qz, (e, proj, "scales"): s})
    from torchforge.prune.export import restore_pruned

    model = restore_pruned(model, path)  # drop-pruned checkpoints: PrunedMoE(drop) over the kept experts
    kinds = {ForgeGPTQLinear: ("qweight", "qzeros", "scales", "g_idx"), ForgeAWQLinear: ("qweight", "qzeros", "scales")}
    quantized = {n: {k: getattr(m, k) for k in kinds[type(m)]} for n, m in model.named_modules() if type(m) in kinds}
    model.to_empty(device=device)
    for n, tensors in quantized.items():  # to_empty dropped the stored values: put them back on `device`
        m = model.get_submodule(n)
        for k, t in tensors.items():
            setattr(m, k, t.to(device))
    state.update(_stack_experts(model, stacked_parts))
    # GPTQ buffers were assigned above, not through the state dict
    return finish_load(model, state, device,
                       ignore_missing=lambda k: k.rpartition(".")[0] in quantized and not k.endswith(".bias"))
