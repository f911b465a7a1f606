"""torchforge::sigmoid_group_topk: reference == HF's DeepseekV3TopkRouter code, Triton kernel (interpreted on CPU)
== reference, the public op, opcheck, torch.compile, the fake, clear errors."""
import pytest
import torch
from torch.library import opcheck

from torchforge.ops import sigmoid_group_topk
from torchforge.ops._triton import can_launch
from torchforge.ops.sigmoid_group_topk import launch_sigmoid_group_topk, sigmoid_group_topk_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (E, n_group, topk_group, top_k)
CONFIGS = [(64, 8, 4, 8), (256, 8, 4, 8), (16, 4, 2, 3), (12, 3, 2, 4), (8, 1, 1, 2)]


def hf_router(logits, bias, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor):
    """HF transformers' DeepseekV3TopkRouter.forward after router_logits, restated (view(T, ...) instead of
    view(-1, ...) so that T = 0 works; n_group = 1 goes through the same group code)."""
    T, E = logits.shape
    scores = logits.sigmoid()
    scores_for_choice = scores + bias
    group_scores = scores_for_choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_indices


def by_id(weights, ids):
    """Rows sorted by id, weights permuted the same way (the routed order is unspecified)."""
    ids, perm = ids.sort(dim=-1)
    return weights.gather(1, perm), ids


def assert_same_picks(got, want, *, exact=True):
    (gw, gi), (ww, wi) = by_id(*got), by_id(*want)
    assert gi.dtype == torch.int64 and gw.dtype == torch.float32 and gi.shape == wi.shape
    assert torch.equal(gi, wi)
    if exact:
        assert torch.equal(gw, ww)
    else:
        torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-7)


def spaced_case(T, E, seed):
    """Rows of well-spaced values in random order plus a small bias: for the seeds used here the choice and
    group scores have no near-ties (margins >= 1e-5), so the kernel must pick exactly the reference's ids."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(E, generator=g) * 0.37 / E - 0.2 for _ in range(T)]
    logits = torch.stack(rows) if T else torch.zeros(0, E)
    return logits, torch.randperm(E, generator=g) * 0.01 / E


@pytest.mark.parametrize("E, n_group, topk_group, top_k", CONFIGS)
def test_reference_matches_hf(E, n_group, topk_group, top_k):
    g = torch.Generator().manual_seed(E + n_group)
    for i, T in enumerate((0, 1, 5, 33)):
        logits = torch.randn(T, E, generator=g) * 2
        bias = torch.randn(E, generator=g) * 0.1 if i % 2 else None
        norm, num_shared = bool(i % 3 != 1), i % 3
        want_w, want_i = hf_router(logits, torch.zeros(E) if bias is None else bias, n_group, topk_group, top_k,
                                   norm, 2.5)
        w, ids = sigmoid_group_topk_ref(logits, bias, n_group, topk_group, top_k, norm, 2.5, num_shared)
        assert w.shape == ids.shape == (T, top_k + num_shared)
        assert torch.equal(ids[:, top_k:], torch.arange(E, E + num_shared).expand(T, -1))
        assert bool((w[:, top_k:] == 1.0).all())
        assert_same_picks((w[:, :top_k], ids[:, :top_k]), (want_w, want_i))
        # the public op on CPU runs the reference
        assert_same_picks(sigmoid_group_topk(logits, bias, n_group, topk_group, top_k, norm, 2.5, num_shared), (w, ids))


def test_group_limit_and_unbiased_weights():
    # groups {0,1}, {2,3}: the bias moves the choice to group 1, the weights stay the unbiased scores
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.1]])
    bias = torch.tensor([0.0, 0.0, 0.9, 0.9])
    w, ids = sigmoid_group_topk(logits, bias, 2, 1, 2, False, 1.0, 1)
    w, ids = by_id(w, ids)
    assert ids.tolist() == [[2, 3, 4]]
    assert torch.equal(w, torch.cat([logits.sigmoid()[:, 2:], torch.ones(1, 1)], dim=1))


# --------------------------------------------------------------------------------- Triton kernel
needs_kernel = pytest.mark.skipif(not can_launch(torch.empty(0, device=DEVICE)),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


@needs_kernel
@pytest.mark.parametrize("E, n_group, topk_group, top_k, norm, num_shared",
                         [(64, 8, 4, 8, True, 1), (12, 3, 2, 4, False, 2), (8, 1, 1, 2, True, 0)])
def test_kernel_matches_reference(E, n_group, topk_group, top_k, norm, num_shared):
    logits, bias = spaced_case(5, E, seed=E)
    bias = bias if n_group > 1 else None
    args = (bias, n_group, topk_group, top_k, norm, 2.5, num_shared)
    ref = sigmoid_group_topk_ref(logits, *args)
    dev_bias = None if bias is None else bias.to(DEVICE)
    w, ids = launch_sigmoid_group_topk(logits.to(DEVICE), dev_bias, *args[1:])
    assert_same_picks((w.cpu(), ids.cpu()), ref, exact=False)
    assert bool((w[:, top_k:] == 1.0).all())
    # the routed picks come out in descending choice order
    choice = logits.sigmoid() + (0 if bias is None else bias)
    assert bool((choice.gather(1, ids[:, :top_k].cpu()).diff(dim=1) < 0).all())


@needs_kernel
def test_kernel_ties_empty_and_non_contiguous():
    # a tied maximum counts twice in the group's top-2 sum: group {0..3} (2 * sigmoid(1)) beats {4..7}
    logits = torch.tensor([[1.0, 1.0, -5.0, -5.0, 1.5, -5.0, -5.0, -5.0]])
    ids = launch_sigmoid_group_topk(logits.to(DEVICE), None, 2, 1, 2, True, 1.0, 0)[1]
    ref_ids = sigmoid_group_topk_ref(logits, None, 2, 1, 2, True, 1.0)[1]
    assert sorted(ids[0].tolist()) == sorted(ref_ids[0].tolist()) == [0, 1]
    # equal scores everywhere: ties are broken arbitrarily, but every pick is a distinct expert
    w, ids = launch_sigmoid_group_topk(torch.zeros(2, 12, device=DEVICE), None, 3, 2, 8, True, 1.0, 1)
    assert sorted(ids[0, :8].tolist()) == sorted(set(ids[0, :8].tolist())) and ids[0, 8] == 12
    torch.testing.assert_close(w[:, :8].cpu(), torch.full((2, 8), 1 / 8))
    w, ids = launch_sigmoid_group_topk(torch.zeros(0, 16, device=DEVICE), None, 4, 2, 3, True, 2.5, 1)
    assert w.shape == ids.shape == (0, 4)
    logits = spaced_case(3, 16, seed=1)[0].T.contiguous().T  # [3, 16], stride (1, 3)
    got = launch_sigmoid_group_topk(logits.to(DEVICE), None, 4, 2, 3, True, 2.5, 0)
    assert_same_picks((got[0].cpu(), got[1].cpu()), sigmoid_group_topk_ref(logits, None, 4, 2, 3, True, 2.5),
                      exact=False)


# --------------------------------------------------------------------------------- op: opcheck, compile, fake
def test_opcheck():
    op = torch.ops.torchforge.sigmoid_group_topk.default
    logits, bias = spaced_case(4, 16, seed=0)
    opcheck(op, (logits, bias, 4, 2, 3, True, 2.5, 1))
    opcheck(op, (logits, None, 1, 1, 2, False, 1.0, 0))
    opcheck(op, (torch.zeros(0, 16), None, 4, 2, 3, True, 2.5, 2))


def test_compile_fullgraph():
    torch._dynamo.reset()
    logits, bias = spaced_case(6, 16, seed=3)

    @torch.compile(fullgraph=True)
    def f(x):
        w, ids = sigmoid_group_topk(x, bias, 4, 2, 3, True, 2.5, 1)
        return w * 2, ids + 1

    w, ids = f(logits)
    ref_w, ref_ids = sigmoid_group_topk_ref(logits, bias, 4, 2, 3, True, 2.5, 1)
    assert_same_picks((w, ids), (ref_w * 2, ref_ids + 1))


def test_fake_shapes():
    w, ids = sigmoid_group_topk(torch.empty(7, 256, device="meta"), torch.empty(256, device="meta"), 8, 4, 8, True,
                                2.5, 1)
    assert w.device.type == "meta" and w.shape == ids.shape == (7, 9)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64


def test_bad_arguments():
    x, b = torch.zeros(2, 16), torch.zeros(16)

    def call(x=x, b=b, n_group=4, topk_group=2, top_k=3, num_shared=0):
        return sigmoid_group_topk(x, b, n_group, topk_group, top_k, True, 1.0, num_shared)

    with pytest.raises(TypeError, match=r"logits must be float32 .*got torch.float16; pass logits.float\(\)"):
        call(x=x.half())
    with pytest.raises(ValueError, match=r"logits must be 2-D \[T, E\], got shape \(2, 4, 4\)"):
        call(x=x.view(2, 4, 4))
    with pytest.raises(TypeError, match="bias .* must be float32, got torch.float64"):
        call(b=b.double())
    with pytest.raises(ValueError, match=r"bias must be \[E\] = \[16\] .*got shape \(8,\)"):
        call(b=b[:8])
    with pytest.raises(ValueError, match="bias is on meta but logits is on cpu"):
        call(b=b.to("meta"))
    with pytest.raises(ValueError, match="n_group must be >= 1"):
        call(n_group=0)
    with pytest.raises(ValueError, match="E=16 experts must split into n_group=3 equal groups of at least 2"):
        call(n_group=3)
    with pytest.raises(ValueError, match="E=16 experts must split into n_group=16 equal groups of at least 2"):
        call(n_group=16, topk_group=1)
    with pytest.raises(ValueError, match=r"topk_group must be in \[1, n_group=4\], got 5"):
        call(topk_group=5)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, topk_group \* E // n_group = 8\].*got 9"):
        call(top_k=9)
    with pytest.raises(ValueError, match="top_k must be in .*got 0"):
        call(top_k=0)
    with pytest.raises(ValueError, match="num_shared must be >= 0, got -1"):
        call(num_shared=-1)


@pytest.mark.cuda
def test_cuda_op_uses_kernel():
    logits, bias = spaced_case(9, 256, seed=13)
    got = sigmoid_group_topk(logits.cuda(), bias.cuda(), 8, 4, 8, True, 2.5, 1)
    assert_same_picks((got[0].cpu(), got[1].cpu()), sigmoid_group_topk_ref(logits, bias, 8, 4, 8, True, 2.5, 1),
                      exact=False)
