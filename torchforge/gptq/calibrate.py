"""GPTQ calibration of an HF model: collect layer inputs with hooks, build Hessians, solve, swap modules.

Entry point: ``torchforge.quantize(model, "w4a16-gptq", calib_data=..., gptq=GPTQConfig(...))``, which calls
:func:`quantize_gptq`.

What is collected, per selected module (recipe targets / ignore, as for RTN):

* ``nn.Linear``: its input rows, into a streaming Hessian (:class:`torchforge.gptq.HessianAccumulator`).
* fused routed experts (transformers 5 ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``): a pre-hook on
  the experts module sees ``(hidden [T, H], top_k_index [T, k], ...)``; expert ``e`` gets only the tokens
  routed to it. ``gate_proj`` and ``up_proj`` of an expert read the same tokens, so they share one
  Hessian (the fused ``gate_up`` matrix is solved as one ``[2I, H]`` weight); ``down_proj``'s inputs
  ``act(x W_gate^T) * (x W_up^T)`` are recomputed in the hook from the expert's (still unquantized) weights.

Modes:

* sequential (default, GPTQ's): the inputs of the first decoder layer, and the arguments the model passes every
  decoder layer (each layer's own attention mask: sliding-window and full-attention layers get different ones),
  are captured once by a forward that skips the layers, then layer by layer: run the layer on the stored inputs
  with hooks, solve and swap its modules, run the now quantized layer again, and its outputs become the next
  layer's inputs. Later layers are calibrated on what the quantized earlier layers produce. Memory: one layer's
  Hessians and the hidden states of the calibration set.
* non-sequential (``GPTQConfig(sequential=False)``): one forward of the unquantized model with hooks on
  every selected module, then everything is solved. Faster, more memory, no error feedback across layers.

Selected modules outside the decoder layers (when targeted) are calibrated by one extra forward at the end.
A module (or expert) that sees no calibration token is quantized with ``H = I``, which is round-to-nearest
on the same grid, and a log line names it.

Results: ``nn.Linear`` -> :class:`torchforge.nn.ForgeGPTQLinear` (GPTQ layout); fused experts ->
:class:`torchforge.nn.ForgeAWQExperts` inside a :class:`torchforge.nn.ForgeMoE` (the grouped MoE kernel
reads the AWQ layout, which holds GPTQ codes exactly: same ``(q - z) * s``, no act-order).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from torchforge.gptq.hessian import HessianAccumulator
from torchforge.gptq.solver import GPTQResult, check_scale_range, solve_batched
from torchforge.matching import is_fused_experts
from torchforge.nn.awq_experts import ForgeAWQExperts
from torchforge.nn.gptq_linear import ForgeGPTQLinear, w4_linear_from_gptq
from torchforge.nn.moe import ForgeMoE
from torchforge.ops.awq import awq_pack
from torchforge.ops.awq_reference import check_finite_weight
from torchforge.ops.gptq import gptq_pack

__all__ = ["GPTQConfig", "quantize_gptq"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ options beyond the recipe (which gives bits, group_size, symmetric, targets, ignore).

    block_size: columns per GPTQ block. damp: fraction of ``mean(diag(H))`` added to the diagonal.
    mse: refine group scales by the L^``mse_norm`` grid search. static_groups: group scales from the original
    weights (seed 002) instead of the error-updated ones. sequential: GPTQ's layer-by-layer mode.
    hessian_block_size: keep only block-diagonal Hessians of this size (low memory). max_tokens: cap on
    the tokens per module (per expert for routed experts). chunk_size: experts solved per call.
    batch_size: rows of an ``input_ids`` tensor per calibration forward.
    """

    block_size: int = 128
    damp: float = 0.01
    mse: bool = False
    mse_norm: float = 2.4
    static_groups: bool = False
    sequential: bool = True
    hessian_block_size: Optional[int] = None
    max_tokens: Optional[int] = None
    chunk_size: Optional[int] = None
    batch_size: int = 8

    def __post_init__(self) -> None:
        # a batch size <= 0 split the calibration data into no batch at all: every module then saw no token and was
        # quantized round-to-nearest, with log lines only
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"GPTQConfig: batch_size={self.batch_size!r} must be a positive int (rows of an "
                             "input_ids tensor per calibration forward)")

    @classmethod
    def coerce(cls, x) -> "GPTQConfig":
        if x is None:
            return cls()
        if isinstance(x, cls):
            return x
        if isinstance(x, dict):
            valid = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(x) - valid)
            if unknown:
                raise ValueError(f"GPTQConfig: unknown option(s) {unknown}; valid: {sorted(valid)}")
            return cls(**x)
        raise TypeError(f"gptq options must be a GPTQConfig or a dict, got {type(x).__name__}")


class _StopForward(Exception):
    pass


# ----------------------------------------------------------------------------------- calibration data
def _input_ids(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() == 1:
        t = t.reshape(1, -1)
    if t.dim() != 2 or t.is_floating_point():
        raise ValueError(f"quantize: {what} must be integer input_ids [N, S] (or [S]); got {t.dim()}-D {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"quantize: {what} holds no tokens (shape {tuple(t.shape)})")
    return t


def _split(inputs: Mapping, batch_size: int) -> List[Dict[str, Any]]:
    """A dict of model inputs in batches of `batch_size` rows: the tensors with input_ids' leading size are split."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return [dict(inputs)]
    ids = _input_ids(ids, "calib_data['input_ids']")
    n = ids.shape[0]
    rows = {k: (v.reshape(1, -1) if k == "input_ids" and v.dim() == 1 else v) for k, v in inputs.items()}
    return [{k: v[i:i + batch_size] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n else v
             for k, v in rows.items()} for i in range(0, n, batch_size)]


def _batches(calib_data, batch_size: int) -> List[Dict[str, Any]]:
    """calib_data -> list of model kwargs. Accepts an ``input_ids`` tensor ``[N, S]`` or a dict of model inputs
    (a tokenizer's output: with ``attention_mask``, padding is left out of the statistics), both split in batches
    of ``batch_size`` rows, or an iterable of tensors / dicts, one batch each."""
    if isinstance(calib_data, torch.Tensor):
        t = _input_ids(calib_data, "calib_data")
        return [{"input_ids": t[i:i + batch_size]} for i in range(0, t.shape[0], batch_size)]
    if isinstance(calib_data, Mapping):
        return _split(calib_data, batch_size)
    out = []
    for item in calib_data:
        if isinstance(item, torch.Tensor):
            out.append({"input_ids": _input_ids(item, "a calib_data item")})
        elif isinstance(item, Mapping):
            out.append(dict(item))
        else:
            raise TypeError(f"quantize: calib_data items must be input_ids tensors or dicts of model inputs, got "
                            f"{type(item).__name__}")
    if not out:
        raise ValueError("quantize: calib_data is empty")
    return out


def _kept_tokens(batch: Dict[str, Any]) -> Optional[torch.Tensor]:
    """[B * S] bool, False at padding: from a 2-D attention_mask (None: every token counts)."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.reshape(-1) != 0
    return None


def _without_padding(x: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The rows of x ([..., D], one per token) that are not padding; all of them where keep does not fit."""
    flat = x.reshape(-1, x.shape[-1])
    if keep is None or keep.numel() != flat.shape[0]:
        return flat
    return flat[keep.to(flat.device)]


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _to(batch: Dict[str, Any], device) -> Dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ----------------------------------------------------------------------------------- statistics
class _ExpertStats:
    """Per-expert Hessians of one fused experts module: gate/up share one (inputs [T, H]), down has one."""

    def __init__(self, mod: nn.Module, cfg: GPTQConfig):
        e, two_i, h = mod.gate_up_proj.shape
        kw = dict(block_size=cfg.hessian_block_size, max_tokens=cfg.max_tokens)
        self.gate_up = [HessianAccumulator(h, **kw) for _ in range(e)]
        self.down = [HessianAccumulator(two_i // 2, **kw) for _ in range(e)]
        self.keep: Optional[torch.Tensor] = None  # the current batch's non-padding tokens (_Collector.set_keep)

    @torch.no_grad()
    def hook(self, mod, args, kwargs) -> None:
        names = ("hidden_states", "top_k_index", "top_k_weights")
        vals = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        hidden, idx = vals[0], vals[1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        idx = idx.reshape(flat.shape[0], -1)
        num = mod.gate_up_proj.shape[0]
        routed = (idx >= 0) & (idx < num)  # HF marks dropped slots with id == num_experts
        if self.keep is not None and self.keep.numel() == flat.shape[0]:  # padding tokens route too: leave them out
            routed &= self.keep.to(routed.device)[:, None]
        if len(vals) > 2:  # a pick with weight 0 reaches no output: PrunedMoE(drop) sends pruned picks to id 0 so
            routed &= vals[2].reshape(idx.shape) != 0  # (they would enter expert 0's Hessians)
        for e in torch.unique(idx[routed]).tolist():
            if self.gate_up[e].full and self.down[e].full:
                continue
            x = flat[((idx == e) & routed).any(-1)]
            self.gate_up[e].add(x)
            gate, up = nn.functional.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
            self.down[e].add(mod.act_fn(gate) * up)


class _Collector:
    """Hooks that accumulate the Hessians of a set of selected modules."""

    def __init__(self, modules: List[Tuple[str, nn.Module]], cfg: GPTQConfig):
        self.cfg = cfg
        self.linears: Dict[str, HessianAccumulator] = {}
        self.experts: Dict[str, _ExpertStats] = {}
        self.modules = dict(modules)
        self._handles = []
        self.keep: Optional[torch.Tensor] = None
        for name, mod in modules:
            if is_fused_experts(mod):
                self.experts[name] = _ExpertStats(mod, cfg)
            elif isinstance(mod, nn.Linear):
                self.linears[name] = HessianAccumulator(mod.in_features, block_size=cfg.hessian_block_size,
                                                        max_tokens=cfg.max_tokens)

    def set_keep(self, keep: Optional[torch.Tensor]) -> None:
        """The next forward's non-padding tokens (_kept_tokens of its batch)."""
        self.keep = keep
        for st in self.experts.values():
            st.keep = keep

    def __enter__(self):
        for name, acc in self.linears.items():
            def hook(mod, args, acc=acc):  # returns None: a pre-hook's return value would replace the inputs
                acc.add(_without_padding(args[0].detach(), self.keep))
            self._handles.append(self.modules[name].register_forward_pre_hook(hook))
        for name, st in self.experts.items():
            self._handles.append(self.modules[name].register_forward_pre_hook(st.hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ------------------------------------------------------------------------------------------ solving
def _identity(in_features: int, cfg: GPTQConfig, device) -> torch.Tensor:
    bs = cfg.hessian_block_size
    if bs is None:
        return torch.eye(in_features, device=device)
    return torch.eye(bs, device=device).repeat(math.ceil(in_features / bs), 1, 1)


def _hessian(acc: HessianAccumulator, name: str, cfg: GPTQConfig, device) -> torch.Tensor:
    try:
        h, n = acc.finalize()
    except ValueError as err:  # NaN/Inf activations: say whose inputs they were
        raise ValueError(f"quantize: cannot quantize {name}: {err}") from err
    if n == 0:
        log.info("gptq: %s saw no calibration tokens; quantizing it round-to-nearest (H = I)", name)
        return _identity(acc.in_features, cfg, device)
    return h.to(device)


def _solve(weight: torch.Tensor, hessian: torch.Tensor, recipe, cfg: GPTQConfig) -> GPTQResult:
    return solve_batched(weight, hessian, bits=recipe.bits, group_size=recipe.group_size, symmetric=recipe.symmetric,
                         block_size=cfg.block_size, damp=cfg.damp, mse=cfg.mse, mse_norm=cfg.mse_norm,
                         static_groups=cfg.static_groups, chunk_size=cfg.chunk_size, inplace=True)


def _check_module(name: str, mod: nn.Module, recipe) -> None:
    """Fail before calibrating when a selected module cannot hold the format (same errors as the swap)."""
    g = recipe.group_size
    try:
        if is_fused_experts(mod):
            e, two_i, h = mod.gate_up_proj.shape
            ForgeAWQExperts(e, h, two_i // 2, group_size=g, device="meta")
            if getattr(mod, "is_transposed", False) or getattr(mod, "has_bias", False):
                raise ValueError(f"{type(mod).__name__} with transposed weights or biases is not supported")
        elif isinstance(mod, nn.Linear):
            ForgeGPTQLinear(mod.in_features, mod.out_features, group_size=g, device="meta")
        weights = (mod.gate_up_proj, mod.down_proj) if is_fused_experts(mod) else (mod.weight,)
        for w in weights:
            if w.device.type != "meta":
                check_finite_weight(w.detach(), "gptq")  # NaN compares False: the range check below lets it pass
                check_scale_range("quantize", w.detach(), recipe.bits, g, recipe.symmetric)
    except ValueError as err:
        raise ValueError(f"quantize: cannot quantize {name}: {err}") from err


@torch.no_grad()
def _quantize_collected(model: nn.Module, col: _Collector, recipe, cfg: GPTQConfig, counts: Dict[str, int]) -> None:
    for name, acc in col.linears.items():
        lin = col.modules[name]
        w = lin.weight.detach()
        res = _solve(w[None], _hessian(acc, name, cfg, w.device)[None], recipe, cfg)
        # a ForgeGPTQLinear, or a ForgeAWQLinear where an asymmetric group got a zero point of 0 (the solver has no
        # act-order: the AWQ layout holds the result exactly); vllm-gptq export then refuses the layer by name,
        # compressed-tensors and vllm-awq write it. Scales in the solver's scale dtype.
        codes, scales, zeros = (t[0].T.contiguous() for t in (res.codes, res.scales, res.zeros))
        model.set_submodule(name, w4_linear_from_gptq(lin, gptq_pack(codes), scales, zeros=zeros,
                                                      group_size=recipe.group_size, symmetric=recipe.symmetric))
        counts["linear"] += 1
    for name, st in col.experts.items():
        mod = col.modules[name]
        gu, down = mod.gate_up_proj.detach(), mod.down_proj.detach()
        num, two_i, hid = gu.shape
        empty = [e for e in range(num) if st.gate_up[e].n_seen == 0]
        if empty:
            log.info("gptq: %s: experts %s saw no calibration tokens; quantizing them round-to-nearest (H = I)",
                     name, empty)
        h_gu = torch.stack([_hessian(a, f"{name}.{e}.gate_up", cfg, gu.device) if a.n_seen else
                            _identity(hid, cfg, gu.device) for e, a in enumerate(st.gate_up)])
        h_dn = torch.stack([_hessian(a, f"{name}.{e}.down", cfg, gu.device) if a.n_seen else
                            _identity(two_i // 2, cfg, gu.device) for e, a in enumerate(st.down)])
        r_gu = _solve(gu, h_gu, recipe, cfg)
        del h_gu
        r_dn = _solve(down, h_dn, recipe, cfg)
        experts = ForgeAWQExperts(num, hid, two_i // 2, group_size=recipe.group_size, symmetric=recipe.symmetric,
                                  act_fn=mod.act_fn, device=gu.device)
        for prefix, r in (("gate_up", r_gu), ("down", r_dn)):
            setattr(experts, f"{prefix}_qweight", awq_pack(r.codes.transpose(-1, -2).contiguous()))
            setattr(experts, f"{prefix}_scales", r.scales.transpose(-1, -2).to(torch.float16).contiguous())
            setattr(experts, f"{prefix}_qzeros", awq_pack(r.zeros.transpose(-1, -2).contiguous()))
        block_name = name.rsplit(".", 1)[0]
        model.set_submodule(block_name, ForgeMoE.from_hf(model.get_submodule(block_name), experts))
        counts["moe"] += 1


def _find_layers(model: nn.Module) -> Tuple[Optional[str], Optional[nn.ModuleList]]:
    """The decoder layers: the ModuleList named ``layers`` (HF's ``model.layers``) with the most entries."""
    best = (None, None)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(mod) > 0:
            if best[1] is None or len(mod) > len(best[1]):
                best = (name, mod)
    return best


def _forward_all(model: nn.Module, batches, device, col: "_Collector") -> None:
    for b in batches:
        col.set_keep(_kept_tokens(b))
        model(**_to(b, device), use_cache=False)


def require_calib_data(calib_data) -> None:
    if calib_data is None:
        raise ValueError("quantize: scheme 'w4a16-gptq' needs calib_data (input_ids tensors or dicts of model "
                         "inputs); use 'w4a16-rtn' to quantize without calibration")


def select_and_check_gptq(model: nn.Module, recipe) -> list:
    """The recipe's modules for GPTQ, each checked (shapes, group size, finite weights) before any is replaced."""
    selected = recipe.select(model, check_fused=False)
    if not recipe.quantize_experts:
        selected = [(n, m) for n, m in selected if not is_fused_experts(m)]
    selected = [(n, m) for n, m in selected if is_fused_experts(m) or isinstance(m, nn.Linear)]
    from torchforge.quantize import check_selection

    check_selection(model, selected, recipe)
    for name, mod in selected:
        _check_module(name, mod, recipe)
    return selected


@torch.no_grad()
def quantize_gptq(model: nn.Module, recipe, calib_data, cfg: Optional[GPTQConfig] = None) -> Dict[str, int]:
    """GPTQ-quantizes the recipe's modules of ``model`` in place; returns ``{"linear": n, "moe": m}``."""
    cfg = GPTQConfig.coerce(cfg)
    require_calib_data(calib_data)
    selected = select_and_check_gptq(model, recipe)
    batches = _batches(calib_data, cfg.batch_size)
    if all(k is not None and not bool(k.any()) for k in map(_kept_tokens, batches)):
        # else every module saw no token and was quantized round-to-nearest, with log lines only
        raise ValueError("quantize: calib_data holds no real token (its attention_mask is 0 everywhere); pass "
                         "calibration text with attention_mask 1 at its tokens")
    device = _model_device(model)
    counts = {"linear": 0, "moe": 0}
    was_training = model.training
    model.eval()
    layers_name, layers = _find_layers(model) if cfg.sequential else (None, None)
    if cfg.sequential and layers is None:
        log.info("gptq: no decoder `layers` list found; calibrating non-sequentially")
    try:
        if layers is None:
            with _Collector(selected, cfg) as col:
                _forward_all(model, batches, device, col)
            _quantize_collected(model, col, recipe, cfg, counts)
        else:
            _sequential(model, layers_name, layers, selected, batches, device, recipe, cfg, counts)
    finally:
        model.train(was_training)
    return counts


def _with_hidden(call: Tuple[tuple, dict], hs) -> Tuple[tuple, dict]:
    """A captured layer call with its hidden states replaced by `hs` (positional or keyword, as the model passed
    them)."""
    args, kwargs = call
    return ((hs, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hs})


def _capture_layer_calls(model, layers_name, layers, batches, device) -> Tuple[list, List[list]]:
    """Per batch: the hidden states entering ``layers[0]`` and, for every layer, the (args, kwargs) the model's own
    forward calls it with (hidden states set to None). Each layer keeps its own call: transformers gives every layer
    the attention mask of its type (``causal_mask_mapping[layer_types[i]]``: sliding-window, chunked or full), so
    layer 0's mask cannot stand in for the others. The layers are skipped while capturing (each returns its input
    unchanged; a model whose loop cannot take that runs them) and the forward stops at the last one."""
    n = len(layers)
    cur: list = [None] * n

    def pre(i):
        def fn(mod, args, kwargs):
            cur[i] = (args, kwargs)
            if i == n - 1:
                raise _StopForward
        return fn

    def skip(*args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]

    def run(b, skipped: bool) -> None:
        saved = [layer.__dict__.get("forward") for layer in layers]  # an instance forward (accelerate's hooks)
        cur[:] = [None] * n
        try:
            if skipped:
                for layer in layers:
                    layer.forward = skip
            model(**_to(b, device), use_cache=False)
        except _StopForward:
            pass
        finally:
            if skipped:
                for layer, f in zip(layers, saved):
                    if f is None:
                        del layer.forward
                    else:
                        layer.forward = f

    hidden, calls = [], []
    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for b in batches:
            try:
                run(b, skipped=True)
            except Exception:  # noqa: BLE001 - the model's loop needs the layers' real outputs: run them
                run(b, skipped=False)
            if cur[0] is None:
                raise ValueError(f"quantize: the model's forward never called {layers_name}.0; calibrate with "
                                 "gptq={'sequential': False}")
            args, kwargs = cur[0]
            hidden.append(args[0] if args else kwargs["hidden_states"])
            row, last = [], None
            for call in cur:
                last = _with_hidden(call, None) if call is not None else last  # a layer not called: the one before
                row.append(last)
            calls.append(row)
    finally:
        for h in handles:
            h.remove()
    return hidden, calls


def _sequential(model, layers_name, layers, selected, batches, device, recipe, cfg, counts) -> None:
    hidden, calls = _capture_layer_calls(model, layers_name, layers, batches, device)
    keeps = [_kept_tokens(b) for b in batches]  # one captured call per batch, in order
    prefixes = [f"{layers_name}.{i}." for i in range(len(layers))]
    rest = [(n, m) for n, m in selected if not any(n.startswith(p) for p in prefixes)]
    for i, layer in enumerate(layers):
        mods = [(n, m) for n, m in selected if n.startswith(prefixes[i])]
        if mods:
            with _Collector(mods, cfg) as col:
                for hs, row, keep in zip(hidden, calls, keeps):
                    col.set_keep(keep)
                    args, kwargs = _with_hidden(row[i], hs)
                    layer(*args, **kwargs)
            _quantize_collected(model, col, recipe, cfg, counts)
        if i + 1 < len(layers):
            nxt = []
            for hs, row in zip(hidden, calls):
                args, kwargs = _with_hidden(row[i], hs)
                out = layer(*args, **kwargs)
                nxt.append(out[0] if isinstance(out, (tuple, list)) else out)
            hidden = nxt
    if rest:
        with _Collector(rest, cfg) as col:
            _forward_all(model, batches, device, col)
        _quantize_collected(model, col, recipe, cfg, counts)
