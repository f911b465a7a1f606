"""Expert maps: invariants over random hit maps, ordering and ties, budgets, file round trip, clear errors."""
import os
import random

import pytest
import torch

from tests import models
from torchforge.prune import (
    EXPERT_MAP_FILE,
    build_expert_map,
    check_hit_map_matches,
    load_expert_map,
    save_expert_map,
    validate_expert_map,
)


def _expected_row(hits: list[float], k: int) -> list[int]:
    """Oracle: rank by (hit descending, expert id ascending)."""
    order = sorted(range(len(hits)), key=lambda e: (-hits[e], e))
    row = [-1] * len(hits)
    for rank, e in enumerate(order[:k]):
        row[e] = rank
    return row


def test_invariants_random_hit_maps():
    rng = random.Random(0)
    for case in range(60):
        L, E = rng.randint(1, 5), rng.randint(1, 40)
        g = torch.Generator().manual_seed(case)
        if case % 3 == 0:  # many ties: small integer hits
            hit = torch.randint(0, 3, (L, E), generator=g).float()
        else:
            hit = torch.rand(L, E, generator=g, dtype=torch.float64) * 10 ** rng.randint(-3, 6)
        keep = [rng.randint(1, E) for _ in range(L)] if case % 2 else rng.randint(1, E)
        m = build_expert_map(hit, keep_k=keep)
        assert m.dtype == torch.int32 and m.shape == (L, E)
        assert torch.equal(validate_expert_map(m, num_experts=E), m)
        ks = keep if isinstance(keep, list) else [keep] * L
        for layer in range(L):
            assert m[layer].tolist() == _expected_row(hit[layer].tolist(), ks[layer])
            assert int((m[layer] >= 0).sum()) == ks[layer] >= 1


def test_descending_hit_order_and_ties():
    hit = torch.tensor([[0.1, 5.0, 0.1, 3.0, 5.0]])
    assert build_expert_map(hit, keep_k=4).tolist() == [[3, 0, -1, 2, 1]]  # 5.0 (ids 1, 4), 3.0, 0.1 (id 0)
    assert build_expert_map(torch.zeros(1, 4), keep_k=2).tolist() == [[0, 1, -1, -1]]


def test_keep_ratio_and_per_layer_budgets():
    hit = torch.rand(3, 10)
    assert (build_expert_map(hit, keep_ratio=0.5) >= 0).sum(1).tolist() == [5, 5, 5]
    assert (build_expert_map(hit, keep_ratio=0.01) >= 0).sum(1).tolist() == [1, 1, 1]  # at least one
    assert (build_expert_map(hit, keep_ratio=1.0) >= 0).sum(1).tolist() == [10, 10, 10]
    # rounded half up, whatever the parity: 2.5 -> 3, 3.5 -> 4, and 0.29 * 50 (14.499999999999998 in floats) -> 15
    for ratio, experts, kept in ((0.5, 5, 3), (0.5, 7, 4), (0.29, 50, 15), (0.3, 10, 3), (0.24, 10, 2)):
        assert (build_expert_map(torch.rand(1, experts), keep_ratio=ratio) >= 0).sum().item() == kept, (ratio, experts)
    assert (build_expert_map(hit, keep_k=[1, 10, 4]) >= 0).sum(1).tolist() == [1, 10, 4]
    assert torch.equal(build_expert_map(hit, keep_k=torch.tensor([2, 2, 2])), build_expert_map(hit, keep_k=2))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(keep_k=9), ValueError, r"keep_k=9 \(layer 0\) is above the number of routed experts E=8"),
    (dict(keep_k=0), ValueError, r"keep_k=0 \(layer 0\) is below 1"),
    (dict(keep_k=[2, 0]), ValueError, r"keep_k=0 \(layer 1\) is below 1"),
    (dict(keep_k=[2, 2, 2]), ValueError, "keep_k has 3 per-layer budgets but hit_map has 2 layers"),
    (dict(keep_k=2, keep_ratio=0.5), ValueError, "exactly one of keep_k.*both were given"),
    (dict(), ValueError, "exactly one of keep_k.*neither was given"),
    (dict(keep_ratio=0.0), ValueError, r"keep_ratio=0.0 must be a number in \(0, 1\]"),
    (dict(keep_ratio=1.5), ValueError, r"keep_ratio=1.5 must be a number in \(0, 1\]"),
    (dict(keep_k=True), TypeError, "keep_k must be an int"),
    (dict(keep_k=2.0), TypeError, "keep_k must be an int"),
])
def test_bad_budgets(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        build_expert_map(torch.rand(2, 8), **kwargs)


def test_bad_hit_maps():
    hit = torch.rand(2, 8)
    hit[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"1 NaN/Inf entries \(first at layer 1, expert 3: nan\)"):
        build_expert_map(hit, keep_k=2)
    hit[1, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        build_expert_map(hit, keep_k=2)
    with pytest.raises(ValueError, match=r"hit_map must be 2-D \[L, E\].*got shape \(8,\)"):
        build_expert_map(torch.rand(8), keep_k=2)
    with pytest.raises(TypeError, match="hit_map must be a float tensor.*torch.int64"):
        build_expert_map(torch.ones(2, 8, dtype=torch.int64), keep_k=2)
    with pytest.raises(ValueError, match="at least one layer and one expert"):
        build_expert_map(torch.rand(0, 8), keep_k=2)


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([[0, 1, -1], [-1, -1, -1]], dtype=torch.int32), "row 1 keeps no expert"),
    (torch.tensor([[0, 0, -1]], dtype=torch.int32), r"compact ids are \[0, 0\], not 0..1"),
    (torch.tensor([[0, 2, -1]], dtype=torch.int32), r"compact ids are \[0, 2\], not 0..1"),
    (torch.tensor([[0, -2, 1]], dtype=torch.int32), "values below -1"),
    (torch.tensor([[0.0, 1.0]]), "integer tensor"),
    (torch.tensor([0, 1], dtype=torch.int32), "2-D"),
])
def test_validate_rejects(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        validate_expert_map(bad)


def test_validate_num_experts():
    with pytest.raises(ValueError, match="3 columns but the router has 8 experts"):
        validate_expert_map(torch.tensor([[0, 1, -1]], dtype=torch.int32), num_experts=8)


def test_save_load_round_trip(tmp_path):
    m = build_expert_map(torch.rand(3, 16), keep_k=[4, 8, 1])
    path = save_expert_map(m, tmp_path)
    assert path == os.path.join(str(tmp_path), EXPERT_MAP_FILE)
    assert sorted(os.listdir(tmp_path)) == [EXPERT_MAP_FILE]  # no temporary file left behind
    loaded = load_expert_map(tmp_path)
    assert loaded.dtype == torch.int32 and torch.equal(loaded, m)
    assert torch.equal(load_expert_map(path), m)
    save_expert_map(m[:1], tmp_path)  # overwrite in place
    assert load_expert_map(tmp_path).shape == (1, 16)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="expert_map.pt does not exist"):
        load_expert_map(tmp_path)
    torch.save(torch.tensor([[0, 0]], dtype=torch.int32), tmp_path / EXPERT_MAP_FILE)
    with pytest.raises(ValueError, match=r"load_expert_map: .*expert_map.pt: .*compact ids are \[0, 0\]"):
        load_expert_map(tmp_path)
    with pytest.raises(ValueError, match="keeps no expert"):
        save_expert_map(torch.full((1, 4), -1, dtype=torch.int32), tmp_path)


def test_hit_map_must_match_model():
    model = models.build("qwen3_moe")  # 2 MoE layers, 8 experts
    check_hit_map_matches(torch.rand(2, 8), model)
    with pytest.raises(ValueError, match=r"hit map has shape \(3, 8\) but the model has 2 MoE layers "
                                         r"\(model.layers.0.mlp, model.layers.1.mlp\) with 8 routed experts each: "
                                         r"expected \(2, 8\)"):
        check_hit_map_matches(torch.rand(3, 8), model)
    with pytest.raises(ValueError, match=r"expected \(1, 8\)"):  # DeepSeek-V3: layer 0 is dense
        check_hit_map_matches(torch.rand(2, 8), models.build("deepseek_v3"))
    with pytest.raises(ValueError, match="has no MoE blocks"):
        check_hit_map_matches(torch.rand(2, 8), models.build("llama"))


def test_group_balanced_map_keeps_the_best_of_each_group():
    hits = torch.tensor([[9.0, 8, 7, 6, 1, 2, 3, 0.5], [1.0, 2, 3, 4, 5, 6, 7, 8]])
    m = build_expert_map(hits, keep_k=4, n_group=2)
    # layer 0: group 0 keeps experts 0, 1 and group 1 keeps 6, 5; compact ids by overall hit order
    assert m[0].tolist() == [0, 1, -1, -1, -1, 3, 2, -1]
    assert m[1].tolist() == [-1, -1, 3, 2, -1, -1, 1, 0]
    assert ((m >= 0).view(2, 2, 4).sum(-1) == 2).all()
    with pytest.raises(ValueError, match="keep_k=3 does not split evenly over n_group=2"):
        build_expert_map(hits, keep_k=3, n_group=2)
    with pytest.raises(ValueError, match="keep_ratio=0.375 keeps 3 experts per layer, which does not split evenly"):
        build_expert_map(hits, keep_ratio=0.375, n_group=2)
    with pytest.raises(ValueError, match="positive divisor of the 8"):
        build_expert_map(hits, keep_k=4, n_group=3)


def test_a_corrupt_expert_map_file_is_named(tmp_path):
    """A truncated or foreign expert_map.pt raised torch.load's own error (an UnpicklingError, a struct error) naming
    no file; the CLI printed a traceback."""
    from torchforge.cli import main

    m = build_expert_map(torch.rand(2, 8), keep_k=3)
    save_expert_map(m, tmp_path)
    data = (tmp_path / EXPERT_MAP_FILE).read_bytes()
    assert torch.equal(load_expert_map(tmp_path), m)
    for junk in (data[: len(data) // 2], b"not a torch file"):
        (tmp_path / EXPERT_MAP_FILE).write_bytes(junk)
        with pytest.raises(ValueError, match=r"load_expert_map: .*expert_map\.pt cannot be read by torch\.load"):
            load_expert_map(tmp_path)
    torch.save(torch.rand(2, 8), tmp_path / "hit.pt")
    assert main(["plot-hitmap", str(tmp_path / "hit.pt"), "--out", str(tmp_path / "h.png"),
                 "--expert-map", str(tmp_path)]) == 2
    assert not (tmp_path / "h.png").exists()
