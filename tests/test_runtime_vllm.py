"""The vLLM routing hook computes what PrunedMoE(drop) computes (vLLM itself is not available here)."""
import pytest
import torch
import torch.nn.functional as F

from tests import models
from torchforge.prune import build_expert_map, prune_experts
from torchforge.runtime.vllm import make_routing_function


def _by_id(ids, w):
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), w.gather(1, order)


@pytest.mark.parametrize("arch,renorm", [("deepseek_v3", False), ("deepseek_v3", True), ("qwen3_moe", False)])
def test_routing_function_matches_pruned_moe_drop(arch, renorm):
    model = models.build(arch)
    blocks = [m for _, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    E = blocks[0].gate.weight.shape[0]
    emap = build_expert_map(torch.rand(len(blocks), E), keep_k=E // 2)
    prune_experts(model, emap, mode="drop", renormalize=renorm)
    block = [m for _, m in model.named_modules() if type(m).__name__ == "PrunedMoE"][0]
    gate, cfg = block.gate, model.config
    x = torch.randn(13, cfg.hidden_size)
    ids_ref, w_ref = block.remap(*block.route(x))
    logits = F.linear(x.float(), gate.weight.float())
    if arch == "deepseek_v3":
        fn = make_routing_function(emap[0], scoring="sigmoid", e_score_correction_bias=gate.e_score_correction_bias,
                                   n_group=cfg.n_group, topk_group=cfg.topk_group, renormalize_kept=renorm)
        w_ref = w_ref / cfg.routed_scaling_factor  # vLLM applies the scaling to the experts' output
        renormalize = cfg.norm_topk_prob
    else:
        fn = make_routing_function(emap[0], scoring="softmax", renormalize_kept=renorm)
        renormalize = cfg.norm_topk_prob
    w, ids = fn(hidden_states=x, gating_output=logits, topk=gate.top_k, renormalize=renormalize)
    assert ids.dtype == torch.int32 and bool(((ids >= 0) & (ids < E // 2)).all())
    a_ids, a_w = _by_id(ids.long(), w.float())
    b_ids, b_w = _by_id(ids_ref.long(), w_ref.float())
    # pruned picks all map to id 0 with weight 0: compare the weight each compact id receives per token
    a = torch.zeros(13, E // 2).scatter_add_(1, a_ids, a_w)
    b = torch.zeros(13, E // 2).scatter_add_(1, b_ids, b_w)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_scoring():
    with pytest.raises(ValueError, match="scoring"):
        make_routing_function(torch.zeros(4, dtype=torch.int32), scoring="relu")


def test_install_takes_each_layers_group_limited_routing():
    """install() turns vLLM's grouped top-k off; without n_group / topk_group it must take the layer's own (it routed
    a DeepSeek-V3 layer without its group limit: 138 of 256 tokens differed)."""
    from torch import nn

    from torchforge.runtime.vllm import install

    torch.manual_seed(3)
    model = models.build("deepseek_v3")
    gate, cfg = models.moe_blocks(model)[0][1].gate, model.config
    emap = build_expert_map(torch.rand(1, 8), keep_k=6)

    class FakeFusedMoE(nn.Module):  # the attributes vLLM's FusedMoE has for DeepSeek-V3
        def __init__(self):
            super().__init__()
            self.top_k, self.custom_routing_function = cfg.num_experts_per_tok, None
            self.use_grouped_topk, self.num_expert_group, self.topk_group = True, cfg.n_group, cfg.topk_group
            self.e_score_correction_bias = gate.e_score_correction_bias

    vm = nn.Sequential(FakeFusedMoE())
    assert install(vm, emap, scoring="sigmoid") == 1 and vm[0].use_grouped_topk is False
    prune_experts(model, emap, mode="drop")
    block = models.moe_blocks(model)[0][1]
    x = torch.randn(256, cfg.hidden_size)
    ids_ref, w_ref = block.remap(*block.route(x))
    w, ids = vm[0].custom_routing_function(hidden_states=x, gating_output=F.linear(x, gate.weight),
                                           topk=cfg.num_experts_per_tok, renormalize=True)
    a = torch.zeros(256, 6).scatter_add_(1, ids.long(), w)
    b = torch.zeros(256, 6).scatter_add_(1, ids_ref.long(), w_ref / cfg.routed_scaling_factor)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# stand-ins for current vLLM's router-based FusedMoE (router built once in __init__, held by the layer and its
# runner, which calls router.select_experts) and its custom-routing router; no vLLM code, only the names it uses
class _FakeGroupedRouter:
    def __init__(self, top_k, E, ng, tg, bias, scale):
        self.top_k, self.global_num_experts, self.renormalize = top_k, E, True
        self.num_expert_group, self.topk_group, self.scoring_func = ng, tg, "sigmoid"
        self.e_score_correction_bias, self.routed_scaling_factor = bias, scale
        self.eplb_state, self.enable_eplb, self.indices_type_getter = object(), False, lambda: None
        self.num_fused_shared_experts = 0

    def select_experts(self, hidden_states, router_logits):
        raise AssertionError("the grouped router must have been replaced")


class _FakeCustomRouter:
    def __init__(self, **kw):
        self.kw, self.top_k, self.renormalize = kw, kw["top_k"], kw["renormalize"]
        self.global_num_experts, self.eplb_state = kw["global_num_experts"], kw.get("eplb_state")
        self.enable_eplb, self.indices_type_getter = kw.get("enable_eplb", False), kw.get("indices_type_getter")
        self.custom_routing_function = kw["custom_routing_function"]
        self.routing_method_type = "Custom"

    def select_experts(self, hidden_states, router_logits):
        w, ids = self.custom_routing_function(hidden_states=hidden_states, gating_output=router_logits,
                                              topk=self.top_k, renormalize=self.renormalize)
        return w.to(torch.float32), ids.to(torch.int32)


def _fake_factory(calls):
    def factory(**kw):
        calls.append(kw)
        assert kw["use_grouped_topk"] is False  # vLLM's factory asserts no custom function with grouped top-k
        return _FakeCustomRouter(**kw)
    return factory


def _router_style_layer(cfg, gate, *, monolithic=False, router_cls=_FakeGroupedRouter):
    from torch import nn

    class Runner:
        def __init__(self, router):
            self.router = router

    class FakeFusedMoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k, self.custom_routing_function = cfg.num_experts_per_tok, None
            self.use_grouped_topk, self.num_expert_group, self.topk_group = True, cfg.n_group, cfg.topk_group
            self.e_score_correction_bias, self.scoring_func = gate.e_score_correction_bias, "sigmoid"
            self.routed_scaling_factor = cfg.routed_scaling_factor
            self.router = router_cls(cfg.num_experts_per_tok, 8, cfg.n_group, cfg.topk_group,
                                     gate.e_score_correction_bias, cfg.routed_scaling_factor)
            self.runner = Runner(self.router)
            self.quant_method = type("QM", (), {"is_monolithic": monolithic})()
            self.routing_method_type = "DeepSeekV3"
    return FakeFusedMoE()


def _reference(model, emap, cfg, x):
    prune_experts(model, emap, mode="drop")
    block = models.moe_blocks(model)[0][1]
    ids_ref, w_ref = block.remap(*block.route(x))
    return torch.zeros(x.shape[0], 6).scatter_add_(1, ids_ref.long(), w_ref)


def test_install_router_style_replaces_the_router_on_layer_and_runner():
    from torch import nn

    from torchforge.runtime.vllm import install

    torch.manual_seed(3)
    model = models.build("deepseek_v3")
    gate, cfg = models.moe_blocks(model)[0][1].gate, model.config
    emap = build_expert_map(torch.rand(1, 8), keep_k=6)
    layer = _router_style_layer(cfg, gate)
    old, calls = layer.router, []
    vm = nn.Sequential(layer)
    assert install(vm, emap, scoring="sigmoid", router_factory=_fake_factory(calls)) == 1
    assert len(calls) == 1 and layer.router is not old and layer.runner.router is layer.router
    assert calls[0]["eplb_state"] is old.eplb_state and calls[0]["indices_type_getter"] is old.indices_type_getter
    assert calls[0]["top_k"] == cfg.num_experts_per_tok and calls[0]["global_num_experts"] == 8
    assert layer.routing_method_type == "Custom" and layer.use_grouped_topk is False
    x = torch.randn(256, cfg.hidden_size)
    w, ids = layer.runner.router.select_experts(x, F.linear(x, gate.weight))
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    a = torch.zeros(256, 6).scatter_add_(1, ids.long(), w)
    # current vLLM's grouped router multiplies the weights by routed_scaling_factor; the custom one must too
    torch.testing.assert_close(a, _reference(model, emap, cfg, x), rtol=1e-5, atol=1e-6)
    # a second install reads the original routing (grouped, scale), not its own
    assert install(vm, emap, scoring="sigmoid", router_factory=_fake_factory(calls)) == 1
    w2, ids2 = layer.runner.router.select_experts(x, F.linear(x, gate.weight))
    torch.testing.assert_close(torch.zeros(256, 6).scatter_add_(1, ids2.long(), w2), a)


def test_install_attribute_style_applies_the_layers_weight_scale():
    """Attribute-style FusedMoE whose grouped routing scaled the weights (routed_scaling_factor on the layer)."""
    from torch import nn

    from torchforge.runtime.vllm import install

    torch.manual_seed(4)
    model = models.build("deepseek_v3")
    gate, cfg = models.moe_blocks(model)[0][1].gate, model.config
    emap = build_expert_map(torch.rand(1, 8), keep_k=6)
    layer = _router_style_layer(cfg, gate)
    del layer.router, layer.runner  # the older FusedMoE: attributes only
    vm = nn.Sequential(layer)
    assert install(vm, emap, scoring="sigmoid", router_factory=lambda **kw: pytest.fail("no router")) == 1
    x = torch.randn(64, cfg.hidden_size)
    w, ids = layer.custom_routing_function(hidden_states=x, gating_output=F.linear(x, gate.weight),
                                           topk=cfg.num_experts_per_tok, renormalize=True)
    a = torch.zeros(64, 6).scatter_add_(1, ids.long(), w)
    torch.testing.assert_close(a, _reference(model, emap, cfg, x), rtol=1e-5, atol=1e-6)


def test_install_router_style_refusals():
    from torch import nn

    from torchforge.runtime.vllm import install

    model = models.build("deepseek_v3")
    gate, cfg = models.moe_blocks(model)[0][1].gate, model.config
    emap = build_expert_map(torch.rand(1, 8), keep_k=6)
    calls = []
    with pytest.raises(RuntimeError, match="monolithic"):
        install(nn.Sequential(_router_style_layer(cfg, gate, monolithic=True)), emap, scoring="sigmoid",
                router_factory=_fake_factory(calls))

    class ZeroExpertRouter(_FakeGroupedRouter):
        pass
    with pytest.raises(RuntimeError, match="zero-expert"):
        install(nn.Sequential(_router_style_layer(cfg, gate, router_cls=ZeroExpertRouter)), emap,
                scoring="sigmoid", router_factory=_fake_factory(calls))
    with pytest.raises(ValueError, match="scoring"):
        install(nn.Sequential(_router_style_layer(cfg, gate)), emap, scoring="softmax",
                router_factory=_fake_factory(calls))
    with pytest.raises(RuntimeError, match="not a custom-routing router"):
        install(nn.Sequential(_router_style_layer(cfg, gate)), emap, scoring="sigmoid",
                router_factory=lambda **kw: _FakeGroupedRouter(1, 8, 1, 1, None, 1.0))
    assert calls == []


def _attribute_style_select_experts(layer, x, logits):
    """The branch order of attribute-style vLLM's `FusedMoE.select_experts` (e.g. the v0.10 / v0.11 layer.py,
    which gets `e_score_correction_bias=self.e_score_correction_bias` from the layer): grouped top-k, then the
    fused top-k-with-bias router, then plain top-k, and only then the custom routing function."""
    if layer.use_grouped_topk:
        raise AssertionError("grouped top-k taken: the custom routing function is never called")
    if layer.e_score_correction_bias is not None:
        raise AssertionError("fused_topk_bias taken (unpruned ids, no group limit): custom function never called")
    if layer.custom_routing_function is None:
        raise AssertionError("plain top-k taken")
    return layer.custom_routing_function(hidden_states=x, gating_output=logits, topk=layer.top_k,
                                         renormalize=True)


def test_install_attribute_style_with_bias_reaches_the_custom_function():
    """A DeepSeek-V3 FusedMoE of attribute-style vLLM holds `e_score_correction_bias`; its select_experts takes the
    bias branch before the custom one, so install must take the bias into the function and off the layer, and a
    second install must still route with it."""
    from torch import nn

    from torchforge.runtime.vllm import install

    torch.manual_seed(5)
    model = models.build("deepseek_v3")
    gate, cfg = models.moe_blocks(model)[0][1].gate, model.config
    emap = build_expert_map(torch.rand(1, 8), keep_k=6)
    layer = _router_style_layer(cfg, gate)
    del layer.router, layer.runner
    layer.routed_scaling_factor = 1.0  # the model scales the output (vLLM's DeepSeek MoE before the router refactor)
    vm = nn.Sequential(layer)
    x = torch.randn(64, cfg.hidden_size)
    ref = _reference(model, emap, cfg, x) / cfg.routed_scaling_factor
    for _ in range(2):
        assert install(vm, emap, scoring="sigmoid") == 1
        w, ids = _attribute_style_select_experts(layer, x, F.linear(x, gate.weight))
        torch.testing.assert_close(torch.zeros(64, 6).scatter_add_(1, ids.long(), w), ref, rtol=1e-5, atol=1e-6)


def test_install_passes_only_keywords_of_vllms_router_factory():
    """The keywords of vLLM's `create_fused_moe_router` (router/router_factory.py), without **kwargs, so a keyword
    install invents fails here; the fake factory of the tests above takes anything."""
    from torch import nn

    from torchforge.runtime.vllm import install

    def create_fused_moe_router(top_k, global_num_experts, renormalize=True, indices_type_getter=None,
                                use_grouped_topk=False, num_expert_group=None, topk_group=None,
                                scoring_func="softmax", num_fused_shared_experts=0, routed_scaling_factor=1.0,
                                e_score_correction_bias=None, custom_routing_function=None, enable_eplb=False,
                                eplb_state=None, zero_expert_type=None, num_logical_experts=None,
                                hash_indices_table=None):
        assert not use_grouped_topk and custom_routing_function is not None
        return _FakeCustomRouter(top_k=top_k, global_num_experts=global_num_experts, renormalize=renormalize,
                                 eplb_state=eplb_state, enable_eplb=enable_eplb,
                                 indices_type_getter=indices_type_getter,
                                 custom_routing_function=custom_routing_function)

    model = models.build("deepseek_v3")
    gate, cfg = models.moe_blocks(model)[0][1].gate, model.config
    layer = _router_style_layer(cfg, gate)
    assert install(nn.Sequential(layer), build_expert_map(torch.rand(1, 8), keep_k=6), scoring="sigmoid",
                   router_factory=create_fused_moe_router) == 1
    assert layer.runner.router is layer.router and layer.router.custom_routing_function is layer.custom_routing_function


def test_install_counts_a_llama4_style_block_once():
    """vLLM's Llama4MoE has `top_k` and a static `custom_routing_function` itself, beside its FusedMoE `experts`: it
    was counted as a second layer, so install refused a matching expert map (2 layers for 1 row)."""
    from torch import nn

    from torchforge.runtime.vllm import install

    class FakeFusedMoE(nn.Module):  # attribute-style, no grouped top-k (as for Llama 4)
        def __init__(self):
            super().__init__()
            self.top_k, self.custom_routing_function, self.use_grouped_topk = 1, None, False
            self.e_score_correction_bias = None

    class FakeLlama4MoE(nn.Module):
        @staticmethod
        def custom_routing_function(hidden_states, gating_output, topk, renormalize):
            raise AssertionError("not called by install")

        def __init__(self):
            super().__init__()
            self.top_k = 1
            self.experts = FakeFusedMoE()

    vm = nn.Sequential(FakeLlama4MoE(), FakeLlama4MoE())
    emap = torch.tensor([[0, 1, -1, 2], [-1, 0, 1, 2]], dtype=torch.int32)
    assert install(vm, emap, scoring="sigmoid") == 2
    assert all(callable(b.experts.custom_routing_function) for b in vm)
    assert FakeLlama4MoE.custom_routing_function is vm[0].custom_routing_function  # the block itself is untouched


def test_install_keeps_a_layer_whose_runner_holds_its_router():
    """An inner module that holds the layer's own router (a runner built as an nn.Module) is part of the layer: the
    layer is installed, not the runner."""
    from torch import nn

    from torchforge.runtime.vllm import _innermost_layers

    class Router:
        def select_experts(self, *a, **kw):
            raise AssertionError

    class Runner(nn.Module):
        def __init__(self, router):
            super().__init__()
            self.top_k, self.router = 2, router

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k, self.router = 2, Router()
            self.runner = Runner(self.router)

    layer = Layer()
    assert _innermost_layers([layer, layer.runner]) == [layer]
