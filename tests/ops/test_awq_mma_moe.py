"""MoE experts on the mma layout: awq_mma_moe_gate_up_silu / awq_mma_moe_down_combine against an fp64 oracle (CPU:
the AWQ-layout path after an exact conversion; CUDA: the grouped kernel of csrc/awq_mma_moe.cu, decode and prefill
block sizes), ForgeAWQExperts.use_mma_layout (same outputs, AWQ state dict and export), compile and CUDA graphs."""
import pytest
import torch

from tests.ops.test_awq_moe_fused import _oracle as moe_oracle
from torchforge.ops import awq_quantize
from torchforge.ops._ext import has_cuda_ext
from torchforge.ops.awq_mma import awq_mma_moe_down_combine, awq_mma_moe_gate_up_silu
from torchforge.ops.awq_mma_layout import awq_to_mma_layout, mma_layout_to_awq

H, I = 128, 128  # I is a multiple of every group size used here (64, 128)


def _experts(E, G, device, seed=0):
    torch.manual_seed(seed)
    gu = awq_quantize(torch.randn(E, 2 * I, H) * 0.2, G, symmetric=False)
    down = awq_quantize(torch.randn(E, H, I) * 0.2, G, symmetric=True)
    return [t.to(device) for t in gu], [t.to(device) for t in down]


def _oracle(x, ids, w, gu, down, k, G):
    return moe_oracle(x, ids, w, gu, down, k, group_size=G)  # on x's device, as the kernel under test


def _run(x, ids, w, gu, down, G, k):
    h = awq_mma_moe_gate_up_silu(x, ids, awq_to_mma_layout(gu[0]), gu[1], gu[2], G, k)
    return h, awq_mma_moe_down_combine(h, ids, w, awq_to_mma_layout(down[0]), down[1], down[2], G)


@pytest.mark.parametrize("chunked", [False, True, "under one matrix"])
def test_batched_layout_round_trip(chunked, monkeypatch):
    import torchforge.ops.awq_mma_layout as layout

    if chunked:  # experts converted a few at a time (bounded temporaries), as for 256 DeepSeek-V3 experts
        monkeypatch.setattr(layout, "_CHUNK_WEIGHTS", 2 * H * I)
    if chunked == "under one matrix":  # a chunk smaller than one matrix: one matrix a chunk (it recursed forever)
        monkeypatch.setattr(layout, "_CHUNK_WEIGHTS", 64)
    gu, down = _experts(5, 64, "cpu")
    for qw in (gu[0], down[0]):
        mma = awq_to_mma_layout(qw)
        assert mma.shape == (5, qw.shape[2] // 8, qw.shape[1] * 8)
        assert torch.equal(mma_layout_to_awq(mma), qw)
        assert all(torch.equal(mma[e], awq_to_mma_layout(qw[e])) for e in range(5))


@pytest.mark.parametrize("T,k", [(1, 4), (5, 2)])
def test_cpu_ops_match_fp64_oracle_and_opcheck(T, k):
    E, G = 6, 64
    gu, down = _experts(E, G, "cpu", seed=T)
    g = torch.Generator().manual_seed(T)
    ids, w = torch.randint(0, E, (T * k,), generator=g), torch.rand(T, k, generator=g)
    x = torch.randn(T, H)
    h, out = _run(x, ids, w, gu, down, G, k)
    h_ref, out_ref = _oracle(x, ids, w, gu, down, k, G)
    torch.testing.assert_close(h.double(), h_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-4, atol=1e-4)
    mma_gu, mma_dn = awq_to_mma_layout(gu[0]), awq_to_mma_layout(down[0])
    torch.library.opcheck(torch.ops.torchforge.awq_mma_moe_gate_up_silu, (x, ids, mma_gu, gu[1], gu[2], G, k))
    torch.library.opcheck(torch.ops.torchforge.awq_mma_moe_down_combine, (h, ids, w, mma_dn, down[1], down[2], G))


def test_errors_name_the_tensor():
    gu, down = _experts(2, 64, "cpu")
    x, ids = torch.randn(1, H), torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match=r"awq_mma_moe_gate_up_silu: qweight_mma must be an int32 tensor \[E"):
        awq_mma_moe_gate_up_silu(x, ids, awq_to_mma_layout(gu[0]).float(), gu[1], gu[2], 64, 2)
    with pytest.raises(ValueError, match=r"qweight_mma \(2, 128, 32\) is not \[E, OC / 64, IC \* 8\] for x \(1, 128\)"):
        awq_mma_moe_gate_up_silu(x, ids, gu[0], gu[1], gu[2], 64, 2)  # still the AWQ layout


def test_module_use_mma_layout_same_outputs_and_awq_exports():
    from torchforge.nn import ForgeAWQExperts

    torch.manual_seed(0)
    E, k, T = 4, 2, 3
    mod = ForgeAWQExperts(E, H, I, group_size=64).pack_weights(torch.randn(E, 2 * I, H) * 0.1,
                                                               torch.randn(E, H, I) * 0.1)
    x = torch.randn(T, H)
    idx, w = torch.randint(0, E, (T, k)), torch.rand(T, k)
    with torch.no_grad():
        before = mod(x, idx, w)
    state = {n: t.clone() for n, t in mod.state_dict().items()}
    deq = mod.dequantized_weights()
    assert mod.use_mma_layout() and mod.gate_up_qweight.shape == (E, 2 * I // 64, H * 8)
    with torch.no_grad():
        torch.testing.assert_close(mod(x, idx, w), before, rtol=0, atol=0)  # CPU: the same AWQ ops after conversion
    after = mod.state_dict()
    assert all(torch.equal(after[n], state[n]) for n in state)
    assert all(torch.equal(a, b) for a, b in zip(mod.dequantized_weights(), deq))
    fresh = ForgeAWQExperts(E, H, I, group_size=64)
    assert fresh.use_mma_layout()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.gate_up_qweight, mod.gate_up_qweight) and torch.equal(fresh.down_qweight, mod.down_qweight)
    assert not ForgeAWQExperts(E, 96, 32, group_size=32).use_mma_layout()  # 96 and 32 are not multiples of 64
    assert ForgeAWQExperts(E, 128, 64, group_size=32).use_mma_layout()  # groups of 32: dequantized per register


cuda = pytest.mark.skipif(not has_cuda_ext(), reason="needs the compiled extension (csrc/) and a GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("T,k,E,G", [(1, 8, 16, 128), (2, 4, 16, 64), (3, 8, 16, 64), (40, 8, 16, 128), (7, 1, 4, 128),
                                     (1, 8, 16, 32), (40, 8, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_grouped_kernel_matches_oracle(T, k, E, G, dtype, monkeypatch):
    """Decode (rows <= experts: one row per block, no sort) and prefill (sorted blocks of 16, several rows per
    expert) shapes; groups of 32 (each register dequantized), with the grouped wgmma kernel asked for where the rows
    are sorted."""
    import torchforge.ops.awq_mma_cuda as mma_cuda
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_moe_cuda

    if G == 32:
        monkeypatch.setattr(mma_cuda, "MOE_WGMMA", True)

    gu, down = _experts(E, G, "cuda", seed=T * k)
    g = torch.Generator().manual_seed(T)
    ids, w = torch.randint(0, E, (T * k,), generator=g).cuda(), torch.rand(T, k, generator=g).cuda()
    x = torch.randn(T, H, device="cuda").to(dtype)
    h, out = _run(x, ids, w, gu, down, G, k)
    h_ref, out_ref = _oracle(x, ids, w, gu, down, k, G)
    assert ((h.double() - h_ref).norm() / h_ref.norm()) < 1e-2
    assert ((out.double() - out_ref).norm() / out_ref.norm()) < 1e-2
    part = launch_awq_mma_moe_cuda(x, ids, awq_to_mma_layout(gu[0]), gu[1], gu[2], G, k)
    assert part.dtype == torch.float32 and part.shape[1:] == (T * k, 2 * I)
    assert torch.isfinite(part).all()  # every routed row written


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("block_rows", [8, 16])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("T", [2, 40])  # direct (16 routed rows, 16 experts) and sorted
def test_cuda_sorted_blocks_of_8_or_16(block_rows, warps, T, monkeypatch):
    """Sorted routed rows in blocks of 8 (one MMA tile) or 16 (two), blocks of 4 or 8 warps: the same sums
    (MOE_SORTED_BLOCK_ROWS, MOE_WARPS)."""
    import torchforge.ops.awq_mma_cuda as mma_cuda

    if T == 2 and block_rows == 16:
        pytest.skip("direct mode (one row per block) ignores the sorted block size: the 8-row case covers it")
    monkeypatch.setattr(mma_cuda, "MOE_SORTED_BLOCK_ROWS", block_rows)
    monkeypatch.setattr(mma_cuda, "MOE_WARPS", warps)
    k, E, G = 8, 16, 128
    gu, down = _experts(E, G, "cuda", seed=3)
    g = torch.Generator().manual_seed(3)
    ids, w = torch.randint(0, E, (T * k,), generator=g).cuda(), torch.rand(T, k, generator=g).cuda()
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    part = mma_cuda.launch_awq_mma_moe_cuda(x, ids, awq_to_mma_layout(gu[0]), gu[1], gu[2], G, k)
    h, out = _run(x, ids, w, gu, down, G, k)
    h_ref, out_ref = _oracle(x, ids, w, gu, down, k, G)
    assert torch.isfinite(part).all()  # every routed row written
    assert ((h.double() - h_ref).norm() / h_ref.norm()) < 1e-2
    assert ((out.double() - out_ref).norm() / out_ref.norm()) < 1e-2


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("T", [1, 40])  # direct (one row per block) and sorted blocks of 16
def test_cuda_grouped_kernel_bf16_scales(T):
    """Experts whose scales were cast to bf16 (model.to(bfloat16)) stay on the grouped kernel, bf16 x only."""
    from tests.ops.awq_oracle import dequant_independent
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_moe_cuda, mma_moe_cuda_ok

    E, k, G = 16, 4, 128
    gu, _ = _experts(E, G, "cuda", seed=3)
    s16 = gu[1].to(torch.bfloat16)
    ids = torch.randint(0, E, (T * k,), generator=torch.Generator().manual_seed(T)).cuda()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    mma = awq_to_mma_layout(gu[0])
    assert mma_moe_cuda_ok(x, mma, s16, G) and not mma_moe_cuda_ok(x.half(), mma, s16, G)
    part = launch_awq_mma_moe_cuda(x, ids, mma, s16, gu[2], G, k).double().sum(0)
    w = [dequant_independent(gu[0][e], s16[e], gu[2][e], G).double() for e in range(E)]
    ref = torch.stack([x[r // k].double() @ w[e].T for r, e in enumerate(ids.tolist())])
    assert ((part - ref).norm() / ref.norm()) < 4e-3


@pytest.mark.cuda
@cuda
def test_cuda_module_compile_and_graph():
    from torchforge.nn import ForgeAWQExperts

    torch.manual_seed(1)
    E, k = 16, 8
    mod = ForgeAWQExperts(E, H, I, group_size=128).pack_weights(torch.randn(E, 2 * I, H) * 0.1,
                                                                torch.randn(E, H, I) * 0.1).cuda()
    x = torch.randn(2, H, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(2)]).cuda()
    w = torch.rand(2, k, device="cuda")
    with torch.no_grad():
        before = mod(x, idx, w)
        assert mod.use_mma_layout()
        eager = mod(x, idx, w)
        assert ((eager.float() - before.float()).norm() / before.float().norm()) < 1e-2
        compiled = torch.compile(mod, fullgraph=True)
        torch.testing.assert_close(compiled(x, idx, w), eager, rtol=0, atol=0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mod(x, idx, w)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(captured, mod(x, idx, w), rtol=0, atol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [4, 40])  # direct mode (rows <= experts), sorted blocks of 16
@pytest.mark.parametrize("shared", [False, True])
def test_cuda_out_of_range_expert_gives_nan_rows(rows, shared):
    """Ids outside the experts come out NaN; with a shared expert id E is one (rows 0 and 2 pick it), E + 1 is not."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_moe_cuda

    gu, _ = _experts(5, 128, "cuda")
    mma = awq_to_mma_layout(gu[0])
    ids = torch.arange(rows, device="cuda") % 4
    ids[1], ids[3] = (5 if shared else 7), -1  # not experts
    extra = None
    if shared:
        ids[0] = ids[2] = 4
        extra = (mma[4].contiguous(), gu[1][4].contiguous(), gu[2][4].contiguous())
    part = launch_awq_mma_moe_cuda(torch.randn(rows, H, device="cuda", dtype=torch.bfloat16), ids,
                                   mma[:4].contiguous(), gu[1][:4].contiguous(), gu[2][:4].contiguous(), 128, 1,
                                   extra)
    rows_nan = part.isnan().all(-1).any(0)
    assert rows_nan.tolist() == [r in (1, 3) for r in range(rows)]
    assert torch.isfinite(part[:, [r for r in range(rows) if r not in (1, 3)]]).all()


@pytest.mark.parametrize("device,T,k,G", [
    ("cpu", 3, 3, 64),
    pytest.param("cuda", 2, 9, 64, marks=[pytest.mark.cuda, cuda]),   # 18 routed rows > 8 experts: sorted
    pytest.param("cuda", 1, 5, 64, marks=[pytest.mark.cuda, cuda]),   # direct: one row per block
    pytest.param("cuda", 40, 5, 64, marks=[pytest.mark.cuda, cuda]),  # sorted blocks of 16
    pytest.param("cuda", 1, 5, 32, marks=[pytest.mark.cuda, cuda]),   # groups of 32 (item_dq), direct
    pytest.param("cuda", 40, 5, 32, marks=[pytest.mark.cuda, cuda]),  # and sorted
])
def test_grouped_shared_expert_equals_stacked(device, T, k, G, monkeypatch):
    """A shared expert passed on its own (`shared=`, routed as expert id E) gives what the same expert stacked as row
    E of the experts gives, bit for bit: the kernel only reads its words from another address."""
    E = 7
    gu, down = _experts(E + 1, G, device, seed=k)
    mgu, mdn = awq_to_mma_layout(gu[0]), awq_to_mma_layout(down[0])
    g = torch.Generator().manual_seed(T)
    routed = torch.randint(0, E, (T, k - 1), generator=g)
    ids = torch.cat([routed, torch.full((T, 1), E)], 1).reshape(-1).to(device)  # every token also picks E
    w = torch.rand(T, k, generator=g).to(device)
    x = torch.randn(T, H, device=device).to(torch.bfloat16 if device == "cuda" else torch.float32)
    h_all = awq_mma_moe_gate_up_silu(x, ids, mgu, gu[1], gu[2], G, k)
    out_all = awq_mma_moe_down_combine(h_all, ids, w, mdn, down[1], down[2], G)
    split = lambda q, t: ((q[:E], t[1][:E], t[2][:E]), (q[E], t[1][E], t[2][E]))  # noqa: E731
    (gq, gs, gz), gu_shared = split(mgu, gu)
    (dq, ds, dz), dn_shared = split(mdn, down)
    h = awq_mma_moe_gate_up_silu(x, ids, gq.contiguous(), gs.contiguous(), gz.contiguous(), G, k,
                                 tuple(t.contiguous() for t in gu_shared))
    out = awq_mma_moe_down_combine(h, ids, w, dq.contiguous(), ds.contiguous(), dz.contiguous(), G,
                                   tuple(t.contiguous() for t in dn_shared))
    assert torch.equal(h, h_all) and torch.equal(out, out_all)
    if G == 32:  # zero words the mma.sync kernel would read misaligned (4 bytes in): copied first, same bits
        import torchforge.ops.awq_mma_cuda as mma_cuda

        def shifted(t):
            u = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
            return u.copy_(t)
        monkeypatch.setattr(mma_cuda, "MOE_WGMMA", False)  # (the grouped wgmma kernel needs aligned ones: not taken)
        shared_gu = tuple(t.contiguous() for t in gu_shared)
        h1 = awq_mma_moe_gate_up_silu(x, ids, gq.contiguous(), gs.contiguous(), gz.contiguous(), G, k, shared_gu)
        h2 = awq_mma_moe_gate_up_silu(x, ids, gq.contiguous(), gs.contiguous(), shifted(gz), G, k,
                                      (*shared_gu[:2], shifted(gu_shared[2])))
        assert torch.equal(h2, h1)
    if device == "cpu":
        args = (gq.contiguous(), gs.contiguous(), gz.contiguous(), G)
        torch.library.opcheck(torch.ops.torchforge.awq_mma_moe_gate_up_silu,
                              (x, ids, *args, k, *(t.contiguous() for t in gu_shared)))
    with pytest.raises(ValueError, match="shared_scales must be one expert of the stacked tensor"):
        awq_mma_moe_gate_up_silu(x, ids, gq.contiguous(), gs.contiguous(), gz.contiguous(), G, k,
                                 (gu_shared[0].contiguous(), gs[:2].contiguous(), gu_shared[2].contiguous()))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("T,k,G", [(1, 8, 128), (2, 4, 64), (40, 8, 128), (40, 8, 64), (1, 8, 32)])
@pytest.mark.parametrize("warps", [4, 8])
def test_cuda_symmetric_same_bits_without_reading_zeros(T, k, G, warps, monkeypatch):
    """symmetric=True on the grouped kernel, direct (one row per block: the one-row fold too) and sorted, with a shared
    expert: the bits of the kernel that reads the zero points, and none read (zero words of 0 passed: same bits).
    Blocks of 16 rows (T = 40: 20 routed rows per expert, moe_sorted_block_rows) put the 8 into each A register
    instead (awq_mma.cuh ZA): within a rounding of those bits. Groups of 32 read them anyway."""
    import torchforge.ops.awq_mma_cuda as mma_cuda
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_moe_cuda

    monkeypatch.setattr(mma_cuda, "MOE_WARPS", warps)
    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", False)  # the mma.sync kernel for sorted rows too
    E = 16
    torch.manual_seed(T + k)
    gu = [t.cuda() for t in awq_quantize(torch.randn(E + 1, 2 * I, H) * 0.2, G, symmetric=True)]
    mgu = awq_to_mma_layout(gu[0])
    ids = torch.cat([torch.randint(0, E, (T, k - 1)), torch.full((T, 1), E)], 1).reshape(-1).cuda()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    stacked = (mgu[:E].contiguous(), gu[1][:E].contiguous(), gu[2][:E].contiguous())
    shared = (mgu[E], gu[1][E], gu[2][E])
    run = lambda z, zs, sym: launch_awq_mma_moe_cuda(x, ids, stacked[0], stacked[1], z, G, k,  # noqa: E731
                                                     (shared[0], shared[1], zs), symmetric=sym)
    part = run(stacked[2], shared[2], True)
    read = run(stacked[2], shared[2], False)
    experts = E + 1  # the launcher counts the shared expert
    if not mma_cuda.mma_moe_sorts(T * k, experts) or mma_cuda.moe_sorted_block_rows(T * k, experts) == 8 or G == 32:
        assert torch.equal(part, read)  # one row tile a block
    else:
        assert not torch.equal(part, read)  # the zero in A really runs
        assert ((part.double() - read.double()).norm() / read.double().norm()) < 1e-3
    if G != 32:
        assert torch.equal(part, run(torch.zeros_like(stacked[2]), torch.zeros_like(shared[2]), True))


def test_sorted_block_rows_rule(monkeypatch):
    """Blocks of 8 rows up to 8 routed rows per expert, 16 beyond (H100 sweep in awq_mma_cuda.py); the module-level
    override wins."""
    import torchforge.ops.awq_mma_cuda as mma_cuda

    assert [mma_cuda.moe_sorted_block_rows(r, 256) for r in (257, 512, 2048, 2049, 4096)] == [8, 8, 8, 16, 16]
    assert mma_cuda.moe_sorted_block_rows(128, 64) == 8  # decode batch 16, top-8 over 64 experts
    monkeypatch.setattr(mma_cuda, "MOE_SORTED_BLOCK_ROWS", 16)
    assert mma_cuda.moe_sorted_block_rows(512, 256) == 16
