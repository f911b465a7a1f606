"""Router re-implementations (torchforge.nn.routing): equal to HF's routers with nothing pruned, equal to the
smaller HF router of the exported checkpoint with experts pruned, and the group rule on pruned groups."""
import copy

import pytest
import torch

from tests import models
from torchforge.nn.routing import KeptExperts, route_kept, router_groups


def _gate(arch, dtype=torch.float32, **kw):
    model = models.build(arch, dtype=dtype, **kw)
    return models.moe_blocks(model)[-1][1].gate, model.config


def _kept(gate, mask):
    return KeptExperts(torch.as_tensor(mask, dtype=torch.bool), router_groups(gate)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", sorted(models.MOE_BUILDERS))
@torch.no_grad()
def test_equals_hf_router_with_nothing_pruned(arch, dtype):
    gate, _ = _gate(arch, dtype)
    x = torch.randn(64, gate.weight.shape[1]).to(dtype)
    _, hf_w, hf_ids = gate(x)
    E = gate.weight.shape[0]
    for kept in (None, _kept(gate, [True] * E)):
        w, ids = route_kept(gate, x, kept)
        assert w.dtype == hf_w.dtype
        assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)


def _smaller_router(gate, config, kept_ids):
    """The router stock HF builds from the exported config: rows (and bias) of the kept experts only."""
    cfg = copy.deepcopy(config)
    for name in ("n_routed_experts", "num_experts", "num_local_experts"):
        if hasattr(cfg, name):
            setattr(cfg, name, len(kept_ids))
    small = type(gate)(cfg)
    small.weight.data = gate.weight.data[kept_ids].clone()
    if hasattr(gate, "e_score_correction_bias"):
        small.e_score_correction_bias.data = gate.e_score_correction_bias.data[kept_ids].clone()
    return small


@pytest.mark.parametrize("arch, kept_ids", [
    ("deepseek_v3", [1, 2, 4, 7]),  # 2 of each group of 4: n_group survives
    ("deepseek_v2", [0, 3, 5, 6]),
    ("qwen3_moe", [0, 2, 3, 6, 7]),
    ("mixtral", [1, 3]),
])
@torch.no_grad()
def test_pruned_equals_smaller_hf_router(arch, kept_ids):
    gate, config = _gate(arch)
    E = gate.weight.shape[0]
    mask = torch.zeros(E, dtype=torch.bool)
    mask[kept_ids] = True
    x = torch.randn(200, gate.weight.shape[1])
    w, ids = route_kept(gate, x, _kept(gate, mask))
    assert bool(mask[ids].all()), "a pruned expert was picked"
    _, small_w, small_ids = _smaller_router(gate, config, kept_ids)(x)
    assert torch.equal(torch.tensor(kept_ids)[small_ids], ids) and torch.equal(small_w, w)


def _brute_force_v3(gate, x, mask):
    """Per token, the documented rule: group score = sum of the top-2 kept choice scores (missing ones count
    0; no kept expert -> never chosen); top_k of the kept experts in the best topk_group groups, the rest of
    the picks from the other groups by score."""
    n_group, topk_group, top_k = gate.num_group, gate.topk_group, gate.top_k
    E = mask.numel()
    size = E // n_group
    scores = torch.sigmoid(x.double() @ gate.weight.double().T)
    choice = scores + gate.e_score_correction_bias.double()
    out = []
    for t in range(x.shape[0]):
        group_score = {}
        for g in range(n_group):
            kept = [choice[t, e].item() for e in range(g * size, (g + 1) * size) if mask[e]]
            if kept:
                group_score[g] = sum(sorted(kept, reverse=True)[:2])
        groups = sorted(group_score, key=lambda g: -group_score[g])[:topk_group]
        inside = [e for e in range(E) if mask[e] and e // size in groups]
        outside = [e for e in range(E) if mask[e] and e // size not in groups]
        picks = (sorted(inside, key=lambda e: -choice[t, e]) + sorted(outside, key=lambda e: -choice[t, e]))[:top_k]
        w = scores[t, picks]
        w = w / w.sum() * gate.routed_scaling_factor
        out.append(dict(zip(picks, w.tolist())))
    return out


@pytest.mark.parametrize("kept_ids, n_group", [
    ([4, 5, 6, 7], 2),  # group 0 fully pruned: never chosen
    ([0, 4, 5, 6, 7], 2),  # unequal groups, one group with a single kept expert
    ([0, 2, 3, 5, 6, 7], 4),  # groups of 2 keeping 1 or 2, topk_group=1 < top_k: picks filled from other groups
])
@torch.no_grad()
def test_deepseek_v3_group_rule_with_pruned_groups(kept_ids, n_group):
    gate, _ = _gate("deepseek_v3", n_group=n_group, topk_group=1)
    mask = torch.zeros(gate.weight.shape[0], dtype=torch.bool)
    mask[kept_ids] = True
    x = torch.randn(40, gate.weight.shape[1])
    w, ids = route_kept(gate, x, _kept(gate, mask))
    expected = _brute_force_v3(gate, x, mask)
    for t in range(x.shape[0]):
        assert len(set(ids[t].tolist())) == gate.top_k
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        assert got.keys() == expected[t].keys(), (t, got, expected[t])
        for e in got:
            assert got[e] == pytest.approx(expected[t][e], rel=1e-5)
    if kept_ids[0] == 4:
        assert bool((ids >= 4).all())


@torch.no_grad()
def test_deepseek_v2_group_with_no_kept_expert_is_never_chosen():
    gate, _ = _gate("deepseek_v2")
    mask = torch.tensor([False] * 4 + [True] * 4)
    w, ids = route_kept(gate, torch.randn(50, gate.weight.shape[1]), _kept(gate, mask))
    assert bool((ids >= 4).all()) and bool((w > 0).all())


def test_kept_experts_errors_and_layout():
    with pytest.raises(ValueError, match="no expert is kept"):
        KeptExperts(torch.zeros(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="8 experts do not split into n_group=3"):
        KeptExperts(torch.ones(8, dtype=torch.bool), 3)
    kept = KeptExperts(torch.tensor([1, 0, 0, 0, 1, 1, 0, 1], dtype=torch.bool), 2)
    assert kept.group_counts == [1, 3] and not kept.uniform and kept.min_kept_in(1) == 1
    assert kept.group_table.tolist() == [[0, 4, 4], [1, 2, 3]]  # padded with K = 4


def test_unknown_router_family():
    class Gate(torch.nn.Module):
        pass

    with pytest.raises(TypeError, match="no router re-implementation for Gate.*use mode='drop'"):
        route_kept(Gate(), torch.randn(2, 4))
