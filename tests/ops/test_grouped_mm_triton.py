"""The fp32 grouped GEMM over rows sorted by expert (the quantized MoE backward's, for fp16 / fp32 activations), launched
under TRITON_INTERPRET=1 on CPU (or on CUDA), against a float64 product with each row's expert weight."""
import pytest
import torch

from torchforge.ops._triton import can_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not can_launch(torch.empty(0, device=DEVICE)),
                                reason="needs triton (CUDA, or the interpreter on CPU)")


@pytest.mark.parametrize("counts,a,b,transposed", [
    ([3, 0, 70, 1, 0], 40, 72, True),  # empty experts, a row tile across no expert boundary, K and N tails
    ([0, 0, 5], 64, 16, False),         # leading empty experts
    ([130], 32, 64, False),             # one expert, three row tiles
    ([1] * 9, 16, 130, True),           # a tile per row
])
def test_matches_each_rows_expert(counts, a, b, transposed):
    from torchforge.ops.grouped_mm_triton import launch_grouped_rows_mm

    torch.manual_seed(len(counts) * 100 + a)
    counts = torch.tensor(counts)
    e, r = len(counts), int(counts.sum())
    rows = torch.randn(r, a, device=DEVICE)
    w = (torch.randn(e, b, a, device=DEVICE).transpose(1, 2) if transposed else torch.randn(e, a, b, device=DEVICE))
    offs = torch.cumsum(counts, 0).to(torch.int32).to(DEVICE)
    out = launch_grouped_rows_mm(rows, w, offs)
    ids = torch.repeat_interleave(torch.arange(e), counts).to(DEVICE)
    want = torch.einsum("ra,rab->rb", rows.double(), w[ids].double())
    assert out.dtype == torch.float32 and out.shape == (r, b)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)  # IEEE fp32 products (no TF32)


def test_no_rows():
    from torchforge.ops.grouped_mm_triton import launch_grouped_rows_mm

    out = launch_grouped_rows_mm(torch.empty(0, 16, device=DEVICE), torch.randn(3, 16, 8, device=DEVICE),
                                 torch.zeros(3, dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, 8)
