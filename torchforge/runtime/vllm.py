"""Serving a `drop`-pruned checkpoint in vLLM through FusedMoE's custom routing hook (seed 000 section 5).

vLLM loads the pruned checkpoint as an ordinary model with fewer experts; the router, however, still has a
row per ORIGINAL expert. The routing function below routes over all original experts exactly as the model
does, then maps the picks through the expert map: kept experts get their compact id, pruned ones go to id 0
with weight 0, so vLLM's kernels never see a negative or out-of-range id. vLLM calls it with keywords,
`custom_routing_function(hidden_states=, gating_output=, topk=, renormalize=)`, and expects
`(topk_weights, topk_ids)`; it returns float32 weights and int32 ids (current vLLM casts to those anyway, or the
ids to the kernel's `topk_indices_dtype`). The function does DeepSeek's group-limited selection itself, because
vLLM never combines grouped top-k with a custom function.

Two FusedMoE styles, told apart by duck typing in `install`:

* older vLLM (attribute-based): FusedMoE reads `use_grouped_topk` / `custom_routing_function` on every forward
  and consults the custom function only when `use_grouped_topk` is False and (vLLM ~0.10 / 0.11, whose
  select_experts tries the top-k-with-bias routing first) `e_score_correction_bias` is None; `install` sets both
  attributes and takes the bias off the layer (the routing function holds it).
* current vLLM (router-based): `FusedMoE.__init__` builds `self.router = create_fused_moe_router(...)` once from
  its arguments and hands that object to its `MoERunner` (`runner.router`), which calls
  `router.select_experts(...)`. The attributes `custom_routing_function`, `use_grouped_topk`, ... are still set on
  the layer but only read by monolithic kernels, so setting them afterwards changes nothing. In the factory a
  grouped top-k router wins over a custom function (`use_grouped_topk=True` asserts `custom_routing_function is
  None`), then the custom router, then the bias / plain top-k routers. `install` therefore builds a new router
  with vLLM's own factory (`use_grouped_topk=False`, our function, and the old router's top_k,
  global_num_experts, renormalize, eplb state, indices-type getter) and puts it in place of the old one on the
  layer and on whatever holds it (the runner). It refuses, naming the feature, what cannot be redirected this
  way: a monolithic quant method (`quant_method.is_monolithic`, e.g. FlashInfer TRT-LLM MoE: it routes inside
  the kernel from the raw logits and never calls the router), the zero-expert / routing-simulator routers, ROCm
  AITER fused shared experts. The alternative there: a modular (non-monolithic) MoE backend, no routing
  simulation, fused shared experts off. EPLB state is carried over to the new router unchanged.

`routed_scaling_factor`: older vLLM's DeepSeek MoE applied it to the experts' output (FusedMoE got 1.0). Current
vLLM passes it to FusedMoE and the grouped top-k / bias routers multiply the WEIGHTS by it, unless the model
asks for `apply_routed_scale_to_output` (then the layer and router hold 1.0 and the runner scales the output).
The custom router never applies it, so `install` multiplies the weights by the factor the replaced router (or,
in the attribute style, the layer's grouped / bias routing) would have applied. `e_score_correction_bias` is
unchanged: it picks experts and the weights are the unbiased scores, taken here from the router (or layer).

vLLM files read (vllm-project/vllm, stored snapshots; commit as reported by the index):
  vllm/model_executor/layers/fused_moe/router/router_factory.py      033da35c5c42b17d59960d97e9974ee6fe15ec65
  vllm/model_executor/layers/fused_moe/router/custom_routing_router.py 05da17cdc63b202f32302ff92c24ae65c88d32ec
  vllm/model_executor/layers/fused_moe/router/base_router.py          03919875d63dee772b22935326c8ad468683e43e
  vllm/model_executor/layers/fused_moe/router/grouped_topk_router.py  055e47c28003156421365af985d676fc921cb075
  vllm/model_executor/layers/fused_moe/runner/moe_runner.py           01cb3084506318d5a2d4c40f0798b0db04498b42
  vllm/model_executor/models/deepseek_v2.py                           002d6073aa034d4f5545d45021b0e56d1f3c3593
  vllm/model_executor/layers/fused_moe/layer.py (FusedMoE.__init__, excerpt; commit not reported) and, for the
  attribute style, layer.py 0014ec6c58e1b74e660a1e6d059b5689716183ff.
Not run against a real vLLM here (it cannot run on these machines): `make_routing_function` is tested against
PrunedMoE(drop); `install` is tested against small stand-ins of both FusedMoE styles.
"""
from __future__ import annotations

import torch

from torchforge.ops import moe_remap


def make_routing_function(layer_map: torch.Tensor, *, scoring: str = "softmax",
                          e_score_correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                          renormalize_kept: bool = False, routed_scaling_factor: float = 1.0):
    """A vLLM custom routing function for one layer. `layer_map[E_orig]`: compact id or -1 (expert_map row).

    `routed_scaling_factor` multiplies the returned weights (1.0: not applied; see the module docstring)."""
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"make_routing_function: scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    slot = layer_map.to(torch.int32)

    def routing(hidden_states, gating_output, topk, renormalize, **_):
        logits = gating_output.float()
        scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + e_score_correction_bias.to(scores) if e_score_correction_bias is not None else scores
        if n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, n_group, E // n_group)
            # DeepSeek-V3 (sigmoid) scores a group by its top-2 sum, DeepSeek-V2 (softmax) by its max
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if scoring == "sigmoid" else grouped.amax(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1.0)
            mask = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E).bool()
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = choice.topk(topk, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        total = weights.sum(dim=-1, keepdim=True)
        new_ids, new_w = moe_remap(ids, weights, slot.to(ids.device))
        if renormalize_kept:  # kept weights scaled back to the total of all picks (PrunedMoE's renormalize)
            kept = new_w.sum(dim=-1, keepdim=True)
            new_w = torch.where(kept > 0, new_w * total / torch.where(kept > 0, kept, 1), 0)
        if routed_scaling_factor != 1.0:
            new_w = new_w * routed_scaling_factor
        return new_w.float(), new_ids.to(torch.int32)

    return routing


_REFUSED_ROUTERS = {
    "ZeroExpertRouter": "zero-expert routing (its router also computes the zero experts' output)",
    "RoutingSimulatorRouter": "VLLM_MOE_ROUTING_SIMULATION_STRATEGY (the routing simulator replaces all routing)",
}


def _default_router_factory():
    try:
        from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router
    except ImportError as e:  # a router-style layer without the factory: no supported way to rebuild its router
        raise RuntimeError("torchforge.runtime.vllm.install: this FusedMoE routes through `layer.router` but vLLM's "
                           "`vllm.model_executor.layers.fused_moe.router.router_factory.create_fused_moe_router` "
                           "cannot be imported; pass `router_factory=` (a callable taking the factory's keywords)") from e
    return create_fused_moe_router


def _quant_method(layer):
    qm = getattr(layer, "quant_method", None)
    if qm is None:
        experts = getattr(getattr(layer, "runner", None), "routed_experts", None)
        qm = getattr(experts, "quant_method", None)
    return qm


def _routing_of(layer):
    """What the layer routes with before install: (grouped, n_group, topk_group, bias, weight scale, scoring).

    Stashed on the layer at the first install, so a second install does not read back its own settings."""
    saved = getattr(layer, "_torchforge_vllm_routing", None)
    if saved is not None:
        return saved
    router = getattr(layer, "router", None)
    src = router if router is not None and hasattr(router, "select_experts") else layer
    grouped = bool(getattr(layer, "use_grouped_topk", False)) or hasattr(src, "num_expert_group") and src is router
    n_group = getattr(src, "num_expert_group", None) or getattr(layer, "num_expert_group", None)
    topk_group = getattr(src, "topk_group", None) or getattr(layer, "topk_group", None)
    bias = getattr(src, "e_score_correction_bias", None)
    if bias is None:
        bias = getattr(layer, "e_score_correction_bias", None)
    # the factor vLLM multiplies the weights by: the router's own (grouped / bias routers hold it, the plain top-k
    # router has none), or, in the attribute style, the layer's where its grouped / bias routing would apply it
    if src is router:
        scale = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)
    else:
        scale = float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0) if grouped or bias is not None else 1.0
    scoring = getattr(src, "scoring_func", None) or getattr(layer, "scoring_func", None)
    saved = (grouped, n_group, topk_group, bias, scale, scoring)
    try:
        object.__setattr__(layer, "_torchforge_vllm_routing", saved)
    except (AttributeError, TypeError):
        pass
    return saved


def _replace_router(layer, fn, factory):
    """Router-style FusedMoE: a custom-routing router built by vLLM's factory, in place of the old one."""
    old = layer.router
    name = type(old).__name__
    if name in _REFUSED_ROUTERS:
        raise RuntimeError(f"torchforge.runtime.vllm.install: cannot redirect {name}: {_REFUSED_ROUTERS[name]}; "
                           "serve without it")
    qm = _quant_method(layer)
    if bool(getattr(qm, "is_monolithic", False)):
        raise RuntimeError(
            f"torchforge.runtime.vllm.install: the MoE kernel of this layer ({type(qm).__name__}) is monolithic "
            "(vLLM >= the router refactor: `quant_method.is_monolithic`, e.g. FlashInfer TRT-LLM MoE); it routes "
            "inside the kernel from the raw router logits and never calls `layer.router`, so a custom routing "
            "function cannot take effect. Choose a modular MoE backend (e.g. Triton / CUTLASS via vLLM's MoE "
            "backend setting) for the pruned checkpoint")
    if int(getattr(old, "num_fused_shared_experts", 0) or 0) > 0:
        raise RuntimeError("torchforge.runtime.vllm.install: this layer fuses shared experts into the routed ones "
                           "(ROCm AITER, VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS); the custom router does not "
                           "add them. Turn that fusion off")
    for attr in ("top_k", "global_num_experts"):
        if not hasattr(old, attr):
            raise RuntimeError(f"torchforge.runtime.vllm.install: {name} has no `{attr}`; this vLLM's router "
                               "API is not one install knows how to rebuild")
    kwargs = dict(top_k=old.top_k, global_num_experts=old.global_num_experts,
                  renormalize=bool(getattr(old, "renormalize", getattr(layer, "renormalize", True))),
                  use_grouped_topk=False, custom_routing_function=fn)
    for attr in ("eplb_state", "enable_eplb", "indices_type_getter"):
        if hasattr(old, attr):
            kwargs[attr] = getattr(old, attr)
    new = factory(**kwargs)
    if getattr(new, "custom_routing_function", None) is not fn:
        raise RuntimeError(f"torchforge.runtime.vllm.install: vLLM's router factory returned {type(new).__name__}, "
                           "not a custom-routing router (is VLLM_MOE_ROUTING_SIMULATION_STRATEGY set?)")
    # every holder of the old router: the layer, its runner (which calls select_experts), their submodules
    holders = [layer, getattr(layer, "runner", None)]
    holders += list(layer.modules()) if hasattr(layer, "modules") else []
    seen = set()
    for h in holders:
        if h is None or id(h) in seen or h is old:
            continue
        seen.add(id(h))
        for key, value in list(vars(h).items()) + list(getattr(h, "_modules", {}).items()):
            if value is old:
                setattr(h, key, new)
    if hasattr(layer, "routing_method_type") and hasattr(new, "routing_method_type"):
        layer.routing_method_type = new.routing_method_type
    return new


def _innermost_layers(candidates: list) -> list:
    """The FusedMoE layers among modules that look like one. A MoE block can look like a layer too: vLLM's Llama4MoE
    holds `top_k` and a static `custom_routing_function` (which it passes to its FusedMoE `experts`), so a candidate
    with candidates inside it is such a block, and the inner ones are the layers. Except where the inner one holds the
    outer one's own router: that is a part of the layer (a runner), not a layer."""
    found = {id(m) for m in candidates}

    def shares_router(outer, inner) -> bool:
        router = getattr(inner, "router", None)
        return router is not None and router is getattr(outer, "router", None)

    inside = {id(m): [d for d in list(m.modules())[1:] if id(d) in found] for m in candidates}
    parts = {id(d) for m in candidates for d in inside[id(m)] if shares_router(m, d)}
    return [m for m in candidates if id(m) not in parts and all(id(d) in parts for d in inside[id(m)])]


def install(vllm_model, expert_map: torch.Tensor, *, scoring: str, n_group: int | None = None,
            topk_group: int | None = None, renormalize_kept: bool = False, router_factory=None) -> int:
    """Sets a routing function on every FusedMoE of a loaded vLLM model, in layer order. Returns the count.

    `n_group` / `topk_group`: None takes each layer's own group-limited routing (`num_expert_group`, `topk_group`,
    where grouped top-k is on), which `install` turns off in vLLM and does in the routing function instead;
    silently routing a DeepSeek model without its group limit would pick other experts.
    Attribute-style FusedMoE (older vLLM): sets `custom_routing_function` and turns `use_grouped_topk` off.
    Router-style FusedMoE (current vLLM, `layer.router` with `select_experts`): also replaces the router with one
    from `router_factory` (default: vLLM's `create_fused_moe_router`), see the module docstring; refuses, with
    the reason, layers whose routing cannot be redirected that way."""
    modules = list(vllm_model.modules())
    routers = {id(getattr(m, "router", None)) for m in modules if getattr(m, "router", None) is not None}
    layers = [m for m in modules if id(m) not in routers and hasattr(m, "top_k")
              and (hasattr(m, "custom_routing_function") or hasattr(getattr(m, "router", None), "select_experts"))]
    layers = _innermost_layers(layers)
    if len(layers) != expert_map.shape[0]:
        raise ValueError(f"torchforge.runtime.vllm.install: the model has {len(layers)} FusedMoE layers but the "
                         f"expert map has {expert_map.shape[0]} rows")
    factory = router_factory
    for row, layer in zip(expert_map, layers):
        grouped, layer_ng, layer_tg, bias, scale, layer_scoring = _routing_of(layer)
        if layer_scoring is not None and layer_scoring != scoring:
            raise ValueError(f"torchforge.runtime.vllm.install: scoring={scoring!r} but the layer scores with "
                             f"{layer_scoring!r}")
        ng = n_group if n_group is not None else (layer_ng or 1) if grouped else 1
        tg = topk_group if topk_group is not None else (layer_tg or 1) if grouped else 1
        # the map on the layer's device once: a host-to-device copy per call would not be CUDA-graph capturable
        param = next(iter(layer.parameters()), None) if hasattr(layer, "parameters") else None
        row = row.to(param.device) if param is not None else row
        fn = make_routing_function(row, scoring=scoring, e_score_correction_bias=bias, n_group=ng, topk_group=tg,
                                   renormalize_kept=renormalize_kept, routed_scaling_factor=scale)
        if hasattr(getattr(layer, "router", None), "select_experts"):
            factory = factory or _default_router_factory()
            _replace_router(layer, fn, factory)
        elif getattr(layer, "e_score_correction_bias", None) is not None:
            # attribute style: select_experts tries the fused top-k-with-bias routing before the custom function
            # (vLLM ~0.10/0.11), so the bias, now inside `fn` (and stashed by _routing_of), comes off the layer
            layer.e_score_correction_bias = None
        layer.custom_routing_function = fn
        layer.use_grouped_topk = False
    return len(layers)
