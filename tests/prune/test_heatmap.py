"""plot-hitmap's kept-expert marks stay inside their own cell at every cell size."""
import pytest
import torch

from torchforge.prune.heatmap import hitmap_image


@pytest.mark.parametrize("cell", [1, 2, 3, 4, 8])
def test_kept_marks_land_in_their_cells(cell):
    """With cell < 3 the centre mark started at a negative offset: slices wrapped into other cells, or were empty."""
    hit = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [1.0, 1.0, 1.0]])
    em = torch.full((3, 3), -1, dtype=torch.int32)
    for kept in ([(0, 2), (1, 0)], [(0, 0)], [(1, 1)], [(2, 2)]):
        em.fill_(-1)
        for l_idx, e_idx in kept:
            em[l_idx, e_idx] = 0
        white = (hitmap_image(hit, em, cell=cell) == 255).all(-1)
        assert sorted({(r // cell, c // cell) for r, c in white.nonzero().tolist()}) == sorted(kept)
        if cell < 3:  # tiny cells are marked whole
            assert int(white.sum()) == len(kept) * cell * cell


@pytest.mark.parametrize("cell", [0, -2, 2.5])
def test_a_cell_under_one_pixel_is_refused(cell):
    with pytest.raises(ValueError, match="cell must be an integer >= 1"):
        hitmap_image(torch.rand(2, 4), cell=cell)


def test_plot_hitmap_ranks_integer_counts_past_2_24_exactly(tmp_path):
    """Counts as int64: 2^24 + 1 and 2^24 are equal in float32, so the CLI (which ranked in float32) could keep the
    wrong expert of the two; the library ranks in float64."""
    from torchforge.cli import main
    from torchforge.prune import build_expert_map

    hit = torch.tensor([[2 ** 24, 2 ** 24 + 1, 5, 7]])
    torch.save(hit, tmp_path / "hit.pt")
    assert torch.equal(build_expert_map(hit.double(), keep_k=1)[0] >= 0, torch.tensor([False, True, False, False]))
    main(["plot-hitmap", str(tmp_path / "hit.pt"), "--out", str(tmp_path / "h.png"), "--keep-k", "1"])
    from torchforge.prune.heatmap import hitmap_image

    marked = hitmap_image(hit.double(), build_expert_map(hit.double(), keep_k=1))
    unmarked_wrong = hitmap_image(hit.double(), build_expert_map(hit.float(), keep_k=1))
    assert not torch.equal(marked, unmarked_wrong)  # float32 ranking picks the other expert: the test can fail
    from torchforge.prune.heatmap import png_bytes

    assert (tmp_path / "h.png").read_bytes() == png_bytes(marked)
