"""The `nvfp4` scheme of `torchforge.quantize`: routed experts -> NVFP4Experts in NVFP4MoE, targeted Linear
layers (attention, dense MLPs, shared experts) -> NVFP4Linear, optional activation calibration.

Global scales follow ModelOpt's export (`modelopt/torch/export/quant_utils.py`, `preprocess_linear_fusion`):
layers vLLM fuses into one GEMM (q/k/v, gate/up, MLA's q_a + kv_a) share one ``weight_scale_2`` (the max of
their amax / (6 * 448)) and one ``input_scale``; an expert's gate and up share both as well. Calibration
(``calib_data``) records the amax of every quantized layer's input -> ``input_scale = amax / (6 * 448)``
(`NVFP4QTensor.get_activation_scaling_factor`), per expert for routed experts (the hidden states routed to
it, and SiLU(gate) * up for down). Experts that no calibration token reached get the largest amax of their
layer. Without calib_data the model is weight-only NVFP4 (W4A16; exports as ModelOpt's W4A16_NVFP4).
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict

import torch
from torch import nn

from torchforge.export.naming import VLLM_FUSED
from torchforge.matching import is_fused_experts
from torchforge.nn.nvfp4_experts import NVFP4Experts
from torchforge.nn.nvfp4_linear import E2M1_E4M3_MAX, NVFP4Linear
from torchforge.nn.nvfp4_moe import NVFP4MoE
from torchforge.recipe import Recipe

log = logging.getLogger(__name__)


def _parent_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _fused_key(name: str) -> str:
    parent, _, leaf = name.rpartition(".")
    return f"{parent}.{VLLM_FUSED[leaf]}" if leaf in VLLM_FUSED else name


def _run_batch(model: nn.Module, batch) -> None:
    """One calibration forward; tensors go to the model's device (calibration text usually sits on the host)."""
    param = next(model.parameters(), None)
    dev = param.device if param is not None else None

    def move(v):
        return v.to(dev) if isinstance(v, torch.Tensor) and dev is not None else v

    if isinstance(batch, dict):
        model(**{k: move(v) for k, v in batch.items()})
    elif isinstance(batch, (tuple, list)):
        model(*(move(v) for v in batch))
    else:
        model(move(batch))


@torch.no_grad()
def calibrate(model: nn.Module, selected: list[tuple[str, nn.Module]], calib_data) -> dict:
    """Runs ``model`` on every batch of ``calib_data`` (input_ids tensors, tuples or dicts of model kwargs) and
    returns ``{linear name: amax}`` and ``{experts name: (gate_up amax [E], down amax [E])}``."""
    amax: dict = {}
    nonfinite: dict[str, float] = {}  # layer -> a non-finite input amax (Python's max would drop a NaN)
    hooks = []

    def note(name: str, a: float) -> float:
        if not math.isfinite(a):
            nonfinite.setdefault(name, a)
        return a

    def linear_hook(name):
        def hook(mod, args):
            a = note(name, float(args[0].detach().abs().amax()) if args[0].numel() else 0.0)
            amax[name] = max(amax.get(name, 0.0), a)
        return hook

    def experts_hook(name):
        def hook(mod, args, kwargs):
            vals = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
            hidden, ids = vals[0], vals[1]
            E = mod.gate_up_proj.shape[0]
            gu, dn = amax.setdefault(name, (torch.zeros(E), torch.zeros(E)))
            tok = hidden.detach().abs().amax(dim=-1).float().cpu()
            ids = ids.detach().cpu().long()
            routed = ids < E
            if len(vals) > 2:  # a pick with weight 0 reaches no output: PrunedMoE(drop) sends pruned picks to id 0 so
                routed &= vals[2].detach().cpu() != 0  # (they would loosen expert 0's input scale)
            bad = tok[routed.any(dim=1) & ~torch.isfinite(tok)]
            if bad.numel():
                note(f"{name} (gate_up_proj)", float(bad[0]))
            for j in range(ids.shape[1]):
                valid = routed[:, j]
                gu.scatter_reduce_(0, ids[valid, j], tok[valid], reduce="amax")
            for e in torch.unique(ids[routed]).tolist():
                rows = ((ids == e) & routed).any(dim=1).nonzero().squeeze(-1).to(hidden.device)
                gate, up = nn.functional.linear(hidden[rows], mod.gate_up_proj[e]).chunk(2, dim=-1)
                h = mod.act_fn(gate) * up
                dn[e] = max(float(dn[e]), note(f"{name}.{e}.down_proj", float(h.abs().amax())))
        return hook

    for name, mod in selected:
        if is_fused_experts(mod):
            hooks.append(mod.register_forward_pre_hook(experts_hook(name), with_kwargs=True))
        elif isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_pre_hook(linear_hook(name)))
    was_training = model.training
    model.eval()
    try:
        n = 0
        if isinstance(calib_data, torch.Tensor):  # input_ids [N, S] (or one sequence [S]): batches of 8 rows
            calib_data = (calib_data if calib_data.dim() == 2 else calib_data.reshape(1, -1)).split(8)
        for batch in calib_data:
            _run_batch(model, batch)
            n += 1
        if n == 0:
            raise ValueError("quantize: calib_data is empty")
        if nonfinite:
            # input_scale = amax / (6 * 448) would be inf / NaN: vLLM quantizes with its reciprocal (0), and the
            # all-or-nothing W4A4 export would otherwise fall back to weight-only without a word
            name, a = next(iter(nonfinite.items()))
            raise ValueError(f"quantize: calibration saw a non-finite activation ({a}) at the input of {name} "
                             f"({len(nonfinite)} layer(s) in all): the model overflows or yields NaN on calib_data "
                             "in its dtype; calibrate in bfloat16 or float32, or check calib_data (no layer was "
                             "quantized)")
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    for name, v in amax.items():
        if isinstance(v, tuple):
            for t in v:  # experts no calibration token reached: the layer's largest amax
                t[t == 0] = float(t.max())
    return amax


def select_and_check_nvfp4(model: nn.Module, recipe: Recipe) -> list:
    """The recipe's modules, each checked (shapes, finite weights) before any is replaced."""
    from torchforge.quantize import check_quantizable, check_selection

    selected = recipe.select(model, check_fused=False)
    check_selection(model, selected, recipe)
    check_quantizable(selected, lambda m: NVFP4Linear(m.in_features, m.out_features, bias=m.bias is not None,
                                                       device="meta"),
                      lambda m: NVFP4Experts.empty_for(m, device="meta"), recipe.quantize_experts,
                      op="nvfp4_quantize")
    return selected


@torch.no_grad()
def quantize_nvfp4(model: nn.Module, recipe: Recipe, calib_data=None) -> dict:
    """Swaps modules in place; returns counts {"linear": n, "moe": n}."""
    # Every module is checked before the first is replaced (as in torchforge.quantize): one that cannot be quantized
    # leaves the model as it was. Then they are calibrated, quantized and swapped one at a time.
    selected = select_and_check_nvfp4(model, recipe)
    amax = calibrate(model, selected, calib_data) if calib_data is not None else {}
    # One weight_scale_2 and one input amax per group of Linear layers vLLM fuses (ModelOpt does the same).
    group_w: dict[str, float] = defaultdict(float)
    group_a: dict[str, float] = defaultdict(float)
    for name, mod in selected:
        if isinstance(mod, nn.Linear) and not is_fused_experts(mod):
            key = _fused_key(name)
            group_w[key] = max(group_w[key], float(mod.weight.detach().abs().amax()))
            group_a[key] = max(group_a[key], amax.get(name, 0.0))
    counts = {"linear": 0, "moe": 0}
    for name, module in selected:
        try:
            if is_fused_experts(module):
                if not recipe.quantize_experts:
                    continue
                experts = NVFP4Experts.from_hf(module)
                if name in amax:
                    experts.set_input_amax(*amax[name])
                block_name = _parent_name(name)
                block = model.get_submodule(block_name)
                model.set_submodule(block_name, NVFP4MoE.from_hf(block, experts))
                counts["moe"] += 1
            elif isinstance(module, nn.Linear):
                key = _fused_key(name)
                ws2 = None
                if key != name and group_w[key] > 0:  # shared by the fused group (amax / (6 * 448), as the op)
                    ws2 = torch.tensor(group_w[key], dtype=torch.float32) / E2M1_E4M3_MAX
                    ws2 = ws2.to(module.weight.device)
                a = group_a[key] if name in amax else None
                model.set_submodule(name, NVFP4Linear.from_linear(module, ws2, a))
                counts["linear"] += 1
        except ValueError as e:  # not seen by the checks (a quantizer's own error); earlier modules are swapped
            raise ValueError(f"quantize: cannot quantize {name}: {e}") from e
    return counts
