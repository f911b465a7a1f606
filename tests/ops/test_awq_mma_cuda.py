"""torch.ops.torchforge.awq_mma_cuda (csrc/awq_mma.cu), the tensor-core W4A16 kernel on the mma layout, against an
independent dequantization; awq_mma_linear's dispatch, torch.compile and CUDA-graph capture."""
import pytest
import torch

from tests.ops.awq_oracle import dequant_independent
from tests.ops.graph_check import check_compile_and_cuda_graph
from torchforge.ops import awq_quantize, w4a16_linear
from torchforge.ops._ext import has_cuda_ext
from torchforge.ops.awq_mma_layout import awq_to_mma_layout

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not has_cuda_ext(), reason="needs the compiled extension (csrc/) and a GPU")]
TOL = {torch.float16: 1e-3, torch.bfloat16: 4e-3}


def _case(k, n, G, sym=True, seed=0):
    torch.manual_seed(seed)
    qw, s, z = [t.cuda() for t in awq_quantize(torch.randn(n, k) * 3, G, symmetric=sym)]
    return qw, awq_to_mma_layout(qw), s, z


def _check(out, x, qw, s, z, G, b=None):
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double()
    if b is not None:
        expected += b.double()
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert ((out.double() - expected).norm() / expected.norm()) < TOL[x.dtype]


@pytest.mark.parametrize("k,n,G,m,splits,sym", [
    (128, 64, 128, 1, 1, True),       # one block, one group: all warps but one idle
    (384, 192, 64, 3, 2, False),   # 3 blocks of columns; 6 groups over 16 warps
    (1024, 256, 128, 8, 1, True),     # one 8-row tile of x
    (1024, 256, 128, 9, 1, False),    # two tiles, the second with one row
    (2048, 512, 128, 16, 3, True),    # 16 groups over 24 warps (uneven)
    (2048, 128, 64, 17, 4, False),   # two 16-row blocks of x, the second with one row
    (7168, 512, 128, 33, 7, True),    # DeepSeek-V3 width, three row blocks
    (1024, 320, 128, 64, 1, False),
    (1024, 128, 256, 2, 2, False),   # groups of 256: 4 (or 2) items per group
    (1152, 128, 192, 5, 2, False),   # groups of 192: 3 items per group, the group index by division
    (1024, 192, 128, 100, 1, True),  # 65-128 rows (MMA_CUDA_MAX_M): 7 row blocks, the last with 4 rows
    (256, 128, 32, 3, 2, False),     # groups of 32 (dequantized per register): two per chunk
    (2048, 192, 32, 17, 3, True),    # groups of 32, two row blocks, uneven slices
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("item_chunks", [1, 2])
@pytest.mark.parametrize("warps", [4, 8])
def test_matches_dequantized_matmul(k, n, G, m, splits, sym, dtype, with_bias, item_chunks, warps):
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda

    if G % (64 * item_chunks) and not (G == 32 and item_chunks == 1):
        pytest.skip("an item of 128 k must lie inside one group; groups of 32 take items of 64 k")
    qw, mma, s, z = _case(k, n, G, sym, seed=k + n + m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    # the plain loop (the prefetching one: test_prefetch_same_bits)
    run = lambda splits: launch_awq_mma_cuda(x, mma, s, z, G, b, splits=splits, item_chunks=item_chunks,  # noqa: E731
                                             warps=warps, prefetch=False)
    out = run(splits)
    _check(out, x, qw, s, z, G, b)
    assert torch.equal(out, run(splits))  # deterministic
    if splits > 1:  # the K slices change only the fp32 summation order
        one = run(1)
        assert ((one.float() - out.float()).norm() / one.float().norm()) < 1e-2


@pytest.mark.parametrize("k,n,G,m,splits", [
    (128, 64, 128, 1, 1),       # one item: most warps idle, no second buffer used
    (1024, 256, 128, 8, 1),     # one 8-row tile; 8 items over 8 or 4 warps
    (2048, 512, 128, 16, 3),    # 16 items over 24 / 12 workers: 0-2 items per warp
    (7168, 512, 128, 17, 1),    # 56 items, two row blocks
    (7168, 448, 256, 33, 2),    # groups of 256: 2 items per group
    (3072, 192, 128, 100, 5),   # 65-128 rows, 24 items over 5 slices
])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_prefetch_same_bits(k, n, G, m, splits, warps, scale_dtype):
    """The software-pipelined loop (prefetch) does the same arithmetic in the same order as the plain one: equal bits,
    and both within tolerance of the independent dequantization."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda

    qw, mma, s, z = _case(k, n, G, sym=False, seed=k + m)
    s = s.to(scale_dtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    run = lambda pf: launch_awq_mma_cuda(x, mma, s, z, G, b, splits=splits, item_chunks=2, warps=warps,  # noqa: E731
                                         prefetch=pf)
    out = run(True)
    _check(out, x, qw, s, z, G, b)
    assert torch.equal(out, run(False))


@pytest.mark.parametrize("m,splits", [(3, 2), (24, 1)])
def test_bf16_scales(m, splits):
    """After model.to(bfloat16) the scales are bf16: the kernel reads them as they are (bf16 x only)."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda, mma_cuda_ok

    qw, mma, s, z = _case(2048, 640, 128, seed=9)
    s16 = s.to(torch.bfloat16)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    assert mma_cuda_ok(x, mma, s16, z, 128, None)
    assert not mma_cuda_ok(x.half(), mma, s16, z, 128, None)
    out = launch_awq_mma_cuda(x, mma, s16, z, 128, splits=splits)
    _check(out, x, qw, s16, z, 128)
    op = torch.ops.torchforge.awq_mma_cuda
    with pytest.raises(RuntimeError, match="scales must be float16 \\(or bfloat16 with bfloat16 x\\)"):
        op(x.half(), mma, s16, z, 128, None, 1, 1)
    with pytest.raises(RuntimeError, match="scales must be float16"):
        op(x, mma, s.float(), z, 128, None, 1, 1)


def test_rows_of_x_are_independent():
    """Row i of a 40-row call equals the same row alone (no leakage between 8-row tiles or 16-row blocks)."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda

    qw, mma, s, z = _case(1024, 256, 128, seed=2)
    x = torch.randn(40, 1024, device="cuda", dtype=torch.bfloat16)
    full = launch_awq_mma_cuda(x, mma, s, z, 128, splits=2)
    for i in (0, 7, 8, 15, 16, 39):
        one = launch_awq_mma_cuda(x[i:i + 1], mma, s, z, 128, splits=2)
        torch.testing.assert_close(full[i:i + 1], one, rtol=0, atol=0)


@pytest.mark.parametrize("k,n,G,m,splits,item_chunks,warps,prefetch", [
    (1024, 256, 128, 1, 1, 2, 4, False),   # one row, 4 warps: the one-row fold (R1)
    (7168, 512, 128, 1, 3, 2, 4, False),   # as 18432x7168 dispatches at one row
    (1024, 256, 128, 1, 2, 2, 8, True),    # one row, prefetching loop
    (2048, 192, 64, 1, 3, 1, 8, False),    # one row, items of 64 k
    (1024, 256, 128, 1, 1, 2, 8, False),   # one row on 8 warps, items of 128 k (the launcher keeps the full fold)
    (1024, 256, 128, 3, 2, 2, 4, False),
    (2048, 512, 128, 16, 3, 2, 8, False),  # two row tiles
    (2048, 512, 128, 16, 3, 2, 4, False),  # two row tiles on 4 warps, as 18432x7168 dispatches at 16 rows
    (1024, 256, 128, 16, 1, 2, 8, True),
    (256, 128, 32, 3, 2, 1, 4, False),     # groups of 32 read their zero points anyway
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_symmetric_and_one_row_same_bits(k, n, G, m, splits, item_chunks, warps, prefetch, dtype):
    """symmetric=True (every zero point 8: the kernel leaves qzeros unread) gives the bits of the kernel that reads
    them with one row tile (up to 8 rows; two row tiles put the 8 into each A register instead, awq_mma.cuh ZA: within
    a rounding of them), and reads none: with other zero words passed it still gives them. One row (the fold without
    odd rows) gives row 0 of the same call on two rows."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda
    from torchforge.ops.zero_points import zeros_are_8

    qw, mma, s, z = _case(k, n, G, sym=True, seed=k + m)
    assert zeros_are_8(z)
    x = torch.randn(max(m, 2), k, device="cuda").to(dtype)
    run = lambda x, z, sym: launch_awq_mma_cuda(x, mma, s, z, G, splits=splits, item_chunks=item_chunks,  # noqa: E731
                                                warps=warps, prefetch=prefetch, symmetric=sym)
    out = run(x[:m], z, True)
    _check(out, x[:m], qw, s, z, G)
    read = run(x[:m], z, False)
    if m <= 8 or G == 32:
        assert torch.equal(out, read)
    else:
        assert not torch.equal(out, read)  # the other arithmetic really runs
        assert ((out.double() - read.double()).norm() / read.double().norm()) < TOL[dtype] / 4
    if G != 32:
        assert torch.equal(out, run(x[:m], torch.zeros_like(z), True))
    if m == 1:
        assert torch.equal(out, run(x[:2], z, False)[:1])
        assert torch.equal(out, run(x[:2], z, True)[:1])


def test_opcheck_and_errors():
    qw, mma, s, z = _case(256, 128, 128)
    x = torch.randn(2, 256, device="cuda", dtype=torch.float16)
    op = torch.ops.torchforge.awq_mma_cuda
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 1))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 2))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 1, torch.zeros(8, dtype=torch.int32, device="cuda")))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 2, None, 4))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 1, 2, None, 8, True))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 1, 2, None, 4, False, None, True))
    with pytest.raises(RuntimeError, match="prefetch needs item_chunks = 2 \\(items of 128 k\\) and groups of 64 rows or "
                                           "more, got item_chunks 1, group_size 128"):
        op(x, mma, s, z, 128, None, 1, 1, None, 8, True)
    with pytest.raises(RuntimeError, match="warps must be 4 or 8, got 6"):
        op(x, mma, s, z, 128, None, 1, 1, None, 6)
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 64 \\* item_chunks = 128 \\(or 32 with "
                                           "item_chunks 1\\), got 64 with item_chunks 2"):
        op(x, mma, s, z, 64, None, 1, 2)
    with pytest.raises(RuntimeError, match="item_chunks must be 1 or 2, got 4"):
        op(x, mma, s, z, 128, None, 1, 4)
    with pytest.raises(RuntimeError, match=r"splits must be in \[1, K / \(64 \* item_chunks\) = 2\]"):
        op(x, mma, s, z, 128, None, 3, 2)
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float16"):
        op(x.float(), mma, s, z, 128, None, 1, 1)
    with pytest.raises(RuntimeError, match=r"qweight must be \[N / 64, K \* 8\]"):
        op(x, qw, s, z, 128, None, 1, 1)
    with pytest.raises(RuntimeError, match="bias must be .* in x's dtype"):
        op(x, mma, s, z, 128, torch.zeros(128, device="cuda"), 1, 1)


@pytest.mark.parametrize("m,splits", [(1, 1), (3, 2), (16, 1), (17, 3), (64, 2), (100, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("item_chunks", [1, 2])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("prefetch", [False, True])
def test_perm_reads_x_through_it(m, splits, dtype, item_chunks, warps, prefetch):
    """perm (an act-order layer's feature order): the op gathers x[:, perm] itself; the same bits as the kernel on the
    gathered copy, in every configuration."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda

    qw, mma, s, z = _case(1024, 192, 128, seed=m)
    x = torch.randn(m, 1024, device="cuda").to(dtype)
    perm = torch.randperm(1024, device="cuda").to(torch.int32)
    if prefetch and item_chunks == 1:
        pytest.skip("the prefetching loop takes items of 128 k")
    kw = dict(splits=splits, item_chunks=item_chunks, warps=warps, prefetch=prefetch)
    out = launch_awq_mma_cuda(x, mma, s, z, 128, perm=perm, **kw)
    assert torch.equal(out, launch_awq_mma_cuda(x[:, perm.long()].contiguous(), mma, s, z, 128, **kw))
    _check(out, x[:, perm.long()], qw, s, z, 128)


@pytest.mark.parametrize("m", [1, 16, 200, 600])  # decode kernel, decode kernel, wgmma (sm_90) or cuBLAS, cuBLAS
def test_awq_mma_linear_with_act_perm(m):
    """awq_mma_linear(act_perm=) on every path (gather + decode kernel, the wgmma x image, a dequantized W^T in x's
    feature order + cuBLAS): x[:, perm] @ W.T within the kernels' tolerance of the fp64 product."""
    from torchforge.ops.awq_mma import awq_mma_linear

    qw, mma, s, z = _case(2048, 512, 128, seed=m)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(2048, device="cuda").to(torch.int32)
    out = awq_mma_linear(x, mma, s, z, 128, act_perm=perm)
    _check(out, x[:, perm.long()], qw, s, z, 128)
    if m <= 128:  # the decode kernel on the gathered copy: the same bits
        assert torch.equal(out, awq_mma_linear(x[:, perm.long()].contiguous(), mma, s, z, 128))


def test_perm_out_of_range_reads_nan_not_out_of_bounds():
    """A perm value outside [0, K) (not checked on CUDA: a host sync) gives NaN in the outputs it touches, on the
    decode kernel's gather and on both x image kernels, instead of a read past x."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda

    qw, mma, s, z = _case(1024, 256, 128)
    perm = torch.randperm(1024, device="cuda").to(torch.int32)
    perm[5] = 1 << 20
    x = torch.randn(70, 1024, device="cuda", dtype=torch.bfloat16)
    assert bool(launch_awq_mma_cuda(x, mma, s, z, 128, perm=perm).isnan().all())
    if torch.cuda.get_device_capability() == (9, 0):  # the x image: the shared-memory row kernel, then the L2 one
        big = _case(24704, 128, 128)[1:]
        big_perm = torch.randperm(24704, device="cuda").to(torch.int32)
        big_perm[7] = -3
        for xx, (m_, s_, z_), p in ((x, (mma, s, z), perm), (torch.randn(70, 24704, device="cuda").bfloat16(), big,
                                                              big_perm)):
            out = torch.ops.torchforge.awq_wgmma_cuda(xx, m_, s_, z_, 128, None, 1, 128, 2, 8, True, 0, None, p)
            assert bool(out.isnan().all())


def test_perm_opcheck_and_errors():
    qw, mma, s, z = _case(256, 128, 128)
    x = torch.randn(2, 256, device="cuda", dtype=torch.float16)
    perm = torch.randperm(256, device="cuda").to(torch.int32)
    op = torch.ops.torchforge.awq_mma_cuda
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 1, None, 8, False, perm))
    with pytest.raises(RuntimeError, match=r"perm must be a contiguous, 16-byte aligned int32 tensor of K = 256"):
        op(x, mma, s, z, 128, None, 1, 1, None, 8, False, perm.long())
    with pytest.raises(RuntimeError, match=r"perm must be .* of K = 256 elements on x's device, got \[128\]"):
        op(x, mma, s, z, 128, None, 1, 1, None, 8, False, perm[:128])
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 1, 2, None, 8, True, perm))


@pytest.mark.parametrize("m", [1, 17, 128])
def test_kept_tickets_stay_zero(m):
    """A caller's ticket buffer gives the result of fresh tickets, bit for bit, and is all zeros again afterwards
    (the last K slice of each tile resets its ticket): so a module can keep one across calls."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda, mma_tickets

    qw, mma, s, z = _case(2048, 320, 128, seed=m)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    tickets = mma_tickets(320, device="cuda")
    fresh = launch_awq_mma_cuda(x, mma, s, z, 128, splits=4)
    for _ in range(3):
        assert torch.equal(launch_awq_mma_cuda(x, mma, s, z, 128, splits=4, tickets=tickets), fresh)
        assert int(tickets.count_nonzero()) == 0
    _check(fresh, x, qw, s, z, 128)
    small = torch.zeros(1, dtype=torch.int32, device="cuda")  # too few tickets: the op takes fresh ones
    assert torch.equal(launch_awq_mma_cuda(x, mma, s, z, 128, splits=4, tickets=small), fresh)


def test_awq_mma_linear_dispatch(monkeypatch):
    import torchforge.ops.awq_mma as awq_mma
    from torchforge.ops.awq_mma import awq_mma_linear

    qw, mma, s, z = _case(1024, 512, 128, seed=4)
    calls = []
    real = awq_mma.launch_awq_mma_cuda
    monkeypatch.setattr(awq_mma, "launch_awq_mma_cuda", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    out = awq_mma_linear(x, mma, s, z, 128)
    assert calls == [1]
    _check(out, x, qw, s, z, 128)
    big = torch.randn(3, 50, 1024, device="cuda", dtype=torch.bfloat16)  # 150 rows: wgmma (sm_90) or dequant + cuBLAS
    torch.testing.assert_close(awq_mma_linear(big, mma, s, z, 128), w4a16_linear(big, qw, s, z, 128))
    assert calls == [1]


def test_compile_and_cuda_graph():
    from torchforge.ops.awq_mma import awq_mma_linear

    qw, mma, s, z = _case(2048, 1024, 128, seed=5)
    x = torch.randn(5, 2048, device="cuda", dtype=torch.float16)
    b = torch.randn(1024, device="cuda", dtype=torch.float16)
    check_compile_and_cuda_graph(lambda x: awq_mma_linear(x, mma, s, z, 128, b), x)
    from torchforge.ops.awq_mma_cuda import mma_tickets

    tickets = mma_tickets(1024, device="cuda")  # a module's kept buffer: K slices on 16 tiles
    check_compile_and_cuda_graph(lambda x: awq_mma_linear(x, mma, s, z, 128, b, tickets), x)
    assert int(tickets.count_nonzero()) == 0


def _exact_case(k, n, x_dtype, scale_dtype, m=5, seed=0):
    """Codes, zeros and scales in [0.01, 0.02) (scale_dtype) and x of small integers, so that every product of x and
    the weight rounded to x's dtype, and every partial sum, is exact in fp32 (at most 22 significant bits): the output
    is then the exact sum rounded once, whatever the order of the sum."""
    from torchforge.ops.awq import awq_pack

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=g)
    zeros = torch.randint(0, 16, (k // 32, n), dtype=torch.uint8, generator=g)
    s = (0.01 + 0.01 * torch.rand(k // 32, n, generator=g)).to(scale_dtype)
    qw, z = awq_pack(codes), awq_pack(zeros)
    x = torch.randint(-2 if x_dtype == torch.bfloat16 else -1, 3 if x_dtype == torch.bfloat16 else 2, (m, k),
                      generator=g).to(x_dtype)
    return [t.cuda() for t in (qw, s, z, x)]


@pytest.mark.parametrize("x_dtype,scale_dtype,k", [
    (torch.bfloat16, torch.float16, 256),   # fp16 scales with bf16 x: s = hi + lo, one rounding of (q - z) s
    (torch.bfloat16, torch.bfloat16, 256),
    (torch.float16, torch.float16, 64),
])
@pytest.mark.parametrize("splits,warps", [(1, 8), (2, 4)])
def test_groups_of_32_compute_with_the_reference_weight(x_dtype, scale_dtype, k, splits, warps):
    """Groups of 32 (csrc/awq_mma.cuh, item_dq): each lane's half of a chunk takes its own group's scale and zero, and
    the weight is (q - z) s rounded once to x's dtype, as awq_reference feeds its matmul. With exact sums (see
    _exact_case) that gives the reference's output bit for bit."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda

    qw, s, z, x = _exact_case(k, 128, x_dtype, scale_dtype, seed=k + splits)
    w = dequant_independent(qw, s, z, 32).to(x_dtype)  # [OC, IC] rounded once from fp32 (exact there)
    expected = (x.double() @ w.double().T).to(x_dtype)
    out = launch_awq_mma_cuda(x, awq_to_mma_layout(qw), s, z, 32, splits=min(splits, k // 64), item_chunks=1,
                              warps=warps, prefetch=False)
    assert torch.equal(out, expected)


def test_groups_of_32_dispatch_and_errors(monkeypatch):
    """awq_mma_linear with groups of 32: the decode kernel at 1 and 16 rows, then the Hopper kernel where its time
    model picks it, or dequantize + cuBLAS; the ops refuse what the kernels are not built for."""
    import torchforge.ops.awq_mma as awq_mma
    from torchforge.ops.awq_mma import awq_mma_linear

    qw, mma, s, z = _case(1024, 512, 32, sym=False, seed=6)
    calls = []
    real = awq_mma.launch_awq_mma_cuda
    monkeypatch.setattr(awq_mma, "launch_awq_mma_cuda", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for m in (1, 16, 128, 300):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        _check(awq_mma_linear(x, mma, s, z, 32), x, qw, s, z, 32)
    assert calls[:2] == [1, 1]
    if hasattr(torch.ops.torchforge, "awq_wgmma_cuda") and torch.cuda.get_device_capability() == (9, 0):
        import torchforge.ops.awq_mma_cuda as mma_cuda  # the Hopper kernel, where its time model picks it

        wg, real_wg = [], awq_mma.launch_awq_wgmma_cuda
        monkeypatch.setattr(awq_mma, "launch_awq_wgmma_cuda", lambda *a, **kw: wg.append(1) or real_wg(*a, **kw))
        monkeypatch.setattr(mma_cuda, "wgmma_rows_ok", lambda *a, **kw: True)
        x = torch.randn(200, 1024, device="cuda", dtype=torch.bfloat16)
        _check(awq_mma_linear(x, mma, s, z, 32), x, qw, s, z, 32)
        assert wg == [1]
        # its group-32 instances (warp-specialized only) start with the registers they hand on, on this build
        idx = torch.cuda.current_device()
        for dt, sdt in ((torch.bfloat16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16,) * 2):
            for grouped in (False, True):
                # false would mean this toolchain's build runs group 32 on the slower kernels: worth knowing
                assert torch.ops.torchforge.awq_wgmma_g32_ready(dt, sdt, grouped), (dt, sdt, grouped)
                assert mma_cuda.wgmma_g32_ready(dt, sdt, grouped, idx)
        assert not torch.ops.torchforge.awq_wgmma_g32_ready(torch.float32, torch.float16, False)  # no such kernels
        # a build whose instances fell short: another kernel takes the call instead of an error
        monkeypatch.setattr(mma_cuda, "wgmma_g32_ready", lambda *a: False)
        _check(awq_mma_linear(x, mma, s, z, 32), x, qw, s, z, 32)
        assert wg == [1]
    op = torch.ops.torchforge.awq_mma_cuda
    x = torch.randn(2, 1024, device="cuda", dtype=torch.float16)
    torch.library.opcheck(op, (x, mma, s, z, 32, None, 2, 1))
    with pytest.raises(RuntimeError, match="or 32 with item_chunks 1\\), got 32 with item_chunks 2"):
        op(x, mma, s, z, 32, None, 1, 2)
    with pytest.raises(RuntimeError, match="groups of 64 rows or more, got item_chunks 1, group_size 32"):
        op(x, mma, s, z, 32, None, 1, 1, None, 8, True)
    from torchforge.ops.awq_mma_cuda import mma_cuda_ok

    shifted = torch.empty(z.numel() + 1, dtype=torch.int32, device="cuda")[1:].view(z.shape)  # 4 bytes in
    shifted.copy_(z)
    assert mma_cuda_ok(x, mma, s, z, 32, None) and not mma_cuda_ok(x, mma, s, shifted, 32, None)
    torch.testing.assert_close(awq_mma_linear(x, mma, s, shifted, 32), awq_mma_linear(x, mma, s, z, 32))
    with pytest.raises(RuntimeError, match="with groups of 32, qzeros must be 16-byte aligned"):
        op(x, mma, s, shifted, 32, None, 1, 1)
    if hasattr(torch.ops.torchforge, "awq_wgmma_cuda") and torch.cuda.get_device_capability() == (9, 0):
        with pytest.raises(RuntimeError, match="groups of 32 run the warp-specialized kernel: producer_warp=True"):
            torch.ops.torchforge.awq_wgmma_cuda(torch.randn(64, 1024, device="cuda", dtype=torch.float16), mma, s, z,
                                                32, None, 1, 64, 4, 1)
