"""torch.ops.torchforge.awq_wgmma_cuda (csrc/awq_wgmma.cu), the Hopper warpgroup-MMA W4A16 kernel on the mma layout:
bit-exact weights through one-hot rows of x, random shapes with tails against an independent dequantization, every
(block_m, tile_set) shape, K slices, dtypes, opcheck, errors, awq_mma_linear's dispatch, compile and CUDA graphs."""
import pytest
import torch

from tests.ops.awq_oracle import dequant_independent
from tests.ops.graph_check import check_compile_and_cuda_graph
from torchforge.ops import awq_quantize
from torchforge.ops._ext import has_cuda_ext
from torchforge.ops.awq_mma_layout import awq_to_mma_layout


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not (has_cuda_ext() and _sm90()),
                                 reason="needs the compiled extension (csrc/) and an sm_90 GPU")]
TOL = {torch.float16: 1e-3, torch.bfloat16: 4e-3}
SHAPES = [(64, 4), (64, 2), (128, 2), (192, 1), (256, 1)]


def _case(k, n, G, sym=True, seed=0):
    torch.manual_seed(seed)
    qw, s, z = [t.cuda() for t in awq_quantize(torch.randn(n, k) * 3, G, symmetric=sym)]
    return qw, awq_to_mma_layout(qw), s, z


def _run(x, mma, s, z, G, b=None, shape=(128, 2), splits=1, group_m=8):
    # groups of 32 run the warp-specialized kernel only (producer_warp)
    return torch.ops.torchforge.awq_wgmma_cuda(x, mma, s, z, G, b, splits, shape[0], shape[1], group_m, G == 32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits,ws", [(1, False), (3, True), (0, True)])  # whole tiles, K slices, stream-K
@pytest.mark.parametrize("m", [70, 300])
@pytest.mark.parametrize("k", [1024, 24576, 24704])  # a row of x in shared memory (48 KB at most), else from L2
@pytest.mark.parametrize("G", [128, 32])
def test_perm_reads_x_through_it(shape, splits, ws, m, k, G):
    """perm (an act-order layer's feature order): the x image kernels gather x[:, perm]; the same bits as the kernel
    on the gathered copy (rows past M zero in both). Groups of 32 (act-order GPTQ checkpoints of group 32): the
    warp-specialized kernels only."""
    if k > 1024 and (shape != (128, 2) or m != 70):
        pytest.skip("the large-K path once per configuration kind")
    if G == 32 and not ws:
        pytest.skip("groups of 32 run the warp-specialized kernel only")
    qw, mma, s, z = _case(k, 256, G, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(k, device="cuda").to(torch.int32)
    op = torch.ops.torchforge.awq_wgmma_cuda
    args = (s, z, G, None, splits, shape[0], shape[1], 8, ws)
    out = op(x, mma, *args, 0, None, perm)
    assert torch.equal(out, op(x[:, perm.long()].contiguous(), mma, *args))
    with pytest.raises(RuntimeError, match=f"perm must be a contiguous, 16-byte aligned int32 tensor of K = {k}"):
        op(x, mma, *args, 0, None, perm[:512])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.bfloat16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("G", [128, 32])
def test_one_hot_rows_give_the_weights_bit_exact(shape, dtype, scale_dtype, splits, G):
    """Row m of x = e_{k_m}: out[m] is column k_m of the weight, (q - z) s rounded once to x's dtype (the reference's
    weight), whatever the k order in shared memory, the column mapping of the warps, the scale split or the slices;
    with groups of 32, whichever of a chunk's two rows of scales each lane takes."""
    k, n = 768, 640  # 640 columns: the last block of 256 has 2 of its 4 column blocks
    qw, mma, s, z = _case(k, n, G, sym=False, seed=1)
    s = s.to(scale_dtype)
    w = dequant_independent(qw, s, z, G)  # fp32 [n, k]: exact products
    torch.manual_seed(2)
    m = 300  # several row blocks, the last partial
    ks = torch.randint(0, k, (m,), device="cuda")
    x = torch.zeros(m, k, device="cuda", dtype=dtype)
    x[torch.arange(m), ks] = 1
    out = _run(x, mma, s, z, G, shape=shape, splits=splits)
    assert torch.equal(out, w[:, ks].T.to(dtype))


@pytest.mark.parametrize("k,n,G,m,splits,sym", [
    (128, 64, 128, 1, 1, True),      # one column block of four, one row
    (384, 192, 64, 3, 2, False),     # groups of 64: a new group every chunk
    (1024, 256, 128, 64, 1, True),
    (1024, 320, 128, 65, 2, False),  # a second row block with one row
    (2048, 128, 64, 130, 4, False),
    (1152, 128, 192, 17, 3, False),  # groups of 192: slices start inside a group
    (7168, 512, 128, 200, 7, True),  # DeepSeek-V3 width, uneven slices
    (1024, 128, 256, 257, 1, False),
    (1024, 256, 32, 70, 1, False),   # groups of 32: two rows of scales per chunk
    (2048, 192, 32, 130, 3, True),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(64, 4), (128, 2)])
def test_matches_dequantized_matmul(k, n, G, m, splits, sym, dtype, with_bias, shape):
    qw, mma, s, z = _case(k, n, G, sym, seed=k + n + m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    out = _run(x, mma, s, z, G, b, shape=shape, splits=splits, group_m=3)
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double()
    if b is not None:
        expected += b.double()
    assert out.dtype == dtype and out.shape == expected.shape
    assert ((out.double() - expected).norm() / expected.norm()) < TOL[dtype]
    assert torch.equal(out, _run(x, mma, s, z, G, b, shape=shape, splits=splits, group_m=3))  # deterministic
    if splits > 1:  # the K slices change only the fp32 summation order
        one = _run(x, mma, s, z, G, b, shape=shape, splits=1)
        assert ((one.float() - out.float()).norm() / one.float().norm()) < 1e-2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,G,splits,scale_dtype", [
    (7168, 128, 1, torch.bfloat16),  # 112 chunks: the stage ring wraps 28 times
    (7168, 128, 3, torch.float16),   # K slices (each restarts the ring); fp16 scales with bf16 x (split scales)
    (576, 64, 8, torch.bfloat16),    # 9 chunks in slices of 2: slices shorter than the ring, the last 3 empty;
])                                   # groups of 64 (one chunk per group)
def test_producer_warp_gives_the_same_bits(shape, k, G, splits, scale_dtype):
    """The warp-specialized kernel (a producer warp, or with two consumer warpgroups a producer warpgroup that hands
    them its registers; full and empty mbarriers per stage) runs the same wgmmas in the same order as the default
    one: the same bits. 640 columns leave a partial group of column blocks; two row blocks, the second partial. (Run
    under a timeout on a new build: a barrier bug hangs rather than fails.)"""
    qw, mma, s, z = _case(k, 640, G, sym=False, seed=7)
    s = s.to(scale_dtype)
    x = torch.randn(shape[0] + 5, k, device="cuda", dtype=torch.bfloat16)
    base = _run(x, mma, s, z, G, shape=shape, splits=splits)
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double()
    assert ((base.double() - expected).norm() / expected.norm()) < TOL[torch.bfloat16]
    op = torch.ops.torchforge.awq_wgmma_cuda
    ws = op(x, mma, s, z, G, None, splits, shape[0], shape[1], 8, True)
    assert torch.equal(ws, base)
    assert torch.equal(op(x, mma, s, z, G, None, splits, shape[0], shape[1], 8, True), base)  # deterministic


@pytest.mark.parametrize("shape", [(64, 2), (128, 2), (192, 1), (256, 1)])
def test_producer_warpgroup_with_fp16_x(shape):
    """fp16 x and scales through the two-warpgroup WS kernels (the producer warpgroup that hands its registers to the
    consumers): the same bits as the default kernel, and the dequantized matmul within tolerance."""
    qw, mma, s, z = _case(2048, 640, 128, sym=False, seed=11)
    x = torch.randn(shape[0] + 9, 2048, device="cuda", dtype=torch.float16)
    base = _run(x, mma, s, z, 128, shape=shape, splits=2)
    expected = x.double() @ dequant_independent(qw, s, z, 128).T.double()
    assert ((base.double() - expected).norm() / expected.norm()) < TOL[torch.float16]
    ws = torch.ops.torchforge.awq_wgmma_cuda(x, mma, s, z, 128, None, 2, shape[0], shape[1], 8, True)
    assert torch.equal(ws, base)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ws", [False, True])
def test_k_slices_on_the_last_tiles_only(shape, ws):
    """dp_tiles: tiles [0, dp_tiles) run whole (the bits of splits = 1), the rest in K slices (the bits of every
    tile in slices), in one launch with the sliced blocks first; each output element is one or the other, and the
    result is right."""
    qw, mma, s, z = _case(2048, 1280, 128, sym=False, seed=17)  # 5 groups of 256 columns
    x = torch.randn(2 * shape[0] + 7, 2048, device="cuda", dtype=torch.float16)  # 3 row blocks, the last partial
    op = torch.ops.torchforge.awq_wgmma_cuda
    whole = op(x, mma, s, z, 128, None, 1, shape[0], shape[1], 2, ws)
    sliced = op(x, mma, s, z, 128, None, 3, shape[0], shape[1], 2, ws)
    same = (whole == sliced).sum()  # rounded to fp16, most elements agree; some hundreds do not
    assert same < whole.numel()
    tiles = 5 * (4 // (shape[1] * (2 if shape[1] == 2 or shape[0] >= 192 else 1))) * 3  # two warpgroups but (64, 4)

    def run(dp):  # after a NaN-filled block of the output's size went back to the allocator: an unwritten tile shows
        torch.full_like(whole, float("nan"))
        return op(x, mma, s, z, 128, None, 3, shape[0], shape[1], 2, ws, dp)

    tickets = torch.zeros(tiles, dtype=torch.int32, device="cuda")  # kept across calls, as a module's
    for dp in (1, tiles // 2, tiles - 1):
        out = run(dp)
        assert torch.all((out == whole) | (out == sliced)), dp
        assert torch.equal(out, run(dp))  # deterministic
        assert torch.equal(out, op(x, mma, s, z, 128, None, 3, shape[0], shape[1], 2, ws, dp, tickets))
        assert not tickets.any()
        if dp == 1:  # all tiles but one sliced
            assert (out == sliced).sum() > same
        if dp == tiles - 1:  # one tile sliced
            assert (out == whole).sum() > same
    expected = x.double() @ dequant_independent(qw, s, z, 128).T.double()
    assert ((out.double() - expected).norm() / expected.norm()) < TOL[torch.float16]
    # Which tiles: with group_m = 1 the tiles go one row block after another, so dp_tiles = tiles - tiles / 3 slices
    # exactly the last row block (rows from 2 block_m) and leaves the first two whole.
    rows = 2 * shape[0]
    assert not torch.equal(whole[:rows], sliced[:rows]) and not torch.equal(whole[rows:], sliced[rows:])
    torch.full_like(whole, float("nan"))
    out = op(x, mma, s, z, 128, None, 3, shape[0], shape[1], 1, ws, tiles - tiles // 3)
    assert torch.equal(out[:rows], whole[:rows]) and torch.equal(out[rows:], sliced[rows:])


def test_rows_of_x_are_independent():
    """Row i of a 200-row call equals the same row inside another block of rows (no leakage between row blocks)."""
    qw, mma, s, z = _case(1024, 256, 128, seed=3)
    x = torch.randn(200, 1024, device="cuda", dtype=torch.bfloat16)
    full = _run(x, mma, s, z, 128, splits=2)
    shifted = _run(x[72:], mma, s, z, 128, splits=2)
    torch.testing.assert_close(full[72:], shifted, rtol=0, atol=0)


def test_opcheck_and_errors():
    qw, mma, s, z = _case(256, 128, 128)
    x = torch.randn(70, 256, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.torchforge.awq_wgmma_cuda
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 128, 2, 8))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 1, 64, 4, 1))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 128, 2, 8, True))
    with pytest.raises(RuntimeError, match=r"\(block_m, tile_set\) must be \(64, 4\), \(64, 2\), \(128, 2\), "
                                           r"\(192, 1\) or \(256, 1\), got \(128, 4\)"):
        op(x, mma, s, z, 128, None, 1, 128, 4, 8)
    with pytest.raises(RuntimeError, match=r"splits must be in \[1, K / \(64 \* item_chunks\) = 4\]"):
        op(x, mma, s, z, 128, None, 5, 128, 2, 8)
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 64, 2, 8, True, 1))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 2, 64, 2, 8, True, 0,
                               torch.zeros(4, dtype=torch.int32, device="cuda")))
    with pytest.raises(RuntimeError, match="tickets must be a contiguous int32 tensor of zeros on x's device"):
        op(x, mma, s, z, 128, None, 2, 64, 2, 8, True, 0, torch.zeros(4, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match=r"dp_tiles must be in \[0, 2\) \(the blocks of this call\), got 2"):
        op(x, mma, s, z, 128, None, 2, 64, 2, 8, True, 2)
    with pytest.raises(RuntimeError, match=r"dp_tiles must be >= 0, got -1"):
        op(x[:0], mma, s, z, 128, None, 2, 64, 2, 8, True, -1)  # checked before the empty-output return
    with pytest.raises(RuntimeError, match="group_m must be >= 1"):
        op(x, mma, s, z, 128, None, 1, 128, 2, 0)
    with pytest.raises(RuntimeError, match="scales must be float16 \\(or bfloat16 with bfloat16 x\\)"):
        op(x.half(), mma, s.bfloat16(), z, 128, None, 1, 128, 2, 8)
    with pytest.raises(RuntimeError, match=r"qweight must be \[N / 64, K \* 8\]"):
        op(x, qw, s, z, 128, None, 1, 128, 2, 8)


def test_awq_mma_linear_dispatch(monkeypatch):
    """awq_mma_linear takes the wgmma kernel exactly where wgmma_rows_ok (the row range and the time model of
    awq_wgmma_cost, against the decode kernel up to 128 rows and dequantize + cuBLAS above) says so, and its result
    is right there."""
    import torchforge.ops.awq_mma as awq_mma
    from torchforge.ops.awq_mma import awq_mma_linear
    from torchforge.ops.awq_mma_cuda import WGMMA_MAX_M, WGMMA_MIN_ROWS, wgmma_rows_ok

    calls = []
    real = awq_mma.launch_awq_wgmma_cuda
    monkeypatch.setattr(awq_mma, "launch_awq_wgmma_cuda", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [  # (k, n, rows)
        (1024, 512, (128, 256, WGMMA_MAX_M)),  # 2 groups of 256 columns: the decode kernel, then cuBLAS
        (2048, 16384, (WGMMA_MIN_ROWS - 1, WGMMA_MIN_ROWS, 100, WGMMA_MAX_M + 1)),  # 100 rows: the kernel
        (4096, 14336, (160,)),  # 112 blocks of (192, 1): faster than dequantize + cuBLAS by the model
    ]
    expected_calls = 0
    for k, n, rows in cases:
        torch.manual_seed(k + n)
        qw, s, z = awq_quantize(torch.randn(n, k, device="cuda") * 3, 128, symmetric=False)
        mma = awq_to_mma_layout(qw)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = awq_mma_linear(x, mma, s, z, 128)
            taken = wgmma_rows_ok(m, k, n, sms)
            expected_calls += taken
            assert len(calls) == expected_calls, (k, n, m)
            if taken:
                expected = x.double() @ dequant_independent(qw, s, z, 128).T.double()
                assert ((out.double() - expected).norm() / expected.norm()) < TOL[torch.bfloat16]
    if sms == 132:  # the H100's count (fewer SMs tip the 160-row case to cuBLAS)
        assert expected_calls == 2


@pytest.mark.parametrize("m,n,dispatched", [(512, 18432, (256, 1, 4, 8, True, 264, False)),
                                            (64, 7168, (64, 2, 4, 8, True, 0, True)),
                                            (256, 7168, (256, 1, 2, 8, True, 0, True)),
                                            (128, 18432, (128, 2, 0, 8, True, 0, False))])
def test_dispatched_k_slices_compile_and_graph(m, n, dispatched):
    """The dispatch's K slices and stream-K through the op, torch.compile and a CUDA graph, on 132 SMs: a last
    round's tiles in K slices (18432x7168 at 512 rows: the 24 tiles of (256, 1) past two rounds in 4 slices, run first
    in the launch), every tile's K slices as one cluster (7168x7168 at 64 rows: 28 tiles of (64, 2) in 4 slices; at
    256 rows 56 of (256, 1) in 2), and stream-K (18432x7168 at 128 rows: 72 tiles' chunks shared by 132 blocks)."""
    from torchforge.ops.awq_mma import awq_mma_linear
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, mma_tickets, wgmma_cuda_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = wgmma_cuda_config(m, 7168, n, sms)
    if sms != 132:
        pytest.skip(f"the dispatch picks {config} on {sms} SMs; these cases are the H100's")
    assert config == dispatched
    torch.manual_seed(19)
    qw, s, z = awq_quantize(torch.randn(n, 7168, device="cuda"), 128, symmetric=False)
    mma = awq_to_mma_layout(qw)
    x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
    out = awq_mma_linear(x, mma, s, z, 128)  # dispatched: the config above
    assert torch.equal(out, launch_awq_wgmma_cuda(x, mma, s, z, 128, config=config))
    expected = x.double() @ dequant_independent(qw, s, z, 128).T.double()
    assert ((out.double() - expected).norm() / expected.norm()) < TOL[torch.bfloat16]
    # a module's kept tickets (mma_tickets): the same bits, and left zero for the next call
    tickets = mma_tickets(n, x.device)
    for _ in range(2):
        assert torch.equal(awq_mma_linear(x, mma, s, z, 128, tickets=tickets), out)
        assert not tickets.any()
    check_compile_and_cuda_graph(lambda x: awq_mma_linear(x, mma, s, z, 128, tickets=tickets), x)
    assert not tickets.any()


def test_compile_and_cuda_graph():
    from torchforge.ops.awq_mma import awq_mma_linear

    from torchforge.ops.awq_mma_cuda import wgmma_cuda_ok

    torch.manual_seed(5)
    qw, s, z = awq_quantize(torch.randn(16384, 2048, device="cuda"), 128, symmetric=True)
    mma = awq_to_mma_layout(qw)
    x = torch.randn(100, 2048, device="cuda", dtype=torch.float16)
    b = torch.randn(16384, device="cuda", dtype=torch.float16)
    assert wgmma_cuda_ok(x, mma, s, z, 128, b)  # the time model sends these 100 rows to the wgmma kernel
    check_compile_and_cuda_graph(lambda x: awq_mma_linear(x, mma, s, z, 128, b), x)


def test_prefill_lengths_past_the_kernel_compile_once():
    """Rows past WGMMA_MAX_M go to dequantize + cuBLAS whatever their count: the dispatch compares the SymInt before
    reading it as an int (which the time model needs inside the range), so after the automatic-dynamic recompile at
    the second length a third runs the same graph. Caches off: a cached graph would pass without tracing anything."""
    from torchforge.ops.awq_mma import awq_mma_linear
    from torchforge.ops.awq_mma_cuda import WGMMA_MAX_M

    import torch._functorch.config
    import torch._inductor.config

    _, mma, s, z = _case(512, 256, 128)
    torch._dynamo.reset()
    f = torch.compile(lambda x: awq_mma_linear(x, mma, s, z, 128), fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for n, m in enumerate((WGMMA_MAX_M + 88, WGMMA_MAX_M + 188, WGMMA_MAX_M + 300)):
            x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            with torch._dynamo.config.patch(error_on_recompile=n == 2):
                out = f(x)
            torch.testing.assert_close(out, awq_mma_linear(x, mma, s, z, 128), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [1, 64, 600])
def test_contiguous_but_misaligned_x_is_copied(m):
    """x a contiguous view 6 bytes into a flat buffer: contiguous() returns it as is, which the kernels' 16-byte
    loads refuse; the dispatch copies it instead, and gives the aligned copy's bits on our kernels (1 row: the decode
    kernel; 64: what the time model picks). Past WGMMA_MAX_M, cuBLAS takes x as it is and picks its kernel by the
    pointer's alignment, so 600 rows agree to rounding only."""
    from torchforge.ops.awq_mma import awq_mma_linear

    _, mma, s, z = _case(512, 256, 128)
    buf = torch.randn(m * 512 + 3, device="cuda", dtype=torch.bfloat16)
    x = buf[3:].view(m, 512)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    out, ref = awq_mma_linear(x, mma, s, z, 128), awq_mma_linear(x.clone(), mma, s, z, 128)
    if m <= 512:
        assert torch.equal(out, ref)
    else:
        assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 4e-3


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("blocks", [0, 5, 37, 10_000])
@pytest.mark.parametrize("G", [128, 32])
def test_stream_k_one_hot_rows_give_the_weights_bit_exact(shape, blocks, G):
    """Stream-K (splits 0): the blocks share the tiles' pairs of chunks evenly (0: one block per SM; 5: each runs the
    tail of one tile, whole tiles and the head of another; 10 000, capped at one block per pair: every tile in
    two-chunk parts). Each output of one-hot rows is a single weight, however its tile was cut: the bits of the weight, so a
    part that is lost, added twice or written to another tile's place shows."""
    k, n = 768, 640
    qw, mma, s, z = _case(k, n, G, sym=False, seed=21)
    w = dequant_independent(qw, s, z, G)
    torch.manual_seed(22)
    m = 2 * shape[0] + 9
    ks = torch.randint(0, k, (m,), device="cuda")
    x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
    x[torch.arange(m), ks] = 1
    tickets = torch.zeros(4096, dtype=torch.int32, device="cuda")
    op = torch.ops.torchforge.awq_wgmma_cuda
    out = op(x, mma, s, z, G, None, 0, shape[0], shape[1], 8, True, blocks, tickets)
    assert torch.equal(out, w[:, ks].T.to(torch.bfloat16))
    assert not tickets.any()  # the last part of each tile reset its ticket


@pytest.mark.parametrize("shape", [(64, 2), (128, 2), (192, 1), (256, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [2048, 1984])
def test_stream_k_matches_dequantized_matmul(shape, dtype, k):
    """Random x, a bias and fp16 scales (split with bf16 x), K = 2048 or 1984 in groups of 64, 320 columns (a
    partial group of column blocks): within the dtype's tolerance of the float64 product, deterministic (parts are
    added in block order, not arrival order), and close to the whole-tile result. 1984 is 31 chunks: stream-K's units
    are pairs, so that call runs whole tiles, with the same bits as splits 1."""
    n, G = 320, 64
    qw, mma, s, z = _case(k, n, G, sym=False, seed=23)
    torch.manual_seed(24)
    x = torch.randn(shape[0] + 70, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    op = torch.ops.torchforge.awq_wgmma_cuda
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double() + b.double()
    for blocks in (0, 3, 11):
        out = op(x, mma, s, z, G, b, 0, shape[0], shape[1], 8, True, blocks)
        assert ((out.double() - expected).norm() / expected.norm()) < TOL[dtype], blocks
        assert torch.equal(out, op(x, mma, s, z, G, b, 0, shape[0], shape[1], 8, True, blocks))
    whole = op(x, mma, s, z, G, b, 1, shape[0], shape[1], 8, True)
    assert ((out.float() - whole.float()).norm() / whole.float().norm()) < 1e-2
    if k // 64 % 2:
        assert torch.equal(out, whole)


def test_stream_k_past_46341_blocks():
    """u0(b) = U b / G = q b + r b / G: r b passes 2^31 from G = 46342 blocks, which dp_tiles may ask for (up to one
    block per unit). 11767 rows of (64, 2) blocks on 4096x4096 are 184 x 16 tiles x 32 pairs of chunks = 94208 units;
    50 000 blocks give q = 1, r = 44208, r b up to 2.2e9. In 32 bits 2684 units ran on no block and 2681 on two."""
    k, n, G = 4096, 4096, 128
    qw, mma, s, z = _case(k, n, G, sym=False, seed=25)
    w = dequant_independent(qw, s, z, G)
    torch.manual_seed(26)
    m = 184 * 64 - 9
    ks = torch.randint(0, k, (m,), device="cuda")
    x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
    x[torch.arange(m), ks] = 1
    tickets = torch.zeros(184 * 16, dtype=torch.int32, device="cuda")
    out = torch.ops.torchforge.awq_wgmma_cuda(x, mma, s, z, G, None, 0, 64, 2, 8, True, 50_000, tickets)
    assert torch.equal(out, w[:, ks].T.to(torch.bfloat16))
    assert not tickets.any()


def test_stream_k_errors_and_opcheck():
    qw, mma, s, z = _case(256, 128, 128)
    x = torch.randn(70, 256, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.torchforge.awq_wgmma_cuda
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 0, 64, 2, 8, True, 0))
    with pytest.raises(RuntimeError, match=r"splits == 0 \(stream-K\) needs producer_warp=True"):
        op(x, mma, s, z, 128, None, 0, 64, 2, 8, False)
    with pytest.raises(RuntimeError, match=r"dp_tiles must be >= 0, got -3"):
        op(x, mma, s, z, 128, None, 0, 64, 2, 8, True, -3)
    with pytest.raises(RuntimeError, match=r"splits must be 0 \(stream-K\) or in \[1, K / 64\], got -1"):
        op(x, mma, s, z, 128, None, -1, 64, 2, 8, True)
