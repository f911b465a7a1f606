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
