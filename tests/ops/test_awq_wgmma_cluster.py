"""awq_wgmma_cuda with cluster=True (csrc/awq_wgmma.cu): each tile's K slices run as one thread block cluster and add
their sums through distributed shared memory. The same additions in the same order as the fp32 partials in global
memory, so the same bits; checked against those and an independent dequantization, with tails, bias, every dense
block shape, slice counts up to 8 (some slices empty), groups of 32 to 128 and both dtypes."""
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
              pytest.mark.skipif(not (has_cuda_ext() and _sm90()
                                      and hasattr(torch.ops.torchforge, "awq_wgmma_cluster_slots")),
                                 reason="needs the compiled extension (csrc/, with clusters) and an sm_90 GPU")]
TOL = {torch.float16: 1e-3, torch.bfloat16: 4e-3}


def _case(k, n, G, sym=False, seed=0):
    torch.manual_seed(seed)
    qw, s, z = [t.cuda() for t in awq_quantize(torch.randn(n, k) * 3, G, symmetric=sym)]
    return qw, awq_to_mma_layout(qw), s, z


@pytest.mark.parametrize("shape", [(64, 4), (64, 2), (128, 2), (192, 1), (256, 1)])
@pytest.mark.parametrize("splits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("k,G", [(1152, 128), (1152, 64), (2048, 32)])  # 18 chunks: 8 slices leave 2 empty
def test_cluster_gives_the_partials_bits(shape, splits, k, G):
    """640 columns (the last 256 has 2 of its 4 column blocks) and shape[0] + 5 rows (a second, nearly empty row
    block); bias. (64, 4) takes the partials (no cluster path)."""
    qw, mma, s, z = _case(k, 640, G, seed=splits + k)
    x = torch.randn(shape[0] + 5, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(640, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.torchforge.awq_wgmma_cuda
    args = (x, mma, s, z, G, b, splits, shape[0], shape[1], 8, True, 0)
    partials = op(*args)
    out = op(*args, cluster=True)
    assert torch.equal(out, partials)
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double() + b.double()
    assert ((out.double() - expected).norm() / expected.norm()) < TOL[torch.bfloat16]
    assert torch.equal(op(*args, cluster=True), out)  # deterministic


@pytest.mark.parametrize("shape", [(64, 2), (128, 2), (256, 1)])
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.bfloat16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16)])
def test_cluster_one_hot_rows_give_the_weights_bit_exact(shape, dtype, scale_dtype):
    """Row m of x = e_{k_m}: out[m] is column k_m of the weight, rounded once to x's dtype, whichever block of the
    cluster owns the output."""
    k, n = 768, 640
    qw, mma, s, z = _case(k, n, 128, seed=1)
    s = s.to(scale_dtype)
    w = dequant_independent(qw, s, z, 128)
    torch.manual_seed(2)
    m = 300
    ks = torch.randint(0, k, (m,), device="cuda")
    x = torch.zeros(m, k, device="cuda", dtype=dtype)
    x[torch.arange(m), ks] = 1
    out = torch.ops.torchforge.awq_wgmma_cuda(x, mma, s, z, 128, None, 4, shape[0], shape[1], 8, True, 0,
                                              cluster=True)
    assert torch.equal(out, w[:, ks].T.to(dtype))


@pytest.mark.parametrize("G", [128, 32])
def test_cluster_with_perm(G):
    """An act-order layer's permutation (perm) only changes the x image the clusters read: the same bits as the
    partials, and as the clusters on the gathered x."""
    qw, mma, s, z = _case(2048, 512, G, seed=5)
    x = torch.randn(70, 2048, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(2048, device="cuda").to(torch.int32)
    op = torch.ops.torchforge.awq_wgmma_cuda
    args = (s, z, G, None, 4, 64, 2, 8, True, 0)
    out = op(x, mma, *args, None, perm, cluster=True)
    assert torch.equal(out, op(x, mma, *args, None, perm))
    assert torch.equal(out, op(x[:, perm.long()].contiguous(), mma, *args, cluster=True))


@pytest.mark.parametrize("shape", [(64, 2), (128, 2), (192, 1), (256, 1)])
def test_cluster_path_runs_without_tickets(shape):
    """The cluster path takes no ticket: tickets that would make the partials' last-block test fire wrongly (all
    ones) are left as they are and the result is right. The partials path, which the launcher falls back to where
    clusters cannot run, would reset them and read unfinished partials."""
    qw, mma, s, z = _case(1152, 512, 128, seed=3)
    x = torch.randn(shape[0] + 5, 1152, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.torchforge.awq_wgmma_cuda
    tickets = torch.ones(64, dtype=torch.int32, device="cuda")
    out = op(x, mma, s, z, 128, None, 4, shape[0], shape[1], 8, True, 0, tickets, cluster=True)
    assert torch.equal(tickets, torch.ones_like(tickets))
    assert torch.equal(out, op(x, mma, s, z, 128, None, 4, shape[0], shape[1], 8, True, 0))


def test_cluster_slots():
    """One block per SM: clusters of 2 fit at least a third of the SMs' worth; none of 1 or 9 blocks, none of a shape
    that does not exist. The dispatch reads the device's slots (the H100's: the time model's table)."""
    from torchforge.ops.awq_mma_cuda import _device_cluster_slots
    from torchforge.ops.awq_wgmma_cost import H100_CLUSTER_SLOTS

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms == 132:
        assert dict(_device_cluster_slots(0)) == H100_CLUSTER_SLOTS
    slots = torch.ops.torchforge.awq_wgmma_cluster_slots
    for splits in (2, 4, 8):
        n = slots(64, 2, splits)
        assert 0 < n * splits <= sms, (splits, n)
    assert slots(128, 2, 2) >= sms // 3
    assert slots(128, 2, 1) == 0 and slots(128, 2, 9) == 0 and slots(128, 4, 2) == 0
    assert slots(64, 4, 2) == 0  # (64, 4) has no cluster path: with cluster=True it runs the partials


def test_cluster_errors_opcheck_compile_and_graph():
    qw, mma, s, z = _case(1024, 512, 128)
    x = torch.randn(70, 1024, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.torchforge.awq_wgmma_cuda
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 4, 64, 2, 8, True, 0, None, None, True))
    for bad in [(1, True, 0), (9, True, 0), (4, False, 0), (4, True, 1)]:
        splits, ws, dp = bad
        with pytest.raises(RuntimeError, match=r"cluster=True runs every tile in 2\.\.8 K slices"):
            op(x, mma, s, z, 128, None, splits, 64, 2, 8, ws, dp, cluster=True)
    check_compile_and_cuda_graph(lambda x: op(x, mma, s, z, 128, None, 4, 64, 2, 8, True, 0, cluster=True), x)
