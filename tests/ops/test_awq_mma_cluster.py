"""awq_mma_cuda with cluster=True (csrc/awq_mma.cu): each tile's K slices (grid z) run as one thread block cluster and
add their sums in distributed shared memory, in slice order: the same bits as the fp32 partials that one last block
reads, checked against those and an independent dequantization, with row and column tails, bias, 4 and 8 warps, the
prefetching loop, groups of 32 to 128, and act-order's perm."""
import pytest
import torch

from tests.ops.awq_oracle import dequant_independent
from tests.ops.graph_check import check_compile_and_cuda_graph
from torchforge.ops import awq_quantize
from torchforge.ops._ext import has_cuda_ext
from torchforge.ops.awq_mma_layout import awq_to_mma_layout

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not (has_cuda_ext() and torch.cuda.get_device_capability() >= (9, 0)
                                      and hasattr(torch.ops.torchforge, "awq_wgmma_cluster_slots")),
                                 reason="needs the compiled extension (csrc/, with clusters) and an sm_90 GPU")]


def _case(k, n, G, seed=0):
    torch.manual_seed(seed)
    qw, s, z = [t.cuda() for t in awq_quantize(torch.randn(n, k) * 3, G, symmetric=False)]
    return qw, awq_to_mma_layout(qw), s, z


@pytest.mark.parametrize("m", [1, 16, 17, 33])
@pytest.mark.parametrize("splits", [2, 3, 4, 8])
@pytest.mark.parametrize("warps,prefetch", [(4, False), (8, False), (4, True)])
@pytest.mark.parametrize("G", [128, 32])
def test_cluster_gives_the_partials_bits(m, splits, warps, prefetch, G):
    if G == 32 and prefetch:
        pytest.skip("the prefetching loop takes items of 128 k (groups of 64 or more)")
    chunks = 1 if G == 32 else 2
    qw, mma, s, z = _case(2048, 320, G, seed=m + splits)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(320, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.torchforge.awq_mma_cuda
    args = (x, mma, s, z, G, b, splits, chunks, None, warps, prefetch)
    tickets = torch.ones(64, dtype=torch.int32, device="cuda")  # the cluster path takes no ticket: left as is
    out = op(*(args[:8] + (tickets,) + args[9:]), cluster=True)
    assert torch.equal(tickets, torch.ones_like(tickets))
    assert torch.equal(out, op(*args))
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double() + b.double()
    assert ((out.double() - expected).norm() / expected.norm()) < 4e-3


def test_cluster_with_perm_errors_opcheck_compile_and_graph():
    qw, mma, s, z = _case(1024, 256, 128, seed=9)
    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(1024, device="cuda").to(torch.int32)
    op = torch.ops.torchforge.awq_mma_cuda
    out = op(x, mma, s, z, 128, None, 4, 2, None, 4, False, perm, cluster=True)
    assert torch.equal(out, op(x, mma, s, z, 128, None, 4, 2, None, 4, False, perm))
    torch.library.opcheck(op, (x, mma, s, z, 128, None, 4, 2, None, 4, False, None, True))
    for splits in (1, 9):
        with pytest.raises(RuntimeError, match=r"cluster=True runs the K slices as one cluster per tile: splits must "
                                               r"be in \[2, 8\]"):
            op(torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16), *_case(4096, 256, 128)[1:], 128, None,
               splits, 1, None, 4, False, cluster=True)
    check_compile_and_cuda_graph(lambda x: op(x, mma, s, z, 128, None, 4, 2, None, 4, False, cluster=True), x)
