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
    for bad in (torch.randint(0, 96, (8,)), torch.rand(2, 8), {"input_ids": torch.zeros(1, 4, dtype=torch.long)}):
        with pytest.raises(TypeError, match="batches must yield integer input_ids tensors \\[B, S\\]"):
            collect_router_stats(model, [bad])
