"""NVFP4 ops: opcheck on every op, the matmul ops against dequantize + matmul, torch.compile, bad input."""
import pytest
import torch
from torch.library import opcheck

from torchforge.ops import (
    nvfp4_dequantize,
    nvfp4_fake_quantize_activation,
    nvfp4_grouped_linear,
    nvfp4_linear,
    nvfp4_quantize,
    nvfp4_swizzle_scales,
)


def experts(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return nvfp4_quantize(torch.randn(e, n, k, generator=g) * (1 + torch.arange(e).view(e, 1, 1)))


def test_opcheck_all_ops():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    p, s, ws2 = nvfp4_quantize(w)
    pe, se, ge = experts(3, 16, 64, 1)
    x = torch.randn(2, 3, 64, generator=g)
    ins = torch.tensor(float(x.abs().max()) / 2688)
    ops = torch.ops.torchforge
    cases = [
        (ops.nvfp4_quantize.default, (w, None)),
        (ops.nvfp4_quantize.default, (w.bfloat16(), torch.tensor(0.01))),
        (ops.nvfp4_quantize.default, (w.reshape(2, 8, 64), None)),
        (ops.nvfp4_dequantize.default, (p, s, ws2, torch.bfloat16)),
        (ops.nvfp4_dequantize.default, (pe, se, ge, torch.float32)),
        (ops.nvfp4_quantize_activation.default, (x, ins)),
        (ops.nvfp4_fake_quantize_activation.default, (x.half(), ins)),
        (ops.nvfp4_swizzle_scales.default, (se,)),
        (ops.nvfp4_unswizzle_scales.default, (nvfp4_swizzle_scales(s), 16, 4)),
        (ops.nvfp4_linear.default, (x, p, s, ws2, None, None)),
        (ops.nvfp4_linear.default, (x.bfloat16(), p, s, ws2, ins, torch.randn(16))),
        (ops.nvfp4_grouped_linear.default, (x[0], torch.tensor([2, 0, 2]), pe, se, ge, None, 1)),
        (ops.nvfp4_grouped_linear.default, (x[0], torch.tensor([1, 1, 0], dtype=torch.int32), pe, se, ge,
                                            torch.full((3,), float(ins)), 1)),
        (ops.nvfp4_grouped_linear.default, (x[0], torch.tensor([1, 2, 0, 0, 2, 1]), pe, se, ge, None, 2)),
        (ops.nvfp4_grouped_linear.default, (x[0, :0], torch.zeros(0, dtype=torch.int64), pe, se, ge, None, 1)),
    ]
    # test_schema compares the inputs before and after the call with an op that has no float8 kernel on CPU
    # ("mul_cpu_reduced_float"), so cases with fp8 inputs skip it; their inputs are checked unchanged here.
    no_schema = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")
    for op, args in cases:
        fp8_in = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn]
        before = [a.view(torch.uint8).clone() for a in fp8_in]
        opcheck(op, args, test_utils=no_schema if fp8_in else "ALL")
        op(*args)
        assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fp8_in, before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_linear_is_matmul_with_dequantized_experts(dtype):
    pe, se, ge = experts(4, 24, 48, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 48, generator=g).to(dtype)
    ids = torch.tensor([3, 0, 0, 1, 3, 2, 2, 2, 0])
    out = nvfp4_grouped_linear(x, ids, pe, se, ge)
    w = nvfp4_dequantize(pe, se, ge)  # fp32 [E, N, K]
    expected = torch.stack([x[r].float() @ w[ids[r]].T for r in range(9)])
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))
    # x_row_div: pair r reads token r // 3 (top-3 routing without repeating x)
    ids3 = torch.tensor([1, 2, 3, 0, 0, 1])
    torch.testing.assert_close(nvfp4_grouped_linear(x[:2], ids3, pe, se, ge, x_row_div=3),
                               nvfp4_grouped_linear(x[:2].repeat_interleave(3, 0), ids3, pe, se, ge))


def test_w4a4_emulation_is_matmul_of_fake_quantized_activations():
    pe, se, ge = experts(2, 16, 64, 4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 64, generator=g)
    ins = torch.tensor([float(x.abs().max()) / 2688, float(x.abs().max()) / 1000])
    ids = torch.tensor([0, 1, 1, 0, 1])
    out = nvfp4_grouped_linear(x, ids, pe, se, ge, ins)
    w = nvfp4_dequantize(pe, se, ge)
    expected = torch.stack([nvfp4_fake_quantize_activation(x[r], ins[ids[r]]) @ w[ids[r]].T for r in range(5)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # W4A4 differs from W4A16 by the activation rounding: a few percent, not garbage
    rel = (out - nvfp4_grouped_linear(x, ids, pe, se, ge)).norm() / out.norm()
    assert 0.01 < rel < 0.2, rel


def test_linear_with_bias_and_leading_dims():
    g = torch.Generator().manual_seed(6)
    p, s, ws2 = nvfp4_quantize(torch.randn(32, 64, generator=g))
    x = torch.randn(2, 3, 64, generator=g)
    b = torch.randn(32, generator=g)
    out = nvfp4_linear(x, p, s, ws2, bias=b)
    torch.testing.assert_close(out, x @ nvfp4_dequantize(p, s, ws2).T + b, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_grouped_linear():
    torch._dynamo.reset()
    pe, se, ge = experts(3, 16, 32, 7)

    @torch.compile(fullgraph=True)
    def f(x, ids):
        return torch.relu(nvfp4_grouped_linear(x, ids, pe, se, ge)) * 2

    x = torch.randn(4, 32)
    ids = torch.tensor([0, 2, 2, 1])
    torch.testing.assert_close(f(x, ids), torch.relu(nvfp4_grouped_linear(x, ids, pe, se, ge)) * 2)


def test_bad_inputs_grouped():
    pe, se, ge = experts(3, 16, 32, 8)
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"expert_ids has 2 values outside \[0, 3\)"):
        nvfp4_grouped_linear(x, torch.tensor([0, 3, 1, -1]), pe, se, ge)
    with pytest.raises(TypeError, match="expert_ids must be int32 or int64"):
        nvfp4_grouped_linear(x, torch.zeros(4), pe, se, ge)
    with pytest.raises(ValueError, match=r"expert_ids has shape \(3,\), expected \(4,\)"):
        nvfp4_grouped_linear(x, torch.zeros(3, dtype=torch.int64), pe, se, ge)
    with pytest.raises(ValueError, match=r"packed must be \[E, N, K/2\]"):
        nvfp4_grouped_linear(x, torch.zeros(4, dtype=torch.int64), pe[0], se[0], ge[0])
    with pytest.raises(ValueError, match="x has 16 features"):
        nvfp4_grouped_linear(torch.randn(4, 16), torch.zeros(4, dtype=torch.int64), pe, se, ge)
    with pytest.raises(ValueError, match=r"input_scale has shape \(2,\), expected \(3,\)"):
        nvfp4_grouped_linear(x, torch.zeros(4, dtype=torch.int64), pe, se, ge, torch.ones(2))
    with pytest.raises(ValueError, match="input_scale must be positive"):
        nvfp4_grouped_linear(x, torch.zeros(4, dtype=torch.int64), pe, se, ge, torch.zeros(3))
    with pytest.raises(ValueError, match=r"weight_scale_2 has shape \(2,\)"):
        torch.ops.torchforge.nvfp4_grouped_linear(x, torch.zeros(4, dtype=torch.int64), pe, se, ge[:2], None, 1)
    with pytest.raises(ValueError, match=r"expert_ids has shape \(4,\), expected \(8,\) = rows of x \(4\) x x_row_div \(2\)"):
        nvfp4_grouped_linear(x, torch.zeros(4, dtype=torch.int64), pe, se, ge, x_row_div=2)
