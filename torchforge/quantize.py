"""torchforge.quantize(model, recipe): swap an HF model's modules for torchforge's quantized ones, in place."""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from torchforge.hf_save_guard import refuse_hf_save
from torchforge.matching import is_fused_experts, paired_modules_error
from torchforge.nn.awq_experts import ForgeAWQExperts
from torchforge.nn.awq_linear import ForgeAWQLinear
from torchforge.nn.moe import ForgeMoE, unsupported_block_error
from torchforge.ops.awq_reference import check_finite_weight
from torchforge.recipe import Recipe

log = logging.getLogger(__name__)

RECIPE_ATTR = "_torchforge_recipe"


def _parent_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


@torch.no_grad()
def quantize(model: nn.Module, recipe: Recipe | str | dict = "w4a16-rtn", *, calib_data=None,
             gptq=None) -> nn.Module:
    """Quantizes `model` in place and returns it.

    Linear layers matched by `recipe.targets` and not by `recipe.ignore` become `ForgeAWQLinear` (`w4a16-rtn`),
    `ForgeGPTQLinear` (`w4a16-gptq`) or `NVFP4Linear` (`nvfp4`); an HF sparse-MoE block whose fused experts are
    matched becomes a `ForgeMoE` holding `ForgeAWQExperts` (an `NVFP4MoE` holding `NVFP4Experts` for nvfp4), router
    kept as is. Every module is checked (shapes, group size, finite weights) before the first is replaced: such an
    error leaves the model unchanged. Modules are then quantized and swapped one at a time, so peak memory is the
    model plus one quantized module. `calib_data` is accepted for calibrated schemes and unused by `w4a16-rtn`.
    `w4a16-gptq` calibrates on `calib_data` (see torchforge.gptq.calibrate; `gptq`: a GPTQConfig or dict).
    """
    recipe = Recipe.coerce(recipe)
    _refuse_quantized(model)
    _refuse_meta_weights(model)
    if recipe.prune is not None:  # prune first; quantization then covers only the kept experts
        from torchforge.prune.from_recipe import prune_from_recipe

        # the scheme's checks first, so that an error leaves the model unpruned too; pruning keeps every module's
        # dimensions, so what passes here passes again after it
        _select_and_check(model, recipe)
        if recipe.scheme == "w4a16-gptq":
            from torchforge.gptq.calibrate import require_calib_data

            require_calib_data(calib_data)
        prune_from_recipe(model, recipe.prune)
    if recipe.scheme == "nvfp4":  # NVFP4 (issue 6): NVFP4Linear / NVFP4MoE swaps, see torchforge.quantize_nvfp4
        from torchforge.quantize_nvfp4 import quantize_nvfp4

        counts = quantize_nvfp4(model, recipe, calib_data)
        _mark_quantized(model, recipe)
        log.info("quantize: %(linear)d NVFP4 linear layers and %(moe)d NVFP4 MoE blocks", counts)
        return model
    if recipe.scheme == "w4a16-gptq":  # GPTQ (issue 3): ForgeGPTQLinear / ForgeMoE swaps, see torchforge.gptq.calibrate
        from torchforge.gptq.calibrate import quantize_gptq

        counts = quantize_gptq(model, recipe, calib_data, gptq)
        _mark_quantized(model, recipe)
        log.info("quantize: GPTQ %(linear)d linear layers and %(moe)d MoE expert blocks", counts)
        return model
    if recipe.scheme != "w4a16-rtn":
        raise ValueError(f"quantize: scheme {recipe.scheme!r} is not implemented here; use 'w4a16-rtn'")
    if calib_data is not None:
        log.info("quantize: scheme w4a16-rtn needs no calibration data; ignoring calib_data")
    # Every module is checked before the first is replaced: one that cannot be quantized (a shape the group size does
    # not divide, NaN weights) leaves the model as it was, not half quantized with a retry mixing settings. The
    # modules are then quantized and swapped one at a time (building them all first would hold both copies).
    selected = _select_and_check(model, recipe)
    counts = {"linear": 0, "moe": 0}
    for name, module in selected:
        try:
            r = _replacement(model, name, module, recipe)
        except ValueError as e:  # not seen by the checks (a quantizer's own error); earlier modules are swapped
            raise ValueError(f"quantize: cannot quantize {name}: {e}") from e
        if r is not None:
            target, new, kind = r
            model.set_submodule(target, new)
            counts[kind] += 1
    _mark_quantized(model, recipe)
    log.info("quantize: %(linear)d linear layers and %(moe)d MoE expert blocks", counts)
    return model


def _refuse_quantized(model: nn.Module) -> None:
    """A model is quantized once: its exports describe one recipe, and a second would be recorded over the first (or,
    on a model from load_quantized, which records none, mix group sizes or schemes that no format holds)."""
    from torchforge.nn import ForgeAWQExperts, ForgeAWQLinear, ForgeGPTQLinear, NVFP4Experts, NVFP4Linear

    earlier = getattr(model, RECIPE_ATTR, None)
    kinds = (ForgeAWQLinear, ForgeGPTQLinear, ForgeAWQExperts, NVFP4Linear, NVFP4Experts)
    found = earlier is not None or next((n for n, m in model.named_modules() if isinstance(m, kinds)), None)
    if found:
        what = (f"scheme {earlier.scheme!r}" if earlier is not None
                else f"{found} is a {type(model.get_submodule(found)).__name__}")
        raise ValueError(f"quantize: this model is already quantized ({what}); quantize a fresh model with one recipe "
                         "whose targets / ignore cover every module to quantize")


def _refuse_meta_weights(model: nn.Module) -> None:
    """Weights on the meta device have no values to quantize: the swaps would build meta modules that fail only at the
    first forward. A model loaded with accelerate offload (`device_map` with "cpu" / "disk" entries) is one: its hooks
    hold the weights and load them by the original parameter names, which the swapped modules no longer have."""
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if not meta:
        return
    hooked = any(hasattr(m, "_hf_hook") for m in model.modules())
    why = (" (the model has accelerate hooks: it was loaded with device_map offload, whose weights the swaps cannot "
           "reach)" if hooked else "")
    count = "1 parameter is" if len(meta) == 1 else f"{len(meta)} parameters are"
    raise ValueError(f"quantize: {count} on the meta device, e.g. {', '.join(meta[:3])}{why}; "
                     "load the weights onto CPU or GPU first (from_pretrained without offload), or quantize the "
                     "checkpoint tensor by tensor with `torchforge quantize SRC OUT --stream` (round-to-nearest); the "
                     "model is unchanged")


def _mark_quantized(model: nn.Module, recipe: Recipe) -> None:
    """The recipe for the exporters; transformers' save_pretrained refused (see torchforge.hf_save_guard)."""
    setattr(model, RECIPE_ATTR, recipe)
    refuse_hf_save(model)


def _select_and_check(model: nn.Module, recipe: Recipe) -> list:
    """The recipe's modules in `model`, each checked for its scheme (check_quantizable) before any is replaced."""
    if recipe.scheme == "nvfp4":
        from torchforge.quantize_nvfp4 import select_and_check_nvfp4

        return select_and_check_nvfp4(model, recipe)
    if recipe.scheme == "w4a16-gptq":
        from torchforge.gptq.calibrate import select_and_check_gptq

        return select_and_check_gptq(model, recipe)
    selected = recipe.select(model, check_fused=False)
    check_selection(model, selected, recipe)
    check_quantizable(selected, lambda m: ForgeAWQLinear(m.in_features, m.out_features, bias=m.bias is not None,
                                                          group_size=recipe.group_size, symmetric=recipe.symmetric,
                                                          device="meta"),
                      lambda m: ForgeAWQExperts.empty_for(m, recipe.group_size, recipe.symmetric, device="meta"),
                      recipe.quantize_experts, op="awq_quantize")
    return selected


def check_selection(model: nn.Module, selected, recipe: Recipe) -> None:
    """What every scheme's selection passes before a swap: fused groups (q/k/v, gate/up) selected whole or not at all,
    fused experts only in MoE blocks ForgeMoE can wrap, and a recipe whose export format can hold the result."""
    err = paired_modules_error([n for n, _ in selected], [n for n, _ in model.named_modules()])
    if err:
        raise ValueError(err)
    check_moe_blocks(model, selected, recipe.quantize_experts)
    experts = recipe.quantize_experts and any(is_fused_experts(m) for _, m in selected)
    if experts and recipe.export_format == "vllm-gptq" and not recipe.symmetric:
        # save_quantized refuses it (gptq_export.check_vllm_kernels: vLLM's GPTQ MoE path drops zero points); said
        # here, before the model is quantized
        raise ValueError("quantize: an asymmetric recipe with export_format 'vllm-gptq' cannot be exported for MoE "
                         "experts (vLLM's GPTQ MoE path assumes symmetric codes); use export_format "
                         "'compressed-tensors' or 'vllm-awq', or symmetric=True; the model is unchanged")


def check_moe_blocks(model: nn.Module, selected, quantize_experts: bool) -> None:
    """Raises, naming the module, when a selected fused-experts module sits in a MoE block that ForgeMoE cannot wrap
    (a router not named `gate`: GraniteMoE, PhiMoE, Jamba, Llama4): found at the swap, the model would be left half
    quantized."""
    if not quantize_experts:
        return
    for name, module in selected:
        if not is_fused_experts(module):
            continue
        block_name = _parent_name(name)
        err = unsupported_block_error(model.get_submodule(block_name), module)
        if err:
            pattern = "re:.*" + re.escape(".".join(name.split(".")[-2:])) + "$"  # e.g. re:.*mlp\.experts$
            raise ValueError(f"quantize: cannot quantize {name}: {err}; keep these experts unquantized (add "
                             f"{pattern!r} to the recipe's ignore list, or set quantize_experts=False); "
                             "the model is unchanged")


def check_quantizable(selected, linear_shell, experts_shell, quantize_experts: bool,
                      op: str = "awq_quantize") -> None:
    """Raises, naming the module, what quantizing `selected` would raise before anything is swapped: each module's
    empty replacement built on the meta device (`linear_shell(linear)`, `experts_shell(fused experts)`: shapes,
    group size) and its weights' finiteness (not for meta weights; `op`, the scheme's quantizer, names it)."""
    for name, module in selected:
        try:
            if is_fused_experts(module):
                if not quantize_experts:
                    continue
                experts_shell(module)
                weights = (module.gate_up_proj, module.down_proj)
            elif isinstance(module, nn.Linear):
                linear_shell(module)
                weights = (module.weight,)
            else:
                continue
            for w in weights:
                if w.device.type != "meta":
                    check_finite_weight(w.detach(), op)
        except ValueError as e:
            raise ValueError(f"quantize: cannot quantize {name}: {e}; the model is unchanged") from e


def _replacement(model: nn.Module, name: str, module: nn.Module, recipe: Recipe) -> tuple[str, nn.Module, str] | None:
    """(where, new module, "linear" | "moe") for one selected module, or None when it stays as is. A MoE block's
    replacement keeps the block's other children (router, shared experts) as they are, so Linear layers inside
    them may be swapped before or after it."""
    G, sym = recipe.group_size, recipe.symmetric
    if is_fused_experts(module):
        if not recipe.quantize_experts:
            return None
        block_name = _parent_name(name)
        block = model.get_submodule(block_name)
        experts = ForgeAWQExperts.from_hf(module, group_size=G, symmetric=sym)
        if isinstance(block, ForgeMoE):  # already ours (a PrunedMoE): only its experts change, as from_hf would
            return name, experts, "moe"
        return block_name, ForgeMoE.from_hf(block, experts), "moe"
    if isinstance(module, nn.Linear):
        return name, ForgeAWQLinear.from_linear(module, group_size=G, symmetric=sym), "linear"
    return None
