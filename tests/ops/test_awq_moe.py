"""moe_align and the expert-sorted grouped GEMM (awq_moe_gemm)."""
import pytest
import torch

from torchforge.ops import awq_moe_gemm, awq_quantize, awq_unpack
from torchforge.ops._triton import can_launch
from torchforge.ops.moe_align import max_blocks, moe_align


@pytest.mark.parametrize("R,E,BM", [(8, 16, 16), (37, 5, 4), (1, 3, 16), (100, 7, 8), (64, 64, 16)])
def test_moe_align_blocks_hold_one_expert_and_cover_every_row(R, E, BM):
    torch.manual_seed(R * E)
    ids = torch.randint(0, E, (R,))
    rows, block_expert = moe_align(ids, E, BM)
    # the bound counts one bucket more than E: out-of-range ids (none here)
    assert rows.shape == (max_blocks(R, E + 1, BM) * BM,) and rows.dtype == torch.int32
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        blk = rows[b * BM:(b + 1) * BM]
        real = blk[blk < R].long()
        if e >= E:
            assert real.numel() == 0
            continue
        assert bool((ids[real] == e).all())
        seen += real.tolist()
    assert sorted(seen) == list(range(R))


def test_moe_align_puts_out_of_range_ids_in_a_bucket_of_their_own():
    """Ids outside [0, E) are not checked on the host: their rows form blocks of expert E (kernels write NaN)."""
    E, BM = 4, 8
    ids = torch.tensor([2, 9, 0, -1, 2, 4, 3, 3, 1, 7, 0, 2])
    rows, block_expert = moe_align(ids, E, BM)
    assert rows.numel() == max_blocks(ids.numel(), E + 1, BM) * BM
    bad = []
    for b, e in enumerate(block_expert.tolist()):
        blk = rows[b * BM:(b + 1) * BM]
        real = blk[blk < ids.numel()].long()
        if e >= E:
            bad += real.tolist()
        else:
            assert bool((ids[real] == e).all())
    assert sorted(bad) == [1, 3, 5, 9] and block_expert.max().item() == E


def _reference(x, ids, qw, s, z, G, div):
    """Independent: dequantize each row's expert from unpacked nibbles, fp64 matmul."""
    out = []
    for r, e in enumerate(ids.tolist()):
        codes = awq_unpack(qw[e]).double()
        zeros = awq_unpack(z[e]).double().repeat_interleave(G, 0)
        w = (codes - zeros) * s[e].double().repeat_interleave(G, 0)  # [IC, OC]
        out.append(x[r // div].double() @ w)
    return torch.stack(out)


@pytest.mark.parametrize("div", [1, 3])
def test_awq_moe_gemm_reference_path(div):
    torch.manual_seed(div)
    E, K, N, G, T = 4, 64, 24, 32, 5
    qw, s, z = awq_quantize(torch.randn(E, N, K), G, symmetric=False)
    x = torch.randn(T, K)
    ids = torch.randint(0, E, (T * div,))
    out = awq_moe_gemm(x, ids, qw, s, z, G, div)
    expected = _reference(x, ids, qw, s, z, G, div)
    assert ((out.double() - expected).norm() / expected.norm()) < 1e-6


@pytest.mark.skipif(not can_launch(torch.empty(0)), reason="needs triton (interpreter on CPU)")
@pytest.mark.parametrize("T,k,bm", [(1, 2, 16), (9, 3, 16), (40, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sorted_kernel_under_interpreter(T, k, bm, dtype):
    from torchforge.ops.awq_moe_triton import launch_awq_moe_gemm

    torch.manual_seed(T)
    E, K, N, G = 5, 128, 48, 64
    qw, s, z = awq_quantize(torch.randn(E, N, K), G)
    x = torch.randn(T, K).to(dtype)
    ids = torch.randint(0, E, (T * k,))
    out = launch_awq_moe_gemm(x, ids, qw, s, z, G, x_row_div=k, block_m=bm, block_n=32)
    expected = _reference(x, ids, qw, s, z, G, k)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert ((out.double() - expected).norm() / expected.norm()) < tol


@pytest.mark.skipif(not can_launch(torch.empty(0)), reason="needs triton (interpreter on CPU)")
def test_sorted_kernel_out_of_range_ids_give_nan_rows():
    from torchforge.ops.awq_moe_triton import launch_awq_moe_gemm

    torch.manual_seed(7)
    E, K, N, G = 5, 128, 48, 64
    qw, s, z = awq_quantize(torch.randn(E, N, K), G)
    x = torch.randn(12, K)
    ids = torch.randint(0, E, (12,))
    ids[[2, 7]] = torch.tensor([E, -3])
    out = launch_awq_moe_gemm(x, ids, qw, s, z, G, block_m=16, block_n=32)
    good = torch.ones(12, dtype=torch.bool)
    good[[2, 7]] = False
    assert out[~good].isnan().all() and torch.isfinite(out[good]).all()
    expected = _reference(x[good], ids[good], qw, s, z, G, 1)
    assert ((out[good].double() - expected).norm() / expected.norm()) < 1e-6


def test_opcheck_awq_moe_gemm():
    qw, s, z = awq_quantize(torch.randn(3, 16, 64), 32)
    x, ids = torch.randn(4, 64), torch.tensor([0, 2, 1, 1, 0, 2, 2, 0])
    torch.library.opcheck(torch.ops.torchforge.awq_moe_gemm.default, (x, ids, qw, s, z, 32, 2))


def test_bad_ids_length():
    qw, s, z = awq_quantize(torch.randn(3, 16, 64), 32)
    with pytest.raises((ValueError, RuntimeError), match="expected \\(8,\\)"):
        awq_moe_gemm(torch.randn(4, 64), torch.zeros(7, dtype=torch.int64), qw, s, z, 32, 2)


@pytest.mark.cuda
@pytest.mark.parametrize("T,k,E", [(1, 8, 64), (7, 8, 64), (300, 8, 32)])
def test_awq_moe_gemm_cuda(T, k, E):
    torch.manual_seed(T)
    K, N, G = 256, 128, 128
    qw, s, z = awq_quantize(torch.randn(E, N, K, device="cuda"), G)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T * k,), device="cuda")
    out = awq_moe_gemm(x, ids, qw, s, z, G, k)
    expected = _reference(x.cpu().float(), ids.cpu(), qw.cpu(), s.cpu(), z.cpu(), G, k) if T < 10 else None
    cpu = awq_moe_gemm(x.cpu(), ids.cpu(), qw.cpu(), s.cpu(), z.cpu(), G, k)
    assert ((out.cpu().float() - cpu.float()).norm() / cpu.float().norm()) < 1e-2
    if expected is not None:
        assert ((out.cpu().double() - expected).norm() / expected.norm()) < 1e-2
