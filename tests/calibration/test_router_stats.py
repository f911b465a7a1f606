"""Router statistics against a per-token computation written here, and their use for pruning."""
import pytest
import torch

import torchforge
from tests import models
from torchforge.calibration import RouterStats, collect_router_stats


@pytest.mark.parametrize("arch,prob", [("deepseek_v3", "sigmoid"), ("qwen3_moe", "softmax"), ("mixtral", "softmax")])
def test_stats_match_manual_router_math(arch, prob):
    model = models.build(arch)
    batches = [torch.randint(0, 96, (2, 5)), torch.randint(0, 96, (1, 7))]
    stats = collect_router_stats(model, batches)
    assert stats.tokens == 17 and stats.settings["prob"] == prob
    # independent: capture each router's input, recompute probabilities and picks
    captured = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: captured.setdefault(n, []).append((i[0], o)))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    for h in hooks:
        h.remove()
    for li, name in enumerate(stats.layers):
        gate = model.get_submodule(name)
        x = torch.cat([i.reshape(-1, i.shape[-1]) for i, _ in captured[name]]).double()
        logits = x @ gate.weight.double().T
        p = logits.sigmoid() if prob == "sigmoid" else logits.softmax(-1)
        torch.testing.assert_close(stats.hit_map[li].double(), p.sum(0), rtol=1e-4, atol=1e-4)
        ids = torch.cat([o[2].reshape(-1) for _, o in captured[name]])
        assert torch.equal(stats.topk_counts[li], torch.bincount(ids, minlength=gate.weight.shape[0]))
        k = captured[name][0][1][2].shape[-1]
        assert int(stats.topk_counts[li].sum()) == 17 * k


def test_stats_round_trip_and_prune(tmp_path):
    model = models.build("deepseek_v3")
    stats = collect_router_stats(model, [torch.randint(0, 96, (4, 8))])
    path = stats.save(str(tmp_path / "stats.pt"))
    again = RouterStats.load(path)
    assert torch.equal(again.hit_map, stats.hit_map) and again.tokens == 32
    # the saved file is what the recipe's prune section reads
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 32,
                                "prune": {"hit_map": path, "keep_k": 4, "mode": "reroute"}})
    kept = model.model.layers[1].mlp.kept_original_ids()
    assert sorted(kept.tolist()) == sorted(stats.hit_map[0].topk(4).indices.tolist())


def test_unknown_architecture_needs_router_attr():
    model = models.build("llama")
    with pytest.raises(ValueError, match="router_attr"):
        collect_router_stats(model, [torch.randint(0, 96, (1, 4))])


def test_batches_must_be_input_ids_and_no_full_logits_are_built():
    model = models.build("deepseek_v3")
    shapes = []
    model.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    collect_router_stats(model, [torch.randint(0, 96, (2, 8))])
    assert shapes == [(2, 1, 96)]  # logits of one position, not [2, 8, vocab]
    for bad in (torch.randint(0, 96, (8,)), torch.rand(2, 8), {"input_ids": torch.rand(1, 4)}):
        with pytest.raises(TypeError, match="batches must yield integer input_ids tensors \\[B, S\\]"):
            collect_router_stats(model, [bad])
    with pytest.raises(TypeError, match="a batch mapping needs 'input_ids'"):
        collect_router_stats(model, [{"attention_mask": torch.ones(1, 4, dtype=torch.long)}])
    with pytest.raises(ValueError, match="attention_mask has shape \\(1, 3\\), input_ids \\(1, 4\\)"):
        collect_router_stats(model, [{"input_ids": torch.zeros(1, 4, dtype=torch.long),
                                      "attention_mask": torch.ones(1, 3, dtype=torch.long)}])
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask must hold 0 \\(padding\\) and 1 \\(real token\\) only"):
        collect_router_stats(model, [{"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 0, 0], [1, -1, 1, 1]])}])
    with pytest.raises(ValueError, match="attention_mask rows \\[0\\] have no real token"):
        collect_router_stats(model, [{"input_ids": ids, "attention_mask": torch.tensor([[0, 0, 0, 0], [1, 1, 1, 0]])}])


def test_no_calibration_tokens_is_an_error():
    # all-zero statistics were returned, and build_expert_map then kept the experts with the lowest ids
    model = models.build("qwen3_moe")
    for batches, kw in (([], {}), ([torch.randint(0, 96, (1, 4))], {"max_tokens": 0})):
        with pytest.raises(ValueError, match="collect_router_stats: no calibration token was run"):
            collect_router_stats(model, batches, **kw)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_is_not_counted(side):
    """Padding was counted (tokens, picks, mass: a right-padded batch changed the expert ranking) and a tokenizer's
    batch with an attention_mask was refused: masked positions are now left out of every statistic."""
    from transformers import BatchEncoding

    model = models.build("deepseek_v3").eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(1, 96, (1, 12), generator=g), torch.randint(1, 96, (1, 4), generator=g)
    ref = collect_router_stats(model, [a, b])  # the 16 real tokens, unpadded
    pad = torch.zeros(1, 8, dtype=torch.long)
    row, mask = (torch.cat([b, pad], 1), torch.cat([torch.ones_like(b), pad], 1)) if side == "right" else \
        (torch.cat([pad, b], 1), torch.cat([pad, torch.ones_like(b)], 1))
    batch = BatchEncoding({"input_ids": torch.cat([a, row]), "attention_mask": torch.cat([torch.ones_like(a), mask])})
    got = collect_router_stats(model, [batch])
    assert got.tokens == ref.tokens == 16
    assert torch.equal(got.topk_counts, ref.topk_counts)
    torch.testing.assert_close(got.hit_map, ref.hit_map, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.routed_weight, ref.routed_weight, rtol=1e-5, atol=1e-5)
    assert collect_router_stats(model, [batch], max_tokens=16).tokens == 16


def test_a_mask_without_padding_changes_nothing():
    model = models.build("deepseek_v3").eval()
    ids = torch.randint(0, 96, (2, 8))
    bare = collect_router_stats(model, [ids])
    masked = collect_router_stats(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    assert masked.tokens == bare.tokens == 16
    for name in ("hit_map", "topk_counts", "routed_weight"):
        assert torch.equal(getattr(masked, name), getattr(bare, name))


@pytest.mark.parametrize("mode", ["reroute", "drop"])
def test_a_pruned_model_is_refused(mode):
    """PrunedMoE calls HF's full router only for its hooks: its picks include experts the block no longer has
    (reroute) or gives weight 0 (drop), so statistics of them were not the model's routing."""
    from torchforge.prune import build_expert_map

    model = models.build("deepseek_v3")
    torchforge.prune_experts(model, build_expert_map(torch.rand(1, 8), keep_k=4, n_group=2), mode=mode)
    with pytest.raises(ValueError, match=f"model.layers.1.mlp is a PrunedMoE \\({mode}, 4/8 experts kept\\).*"
                                         "unpruned model"):
        collect_router_stats(model, [torch.randint(0, 96, (1, 4))])


def test_non_finite_router_input_names_the_router():
    # a NaN hidden state (e.g. an fp16 overflow) made a NaN hit_map row that was kept, saved and only refused when a
    # prune used it (after the whole, possibly hours-long, calibration run), naming no module
    model = models.build("deepseek_v3")
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("nan")
    batches = [torch.randint(6, 96, (2, 5)), torch.tensor([[1, 2, 5, 7]])]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate.*NaN/Inf"):
        collect_router_stats(model, batches)
    assert not model._forward_hooks and not model.model.layers[1].mlp.gate._forward_hooks  # hooks removed
