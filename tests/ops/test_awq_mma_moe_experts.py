"""awq_mma_moe_experts (one op for a whole experts forward on the mma layout) against its two halves, bit for bit
(CPU: the reference path; CUDA: the grouped kernel, direct and sorted), its checks, and that gate_up and down share
one moe_align where the rows are sorted."""
import pytest
import torch

from tests.ops.test_awq_mma_moe import H, _experts
from torchforge.ops._ext import has_cuda_ext
from torchforge.ops.awq_mma import awq_mma_moe_down_combine, awq_mma_moe_gate_up_silu
from torchforge.ops.awq_mma_layout import awq_to_mma_layout
from torchforge.ops.awq_mma_moe_experts import awq_mma_moe_experts

cuda = pytest.mark.skipif(not has_cuda_ext(), reason="needs CUDA and the compiled extension")


def _case(E, T, k, G, device, shared, seed=0):
    """Experts on the mma layout (the last one apart when `shared`: routed as id E - 1 by every token), ids, weights,
    x."""
    gu, down = _experts(E, G, device, seed=seed)
    mgu, mdn = awq_to_mma_layout(gu[0]), awq_to_mma_layout(down[0])
    g = torch.Generator().manual_seed(seed + T)
    n = E - 1 if shared else E
    ids = torch.randint(0, n, (T, k), generator=g)
    if shared:
        ids[:, -1] = n
    w = torch.rand(T, k, generator=g).to(device)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    gate_up, dn = (mgu, gu[1], gu[2]), (mdn, down[1], down[2])
    extra = None
    if shared:
        cut = lambda t: (tuple(a[:n].contiguous() for a in t), tuple(a[n].contiguous() for a in t))  # noqa: E731
        (gate_up, s_gu), (dn, s_dn) = cut(gate_up), cut(dn)
        extra = (s_gu, s_dn)
    return x, ids.reshape(-1).to(device), w, gate_up, dn, extra


def _two_ops(x, ids, w, gate_up, dn, G, k, extra):
    h = awq_mma_moe_gate_up_silu(x, ids, *gate_up, G, k, extra[0] if extra else None)
    return awq_mma_moe_down_combine(h, ids, w, *dn, G, extra[1] if extra else None)


@pytest.mark.parametrize("device,T,k,shared", [
    ("cpu", 3, 2, False),
    ("cpu", 2, 3, True),
    pytest.param("cuda", 1, 4, False, marks=[pytest.mark.cuda, cuda]),  # direct: a block per routed row
    pytest.param("cuda", 1, 4, True, marks=[pytest.mark.cuda, cuda]),
    pytest.param("cuda", 6, 5, True, marks=[pytest.mark.cuda, cuda]),  # 30 rows over 9 experts: sorted blocks of 8
    pytest.param("cuda", 40, 5, False, marks=[pytest.mark.cuda, cuda]),  # 200 rows: sorted blocks of 16
    pytest.param("cuda", 40, 5, True, marks=[pytest.mark.cuda, cuda]),
    pytest.param("cuda", 300, 8, True, marks=[pytest.mark.cuda, cuda]),
])
def test_equals_the_two_ops(device, T, k, shared):
    E, G = 9, 64
    x, ids, w, gate_up, dn, extra = _case(E, T, k, G, device, shared)
    out = awq_mma_moe_experts(x, ids, w, gate_up, dn, G, k, extra)
    assert out.shape == (T, H) and out.dtype == x.dtype
    assert torch.equal(out, _two_ops(x, ids, w, gate_up, dn, G, k, extra))
    if device == "cpu":
        flat = (*gate_up, *dn, G, k, *((*extra[0], *extra[1]) if extra else (None,) * 6))
        torch.library.opcheck(torch.ops.torchforge.awq_mma_moe_experts, (x, ids, w, *flat))


def _count_aligns(monkeypatch):
    import torchforge.ops.moe_align as moe_align_mod

    calls = []
    real = moe_align_mod.moe_align

    def counting(*args):
        calls.append(args[1:])
        return real(*args)

    monkeypatch.setattr(moe_align_mod, "moe_align", counting)
    return calls


@pytest.mark.parametrize("T,k,sorts", [(1, 2, False), (16, 5, True)])
def test_one_sort_for_both_halves(T, k, sorts, monkeypatch):
    """With the grouped kernel standing in (CPU), the op sorts once where rows outnumber experts and hands the same
    alignment to both launches; in decode it sorts nothing. 80 rows over 9 routed experts + the shared one take
    blocks of 8 rows (80 <= 8 x 10); without the shared expert counted they would take 16."""
    import sys

    import torchforge.ops.awq_mma as awq_mma
    import torchforge.ops.moe_epilogue_triton as epilogue

    experts_op = sys.modules["torchforge.ops.awq_mma_moe_experts"]  # the package exports a function of that name

    E, G = 9, 64
    x, ids, w, gate_up, dn, extra = _case(E + 1, T, k, G, "cpu", True)
    calls = _count_aligns(monkeypatch)
    seen = []

    def launch(x, expert_ids, q, s, z, group_size, x_row_div, shared=None, alignment=None, symmetric=False):
        seen.append(alignment)
        return torch.zeros(1, expert_ids.numel(), q.shape[1] * 64)

    monkeypatch.setattr(experts_op, "mma_moe_cuda_ok", lambda *a: True)
    monkeypatch.setattr(awq_mma, "mma_moe_cuda_ok", lambda *a: True)
    monkeypatch.setattr(awq_mma, "launch_awq_mma_moe_cuda", launch)
    monkeypatch.setattr(epilogue, "launch_silu_mul_reduce", lambda part, dtype: part.sum(0)[:, : part.shape[2] // 2])
    monkeypatch.setattr(epilogue, "launch_combine_reduce", lambda part, w, dtype: part.sum(0)[:: w.shape[1]])
    awq_mma_moe_experts(x, ids, w, gate_up, dn, G, k, extra)
    assert len(seen) == 2 and seen[0] is seen[1]
    if sorts:
        from torchforge.ops.awq_mma_cuda import moe_sorted_block_rows
        from torchforge.ops.moe_align import moe_align_ref

        assert moe_sorted_block_rows(T * k, E + 1) == 8 and moe_sorted_block_rows(T * k, E) == 16
        assert calls == [(E + 1, 8)]
        ref = moe_align_ref(ids, E + 1, moe_sorted_block_rows(T * k, E + 1))
        assert all(torch.equal(a, b) for a, b in zip(seen[0], ref))
    else:
        assert calls == [] and seen[0] is None


@pytest.mark.cuda
@cuda
def test_cuda_sorts_once(monkeypatch):
    E, G, T, k = 9, 64, 40, 5
    x, ids, w, gate_up, dn, extra = _case(E, T, k, G, "cuda", True)
    calls = _count_aligns(monkeypatch)
    out = awq_mma_moe_experts(x, ids, w, gate_up, dn, G, k, extra)
    assert len(calls) == 1
    assert torch.equal(out, _two_ops(x, ids, w, gate_up, dn, G, k, extra)) and len(calls) == 3


def test_errors_name_what_is_wrong():
    E, G, T, k = 5, 64, 2, 2
    x, ids, w, gate_up, dn, extra = _case(E, T, k, G, "cpu", True)
    with pytest.raises(ValueError, match=r"awq_mma_moe_experts: weights must be \[T, top_k\] with T = 2 tokens, got "
                                         r"\(1, 4\)"):
        awq_mma_moe_experts(x, ids, w.reshape(1, 4), gate_up, dn, G, k, extra)
    with pytest.raises(ValueError, match=r"down_qweight must be \[E, OC / 64, I \* 8\] with the intermediate size "
                                         r"I = 128 of gate_up \(gate rows then up rows\), got \(4, 2, 512\)"):
        awq_mma_moe_experts(x, ids, w, gate_up, (dn[0][..., :512].contiguous(), *dn[1:]), G, k, extra)  # I = 64
    with pytest.raises(ValueError, match="gate_up holds 4 experts but down holds 3"):
        awq_mma_moe_experts(x, ids, w, gate_up, tuple(t[:3] for t in dn), G, k, extra)
    with pytest.raises(ValueError, match="shared expert's gate_up and down tensors together"):
        torch.ops.torchforge.awq_mma_moe_experts(x, ids, w, *gate_up, *dn, G, k, *extra[0], None, None, None)
    with pytest.raises(ValueError, match=r"expert_ids has shape \(4,\), expected \(6,\)"):
        awq_mma_moe_experts(x, ids, w, gate_up, dn, G, 3, extra)


def test_compiles_with_dynamic_shapes():
    """torch.compile(fullgraph=True, dynamic=True) of the op (its checks and fake under symbolic sizes): one graph for
    two token counts, the eager result within float
    rounding (inductor compiles the CPU reference path's sums in its own order; on CUDA the kernels give the same
    bits, tests/ops/test_awq_mma_moe.py)."""
    E, G, k = 6, 64, 2
    one = torch.compile(lambda x, ids, w, gu, dn, extra: awq_mma_moe_experts(x, ids, w, gu, dn, G, k, extra),
                        fullgraph=True, dynamic=True)
    for T in (3, 5):
        args = _case(E, T, k, G, "cpu", True)
        torch.testing.assert_close(one(*args), awq_mma_moe_experts(*args[:5], G, k, args[5]), rtol=1e-5, atol=1e-5)
