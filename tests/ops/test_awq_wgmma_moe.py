"""The grouped wgmma kernel for MoE prefill (csrc/awq_wgmma.cu, GROUPED; op awq_wgmma_moe_cuda): routed rows sorted
into blocks of 64 or 128, against the fp64 oracle and the grouped mma.sync kernel; out-of-range ids, the shared
expert, bf16 scales, opcheck, torch.compile and CUDA graphs. Hopper only."""
import pytest
import torch

from tests.ops.test_awq_mma_moe import H, I, _experts, _oracle, _run
from torchforge.ops._ext import has_cuda_ext
from torchforge.ops.awq_mma_layout import awq_to_mma_layout

hopper = pytest.mark.skipif(not (has_cuda_ext() and torch.cuda.get_device_capability() == (9, 0)),
                            reason="needs the compiled extension and an sm_90 GPU")
pytestmark = [pytest.mark.cuda, hopper]


def _spy_blocks(monkeypatch) -> list:
    """The block sizes moe_align is asked for from here on: which grouped kernel a call took (8 / 16: mma.sync; 64 /
    128: wgmma), traced calls under torch.compile included."""
    import torchforge.ops.moe_align as moe_align_mod

    seen, real = [], moe_align_mod.moe_align

    def spy(expert_ids, num_experts, block_m):
        seen.append(block_m)
        return real(expert_ids, num_experts, block_m)

    monkeypatch.setattr(moe_align_mod, "moe_align", spy)
    return seen


def _ids(T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    # uneven load: expert 0 takes about a third of the rows, so some experts fill several blocks of 64 and some few
    ids = torch.where(torch.rand(T * k, generator=g) < 0.3, 0, torch.randint(0, E, (T * k,), generator=g))
    return ids.cuda(), torch.rand(T, k, generator=g).cuda()


@pytest.mark.parametrize("T,k,E,G", [(200, 2, 4, 128), (96, 8, 16, 64), (33, 4, 3, 128), (96, 8, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_m", [64, 128])
def test_matches_oracle_and_the_mma_kernel(T, k, E, G, dtype, block_m, monkeypatch):
    import torchforge.ops.awq_mma_cuda as mma_cuda

    gu, down = _experts(E, G, "cuda", seed=T + k)
    ids, w = _ids(T, k, E, seed=T)
    x = torch.randn(T, H, device="cuda").to(dtype)
    mgu = awq_to_mma_layout(gu[0])
    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", True)
    monkeypatch.setattr(mma_cuda, "WGMMA_MOE_BLOCK_M", block_m)
    assert mma_cuda.moe_align_block_rows(x, T * k, E, gu[1], gu[2], G) == block_m
    blocks = _spy_blocks(monkeypatch)
    part = mma_cuda.launch_awq_mma_moe_cuda(x, ids, mgu, gu[1], gu[2], G, k)
    assert blocks == [block_m]
    assert part.shape == (1, T * k, 2 * I) and part.dtype == torch.float32
    assert torch.isfinite(part).all()  # every routed row written once
    h, out = _run(x, ids, w, gu, down, G, k)
    h_ref, out_ref = _oracle(x, ids, w, gu, down, k, G)
    assert ((h.double() - h_ref).norm() / h_ref.norm()) < 1e-2
    assert ((out.double() - out_ref).norm() / out_ref.norm()) < 1e-2
    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", False)
    ref = mma_cuda.launch_awq_mma_moe_cuda(x, ids, mgu, gu[1], gu[2], G, k).sum(0)
    # the wgmma kernel rounds each dequantized weight to x's dtype, the mma.sync one folds the scales in fp32
    assert ((part[0] - ref).norm() / ref.norm()) < 4e-3


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
def test_out_of_range_ids_give_nan_rows_and_the_shared_expert(shared, block_m, monkeypatch):
    import torchforge.ops.awq_mma_cuda as mma_cuda

    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", True)
    gu, _ = _experts(5, 128, "cuda")
    mma = awq_to_mma_layout(gu[0])
    rows = 300
    ids = torch.arange(rows, device="cuda") % 4
    bad = [1, 3, 150]
    ids[bad] = torch.tensor([5 if shared else 7, -1, 9], device="cuda")
    extra = None
    if shared:
        ids[0] = ids[2] = ids[299] = 4
        extra = (mma[4].contiguous(), gu[1][4].contiguous(), gu[2][4].contiguous())
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    args = (mma[:4].contiguous(), gu[1][:4].contiguous(), gu[2][:4].contiguous(), 128, 1, extra)
    monkeypatch.setattr(mma_cuda, "WGMMA_MOE_BLOCK_M", block_m)
    part = mma_cuda.launch_awq_mma_moe_cuda(x, ids, *args)
    assert part.isnan().all(-1)[0].tolist() == [r in bad for r in range(rows)]
    good = [r for r in range(rows) if r not in bad]
    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", False)
    ref = mma_cuda.launch_awq_mma_moe_cuda(x, ids, *args).sum(0)
    assert ((part[0, good] - ref[good]).norm() / ref[good].norm()) < 4e-3


def test_bf16_scales_and_opcheck(monkeypatch):
    from tests.ops.awq_oracle import dequant_independent
    from torchforge.ops.moe_align import moe_align

    E, k, G, T = 4, 4, 128, 80
    gu, _ = _experts(E, G, "cuda", seed=5)
    s16 = gu[1].to(torch.bfloat16)
    ids, _ = _ids(T, k, E, seed=5)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    mma = awq_to_mma_layout(gu[0])
    sorted_rows, block_expert = moe_align(ids, E, 64)
    op = torch.ops.torchforge.awq_wgmma_moe_cuda
    part = op(x, mma, s16, gu[2], sorted_rows, block_expert, T * k, k, G, 64, 2)[0].double()
    wq = [dequant_independent(gu[0][e], s16[e], gu[2][e], G).double() for e in range(E)]
    ref = torch.stack([x[r // k].double() @ wq[e].T for r, e in enumerate(ids.tolist())])
    assert ((part - ref).norm() / ref.norm()) < 4e-3
    torch.library.opcheck(op, (x, mma, gu[1], gu[2], sorted_rows, block_expert, T * k, k, G, 64, 2))
    rows128, experts128 = moe_align(ids, E, 128)
    part128 = op(x, mma, s16, gu[2], rows128, experts128, T * k, k, G, 128, 2)[0].double()
    assert ((part128 - ref).norm() / ref.norm()) < 4e-3
    torch.library.opcheck(op, (x, mma, gu[1], gu[2], rows128, experts128, T * k, k, G, 128, 2))
    with pytest.raises(RuntimeError, match="sorted_rows must hold B \\* block_m"):
        op(x, mma, gu[1], gu[2], sorted_rows[:-8], block_expert, T * k, k, G, 64, 2)
    with pytest.raises(RuntimeError, match="\\(block_m, tile_set\\) must be \\(64, 2\\) or \\(128, 2\\)"):
        op(x, mma, gu[1], gu[2], sorted_rows, block_expert, T * k, k, G, 64, 4)


def test_experts_op_compiles_and_graphs(monkeypatch):
    """awq_mma_moe_experts (one sort for both halves; 80 rows per expert: blocks of 128), under
    torch.compile(fullgraph=True) and CUDA-graph replay, equal to eager."""
    import torchforge.ops.awq_mma_cuda as mma_cuda
    from torchforge.ops.awq_mma_moe_experts import awq_mma_moe_experts

    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", True)
    E, k, G, T = 8, 4, 128, 160
    gu, down = _experts(E, G, "cuda", seed=2)
    ids, w = _ids(T, k, E, seed=2)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    mgu, mdn = (awq_to_mma_layout(gu[0]), gu[1], gu[2]), (awq_to_mma_layout(down[0]), down[1], down[2])
    f = lambda x, ids, w: awq_mma_moe_experts(x, ids, w, mgu, mdn, G, k)  # noqa: E731
    eager = f(x, ids, w)
    _, out_ref = _oracle(x, ids, w, gu, down, k, G)
    assert ((eager.double() - out_ref).norm() / out_ref.norm()) < 1e-2
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, ids, w), eager, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(x, ids, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, f(x, ids, w), rtol=0, atol=0)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("G", [128, 32])
def test_long_k_wraps_the_stage_ring(block_m, G, monkeypatch):
    """K = 1024 (16 chunks of 64) runs past the kernel's 8 stages, so every stage is refilled (the grouped form of the
    wait-and-refill path; with groups of 32, stages of two rows of scales and zero words); against the fp64 oracle of
    one expert per routed row."""
    from tests.ops.awq_oracle import dequant_independent
    import torchforge.ops.awq_mma_cuda as mma_cuda
    from torchforge.ops import awq_quantize

    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", True)
    monkeypatch.setattr(mma_cuda, "WGMMA_MOE_BLOCK_M", block_m)
    E, N, K, k, T = 3, 192, 1024, 2, 100
    torch.manual_seed(4)
    qw, s, z = [t.cuda() for t in awq_quantize(torch.randn(E, N, K) * 0.2, G, symmetric=False)]
    ids, _ = _ids(T, k, E, seed=4)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    part = mma_cuda.launch_awq_mma_moe_cuda(x, ids, awq_to_mma_layout(qw), s, z, G, k)[0].double()
    w = [dequant_independent(qw[e], s[e], z[e], G).double() for e in range(E)]
    ref = torch.stack([x[r // k].double() @ w[e].T for r, e in enumerate(ids.tolist())])
    assert ((part - ref).norm() / ref.norm()) < 4e-3


def test_experts_op_equals_the_two_ops_when_one_half_cannot_take_wgmma():
    """Down scales that are not 16-byte aligned keep the down half on the mma.sync kernel: the one-op forward then sorts
    that half for itself, and stays bit-identical to the two ops (each half on the kernel it runs alone)."""
    from torchforge.ops.awq_mma import awq_mma_moe_down_combine, awq_mma_moe_gate_up_silu
    from torchforge.ops.awq_mma_moe_experts import awq_mma_moe_experts

    E, k, G, T = 4, 4, 128, 160
    gu, down = _experts(E, G, "cuda", seed=6)
    ds = torch.empty(down[1].numel() + 4, dtype=down[1].dtype, device="cuda")[4:].view_as(down[1]).copy_(down[1])
    assert ds.data_ptr() % 16 != 0
    ids, w = _ids(T, k, E, seed=6)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    mgu, mdn = awq_to_mma_layout(gu[0]), awq_to_mma_layout(down[0])
    one = awq_mma_moe_experts(x, ids, w, (mgu, gu[1], gu[2]), (mdn, ds, down[2]), G, k)
    h = awq_mma_moe_gate_up_silu(x, ids, mgu, gu[1], gu[2], G, k)
    two = awq_mma_moe_down_combine(h, ids, w, mdn, ds, down[2], G)
    assert torch.equal(one, two)


@pytest.mark.parametrize("wgmma,blocks", [(None, {128}), (True, {128}), (False, {16})])
def test_experts_op_compiles_once_for_all_prefill_lengths(wgmma, blocks, monkeypatch):
    """After the automatic-dynamic recompile at the second prefill length a third length runs the same graph, on
    either grouped kernel and through the default dispatch (80-116 rows per expert: wgmma on blocks of 128): the
    dispatch only compares the routed row count, and both ops take it as a SymInt (an int in the schema, or an int()
    in the dispatch, pinned each length: a recompile per prompt). Caches off, and the spy must see the traced sort:
    a graph cached by an earlier case would pass without tracing this one's dispatch."""
    import torchforge.ops.awq_mma_cuda as mma_cuda
    from torchforge.ops.awq_mma_moe_experts import awq_mma_moe_experts

    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", wgmma)
    E, k, G = 8, 4, 128
    gu, down = _experts(E, G, "cuda", seed=7)
    mgu, mdn = (awq_to_mma_layout(gu[0]), gu[1], gu[2]), (awq_to_mma_layout(down[0]), down[1], down[2])
    import torch._functorch.config
    import torch._inductor.config

    torch._dynamo.reset()
    seen = _spy_blocks(monkeypatch)
    f = torch.compile(lambda x, ids, w: awq_mma_moe_experts(x, ids, w, mgu, mdn, G, k), fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for n, T in enumerate((160, 192, 232)):
            ids, w = _ids(T, k, E, seed=T)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            with torch._dynamo.config.patch(error_on_recompile=n == 2):
                out = f(x, ids, w)
            _, out_ref = _oracle(x, ids, w, gu, down, k, G)
            assert ((out.double() - out_ref).norm() / out_ref.norm()) < 1e-2
    assert seen and set(seen) == blocks


@pytest.mark.parametrize("wgmma", [True, False])
def test_contiguous_but_misaligned_x_is_copied(wgmma, monkeypatch):
    """x a contiguous view 6 bytes into a flat buffer (contiguous() would return it as is): both grouped kernels get
    an aligned copy and give its bits."""
    import torchforge.ops.awq_mma_cuda as mma_cuda

    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", wgmma)
    E, k, G, T = 4, 2, 128, 96
    gu, _ = _experts(E, G, "cuda", seed=8)
    mgu = awq_to_mma_layout(gu[0])
    ids, _ = _ids(T, k, E, seed=8)
    x = torch.randn(T * H + 3, device="cuda", dtype=torch.bfloat16)[3:].view(T, H)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    part = mma_cuda.launch_awq_mma_moe_cuda(x, ids, mgu, gu[1], gu[2], G, k)
    assert torch.equal(part, mma_cuda.launch_awq_mma_moe_cuda(x.clone(), ids, mgu, gu[1], gu[2], G, k))


def test_groups_of_32_take_the_mma_kernel_where_the_hopper_instances_cannot_run(monkeypatch):
    """Groups of 32 exist only as warp-specialized instances; where a build's could not run them
    (awq_mma_cuda.wgmma_g32_ready false), the sorted grouped call takes the mma.sync kernel's blocks instead of the
    wgmma kernel's (which would raise)."""
    import torchforge.ops.awq_mma_cuda as mma_cuda

    E, G, T, k = 16, 32, 96, 8
    gu, down = _experts(E, G, "cuda", seed=5)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(mma_cuda, "MOE_WGMMA", True)
    assert mma_cuda.moe_align_block_rows(x, T * k, E, gu[1], gu[2], G) in (64, 128)
    monkeypatch.setattr(mma_cuda, "wgmma_g32_ready", lambda *a: False)
    assert mma_cuda.moe_align_block_rows(x, T * k, E, gu[1], gu[2], G) in (8, 16)
    # group 128 does not ask (moe_align_block_rows reads only the scales' dtype and alignment, so group 32's serve)
    assert mma_cuda.moe_align_block_rows(x, T * k, E, gu[1], gu[2], 128) in (64, 128)
    ids, w = _ids(T, k, E, seed=5)
    h, out = _run(x, ids, w, gu, down, G, k)
    h_ref, out_ref = _oracle(x, ids, w, gu, down, k, G)
    assert ((out.double() - out_ref).norm() / out_ref.norm()) < 1e-2
