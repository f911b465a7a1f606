"""Gradients of the quantized MoE expert ops (torchforge.ops.moe_autograd) against autograd through a plain float
computation on the dequantized experts (a gathered weight per routed row): x, and the router weights where the op
multiplies by them; pruned picks and out-of-range ids; opcheck's autograd registration."""
import pytest
import torch
import torch.nn.functional as F

from torchforge import ops
from torchforge.ops.awq_mma import awq_mma_moe_down_combine, awq_mma_moe_gate_up_silu
from torchforge.ops.awq_mma_layout import awq_to_mma_layout
from torchforge.ops.awq_mma_moe_experts import awq_mma_moe_experts
from torchforge.ops.moe_autograd import _combine_grads, _rows_times_experts

E, H, I, G, T, K = 5, 64, 64, 64, 3, 2  # the mma layout takes multiples of 64 (dims and group size)


def _awq_experts(oc, ic, seed):
    w = torch.randn(E, oc, ic, generator=torch.Generator().manual_seed(seed)) * 0.1
    q, s, z = ops.awq_quantize(w, group_size=G)
    return (q, s, z), ops.awq_dequantize(q, s.float(), z, G)


def _case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_(True)
    ids = torch.randint(0, E, (T * K,), generator=g)
    weights = torch.rand(T, K, generator=g).requires_grad_(True)
    return x, ids, weights


def _ref_rows(x, ids, w, rows_per_x):
    """x[r // rows_per_x] @ w[ids[r]].T in fp32, one gathered weight per row."""
    return torch.einsum("rk,rnk->rn", x.float().repeat_interleave(rows_per_x, 0), w[ids])


def _ref_gate_up_silu(x, ids, w):
    gate, up = _ref_rows(x, ids, w, K).chunk(2, dim=-1)
    return F.silu(gate) * up


def _ref_down_combine(h, ids, weights, w):
    return (_ref_rows(h, ids, w, 1).view(T, K, -1) * weights.float()[..., None]).sum(1)


def _grads(out, inputs, seed=3):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out.float(), inputs, g.to(out.device, out.dtype))


def _close(got, want, tol):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert rel < tol, rel


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["awq_moe_gemm", "awq_grouped_linear", "nvfp4_grouped_linear"])
def test_grouped_linear_input_gradient(op, dtype):
    x, ids, _ = _case(dtype)
    if op == "nvfp4_grouped_linear":
        w = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(1)) * 0.1
        packed, scales, s2 = ops.nvfp4_quantize(w)
        wf = ops.nvfp4_dequantize(packed, scales, s2)
        out, rows_per_x = ops.nvfp4_grouped_linear(x, ids, packed, scales, s2, None, x_row_div=K), K
    else:
        (q, s, z), wf = _awq_experts(2 * I, H, 1)
        if op == "awq_moe_gemm":
            out, rows_per_x = ops.awq_moe_gemm(x, ids, q, s, z, G, K), K
        else:
            out, rows_per_x = ops.awq_grouped_linear(x.repeat_interleave(K, 0), ids, q, s, z, G), K
    xr = x.detach().float().requires_grad_(True)
    (want,) = _grads(_ref_rows(xr, ids, wf.to(dtype).float(), rows_per_x), [xr])
    _close(_grads(out, [x]), [want.to(dtype)], _tol(dtype))


def test_nvfp4_w4a4_passes_the_gradient_straight_through():
    x, ids, _ = _case()
    w = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(1)) * 0.1
    packed, scales, s2 = ops.nvfp4_quantize(w)
    input_scale = torch.full((E,), float(x.detach().abs().max()) / (6 * 448))
    out = ops.nvfp4_grouped_linear(x, ids, packed, scales, s2, input_scale, x_row_div=K)
    xr = x.detach().requires_grad_(True)
    (want,) = _grads(_ref_rows(xr, ids, ops.nvfp4_dequantize(packed, scales, s2), K), [xr])
    _close(_grads(out, [x]), [want], 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_silu_and_down_combine(dtype):
    x, ids, weights = _case(dtype)
    (gu_q, gu_s, gu_z), gu = _awq_experts(2 * I, H, 1)
    (dn_q, dn_s, dn_z), dn = _awq_experts(H, I, 2)
    h = ops.awq_moe_gate_up_silu(x, ids, gu_q, gu_s, gu_z, G, K)
    xr = x.detach().float().requires_grad_(True)
    (want,) = _grads(_ref_gate_up_silu(xr, ids, gu.to(dtype).float()), [xr])
    _close(_grads(h, [x]), [want.to(dtype)], _tol(dtype))

    h = h.detach().requires_grad_(True)
    out = ops.awq_moe_down_combine(h, ids, weights, dn_q, dn_s, dn_z, G)
    hr, wr = h.detach().float().requires_grad_(True), weights.detach().requires_grad_(True)
    want = _grads(_ref_down_combine(hr, ids, wr, dn.to(dtype).float()), [hr, wr])
    _close(_grads(out, [h, weights]), [want[0].to(dtype), want[1]], _tol(dtype))


def _mma_case(shared):
    """mma-layout experts; with `shared`, a shared expert routed as id E by the last pick of every token."""
    x, ids, weights = _case()
    (gu_q, gu_s, gu_z), gu = _awq_experts(2 * I, H, 1)
    (dn_q, dn_s, dn_z), dn = _awq_experts(H, I, 2)
    gate_up, down = (awq_to_mma_layout(gu_q), gu_s, gu_z), (awq_to_mma_layout(dn_q), dn_s, dn_z)
    extra = None
    if shared:  # the last stored expert becomes the shared one; the routed ones are the first E - 1
        cut = lambda t: (tuple(a[:-1].contiguous() for a in t), tuple(a[-1].contiguous() for a in t))  # noqa: E731
        (gate_up, s_gu), (down, s_dn) = cut(gate_up), cut(down)
        extra = (s_gu, s_dn)
        ids = ids.clamp(max=E - 2).view(T, K)
        ids[:, -1] = E - 1
        ids = ids.reshape(-1)
    return x, ids, weights, gate_up, down, extra, gu, dn


@pytest.mark.parametrize("shared", [False, True])
def test_mma_halves_and_whole_experts_op(shared):
    x, ids, weights, gate_up, down, extra, gu, dn = _mma_case(shared)
    xr, wr = x.detach().requires_grad_(True), weights.detach().requires_grad_(True)
    hr = _ref_gate_up_silu(xr, ids, gu)
    want_x, want_w = _grads(_ref_down_combine(hr, ids, wr, dn), [xr, wr])
    # the whole experts forward as one op
    out = awq_mma_moe_experts(x, ids, weights, gate_up, down, G, K, extra)
    _close(_grads(out, [x, weights]), [want_x, want_w], 1e-5)
    # its two halves
    h = awq_mma_moe_gate_up_silu(x, ids, *gate_up, G, K, extra[0] if extra else None)
    out = awq_mma_moe_down_combine(h, ids, weights, *down, G, extra[1] if extra else None)
    _close(_grads(out, [x, weights]), [want_x, want_w], 1e-5)


def test_gradcheck():
    """Finite differences in fp32 (the ops take no float64): loose tolerances, small shapes."""
    x, ids, weights = _case()
    (gu_q, gu_s, gu_z), _ = _awq_experts(2 * I, H, 1)
    (dn_q, dn_s, dn_z), _ = _awq_experts(H, I, 2)

    def experts(x, weights):
        h = ops.awq_moe_gate_up_silu(x, ids, gu_q, gu_s, gu_z, G, K)
        return ops.awq_moe_down_combine(h, ids, weights, dn_q, dn_s, dn_z, G)

    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(experts, (x, weights), eps=1e-2, atol=2e-3, rtol=2e-2, fast_mode=True)


def test_pruned_picks_and_out_of_range_ids_get_no_gradient():
    # a pruned pick (moe_remap: expert 0, weight 0) sends no gradient to its row of h
    x, ids, weights = _case()
    (dn_q, dn_s, dn_z), dn = _awq_experts(H, I, 2)
    h = torch.randn(T * K, I, requires_grad=True)
    w = weights.detach().clone()
    w[1, 0] = 0
    (grad_h,) = _grads(ops.awq_moe_down_combine(h, ids, w, dn_q, dn_s, dn_z, G), [h])
    assert torch.all(grad_h[1 * K + 0] == 0) and grad_h.abs().sum() > 0
    # ids outside [0, E) (CUDA forwards write NaN rows for them; CPU forwards raise): zero rows, NaN rows ignored
    bad = ids.clone()
    bad[0], bad[3] = -1, E
    rows = torch.randn(T * K, H)
    rows[3] = float("nan")
    out = _rows_times_experts(rows, bad, dn.transpose(1, 2).contiguous())
    assert torch.all(out[[0, 3]] == 0)
    torch.testing.assert_close(out[1:3], _ref_rows(rows[1:3], ids[1:3], dn, 1), rtol=1e-5, atol=1e-5)
    grad_h, grad_w = _combine_grads(True, True, torch.randn(T, H), torch.randn(T * K, I), bad, weights.detach(), dn)
    assert torch.all(grad_h[[0, 3]] == 0) and torch.all(grad_w.view(-1)[[0, 3]] == 0)
    assert grad_w.view(-1)[[1, 2]].abs().min() > 0


def test_no_work_when_nothing_needs_a_gradient():
    x, ids, _ = _case()
    (q, s, z), _ = _awq_experts(2 * I, H, 1)
    out = ops.awq_moe_gemm(x.detach(), ids, q, s, z, G, K)
    assert out.grad_fn is None  # no input requires grad: no backward node
    # a trainable scale tensor beside a frozen x: the backward runs but computes nothing for x
    s_train = s.float().requires_grad_(True)
    ops.awq_moe_gemm(x.detach(), ids, q, s_train, z, G, K).sum().backward()
    assert s_train.grad is None


@pytest.mark.parametrize("op", ["awq_moe_gemm", "awq_moe_gate_up_silu", "awq_moe_down_combine", "awq_mma_moe_experts"])
def test_opcheck(op):
    x, ids, weights = _case()
    (gu_q, gu_s, gu_z), _ = _awq_experts(2 * I, H, 1)
    (dn_q, dn_s, dn_z), _ = _awq_experts(H, I, 2)
    h = torch.randn(T * K, I, requires_grad=True)
    args = {"awq_moe_gemm": (x, ids, gu_q, gu_s, gu_z, G, K),
            "awq_moe_gate_up_silu": (x, ids, gu_q, gu_s, gu_z, G, K),
            "awq_moe_down_combine": (h, ids, weights, dn_q, dn_s, dn_z, G),
            "awq_mma_moe_experts": (x, ids, weights, awq_to_mma_layout(gu_q), gu_s, gu_z, awq_to_mma_layout(dn_q),
                                    dn_s, dn_z, G, K) + (None,) * 6}[op]
    torch.library.opcheck(getattr(torch.ops.torchforge, op), args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def _cuda(*ts):
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else (_cuda(*t) if isinstance(t, tuple) else t) for t in ts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16),
                                         (torch.float16, torch.float16)])
def test_gradients_on_cuda(dtype, scale):
    """The backward on the GPU (torch._grouped_mm's bf16 kernel, or its fallback for fp16) through the CUDA forwards:
    the AWQ-layout grouped GEMM, its gate_up / down_combine halves, and the mma-layout experts op with a shared
    expert; the scale dtypes the kernels take (fp16 with either x, as AWQ checkpoints hold them; bf16 with bf16)."""
    x, ids, weights, gate_up, down, extra, gu, dn = _mma_case(shared=True)
    (gu_q, gu_s, gu_z), gu_awq = _awq_experts(2 * I, H, 1)
    (dn_q, dn_s, dn_z), dn_awq = _awq_experts(H, I, 2)
    gate_up = (gate_up[0], gate_up[1].to(scale), gate_up[2])
    down = (down[0], down[1].to(scale), down[2])
    extra = tuple((q, s.to(scale), z) for q, s, z in extra)
    gu_s, dn_s = gu_s.to(scale), dn_s.to(scale)
    x = x.detach().to(dtype).cuda().requires_grad_(True)
    weights = weights.detach().cuda().requires_grad_(True)
    ids, gu, dn, gu_awq, dn_awq = _cuda(ids, gu, dn, gu_awq, dn_awq)
    gate_up, down, extra = _cuda(gate_up, down, extra)
    gu_q, gu_s, gu_z, dn_q, dn_s, dn_z = _cuda(gu_q, gu_s, gu_z, dn_q, dn_s, dn_z)

    # the reference uses the weights as the ops round them: dequantized with the scales in `scale`, in x's dtype
    def ref(t):
        return t.to(dtype).float()

    xr, wr = x.detach().float().requires_grad_(True), weights.detach().requires_grad_(True)
    want_x, want_w = _grads(_ref_down_combine(_ref_gate_up_silu(xr, ids, ref(gu)), ids, wr, ref(dn)), [xr, wr])
    out = awq_mma_moe_experts(x, ids, weights, gate_up, down, G, K, extra)
    _close(_grads(out, [x, weights]), [want_x.to(dtype), want_w], 3e-2)

    plain = ids.clamp(max=E - 2)  # AWQ-layout ops: routed experts only
    (want,) = _grads(_ref_rows(xr, plain, ref(gu_awq), K), [xr])
    _close(_grads(ops.awq_moe_gemm(x, plain, gu_q, gu_s, gu_z, G, K), [x]), [want.to(dtype)], 3e-2)
    h = ops.awq_moe_gate_up_silu(x, plain, gu_q, gu_s, gu_z, G, K)
    (want,) = _grads(_ref_gate_up_silu(xr, plain, ref(gu_awq)), [xr])
    _close(_grads(h, [x]), [want.to(dtype)], 3e-2)
    h = h.detach().requires_grad_(True)
    hr = h.detach().float().requires_grad_(True)
    want = _grads(_ref_down_combine(hr, plain, wr, ref(dn_awq)), [hr, wr])
    out = ops.awq_moe_down_combine(h, plain, weights, dn_q, dn_s, dn_z, G)
    _close(_grads(out, [h, weights]), [want[0].to(dtype), want[1]], 3e-2)


def test_grouped_mm_any_dtype_opcheck():
    """The fp32 / fp16 grouped GEMM of the backward (a shape-only fake where aten's takes bf16 only): opcheck, and the
    same product as one matmul per group."""
    from torchforge.ops.moe_autograd import _grouped_mm_any_dtype

    g = torch.Generator().manual_seed(0)
    rows, weight = torch.randn(7, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # the middle group is empty
    torch.library.opcheck(_grouped_mm_any_dtype, (rows, weight, offs))
    want = torch.cat([rows[:2] @ weight[0], rows[2:] @ weight[2]])
    torch.testing.assert_close(_grouped_mm_any_dtype(rows, weight, offs), want)


def test_experts_dequantized_in_chunks_give_the_same_gradient(monkeypatch):
    """The backward dequantizes a bounded number of experts at a time (moe_autograd._CHUNK_WEIGHTS): one expert a
    chunk gives the same bits as all at once."""
    import torchforge.ops.moe_autograd as moe_autograd

    x, ids, weights = _case()
    (gu_q, gu_s, gu_z), _ = _awq_experts(2 * I, H, 1)
    mma_q = awq_to_mma_layout(gu_q)
    packed, scales, s2 = ops.nvfp4_quantize(torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(1)))
    calls = {  # AWQ layout, mma layout (the halves' dequantization), NVFP4
        "awq": lambda: ops.awq_moe_gemm(x, ids, gu_q, gu_s, gu_z, G, K),
        "mma": lambda: awq_mma_moe_gate_up_silu(x, ids, mma_q, gu_s, gu_z, G, K),
        "nvfp4": lambda: ops.nvfp4_grouped_linear(x, ids, packed, scales, s2, None, x_row_div=K),
    }
    whole = {name: _grads(f(), [x])[0] for name, f in calls.items()}
    monkeypatch.setattr(moe_autograd, "_CHUNK_WEIGHTS", 2 * I * H)
    for name, f in calls.items():
        assert torch.equal(_grads(f(), [x])[0], whole[name]), name
