"""AWQ ops through their public wrappers / torch.ops: dequantize, w4a16_linear, awq_grouped_linear,
opcheck on every op, one torch.compile test, bad-input errors, and CUDA checks (marked `cuda`)."""
import numpy as np
import pytest
import torch
from torch.library import opcheck

from torchforge.ops import (
    awq_dequantize,
    awq_grouped_linear,
    awq_pack,
    awq_quantize,
    awq_unpack,
    w4a16_linear,
)

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def unpack_np(words: torch.Tensor) -> np.ndarray:
    """Independent unpack: [IC, OC // 8] int32 -> [IC, OC] int64 codes (vectorised over rows)."""
    u = words.numpy().astype(np.int64) & 0xFFFFFFFF
    ic, ocp = u.shape
    out = np.zeros((ic, ocp * 8), dtype=np.int64)
    for k in range(8):
        out[:, np.arange(ocp) * 8 + ORDER[k]] = (u >> (4 * k)) & 0xF
    return out


def dequant_np(qweight, scales, qzeros, group_size) -> np.ndarray:
    """fp32 W [OC, IC] = (q - z) * s, from the format description."""
    q = unpack_np(qweight)
    z = np.repeat(unpack_np(qzeros), group_size, axis=0)
    s = np.repeat(scales.float().numpy(), group_size, axis=0)
    return ((q - z).astype(np.float32) * s).T


def oracle_linear(x, qweight, scales, qzeros, group_size, bias=None):
    """(x.float() @ W.float().T).to(x.dtype) with W dequantized in fp32 and rounded to x.dtype."""
    w = torch.from_numpy(dequant_np(qweight, scales, qzeros, group_size)).to(x.dtype).float()
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def random_awq(ic, oc, group_size, seed, experts=None):
    """Random codes/zeros (every nibble value, negative words) and positive fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    codes = torch.randint(0, 16, (*lead, ic, oc), dtype=torch.uint8, generator=g)
    zeros = torch.randint(0, 16, (*lead, ic // group_size, oc), dtype=torch.uint8, generator=g)
    scales = (torch.rand(*lead, ic // group_size, oc, generator=g) * 0.02 + 0.005).half()
    return awq_pack(codes), scales, awq_pack(zeros)


def _tol(dtype):
    return {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}[dtype]


# --------------------------------------------------------------------------------- dequantize
def test_dequantize_matches_formula():
    qweight, scales, qzeros = random_awq(128, 24, 32, seed=0)
    w = awq_dequantize(qweight, scales, qzeros, 32)
    assert w.shape == (24, 128) and w.dtype == torch.float16
    expected = torch.from_numpy(dequant_np(qweight, scales, qzeros, 32)).half()
    assert torch.equal(w, expected)
    w32 = awq_dequantize(qweight, scales.float(), qzeros, 32)
    assert w32.dtype == torch.float32
    np.testing.assert_array_equal(w32.numpy(), dequant_np(qweight, scales, qzeros, 32))


def test_dequantize_batched():
    qweight, scales, qzeros = random_awq(64, 16, 32, seed=1, experts=3)
    w = awq_dequantize(qweight, scales, qzeros, 32)
    assert w.shape == (3, 16, 64)
    for e in range(3):
        assert torch.equal(w[e], awq_dequantize(qweight[e], scales[e], qzeros[e], 32))


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_dequantize_error_bound(symmetric):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(32, 256, generator=g) * 0.1
    qweight, scales, qzeros = awq_quantize(w, group_size=64, symmetric=symmetric)
    wq = awq_dequantize(qweight, scales.float(), qzeros, 64)
    s = scales.float().repeat_interleave(64, dim=0).T  # [OC, IC]
    # symmetric never clips (|w / s| <= 7); asymmetric can clip by one step at the range ends
    bound = 0.5 * s * (1 + 1e-3) if symmetric else s * (1 + 1e-3)
    assert ((wq - w).abs() <= bound).all()


# ------------------------------------------------------------------------------- w4a16_linear
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5), ()])
def test_w4a16_linear_cpu(dtype, lead):
    qweight, scales, qzeros = random_awq(128, 40, 64, seed=2)
    g = torch.Generator().manual_seed(len(lead))
    x = torch.randn(*lead, 128, generator=g).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype)
    for b in (None, bias):
        out = w4a16_linear(x, qweight, scales, qzeros, 64, b)
        assert out.shape == (*lead, 40) and out.dtype == dtype
        ref = oracle_linear(x, qweight, scales, qzeros, 64, b)
        rtol, atol = _tol(dtype)
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_w4a16_linear_matches_dequantized_linear():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 128, generator=g) * 0.05
    qweight, scales, qzeros = awq_quantize(w, group_size=32, symmetric=False)
    x = torch.randn(7, 128, generator=g)
    # fp32 activations see the fp32 dequantized weight (not rounded to fp16)
    expected = torch.nn.functional.linear(x, awq_dequantize(qweight, scales.float(), qzeros, 32))
    torch.testing.assert_close(w4a16_linear(x, qweight, scales, qzeros, 32), expected, rtol=1e-5, atol=1e-5)


def test_w4a16_linear_empty_rows():
    qweight, scales, qzeros = random_awq(64, 16, 32, seed=3)
    out = w4a16_linear(torch.randn(0, 64), qweight, scales, qzeros, 32)
    assert out.shape == (0, 16)


# ------------------------------------------------------------------------- awq_grouped_linear
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_grouped_linear_cpu(id_dtype):
    E, ic, oc, G = 4, 64, 24, 32
    qweight, scales, qzeros = random_awq(ic, oc, G, seed=4, experts=E)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, ic, generator=g)
    ids = torch.tensor([3, 0, 3, 1, 1, 3, 0, 0, 3], dtype=id_dtype)  # expert 2 unused
    out = awq_grouped_linear(x, ids, qweight, scales, qzeros, G)
    assert out.shape == (9, oc) and out.dtype == x.dtype
    for r in range(9):
        e = int(ids[r])
        ref = oracle_linear(x[r : r + 1], qweight[e], scales[e], qzeros[e], G)
        torch.testing.assert_close(out[r : r + 1], ref, rtol=1e-5, atol=1e-5)


def test_grouped_linear_empty():
    qweight, scales, qzeros = random_awq(64, 16, 32, seed=5, experts=2)
    out = awq_grouped_linear(torch.randn(0, 64), torch.zeros(0, dtype=torch.int64), qweight, scales, qzeros, 32)
    assert out.shape == (0, 16)


# ----------------------------------------------------------------------------------- opcheck
def test_opcheck_all_ops():
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (2, 8, 16), dtype=torch.uint8, generator=g)
    w = torch.randn(16, 64, generator=g)
    qweight, scales, qzeros = awq_quantize(w, group_size=32, symmetric=False)
    qw_e, s_e, qz_e = random_awq(64, 16, 32, seed=6, experts=3)
    x = torch.randn(2, 3, 64, generator=g)
    ops = torch.ops.torchforge
    cases = [
        (ops.awq_pack.default, (codes,)),
        (ops.awq_unpack.default, (awq_pack(codes),)),
        (ops.awq_quantize.default, (w, 32, True)),
        (ops.awq_quantize.default, (w.half(), 32, False)),
        (ops.awq_quantize.default, (w.reshape(2, 8, 64), 32, True)),
        (ops.awq_dequantize.default, (qweight, scales, qzeros, 32)),
        (ops.awq_dequantize.default, (qw_e, s_e, qz_e, 32)),
        (ops.awq_dequantize.default, (qw_e, s_e, qz_e, 32, torch.bfloat16)),
        (ops.w4a16_linear.default, (x, qweight, scales, qzeros, 32, None)),
        (ops.w4a16_linear.default, (x.half(), qweight, scales, qzeros, 32, torch.randn(16).half())),
        (ops.awq_grouped_linear.default, (x[0], torch.tensor([2, 0, 2]), qw_e, s_e, qz_e, 32)),
        (ops.awq_grouped_linear.default, (x[0, :0], torch.zeros(0, dtype=torch.int32), qw_e, s_e, qz_e, 32)),
    ]
    for op, args in cases:
        opcheck(op, args)


# ------------------------------------------------------------------------------ torch.compile
def test_compile_fullgraph_w4a16_linear():
    torch._dynamo.reset()
    qweight, scales, qzeros = random_awq(64, 16, 32, seed=7)
    bias = torch.randn(16)

    @torch.compile(fullgraph=True)
    def f(x):
        return torch.relu(w4a16_linear(x, qweight, scales, qzeros, 32, bias)) * 2

    x = torch.randn(3, 64)
    expected = torch.relu(oracle_linear(x, qweight, scales, qzeros, 32, bias)) * 2
    torch.testing.assert_close(f(x), expected, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_linear():
    qweight, scales, qzeros = random_awq(128, 16, 32, seed=8)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="IC=128 input channels, not divisible by group_size=48"):
        w4a16_linear(x, qweight, scales, qzeros, 48)
    with pytest.raises(ValueError, match=r"scales has shape \(2, 16\).*needs \(4, 16\)"):
        w4a16_linear(x, qweight, scales[:2], qzeros, 32)
    with pytest.raises(ValueError, match=r"scales has shape \(4, 8\)"):
        w4a16_linear(x, qweight, scales[:, :8], qzeros, 32)
    with pytest.raises(ValueError, match=r"qzeros has shape \(4, 1\)"):
        w4a16_linear(x, qweight, scales, qzeros[:, :1], 32)
    with pytest.raises(ValueError, match="x has 64 features"):
        w4a16_linear(torch.randn(2, 64), qweight, scales, qzeros, 32)
    with pytest.raises(TypeError, match="x must be float16/bfloat16/float32"):
        w4a16_linear(x.to(torch.int64), qweight, scales, qzeros, 32)
    with pytest.raises(TypeError, match="qweight must be int32"):
        w4a16_linear(x, qweight.to(torch.int64), scales, qzeros, 32)
    with pytest.raises(TypeError, match="scales must be float16"):
        w4a16_linear(x, qweight, scales.to(torch.int32), qzeros, 32)
    with pytest.raises(ValueError, match=r"bias has shape \(8,\), expected \(16,\)"):
        w4a16_linear(x, qweight, scales, qzeros, 32, torch.randn(8))
    with pytest.raises(ValueError, match="IC=128 input channels, not divisible by group_size=48"):
        awq_dequantize(qweight, scales, qzeros, 48)
    # the op itself (no wrapper) checks too
    with pytest.raises(ValueError, match=r"scales has shape \(2, 16\)"):
        torch.ops.torchforge.w4a16_linear(x, qweight, scales[:2], qzeros, 32, None)


def test_bad_inputs_grouped():
    qweight, scales, qzeros = random_awq(64, 16, 32, seed=9, experts=3)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"expert_ids has 2 values outside \[0, 3\)"):
        awq_grouped_linear(x, torch.tensor([0, 3, 1, -1]), qweight, scales, qzeros, 32)
    with pytest.raises(ValueError, match=r"expert_ids has 1 values outside \[0, 3\)"):
        torch.ops.torchforge.awq_grouped_linear(x, torch.tensor([0, 7, 1, 1]), qweight, scales, qzeros, 32)
    with pytest.raises(TypeError, match="expert_ids must be int32 or int64"):
        awq_grouped_linear(x, torch.zeros(4), qweight, scales, qzeros, 32)
    with pytest.raises(ValueError, match=r"expert_ids has shape \(3,\), expected \(4,\)"):
        awq_grouped_linear(x, torch.zeros(3, dtype=torch.int64), qweight, scales, qzeros, 32)
    with pytest.raises(ValueError, match=r"qweight must be \[E, IC, OC // 8\]"):
        awq_grouped_linear(x, torch.zeros(4, dtype=torch.int64), qweight[0], scales[0], qzeros[0], 32)
    with pytest.raises(ValueError, match=r"scales has shape \(2, 2, 16\)"):
        awq_grouped_linear(x, torch.zeros(4, dtype=torch.int64), qweight, scales[:2], qzeros, 32)


# ------------------------------------------------------------------------------------- CUDA
def _cuda_case(ic, oc, group_size, seed, experts=None):
    qweight, scales, qzeros = random_awq(ic, oc, group_size, seed, experts)
    return qweight.cuda(), scales.cuda(), qzeros.cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("shape", [(4096, 4096, 128), (2048, 1032, 64), (512, 72, 32)])
def test_cuda_w4a16_linear(dtype, m, shape):
    ic, oc, G = shape
    qweight, scales, qzeros = _cuda_case(ic, oc, G, seed=m)
    x = torch.randn(m, ic, device="cuda").to(dtype)
    bias = torch.randn(oc, device="cuda").to(dtype)
    out = w4a16_linear(x, qweight, scales, qzeros, G, bias)
    from torchforge.ops.awq_reference import w4a16_linear_ref

    ref = w4a16_linear_ref(x, qweight, scales, qzeros, G, bias)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol * 10)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 64, 257])
def test_cuda_grouped_linear(dtype, rows):
    E, ic, oc, G = 8, 1024, 520, 128
    qweight, scales, qzeros = _cuda_case(ic, oc, G, seed=rows, experts=E)
    x = torch.randn(rows, ic, device="cuda").to(dtype)
    ids = torch.randint(0, E, (rows,), device="cuda", dtype=torch.int32)
    out = awq_grouped_linear(x, ids, qweight, scales, qzeros, G)
    from torchforge.ops.awq_reference import awq_grouped_linear_ref

    ref = awq_grouped_linear_ref(x, ids, qweight, scales, qzeros, G)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol * 10)


@pytest.mark.cuda
def test_cuda_grouped_linear_bad_id_gives_nan_rows():
    qweight, scales, qzeros = _cuda_case(256, 64, 128, seed=1, experts=2)
    x = torch.randn(3, 256, device="cuda", dtype=torch.float16)
    out = awq_grouped_linear(x, torch.tensor([0, 5, 1], device="cuda"), qweight, scales, qzeros, 128)
    assert out[1].isnan().all() and not out[0].isnan().any() and not out[2].isnan().any()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cuda_quantize_bit_exact_with_cpu(dtype, symmetric):
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(4, 512, 1024, generator=g) * 0.05).to(dtype)
    w[0, :8, :128] = 0
    cpu = awq_quantize(w, 128, symmetric)
    gpu = awq_quantize(w.cuda(), 128, symmetric)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())
    codes = awq_unpack(gpu[0])
    assert torch.equal(awq_pack(codes), gpu[0])
    wq = awq_dequantize(*gpu, 128)
    assert torch.equal(wq.cpu(), awq_dequantize(*cpu, 128))


@pytest.mark.cuda
def test_cuda_compile_w4a16_linear():
    torch._dynamo.reset()
    qweight, scales, qzeros = _cuda_case(1024, 512, 128, seed=3)
    f = torch.compile(lambda x: w4a16_linear(x, qweight, scales, qzeros, 128) + 1, fullgraph=True)
    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(f(x), w4a16_linear(x, qweight, scales, qzeros, 128) + 1)


def test_cuda_quantize_takes_only_what_its_kernel_takes():
    """The CUDA op takes group sizes 32-256, contiguous aligned weights, and weights whose scales cannot pass fp16's
    maximum; anything else goes to the reference (a group of 16 raised a RuntimeError; a scale above 65504 came
    back rounded, or inf, where the reference raises)."""
    from torchforge.ops.awq import _cuda_quantize_ok
    from torchforge.ops.awq_reference import FP16_MAX

    w = torch.randn(64, 256)
    assert _cuda_quantize_ok(w, 128) and _cuda_quantize_ok(w, 32)
    assert not _cuda_quantize_ok(w, 16) and not _cuda_quantize_ok(w, 512)
    assert not _cuda_quantize_ok(w.T.contiguous().T, 128)  # not contiguous
    assert not _cuda_quantize_ok(torch.randn(64 * 256 + 1)[1:].view(64, 256), 128)  # 4 bytes past 16-byte alignment
    big = w.clone()
    big[0, 0] = 7 * FP16_MAX * 1.01
    assert not _cuda_quantize_ok(big, 128)
    big[0, 0] = 7 * FP16_MAX
    assert _cuda_quantize_ok(big, 128)
    nan = w.clone()
    nan[3, 3] = float("nan")
    assert not _cuda_quantize_ok(nan, 128)  # the reference raises its NaN error
