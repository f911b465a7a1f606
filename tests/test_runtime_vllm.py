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
