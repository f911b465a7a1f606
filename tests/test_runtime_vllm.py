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
