"""Tensor naming shared by export and load: HF fused experts <-> vLLM's per-expert checkpoint names."""
from __future__ import annotations

import re

# vLLM (and the original HF checkpoints) store routed experts one by one:
#   {prefix}.experts.{e}.{gate_proj|up_proj|down_proj}.{weight | qweight | qzeros | scales}
EXPERT_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>\w+)$")

AWQ_TENSORS = ("qweight", "qzeros", "scales")

# Linear layers vLLM fuses into one module (one quant method for all parts): suffix -> fused name.
VLLM_FUSED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj",
}


def vllm_names(name: str) -> set[str]:
    """Names vLLM may give the module `name` (itself and the fused module it becomes part of)."""
    parent, _, leaf = name.rpartition(".")
    out = {name}
    if leaf in VLLM_FUSED:
        out.add(f"{parent}.{VLLM_FUSED[leaf]}" if parent else VLLM_FUSED[leaf])
    return out


def skip_list_clash(skip, quantized) -> tuple[str, str] | None:
    """vLLM skips a layer when any skip-list entry is a SUBSTRING of its name (is_layer_skipped_awq, ModelOpt's
    exclude_modules), so an unquantized name inside a quantized one would skip that one too: the first such
    (unquantized name in `skip`, quantized name in `quantized`) pair, None where there is none."""
    ordered = sorted(quantized)
    for s in skip:
        hit = next((q for q in ordered if s in q), None)
        if hit is not None:
            return s, hit
    return None


# transformers 5 renames some architectures' checkpoint keys at load time (its conversion_mapping.py);
# vLLM reads the checkpoint names. Export writes the checkpoint names, load reads them back.
# Mixtral: `block_sparse_moe.{gate,experts}` in checkpoints is `mlp.{gate,experts}` in memory, and the
# experts' w1 / w3 / w2 are gate_proj / up_proj / down_proj.
_CHECKPOINT_RENAMES: dict[str, list[tuple[str, str]]] = {
    "mixtral": [
        (r"\.mlp\.(gate|experts)\b", r".block_sparse_moe.\1"),
        (r"(\.experts\.\d+)\.gate_proj\.", r"\1.w1."),
        (r"(\.experts\.\d+)\.up_proj\.", r"\1.w3."),
        (r"(\.experts\.\d+)\.down_proj\.", r"\1.w2."),
    ],
}
_LOAD_RENAMES: dict[str, list[tuple[str, str]]] = {
    "mixtral": [
        (r"\.block_sparse_moe\.(gate|experts)\b", r".mlp.\1"),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    ],
}


def _apply(renames, name: str) -> str:
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


def to_checkpoint_name(name: str, model_type: str | None) -> str:
    """In-memory (transformers 5) name -> the name HF checkpoints and vLLM use."""
    return _apply(_CHECKPOINT_RENAMES.get(model_type or "", ()), name)


def module_names_for_config(names, model) -> list[str]:
    """Module names for a quantization config's lists (ignore, exclude_modules, modules_in_block_to_quantize,
    dynamic): vLLM matches them against its own module names, which are the checkpoint names (Mixtral's
    `block_sparse_moe`), so they are renamed like the tensors."""
    mt = _model_type(model)
    return [to_checkpoint_name(n, mt) for n in names]


def per_expert_ignore_pattern(name: str, model) -> str:
    """A compressed-tensors `re:` entry for the per-expert projections of the fused experts module `name`: vLLM asks
    about a fused-MoE layer by them (`<layer>.0.gate_proj`, ...: compressed_tensors_moe.py) and matches exact names
    or `re:` patterns only (compressed_tensors/utils.py, check_equal_or_regex_match). Covers vLLM's names (gate_proj,
    up_proj, down_proj) and the checkpoint's (Mixtral: w1, w3, w2)."""
    mt = _model_type(model)
    leaves = ["gate_proj", "up_proj", "down_proj"]
    for proj in tuple(leaves):
        prefix, _, leaf = to_checkpoint_name(f"{name}.0.{proj}.weight", mt).removesuffix(".weight").rpartition(".0.")
        leaves += [leaf] if leaf not in leaves else []
    return f"re:^{re.escape(prefix)}\\.\\d+\\.({'|'.join(leaves)})$"


def compressed_tensors_ignore(names, model) -> list[str]:
    """compressed-tensors' `ignore` list for the unquantized modules `names` (in-memory naming): their checkpoint
    names (which transformers matches), and for fused experts also `per_expert_ignore_pattern` (which vLLM does)."""
    from torchforge.matching import is_fused_experts

    out = []
    for name in names:
        out.append(to_checkpoint_name(name, _model_type(model)))
        if is_fused_experts(model.get_submodule(name)):
            out.append(per_expert_ignore_pattern(name, model))
    return out


def from_checkpoint_name(name: str, model_type: str | None) -> str:
    """Inverse of `to_checkpoint_name`."""
    return _apply(_LOAD_RENAMES.get(model_type or "", ()), name)


def _model_type(model) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def checkpoint_state(state: dict, model) -> dict:
    """Renames an in-memory state dict's keys to the checkpoint names of `model`'s architecture."""
    mt = _model_type(model)
    return {to_checkpoint_name(k, mt): v for k, v in state.items()} if mt in _CHECKPOINT_RENAMES else state


def memory_names(path: str, model) -> list[str]:
    """Tensor names of the checkpoint at `path`, in `model`'s in-memory naming."""
    from torchforge.io import checkpoint_tensor_names

    mt = _model_type(model)
    return [from_checkpoint_name(n, mt) for n in checkpoint_tensor_names(path)]


def iter_memory_named(path: str, model):
    """`iter_checkpoint(path)` with the names in `model`'s in-memory naming."""
    from torchforge.io import iter_checkpoint

    mt = _model_type(model)
    for name, t in iter_checkpoint(path):
        yield from_checkpoint_name(name, mt), t
