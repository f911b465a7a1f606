"""rank_by: experts ranked by router probability mass, top-k pick counts or routed weight (build_expert_map and the
recipe's prune.rank_by), against statistics summed by hand from a per-token routing table."""
import pytest
import torch

from tests import models
from torchforge.calibration import RouterStats
from torchforge.prune import RANK_BY, build_expert_map, ranking_statistic
from torchforge.prune.from_recipe import prune_from_recipe
from torchforge.recipe import PRUNE_RANK_BY, PruneRecipe, Recipe, RecipeError

# One MoE layer, 4 experts, top-2: per token the router's sigmoid probabilities and its picks {expert: weight}.
TOKENS = [
    ([0.6, 0.6, 0.9, 0.1], {2: 2.5, 0: 0.9}),
    ([0.6, 0.5, 0.2, 0.8], {3: 1.4, 0: 1.0}),
    ([0.6, 0.5, 0.2, 0.7], {3: 0.3, 0: 0.2}),
    ([0.6, 0.9, 0.2, 0.1], {1: 2.0, 0: 0.5}),
]
# Summed by hand: probability [2.4, 2.5, 1.5, 1.7], counts [4, 1, 1, 2], weight [2.6, 2.0, 2.5, 1.7]; the two
# experts kept by each statistic, best first:
KEEP_2 = {"probability": [1, 0], "count": [0, 3], "weight": [0, 2]}


def _stats(tokens=TOKENS, num_experts=4) -> RouterStats:
    """RouterStats of one layer summed with plain Python loops (the reference the library's ranking is checked on)."""
    hit, counts, weight = [0.0] * num_experts, [0] * num_experts, [0.0] * num_experts
    for probs, picks in tokens:
        for e in range(num_experts):
            hit[e] += probs[e]
        for e, w in picks.items():
            counts[e] += 1
            weight[e] += w
    return RouterStats(torch.tensor([hit]), torch.tensor([counts]), torch.tensor([weight]), tokens=len(tokens),
                       layers=["model.layers.1.mlp.gate"])


def _row(order: list[int], num_experts: int) -> list[int]:
    row = [-1] * num_experts
    for compact, e in enumerate(order):
        row[e] = compact
    return row


def test_hand_summed_statistics_rank_differently():
    stats = _stats()
    assert torch.allclose(stats.hit_map, torch.tensor([[2.4, 2.5, 1.5, 1.7]]))
    assert stats.topk_counts.tolist() == [[4, 1, 1, 2]]
    assert torch.allclose(stats.routed_weight, torch.tensor([[2.6, 2.0, 2.5, 1.7]]))
    for rank_by, order in KEEP_2.items():
        assert build_expert_map(stats, keep_k=2, rank_by=rank_by).tolist() == [_row(order, 4)], rank_by
    # all four kept: the full descending order, count ties (experts 1 and 2, one pick each) by the lower id
    assert build_expert_map(stats, keep_k=4, rank_by="count").tolist() == [_row([0, 3, 1, 2], 4)]
    assert build_expert_map(stats, keep_k=4, rank_by="weight").tolist() == [_row([0, 2, 1, 3], 4)]


def test_default_and_bare_tensors_are_unchanged(tmp_path):
    stats = _stats()
    assert torch.equal(build_expert_map(stats, keep_k=2), build_expert_map(stats.hit_map, keep_k=2))
    assert torch.equal(build_expert_map(stats, keep_k=2, rank_by="weight"),
                       build_expert_map(stats.routed_weight, keep_k=2))  # a statistic's tensor ranks as it is
    # the dict RouterStats.save writes, as torch.load gives it back
    saved = torch.load(stats.save(str(tmp_path / "stats.pt")), weights_only=True)
    for rank_by, order in KEEP_2.items():
        assert build_expert_map(saved, keep_k=2, rank_by=rank_by).tolist() == [_row(order, 4)]
    assert ranking_statistic(saved, "count").dtype == torch.float64  # counts ranked exactly, as floats
    assert list(RANK_BY) == list(PRUNE_RANK_BY) == ["probability", "count", "weight"]


def test_rank_by_with_balanced_groups():
    # 8 experts in 2 groups of 4; weight ranks 4-7 above 0-3, probability the reverse
    hit = [[8.0, 7, 6, 5, 4, 3, 2, 1]]
    weight = [[1.0, 2, 3, 4, 5, 6, 7, 8]]
    stats = RouterStats(torch.tensor(hit), torch.zeros(1, 8, dtype=torch.int64), torch.tensor(weight))
    assert build_expert_map(stats, keep_k=4, rank_by="weight").tolist() == [[-1] * 4 + [3, 2, 1, 0]]
    kept = build_expert_map(stats, keep_k=4, n_group=2, rank_by="weight")
    assert kept.tolist() == [[-1, -1, 3, 2, -1, -1, 1, 0]]  # the best two of each group, by weight


def test_rank_by_errors():
    stats = _stats()
    with pytest.raises(ValueError, match="needs the router statistics.*not a bare"):
        build_expert_map(stats.hit_map, keep_k=2, rank_by="weight")
    with pytest.raises(ValueError, match="rank_by='softmax': choose one of 'probability', 'count', 'weight'"):
        build_expert_map(stats, keep_k=2, rank_by="softmax")
    with pytest.raises(ValueError, match="choose one of"):
        build_expert_map(stats.hit_map, keep_k=2, rank_by=None)
    with pytest.raises(ValueError, match="'routed_weight' tensor"):
        build_expert_map({"hit_map": stats.hit_map}, keep_k=2, rank_by="weight")


def test_recipe_rank_by_round_trip_and_errors(tmp_path):
    # an absolute path: a file's relative one comes back joined to the file's folder
    r = Recipe.from_dict({"scheme": "w4a16-rtn",
                          "prune": {"hit_map": str(tmp_path / "s.pt"), "keep_k": 2, "rank_by": "weight"}})
    assert r.prune.rank_by == "weight" and r.to_dict()["prune"]["rank_by"] == "weight"
    assert Recipe.from_dict(r.to_dict()) == r
    r.to_file(tmp_path / "r.yaml")
    assert Recipe.from_file(tmp_path / "r.yaml") == r
    assert PruneRecipe(hit_map="s.pt", keep_k=2).rank_by == "probability"  # the default is unchanged
    with pytest.raises(RecipeError, match="prune.rank_by: invalid value 'mass'"):
        PruneRecipe(hit_map="s.pt", keep_k=2, rank_by="mass")
    with pytest.raises(RecipeError, match="rank_by applies"):
        PruneRecipe(expert_map="m.pt", rank_by="count")
    with pytest.raises(RecipeError, match="unknown key.*rankby"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"hit_map": "s.pt", "keep_k": 2, "rankby": "weight"}})


def test_prune_from_recipe_ranks_by_the_chosen_statistic(tmp_path):
    """On a DeepSeek-V3 model (one MoE layer, 8 experts): each rank_by keeps the experts its statistic ranks first."""
    probs = [0.9, 0.8, 0.7, 0.6, 0.1, 0.1, 0.1, 0.1]
    tokens = [(probs, {4: 3.0, 5: 0.1}), (probs, {5: 0.2, 6: 2.0}), (probs, {5: 0.3, 7: 2.5}),
              (probs, {3: 1.0, 2: 0.1})]
    path = _stats(tokens, 8).save(str(tmp_path / "stats.pt"))
    want = {"probability": [0, 1], "count": [5, 2], "weight": [4, 7]}  # count: 5 picked 3 times, then 2 (lower id)
    for rank_by, kept in want.items():
        model = models.build("deepseek_v3")
        prune_from_recipe(model, PruneRecipe(hit_map=path, keep_k=2, mode="drop", rank_by=rank_by))
        assert sorted(model.model.layers[1].mlp.kept_original_ids().tolist()) == sorted(kept), rank_by
    torch.save(torch.rand(1, 8), tmp_path / "bare.pt")  # a bare hit map has no counts
    with pytest.raises(ValueError, match="rank_by='count'.*RouterStats.save.*'topk_counts'"):
        prune_from_recipe(models.build("deepseek_v3"), PruneRecipe(hit_map=str(tmp_path / "bare.pt"), keep_k=2,
                                                                   rank_by="count"))


def test_a_corrupt_recipe_hit_map_is_named(tmp_path):
    """prune.hit_map that torch.load cannot read raised torch's own error naming no file."""
    from torchforge.nn.pruned_moe import PrunedMoE

    model = models.build("deepseek_v3")
    (tmp_path / "hits.pt").write_bytes(b"\x80\x02junk")
    with pytest.raises(ValueError, match=r"recipe prune.hit_map: .*hits\.pt cannot be read by torch\.load"):
        prune_from_recipe(model, PruneRecipe(hit_map=str(tmp_path / "hits.pt"), keep_k=4))
    assert not any(isinstance(m, PrunedMoE) for m in model.modules())
