"""Programmatic dependent launch (csrc/pdl.cuh): chains of the extension's kernels, each call reading the output of
the call before it, give the same bits with PDL off and at both levels, eagerly and replayed from a CUDA graph. A
kernel that read x, or wrote its output, partials or tickets, before its griddepcontrol.wait would race with the
kernel before it."""
import os

import pytest
import torch

from tests.ops.awq_oracle import dequant_independent
from torchforge.ops import awq_quantize
from torchforge.ops._ext import has_cuda_ext, set_pdl, set_start_prefetch
from torchforge.ops.awq_mma_layout import awq_to_mma_layout

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not has_cuda_ext(), reason="needs the compiled extension (csrc/) and a GPU")]
STEPS = 12
# compute-sanitizer runs (bench/gpu_suite.sh) turn the caching allocator off, without which CUDA graphs cannot capture
NO_CACHING = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"


def _square(n, G=128, seed=0):
    """A quantized n x n weight scaled so that x -> x W.T keeps |x| about constant over the chain."""
    torch.manual_seed(seed)
    qw, s, z = [t.cuda() for t in awq_quantize(torch.randn(n, n) / n ** 0.5, G, symmetric=False)]
    return qw, awq_to_mma_layout(qw), s, z


def _chain(step, x):
    outs = []
    for _ in range(STEPS):
        x = step(x)
        outs.append(x)
    return torch.stack(outs)


def _same_bits_at_every_level(step, x):
    """The chain without PDL, then at levels 1 and 2 (level 2 also in a CUDA graph): the same bits."""
    previous = set_pdl(0)
    try:
        off = _chain(step, x)
        runs = []
        for level in (1, 2):
            set_pdl(level)
            runs.append(_chain(step, x))
        if not NO_CACHING:
            graph = torch.cuda.CUDAGraph()
            x_static = x.clone()
            with torch.cuda.graph(graph):
                runs.append(_chain(step, x_static))
            graph.replay()
            torch.cuda.synchronize()
    finally:
        set_pdl(previous)
    assert torch.isfinite(off).all()
    for run in runs:
        assert torch.equal(run, off)
    return off


def test_set_pdl_returns_the_previous_level_and_refuses_others():
    previous = set_pdl(0)
    try:
        assert set_pdl(2) == 0
        assert set_pdl(1) == 2
        with pytest.raises(RuntimeError, match="level must be 0"):
            set_pdl(3)
        assert set_pdl(1) == 1
    finally:
        set_pdl(previous)


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_kernel_chain(m, dtype):
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda, mma_cuda_launch_config, mma_tickets

    n, G = 1024, 128
    qw, mma, s, z = _square(n, G, seed=m)
    splits, item_chunks, warps, prefetch = mma_cuda_launch_config(m, n, n, G, 132)
    assert splits > 1  # 16 tiles: K slices, so partials and tickets are in the chain too
    tickets = mma_tickets(n, mma.device)
    step = lambda x: launch_awq_mma_cuda(x, mma, s, z, G, splits=splits, item_chunks=item_chunks,  # noqa: E731
                                         warps=warps, prefetch=prefetch, tickets=tickets)
    x = torch.randn(m, n, device="cuda").to(dtype)
    out = _same_bits_at_every_level(step, x)
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double()
    assert (out[0].double() - expected).norm() / expected.norm() < 4e-3
    previous = set_start_prefetch(0)  # the L2 prefetch at the kernel's start is a hint: the same bits without
    try:
        for rounds in (0, 1, 2):  # and with it forced where the launcher's rule leaves it out
            set_start_prefetch(rounds)
            assert torch.equal(_chain(step, x), out)
        with pytest.raises(RuntimeError, match="mode must be -1"):
            set_start_prefetch(3)
    finally:
        set_start_prefetch(previous)
    # the prefetching loop (one block per SM at most, whole K): its L2 prefetch covers two rounds of items
    step = lambda x: launch_awq_mma_cuda(x, mma, s, z, G, splits=1, item_chunks=2, warps=8,  # noqa: E731
                                         prefetch=True)
    _same_bits_at_every_level(step, x)


@pytest.mark.parametrize("config", [(64, 2, 0, 8, True, 0), (64, 2, 0, 8, True, 7), (128, 2, 3, 8, True, 0),
                                    (256, 1, 1, 8, True, 0), (64, 2, 1, 8, False, 0)],
                         ids=["stream-k", "stream-k-7-blocks", "k-slices", "whole-tiles", "no-ws"])
@pytest.mark.parametrize("m", [64, 200])
def test_wgmma_kernel_chain(config, m):
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, mma_tickets

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    n, G = 1024, 128
    qw, mma, s, z = _square(n, G, seed=m)
    tickets = mma_tickets(n, mma.device)
    step = lambda x: launch_awq_wgmma_cuda(x, mma, s, z, G, config=config, tickets=tickets)  # noqa: E731
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = _same_bits_at_every_level(step, x)
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double()
    assert (out[0].double() - expected).norm() / expected.norm() < 4e-3


def test_moe_decode_chain():
    """The MoE decode kernel reads its expert ids from a torch kernel right before it (no PDL there): it may launch
    early, but reads the ids only after the wait."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_moe_cuda

    E, n, G, rows = 8, 512, 128, 4
    torch.manual_seed(0)
    qws, ss, zs = zip(*[awq_quantize(torch.randn(n, n) / n ** 0.5, G, symmetric=False) for _ in range(E)])
    mma = torch.stack([awq_to_mma_layout(q) for q in qws]).cuda()
    s, z = torch.stack(ss).cuda(), torch.stack(zs).cuda()

    def step(x):
        ids = (x.float().sum(-1).abs() * 1e3).long().remainder(E).repeat_interleave(rows)  # data-dependent ids
        part = launch_awq_mma_moe_cuda(x, ids, mma, s, z, G, rows)
        return part.sum(0).view(x.shape[0], rows, n).mean(1).to(x.dtype)

    x = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    _same_bits_at_every_level(step, x)


# A predecessor that lets the next kernel launch at once (griddepcontrol.launch_dependents at its start) and touches
# memory only ~50 us later: a kernel of ours that read its input, or wrote its output, before its griddepcontrol.wait
# sees the stale input or has its output overwritten, deterministically (the chains above race only with the last
# microseconds of the kernel before).
try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

    @triton.jit
    def _late_copy_kernel(src, dst, n, delay_ns, BLOCK: tl.constexpr):
        gdc_launch_dependents()
        t = globaltimer()
        end = t + delay_ns
        while t < end:
            t = globaltimer()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
except ImportError:  # a Triton without griddepcontrol
    _late_copy_kernel = None


def _late_copy(src, dst, delay_ns=50_000):
    if _late_copy_kernel is None:
        pytest.skip("needs Triton's gdc_launch_dependents")
    n = src.numel()
    torch.cuda._sleep(2_000_000)  # the GPU idles while the host queues the copy and the next op behind it
    _late_copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, delay_ns, BLOCK=1024)


def _waits_for_a_late_predecessor(step, x):
    """Level 2 (the op's first kernel launched with PDL) after _late_copy: the same bits as without PDL."""
    previous = set_pdl(0)
    try:
        expected = step(x)
        set_pdl(2)
        stale = torch.full_like(x, float("nan"))
        _late_copy(x, stale)  # read after wait: x; before: NaN
        assert torch.equal(step(stale), expected)
        # write after wait: the late copy reads `src` (freed, so the op's output may take its block) before it
        src = torch.randn_like(expected)
        keep, ptr, dst = src.clone(), src.data_ptr(), torch.empty_like(src)
        _late_copy(src, dst)
        del src
        out = step(x)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        if out.data_ptr() == ptr:  # (the caching allocator's choice; otherwise only the read is checked)
            assert torch.equal(dst, keep)
    finally:
        set_pdl(previous)


@pytest.mark.parametrize("m", [1, 16])
def test_decode_kernel_waits_for_a_late_predecessor(m):
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda, mma_tickets

    n, G = 1024, 128
    _, mma, s, z = _square(n, G, seed=m)
    tickets = mma_tickets(n, mma.device)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for splits in (1, 4):
        _waits_for_a_late_predecessor(
            lambda x: launch_awq_mma_cuda(x, mma, s, z, G, splits=splits, tickets=tickets), x)


@pytest.mark.parametrize("config", [(64, 2, 0, 8, True, 0), (128, 2, 3, 8, True, 0), (64, 2, 1, 8, False, 0)])
def test_wgmma_kernel_waits_for_a_late_predecessor(config):
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, mma_tickets

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    n, G = 1024, 128
    _, mma, s, z = _square(n, G)
    tickets = mma_tickets(n, mma.device)
    x = torch.randn(200, n, device="cuda", dtype=torch.bfloat16)
    _waits_for_a_late_predecessor(lambda x: launch_awq_wgmma_cuda(x, mma, s, z, G, config=config, tickets=tickets), x)
