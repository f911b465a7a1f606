"""GPTQ W4 layout: pack/unpack and v1 zeros against a numpy oracle written from the format description,
w4a16_gptq_linear (reference and the Triton kernel under TRITON_INTERPRET=1, act-order g_idx included),
opcheck, ForgeGPTQLinear from a GPTQ result, its AWQ-layout twin, bad input."""
import numpy as np
import pytest
import torch
from torch.library import opcheck

from torchforge.gptq import accumulate_hessian, solve
from torchforge.nn.gptq_linear import ForgeGPTQLinear
from torchforge.ops._triton import can_launch
from torchforge.ops.awq import awq_dequantize
from torchforge.ops.gptq import (
    gptq_dequantize,
    gptq_pack,
    gptq_pack_zeros,
    gptq_unpack,
    gptq_unpack_zeros,
    act_order_perm,
    trivial_g_idx,
    w4a16_gptq_linear,
)

HAS_KERNELS = can_launch(torch.empty(0))


def np_unpack_qweight(words):
    """[IC // 8, OC] int32 -> [IC, OC] codes: row 8r + j is nibble j of word r."""
    u = words.cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    icp, oc = u.shape
    out = np.zeros((icp * 8, oc), dtype=np.int64)
    for j in range(8):
        out[j::8] = (u >> (4 * j)) & 0xF
    return out


def np_unpack_qzeros(words):
    """[NG, OC // 8] -> [NG, OC] true zeros: output 8c + j is nibble j, stored minus one."""
    u = words.cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    ng, ocp = u.shape
    out = np.zeros((ng, ocp * 8), dtype=np.int64)
    for j in range(8):
        out[:, j::8] = ((u >> (4 * j)) & 0xF) + 1
    return out


def np_dequant(qweight, scales, qzeros, g_idx):
    """[IC, OC] fp32 (q - z) * s with the group of row k = g_idx[k]."""
    q = np_unpack_qweight(qweight)
    gi = g_idx.cpu().numpy().astype(np.int64)
    z = np_unpack_qzeros(qzeros)[gi]
    s = scales.float().cpu().numpy()[gi]
    return (q - z).astype(np.float32) * s


def random_gptq(ic, oc, group_size, seed, act_order=False):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (ic, oc), dtype=torch.uint8, generator=g)
    ng = ic // group_size
    zeros = torch.randint(1, 16, (ng, oc), dtype=torch.uint8, generator=g)
    scales = (torch.rand(ng, oc, generator=g) * 0.02 + 0.005).half()
    g_idx = trivial_g_idx(ic, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(ic, generator=g)].contiguous()
    return gptq_pack(codes), scales, gptq_pack_zeros(zeros), g_idx, codes, zeros


def test_pack_layout_and_v1_zeros():
    qweight, scales, qzeros, g_idx, codes, zeros = random_gptq(64, 24, 32, seed=0)
    assert qweight.shape == (8, 24) and qweight.dtype == torch.int32 and qzeros.shape == (2, 3)
    np.testing.assert_array_equal(np_unpack_qweight(qweight), codes.numpy())
    np.testing.assert_array_equal(np_unpack_qzeros(qzeros), zeros.numpy())
    assert torch.equal(gptq_unpack(qweight), codes) and torch.equal(gptq_unpack_zeros(qzeros), zeros)
    # symmetric 4-bit: zero point 8 is stored as 7 in every nibble, the familiar 0x77777777
    sym = gptq_pack_zeros(torch.full((2, 16), 8, dtype=torch.uint8))
    assert (sym == 0x77777777).all()
    assert int(gptq_pack(torch.full((8, 8), 15, dtype=torch.uint8))[0, 0]) == -1  # 0xFFFFFFFF as int32
    assert torch.equal(trivial_g_idx(8, 4), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32))


@pytest.mark.parametrize("act_order", [False, True])
def test_dequantize_matches_formula(act_order):
    qweight, scales, qzeros, g_idx, _, _ = random_gptq(128, 32, 32, seed=1, act_order=act_order)
    w = gptq_dequantize(qweight, scales.float(), qzeros, g_idx)
    assert w.shape == (32, 128)
    np.testing.assert_array_equal(w.numpy(), np_dequant(qweight, scales, qzeros, g_idx).T)


def _oracle(x, qweight, scales, qzeros, g_idx, bias=None):
    w = torch.from_numpy(np_dequant(qweight, scales, qzeros, g_idx)).to(x.dtype).double()
    out = x.cpu().double() @ w
    if bias is not None:
        out = out + bias.cpu().double()
    return out.to(x.dtype)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=4e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_reference(dtype):
    qweight, scales, qzeros, g_idx, _, _ = random_gptq(64, 16, 32, seed=2, act_order=True)
    x = torch.randn(2, 3, 64).to(dtype)
    bias = torch.randn(16).to(dtype)
    out = w4a16_gptq_linear(x, qweight, scales, qzeros, g_idx, bias)
    assert out.shape == (2, 3, 16) and out.dtype == dtype
    torch.testing.assert_close(out, _oracle(x, qweight, scales, qzeros, g_idx, bias), **TOL[dtype])


@pytest.mark.skipif(not HAS_KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, ic, oc, g, act_order, blocks", [
    (1, 64, 16, 32, False, dict(block_m=16, block_n=16, block_k=32)),
    (5, 96, 40, 32, True, dict(block_m=16, block_n=32, block_k=64)),  # K tail (96 = 64 + 32), OC tail
    (17, 128, 32, 64, False, dict(block_m=16, block_n=16, block_k=16)),
    (5, 96, 40, 32, True, dict(block_m=16, block_n=32, block_k=32, split_k=2)),  # K slices of 64 + 32, bias after
    (1, 1024, 64, 128, True, dict(block_m=16, block_n=64, block_k=64)),  # the default K slices (gptq_split_k: 2)
    (3, 256, 48, 32, False, dict(block_m=16, block_n=16, block_k=64)),  # contiguous groups, two in each K step
    (3, 256, 48, 128, False, dict(block_m=16, block_n=32, block_k=64)),  # one group in each K step
])
def test_triton_kernel(dtype, m, ic, oc, g, act_order, blocks):
    from torchforge.ops.gptq_triton import gptq_split_k, launch_w4a16_gptq_linear

    assert gptq_split_k(1, 1024, 64, 16, 64, 64) == 2  # the last case runs in two K slices by default

    qweight, scales, qzeros, g_idx, _, _ = random_gptq(ic, oc, g, seed=m, act_order=act_order)
    x = torch.randn(m, ic).to(dtype)
    bias = torch.randn(oc).to(dtype) if m == 5 else None
    out = launch_w4a16_gptq_linear(x, qweight, scales, qzeros, g_idx, bias, **blocks)
    torch.testing.assert_close(out, _oracle(x, qweight, scales, qzeros, g_idx, bias), **TOL[dtype])


@pytest.mark.skipif(not (HAS_KERNELS or torch.cuda.is_available()), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("ic, oc, g, act_order, stack", [(64, 16, 32, False, 0), (96, 40, 32, True, 0),
                                                         (136, 72, 8, True, 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dequant_kernel_is_the_reference(ic, oc, g, act_order, stack, dtype):
    """gptq_dequantize's CUDA path (one launch for a stack) gives the reference's bits, IC and OC tails and act-order
    g_idx included; a g_idx outside the groups gives NaN in its column, not a read past the scales."""
    from torchforge.ops.gptq_reference import gptq_dequantize_ref
    from torchforge.ops.gptq_triton import launch_gptq_dequantize

    parts = [random_gptq(ic, oc, g, seed=ic + i, act_order=act_order) for i in range(max(stack, 1))]
    q, s, z = (torch.stack([p[i] for p in parts]) if stack else parts[0][i] for i in range(3))
    g_idx = parts[0][3]
    s = s.to(dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, s, z, g_idx = q.to(dev), s.to(dev), z.to(dev), g_idx.to(dev)
    out = launch_gptq_dequantize(q, s, z, g_idx)
    want = gptq_dequantize_ref(q, s, z, g_idx)
    assert out.dtype == dtype and out.shape == want.shape and torch.equal(out, want)
    bad = g_idx.clone()
    bad[5] = ic // g  # one past the last group
    out = launch_gptq_dequantize(q, s, z, bad)
    assert out[..., 5].isnan().all() and torch.equal(out[..., 6:], want[..., 6:])


def test_opcheck():
    qweight, scales, qzeros, g_idx, codes, _ = random_gptq(64, 16, 32, seed=3)
    x = torch.randn(3, 64)
    opcheck(torch.ops.torchforge.gptq_pack, (codes,))
    opcheck(torch.ops.torchforge.gptq_unpack, (qweight,))
    opcheck(torch.ops.torchforge.gptq_dequantize, (qweight, scales, qzeros, g_idx))
    opcheck(torch.ops.torchforge.w4a16_gptq_linear, (x, qweight, scales, qzeros, g_idx, None))


def _layer(seed=4, ic=128, oc=32):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(ic, oc, bias=True)
    x = torch.randn(256, ic) @ (torch.randn(ic, ic) * torch.logspace(0, -2, ic).unsqueeze(1))
    return lin, x


def test_module_from_gptq_result():
    lin, x = _layer()
    h, _ = accumulate_hessian(x, 128)
    res = solve(lin.weight.detach(), h, group_size=32)
    mod = ForgeGPTQLinear(128, 32, bias=True, group_size=32, dtype=torch.float32).pack_result(res, lin.bias)
    assert torch.equal(mod.dequantized_weight(), res.dequantize())  # the checkpoint decodes to the solver's W_hat
    assert mod.qweight.shape == (16, 32) and mod.qzeros.shape == (4, 4) and mod.scales.dtype == torch.float16
    torch.testing.assert_close(mod(x[:4]), x[:4] @ res.dequantize().T + lin.bias, rtol=1e-5, atol=1e-5)
    qw, s, qz = mod.awq_tensors()  # the same weight in vLLM's AWQ layout
    assert torch.equal(awq_dequantize(qw, s.float(), qz, 32), res.dequantize())
    built = ForgeGPTQLinear.from_linear(lin, h, group_size=32)
    assert torch.equal(built.qweight, mod.qweight) and torch.equal(built.scales, mod.scales)
    assert not built.has_act_order()


def test_module_without_hessian_is_rtn_and_beats_nothing_else():
    lin, x = _layer(5)
    rtn = ForgeGPTQLinear.from_linear(lin, None, group_size=32)
    gptq = ForgeGPTQLinear.from_linear(lin, accumulate_hessian(x, 128)[0], group_size=32)
    w = lin.weight.detach()

    def err(m):
        return float((x @ (w - m.dequantized_weight()).T).norm() / (x @ w.T).norm())
    assert err(gptq) < 0.7 * err(rtn)


@pytest.mark.parametrize("act_order_layout", [None, "mma", "awq"])
def test_compiled_forward_has_no_graph_break(act_order_layout):
    lin, x = _layer(7, ic=64, oc=32)
    mod = ForgeGPTQLinear.from_linear(lin, None, group_size=32)
    if act_order_layout:  # the run layouts' x permutation too (rows sorted by group)
        qweight, scales, qzeros, g_idx, _, _ = random_gptq(128, 64, 64, seed=4, act_order=True)
        mod, x = _module(qweight, scales, qzeros, g_idx, 128, 64, 64), torch.randn(5, 128)
        switch = mod.use_mma_layout if act_order_layout == "mma" else mod.use_awq_layout
        assert switch() and mod.weight_layout == act_order_layout and mod.act_perm is not None
    torch._dynamo.reset()
    compiled = torch.compile(mod, fullgraph=True)  # fullgraph: a graph break raises
    torch.testing.assert_close(compiled(x[:3]), mod(x[:3]), rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    qweight, scales, qzeros, g_idx, _, _ = random_gptq(64, 16, 32, seed=6)
    with pytest.raises(ValueError, match=r"x has shape \(2, 32\) but qweight \(8, 16\) expects IC=64"):
        w4a16_gptq_linear(torch.randn(2, 32), qweight, scales, qzeros, g_idx)
    with pytest.raises(ValueError, match=r"g_idx has shape \(32,\), expected \(64,\)"):
        w4a16_gptq_linear(torch.randn(2, 64), qweight, scales, qzeros, g_idx[:32])
    with pytest.raises(ValueError, match=r"g_idx has 1 values outside \[0, 2\)"):
        bad = g_idx.clone()
        bad[0] = 2
        w4a16_gptq_linear(torch.randn(2, 64), qweight, scales, qzeros, bad)
    with pytest.raises(ValueError, match="zero points are 0, which the GPTQ \\(v1\\) format cannot store"):
        gptq_pack_zeros(torch.zeros(1, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out_features=12 must be divisible by 8"):
        ForgeGPTQLinear(64, 12)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 33, 300])
def test_cuda_linear(dtype, m):
    qweight, scales, qzeros, g_idx, _, _ = random_gptq(512, 256, 128, seed=m, act_order=m == 33)
    x = torch.randn(m, 512).to(dtype)
    out = w4a16_gptq_linear(x.cuda(), qweight.cuda(), scales.cuda(), qzeros.cuda(), g_idx.cuda())
    torch.testing.assert_close(out.cpu(), _oracle(x, qweight, scales, qzeros, g_idx), **TOL[dtype])


def _module(qweight, scales, qzeros, g_idx, ic, oc, group_size, bias=None):
    mod = ForgeGPTQLinear(ic, oc, bias=bias is not None, group_size=group_size, dtype=torch.float32)
    mod.qweight, mod.scales, mod.qzeros, mod.g_idx = qweight, scales, qzeros, g_idx
    if bias is not None:
        mod.bias = bias
    return mod


def test_mma_layout_same_numbers_and_gptq_exports():
    """use_mma_layout: the layer computes the same, state_dict / gptq_tensors / load stay in the GPTQ layout, and
    groups of unequal sizes or a stored zero of 16 (no 4-bit equivalent) keep the GPTQ path."""
    qweight, scales, qzeros, g_idx, codes, zeros = random_gptq(256, 128, 64, seed=7)
    bias = torch.randn(128)
    from torchforge.export.gptq_export import _unpacked_linear

    mod = _module(qweight, scales, qzeros, g_idx, 256, 128, 64, bias)
    x = torch.randn(5, 256)
    before, state, unpacked = mod(x), {k: v.clone() for k, v in mod.state_dict().items()}, _unpacked_linear(mod)
    assert mod.use_mma_layout() and mod.weight_layout == "mma" and mod.qweight.shape == (2, 2048)
    assert all(torch.equal(a, b) for a, b in zip(_unpacked_linear(mod), unpacked))  # what the exporters write
    torch.testing.assert_close(mod(x), before, rtol=1e-6, atol=1e-6)  # AWQ and GPTQ references: same numbers
    after = mod.state_dict()
    assert all(torch.equal(after[k], state[k]) for k in state)
    assert all(torch.equal(a, b) for a, b in zip(mod.gptq_tensors(), (qweight, qzeros)))
    assert torch.equal(mod.dequantized_weight(), _module(qweight, scales, qzeros, g_idx, 256, 128, 64).dequantized_weight())
    fresh = _module(qweight, scales, qzeros, g_idx, 256, 128, 64, bias)
    assert fresh.use_mma_layout()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.qweight, mod.qweight) and torch.equal(fresh.qzeros, mod.qzeros)
    uneven = g_idx.clone()
    uneven[0] = 1  # group 0 has 63 rows, group 1 65: no order of the rows makes them contiguous
    act = _module(qweight, scales, qzeros, uneven, 256, 128, 64)
    assert not act.use_mma_layout() and act.weight_layout == "gptq"
    with pytest.raises(ValueError, match=r"cannot hold this checkpoint \(g_idx: groups of 63..65 input rows, not 64 each.*"
                                         r"call use_mma_layout\(\) after loading"):
        fresh.load_state_dict({**state, "g_idx": uneven})
    meta = ForgeGPTQLinear(256, 128, group_size=64, device="meta")
    assert not meta.use_mma_layout()  # the zero points cannot be checked on meta
    zeros16 = qzeros.clone()
    zeros16[0, 0] |= 0xF  # stored 15: true zero point 16
    assert not _module(qweight, scales, zeros16, g_idx, 256, 128, 64).use_mma_layout()
    assert not _module(qweight[:, :40], scales[:, :40], qzeros[:, :5], g_idx, 256, 40, 64).use_mma_layout()


@pytest.mark.parametrize("act_order", [False, True])
def test_awq_layout_where_the_mma_layout_does_not_fit(act_order):
    """OC = 96 (not a multiple of 64; group size 32): use_mma_layout() declines, use_awq_layout() re-packs into vLLM's
    AWQ layout (rows sorted by group for act-order, x permuted on each call). Same numbers as the GPTQ layout, and the
    checkpoint, gptq_tensors and dequantized weight stay those of the GPTQ layout; the model-level switch takes it."""
    import torchforge

    qweight, scales, qzeros, g_idx, _, _ = random_gptq(256, 96, 32, seed=10, act_order=act_order)
    bias = torch.randn(96)
    mod = _module(qweight, scales, qzeros, g_idx, 256, 96, 32, bias)
    x = torch.randn(2, 3, 256)
    state = {k: v.clone() for k, v in mod.state_dict().items()}
    assert not mod.use_mma_layout() and mod.weight_layout == "gptq"
    assert mod.use_awq_layout() and mod.weight_layout == "awq" and mod.qweight.shape == (256, 12)
    assert (mod.act_perm is not None) == act_order and "weight_layout=awq" in repr(mod)
    assert mod.use_awq_layout() and not mod.use_mma_layout()  # idempotent; no second switch
    oracle = x.double() @ torch.from_numpy(np_dequant(qweight, scales, qzeros, g_idx)).double() + bias.double()
    torch.testing.assert_close(mod(x).double(), oracle, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(mod.state_dict()[k], state[k]) for k in state)
    assert all(torch.equal(a, b) for a, b in zip(mod.gptq_tensors(), (qweight, qzeros)))
    assert torch.equal(mod.dequantized_weight(), _module(qweight, scales, qzeros, g_idx, 256, 96, 32).dequantized_weight())
    if not act_order:
        qw, s, qz = mod.awq_tensors()
        assert torch.equal(awq_dequantize(qw, s.float(), qz, 32), mod.dequantized_weight())
    fresh = _module(*random_gptq(256, 96, 32, seed=11)[:4], 256, 96, 32, bias)
    assert torchforge.use_mma_layout(torch.nn.Sequential(fresh)) == 1 and fresh.weight_layout == "awq"
    fresh.load_state_dict(state)  # a GPTQ-layout checkpoint into a module on the AWQ layout
    assert torch.equal(fresh.qweight, mod.qweight) and torch.equal(fresh.qzeros, mod.qzeros)
    assert (fresh.act_perm is None) != act_order and torch.equal(fresh(x), mod(x))
    with pytest.raises(ValueError, match="g_idx without qweight and qzeros, into a module on the awq layout"):
        fresh.load_state_dict({"g_idx": g_idx}, strict=False)
    zeros16 = qzeros.clone()
    zeros16[0, 0] |= 0xF  # stored 15: true zero point 16, no 4-bit AWQ equivalent
    kept = _module(qweight, scales, zeros16, g_idx, 256, 96, 32)
    assert not kept.use_awq_layout() and kept.weight_layout == "gptq"
    assert not ForgeGPTQLinear(256, 96, group_size=32, device="meta").use_awq_layout()
    fits = _module(qweight[:, :64], scales[:, :64], qzeros[:, :8], g_idx, 256, 64, 32)  # OC = 64: the mma layout fits
    before = fits(x)
    assert fits.use_awq_layout() and fits.use_mma_layout() and fits.weight_layout == "mma"  # AWQ -> mma, exact
    torch.testing.assert_close(fits(x), before, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(fits.gptq_tensors(), (qweight[:, :64], qzeros[:, :8])))


def test_act_order_perm():
    g_idx = trivial_g_idx(256, 64)
    assert act_order_perm(g_idx, 64) is None
    shuffled = g_idx[torch.randperm(256, generator=torch.Generator().manual_seed(3))]
    perm = act_order_perm(shuffled, 64)
    assert perm.dtype == torch.int64 and torch.equal(shuffled[perm], g_idx)
    assert all(bool((torch.diff(perm[i:i + 64]) > 0).all()) for i in range(0, 256, 64))  # stored order in a group
    with pytest.raises(ValueError, match=r"g_idx has 64 values outside \[0, 4\)"):
        act_order_perm(torch.where(g_idx == 3, 7, g_idx), 64)
    with pytest.raises(ValueError, match=r"g_idx: groups of 0..128 input rows, not 64 each"):
        act_order_perm(torch.where(g_idx == 3, 2, g_idx), 64)


def test_mma_layout_act_order():
    """An act-order layer on the mma layout: rows stored sorted by group, x permuted on each call. It computes what
    the GPTQ layout computes (in another order of the sum), and exports, dequantizes and loads as the GPTQ layout."""
    qweight, scales, qzeros, g_idx, codes, zeros = random_gptq(256, 128, 64, seed=8, act_order=True)
    bias = torch.randn(128)
    mod = _module(qweight, scales, qzeros, g_idx, 256, 128, 64, bias)
    x = torch.randn(2, 5, 256)
    before, state = mod(x), {k: v.clone() for k, v in mod.state_dict().items()}
    assert mod.has_act_order() and mod.use_mma_layout() and mod.weight_layout == "mma"
    assert torch.equal(g_idx[mod.act_perm], trivial_g_idx(256, 64)) and "act_perm" not in mod.state_dict()
    oracle = x.double() @ torch.from_numpy(np_dequant(qweight, scales, qzeros, g_idx)).double() + bias.double()
    torch.testing.assert_close(mod(x).double(), oracle, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mod(x), before, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(mod.state_dict()[k], state[k]) for k in state)  # the checkpoint's row order
    assert all(torch.equal(a, b) for a, b in zip(mod.gptq_tensors(), (qweight, qzeros)))
    assert torch.equal(mod.dequantized_weight(), _module(qweight, scales, qzeros, g_idx, 256, 128, 64).dequantized_weight())
    with pytest.raises(ValueError, match="act-order .* has no AWQ-layout equivalent"):
        mod.awq_tensors()
    plain = random_gptq(256, 128, 64, seed=9)
    fresh = _module(*(t.clone() for t in plain[:4]), 256, 128, 64, bias)  # load_state_dict copies into its buffers
    assert fresh.use_mma_layout() and fresh.act_perm is None
    fresh.load_state_dict(state)  # an act-order checkpoint into a module already on the mma layout
    assert torch.equal(fresh.act_perm, mod.act_perm) and torch.equal(fresh.qweight, mod.qweight)
    assert torch.equal(fresh(x), mod(x))
    fresh.load_state_dict({**state, "qweight": plain[0], "qzeros": plain[2], "g_idx": plain[3]})  # and back
    assert fresh.act_perm is None
    torch.testing.assert_close(fresh(x), _module(plain[0], scales, plain[2], plain[3], 256, 128, 64, bias)(x))
    with pytest.raises(ValueError, match="g_idx without qweight and qzeros.*load qweight, qzeros and g_idx together"):
        fresh.load_state_dict({"g_idx": g_idx}, strict=False)  # would leave the rows sorted by the old groups
    assigned = _module(*(t.clone() for t in plain[:4]), 256, 128, 64, bias)
    assert assigned.use_mma_layout()
    assigned.load_state_dict(state, assign=True)  # qweight becomes the checkpoint's tensor: act_perm beside it
    assert torch.equal(assigned.act_perm, mod.act_perm) and torch.equal(assigned(x), mod(x))


@pytest.mark.cuda
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cuda_awq_layout(m, act_order):
    """OC = 480 (not a multiple of 64) on the GPU: the AWQ layout's w4a16_linear kernels, within bf16 tolerance of the
    fp64 product."""
    qweight, scales, qzeros, g_idx, _, _ = random_gptq(1024, 480, 32, seed=m, act_order=act_order)
    mod = _module(qweight, scales, qzeros, g_idx, 1024, 480, 32).cuda()
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    expected = x.double() @ mod.dequantized_weight(torch.float32).double().T
    assert not mod.use_mma_layout() and mod.use_awq_layout()
    out = mod(x)
    assert out.dtype == torch.bfloat16 and ((out.double() - expected).norm() / expected.norm()) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("G", [128, 32])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cuda_mma_layout(m, act_order, G):
    """On the GPU the mma layout runs csrc/awq_mma.cu (1..128 rows) or Triton dequantize + cuBLAS: same outputs as
    the GPTQ kernel within bf16 tolerance."""
    from torchforge.ops._ext import has_cuda_ext

    if not has_cuda_ext():
        pytest.skip("needs the compiled extension")
    qweight, scales, qzeros, g_idx, _, _ = random_gptq(1024, 512, G, seed=m, act_order=act_order)
    mod = _module(qweight, scales, qzeros, g_idx, 1024, 512, G).cuda()
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    expected = x.double() @ mod.dequantized_weight(torch.float32).double().T
    assert mod.use_mma_layout()
    import torchforge.ops.awq_mma as awq_mma

    calls, real = [], awq_mma.launch_awq_mma_cuda
    awq_mma.launch_awq_mma_cuda = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        out = mod(x)
    finally:
        awq_mma.launch_awq_mma_cuda = real
    assert calls == ([1] if m <= 128 else [])  # the CUDA kernel up to 128 rows, Triton dequantize + cuBLAS beyond
    # relative to the fp64 product: elementwise bounds fail near zero, and the kernels round differently (the GPTQ
    # kernel rounds each dequantized weight to bf16, the mma kernel applies scales in fp32)
    assert out.dtype == torch.bfloat16 and ((out.double() - expected).norm() / expected.norm()) < 4e-3


def test_from_linear_with_zero_points_of_0_says_what_to_do():
    """Asymmetric groups with no negative weight get a zero point of 0, which GPTQ v1 qzeros cannot hold: the error
    says so and names the ways out (torchforge.quantize keeps such layers in the AWQ layout)."""
    lin = torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        lin.weight.abs_()
    with pytest.raises(ValueError, match=r"zero points are 0, which GPTQ v1 qzeros .* ForgeAWQLinear"):
        ForgeGPTQLinear.from_linear(lin, group_size=32, symmetric=False)


def test_w4_linear_from_gptq_picks_the_layout_that_holds_the_zero_points():
    """Zero points 1..15 -> ForgeGPTQLinear; a zero point of 0 (GPTQ v1 cannot hold it) -> ForgeAWQLinear, the same
    weight; either way on the Linear's device and dtype with its bias. Act-order with a zero point of 0 is refused."""
    from torchforge.nn.awq_linear import ForgeAWQLinear
    from torchforge.nn.gptq_linear import w4_linear_from_gptq

    lin = torch.nn.Linear(64, 16, bias=True, dtype=torch.bfloat16)
    lin.weight.requires_grad_(False).abs_()
    res = solve(lin.weight.float(), torch.eye(64), group_size=32, symmetric=False)
    assert (res.zeros == 0).any()
    qweight, scales, zeros = gptq_pack(res.codes.T.contiguous()), res.scales.T.contiguous(), res.zeros.T.contiguous()
    awq = w4_linear_from_gptq(lin, qweight, scales, zeros=zeros, group_size=32, symmetric=False)
    gptq = w4_linear_from_gptq(lin, qweight, scales, zeros=zeros.clamp(min=1), group_size=32, symmetric=False)
    assert type(awq) is ForgeAWQLinear and type(gptq) is ForgeGPTQLinear and not gptq.has_act_order()
    assert torch.equal(awq.dequantized_weight(), res.dequantize())
    for mod in (awq, gptq):
        assert mod.bias.dtype == torch.bfloat16 and torch.equal(mod.bias, lin.bias) and mod.scales is scales
    perm = trivial_g_idx(64, 32).flip(0)
    with pytest.raises(ValueError, match=r"act-order \(a permuted g_idx\) with a zero point of 0"):
        w4_linear_from_gptq(lin, qweight, scales, zeros=zeros, g_idx=perm, group_size=32, symmetric=False)
    assert w4_linear_from_gptq(lin, qweight, scales, zeros=zeros.clamp(min=1), g_idx=perm, group_size=32,
                               symmetric=False).has_act_order()
    with pytest.raises(TypeError, match="exactly one of zeros"):
        w4_linear_from_gptq(lin, qweight, scales, group_size=32, symmetric=False)
