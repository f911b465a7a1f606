"""The moe_align kernels (one program; chunks over three launches) against the torch-ops reference, bit for bit.
Without a GPU they run under TRITON_INTERPRET=1 (tests/conftest.py) on CPU tensors."""
import pytest
import torch

pytest.importorskip("triton")

from torchforge.ops._triton import can_launch  # noqa: E402
from torchforge.ops.moe_align import moe_align_ref  # noqa: E402
from torchforge.ops.moe_align_triton import launch_moe_align_chunked, launch_moe_align_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not can_launch(torch.empty(0, device=DEVICE)):
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def _check(ids, E, BM, chunk_rows=None):
    if chunk_rows is None:
        rows, block_expert = launch_moe_align_triton(ids, E, BM)
    else:
        rows, block_expert = launch_moe_align_chunked(ids, E, BM, chunk_rows)
    ref_rows, ref_block_expert = moe_align_ref(ids, E, BM)
    assert rows.dtype == block_expert.dtype == torch.int32
    assert torch.equal(rows.cpu(), ref_rows.cpu()) and torch.equal(block_expert.cpu(), ref_block_expert.cpu())


@pytest.mark.parametrize("BM", [8, 16])
@pytest.mark.parametrize("E", [1, 8, 65, 257])
@pytest.mark.parametrize("R", [1, 3, 9, 17, 130, 600])
def test_moe_align_triton_matches_reference(R, E, BM):
    g = torch.Generator().manual_seed(R * 1000 + E)
    ids = torch.randint(0, E, (R,), generator=g)
    bad = torch.rand(R, generator=g) < 0.1  # out-of-range ids: their own bucket
    ids[bad] = torch.tensor([-1, E, E + 5])[torch.randint(0, 3, (int(bad.sum()),), generator=g)]
    _check(ids.to(DEVICE), E, BM)


@pytest.mark.parametrize("R,E,BM", [(0, 8, 16), (0, 1, 8), (40, 8, 16), (33, 257, 8)])
def test_moe_align_triton_edge_cases(R, E, BM):
    _check(torch.full((R,), E // 2, dtype=torch.int64, device=DEVICE), E, BM)  # empty / all one expert
    if R:
        _check(torch.full((R,), -1, dtype=torch.int32, device=DEVICE), E, BM)  # all out of range, int32 ids
        _check(torch.arange(R, device=DEVICE).reshape(-1, 1).expand(R, 2)[:, 1] % E, E, BM)  # strided view


@pytest.mark.parametrize("R,E,BM,chunk_rows", [
    (600, 65, 8, 64),     # 10 chunks, the last one partial
    (512, 8, 16, 128),    # whole chunks only
    (130, 257, 8, 16),    # a chunk is one step of the scatter walk (16 rows x 512 buckets)
    (9, 65, 16, 256),     # fewer rows than one chunk
    (0, 8, 16, 64),
])
def test_moe_align_chunked_matches_reference(R, E, BM, chunk_rows):
    g = torch.Generator().manual_seed(R + E)
    ids = torch.randint(-2, E + 3, (R,), generator=g)  # some out of range on both sides
    _check(ids.to(DEVICE), E, BM, chunk_rows)
    _check(torch.full((R,), E - 1, dtype=torch.int32, device=DEVICE), E, BM, chunk_rows)  # all one expert


def test_moe_align_dispatch_by_rows(monkeypatch):
    """moe_align on CUDA: one program up to MOE_ALIGN_TRITON_MAX_ROWS rows, chunks up to MOE_ALIGN_CHUNKED_MAX_ROWS,
    the torch ops beyond (launchers recorded)."""
    import torchforge.ops.moe_align as dispatch
    import torchforge.ops.moe_align_triton as kernels

    calls = []
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(kernels, "launch_moe_align_triton", lambda ids, e, bm: calls.append(("one", ids.numel())))
    monkeypatch.setattr(kernels, "launch_moe_align_chunked",
                        lambda ids, e, bm, c: calls.append(("chunked", ids.numel(), c)))
    monkeypatch.setattr(dispatch, "moe_align_ref", lambda ids, e, bm: calls.append(("torch", ids.numel())))
    one, chunked = dispatch.MOE_ALIGN_TRITON_MAX_ROWS, dispatch.MOE_ALIGN_CHUNKED_MAX_ROWS
    for rows in (one, one + 1, 8192, 8193, chunked, chunked + 1):
        dispatch.moe_align(torch.zeros(rows, dtype=torch.int64), 8, 16)
    assert calls == [("one", one), ("chunked", one + 1, 64), ("chunked", 8192, 64), ("chunked", 8193, 128),
                     ("chunked", chunked, 128), ("torch", chunked + 1)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.compile of the Triton kernels)")
@pytest.mark.parametrize("R", [9, 144, 600, 9000])  # one program, chunks of 64, chunks of 128 (past 8192 rows)
def test_moe_align_compiles_and_graphs(R):
    """moe_align as dispatched under torch.compile(fullgraph=True) (inductor sees the kernels' stores, some inside a
    called jit function, through torch's mutation analysis) and replayed from a CUDA graph on new ids."""
    from torchforge.ops.moe_align import moe_align

    E, BM = 65, 16
    ids = torch.randint(0, E, (R,), device="cuda")
    compiled = torch.compile(lambda i: moe_align(i, E, BM), fullgraph=True)
    for got, want in zip(compiled(ids), moe_align_ref(ids, E, BM)):
        assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_align(ids, E, BM)
    ids.copy_(torch.randint(0, E, (R,), device="cuda"))
    graph.replay()
    for got, want in zip(captured, moe_align_ref(ids, E, BM)):
        assert torch.equal(got, want)
