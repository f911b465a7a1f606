"""Which modules of a model a recipe quantizes.

Patterns use compressed-tensors' vocabulary (``compressed_tensors.utils.match``), so a
``targets``/``ignore`` list written for llm-compressor means the same thing here:

* ``"re:<regex>"`` -- ``re.match(<regex>, full_module_name)``: anchored at the *start* of
  the name only, so ``"re:mlp"`` does not match ``"model.layers.0.mlp"`` (write
  ``"re:.*mlp$"``), and without a trailing ``$`` the regex also matches longer names
  (``"re:.*mlp"`` matches ``"model.layers.0.mlp.gate_proj"`` too).
* any other string is first compared for equality with the full module name
  (``"lm_head"``, ``"model.layers.0.self_attn.q_a_proj"``), then with the ``__name__`` of
  every ``nn.Module`` class in the module's MRO (``"Linear"`` matches ``nn.Linear`` and its
  subclasses). As in compressed-tensors, vLLM's ``LinearBase`` also counts as ``"Linear"``.

One extension: a *fused experts* module -- transformers 5 stores the routed experts of
an MoE block as one module (``DeepseekV3Experts``, ``Qwen3MoeExperts``, ...) holding 3-D
``gate_up_proj`` ``[E, 2*I, H]`` and ``down_proj`` ``[E, H, I]`` parameters -- is a
collection of linears, so the class pattern ``"Linear"`` matches it too (in ``targets``
and in ``ignore`` alike). To keep the routed experts unquantized, ignore them by name,
e.g. ``"re:.*mlp\\.experts$"``, or set ``Recipe(quantize_experts=False)``.

A pattern that matches a module does not reach into its children: ignoring
``"model.layers.0.mlp"`` leaves ``"model.layers.0.mlp.down_proj"`` targeted. Every module
is judged on its own name and class.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Union

import torch
from torch import nn

__all__ = [
    "FUSED_GROUPS",
    "is_fused_experts",
    "is_routed_expert",
    "is_target",
    "match_class",
    "match_name",
    "match_pattern",
    "paired_modules_error",
    "select_modules",
]

Patterns = Union[str, Iterable[str]]

REGEX_PREFIX = "re:"


def match_name(name: str, pattern: str) -> bool:
    """True if ``pattern`` matches the full module ``name``.

    ``"re:<regex>"`` -> ``re.match(<regex>, name)`` (anchored at the start only);
    anything else -> exact string equality.
    """
    if pattern.startswith(REGEX_PREFIX):
        return re.match(pattern[len(REGEX_PREFIX):], name) is not None
    return pattern == name


def match_class(module: nn.Module, pattern: str) -> bool:
    """True if ``pattern`` is the ``__name__`` of an ``nn.Module`` class in ``type(module).__mro__``.

    vLLM's ``LinearBase`` matches ``"Linear"`` (as in compressed-tensors). A ``re:`` pattern
    never matches a class (``:`` cannot occur in a class name). This is the plain
    compressed-tensors rule; the fused-experts extension lives in :func:`match_pattern`.
    """
    for cls in type(module).__mro__:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue
        if cls.__name__ == pattern or (pattern == "Linear" and cls.__name__ == "LinearBase"):
            return True
    return False


def is_fused_experts(module: nn.Module) -> bool:
    """True for a fused routed-experts module: direct 3-D parameters ``gate_up_proj`` and ``down_proj``.

    That is the transformers 5 layout (``DeepseekV3Experts``, ``Qwen3MoeExperts``, ...):
    ``gate_up_proj`` is ``[num_experts, 2 * intermediate, hidden]`` and ``down_proj`` is
    ``[num_experts, hidden, intermediate]``. Only the module's own parameters count (not
    its children's), so the parent MoE block is not a fused-experts module.
    """
    params = module._parameters
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
    )


# ".experts.<int>." -- a routed expert stored as separate nn.Linear modules (older
# transformers and remote-code models); shared experts are named "shared_expert(s)".
_ROUTED_EXPERT_RE = re.compile(r"(?:^|\.)experts\.\d+(?:\.|$)")


def is_routed_expert(name: str, module: nn.Module) -> bool:
    """True for routed-expert weights: a fused experts module, or a module under ``experts.<i>``.

    Used by ``Recipe(quantize_experts=False)``. Shared experts (``shared_expert``,
    ``shared_experts``) are not routed experts and are unaffected.
    """
    return is_fused_experts(module) or _ROUTED_EXPERT_RE.search(name) is not None


def match_pattern(name: str, module: nn.Module, pattern: str) -> bool:
    """One pattern against one module: name match, class match, or ``"Linear"`` vs fused experts."""
    return (
        match_name(name, pattern)
        or match_class(module, pattern)
        or (pattern == "Linear" and is_fused_experts(module))
    )


def _as_patterns(patterns: Patterns | None) -> tuple[str, ...]:
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        return (patterns,)
    return tuple(patterns)


def is_target(name: str, module: nn.Module, targets: Patterns, ignore: Patterns | None = ()) -> bool:
    """True if some pattern of ``targets`` matches the module and no pattern of ``ignore`` does.

    ``targets`` and ``ignore`` may be one string or an iterable of strings; ``ignore``
    patterns match by name and by class exactly like ``targets``.
    """
    targets, ignore = _as_patterns(targets), _as_patterns(ignore)
    return any(match_pattern(name, module, p) for p in targets) and not any(
        match_pattern(name, module, p) for p in ignore
    )


def select_modules(
    model: nn.Module,
    targets: Patterns,
    ignore: Patterns | None = (),
    predicate: Callable[[str, nn.Module], bool] | None = None,
) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every submodule that :func:`is_target` accepts, in ``named_modules()`` order.

    The root module (name ``""``) is never selected. ``predicate(name, module)``, if given,
    must also return True for a module to be selected.
    """
    targets, ignore = _as_patterns(targets), _as_patterns(ignore)
    selected = []
    for name, module in model.named_modules():
        if not name:
            continue
        if is_target(name, module, targets, ignore) and (predicate is None or predicate(name, module)):
            selected.append((name, module))
    return selected


# Sibling modules that vLLM loads into ONE fused layer with ONE quant method, so they must
# be quantized together or skipped together: a checkpoint with one shard quantized and the
# other in bf16 cannot be loaded. Keys are vLLM's fused names, values the sibling suffixes.
#
# fused_qkv_a_proj (MLA, q_lora_rank set: DeepSeek-V2/V3, Kimi-K2, GLM-5, ...): vLLM's
# vllm/model_executor/models/deepseek_v2.py builds, in DeepseekV2MLAAttention.__init__,
#     self.fused_qkv_a_proj = DeepSeekV2FusedQkvAProjLinear(   # a MergedColumnParallelLinear
#         hidden_size, [q_lora_rank, kv_lora_rank + qk_rope_head_dim], quant_config=..., ...)
# and DeepseekV2ForCausalLM sets packed_modules_mapping["fused_qkv_a_proj"] =
# ["q_a_proj", "kv_a_proj_with_mqa"]; load_weights maps the checkpoint's q_a_proj to shard 0
# and kv_a_proj_with_mqa to shard 1 (mla_params_mapping). (Read at vllm-project/vllm commit
# 002d6073aa034d4f5545d45021b0e56d1f3c3593.) Without q_lora_rank (DeepSeek-V2-Lite) there is
# no q_a_proj and kv_a_proj_with_mqa stands alone -- the check then has nothing to pair.
#
# qkv_proj / gate_up_proj: vLLM's usual packed_modules_mapping for llama-style attention
# and MLPs (DeepseekV2MLP builds gate_up_proj as a MergedColumnParallelLinear too).
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def paired_modules_error(
    selected_names: Iterable[str],
    all_names: Iterable[str],
    groups: dict[str, tuple[str, ...]] | None = None,
) -> str | None:
    """A message naming every fused group that is only partly selected, or None if all are consistent.

    ``selected_names``: the modules that will be quantized; ``all_names``: every module name
    of the model (e.g. ``[n for n, _ in model.named_modules()]``). A group is the set of
    siblings ``<parent>.<suffix>`` for the suffixes of one entry of ``groups`` (default
    :data:`FUSED_GROUPS`) that exist in ``all_names``; a group with fewer than two members
    is not checked.
    """
    groups = FUSED_GROUPS if groups is None else groups
    selected = set(selected_names)
    names = list(all_names)
    present = set(names)
    problems = []
    seen = set()
    for name in names:
        parent, _, leaf = name.rpartition(".")
        for fused, suffixes in groups.items():
            if leaf != suffixes[0] or (parent, fused) in seen:
                continue
            seen.add((parent, fused))
            members = [f"{parent}.{s}" if parent else s for s in suffixes]
            members = [m for m in members if m in present]
            if len(members) < 2:
                continue
            quantized = [m for m in members if m in selected]
            skipped = [m for m in members if m not in selected]
            if quantized and skipped:
                problems.append((fused, parent, quantized, skipped))
    if not problems:
        return None
    lines = [
        "modules that vLLM loads into one fused layer (one quantization method for all of "
        "them) must be quantized together or skipped together:"
    ]
    for fused, parent, quantized, skipped in problems:
        where = f"{parent}.{fused}" if parent else fused
        lines.append(
            f"  - {where}: quantized {', '.join(quantized)}; not quantized {', '.join(skipped)}. "
            f"Either add {', '.join(quantized)} to `ignore` too, or make sure `targets` matches "
            f"and `ignore` does not match {', '.join(skipped)}."
        )
    suffixes = sorted({s for fused, *_ in problems for s in groups[fused]})
    alternation = "|".join(re.escape(s) for s in suffixes)
    lines.append(
        f"To skip these groups in every layer, add to `ignore`: 're:.*\\.({alternation})$'"
    )
    return "\n".join(lines)
