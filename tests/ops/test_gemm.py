"""torchforge.ops._gemm.matmul_bias, the GEMM after the W4A16 ops' dequantize pass (large M): shapes and dtypes on
CPU; on CUDA, both ops' dequantize + cuBLAS path with a bias compiles to the same bits as eager."""
import pytest
import torch

from torchforge.ops._gemm import matmul_bias


@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_matmul_bias_shapes_dtypes_values(bias_dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    w_t = torch.randn(64, 48, dtype=torch.bfloat16)
    b = torch.randn(48, dtype=bias_dtype) if bias_dtype is not None else None
    out = matmul_bias(x, w_t, b)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16  # an fp32 bias does not promote
    ref = x.double() @ w_t.double() + (b.double() if b is not None else 0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=5e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fallback runs Triton + cuBLAS)")
@pytest.mark.parametrize("layout", ["awq", "mma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("then_relu", [False, True])
def test_dequant_fallback_with_bias_compiles_bit_exact(layout, dtype, then_relu):
    """200 rows of x on a 4096x4096 weight with a bias of x's dtype: w4a16_linear (AWQ layout, >= 129 rows) and
    awq_mma_linear (the time model leaves these rows to cuBLAS; not 160 since the twenty-sixth session nor 256 since
    the twenty-eighth, which the Hopper kernel takes) dequantize, then matmul_bias; compiled equals eager
    bit for bit (before matmul_bias, a quarter of the elements differed: eager rounded the GEMM, then the bias add).
    then_relu: a pointwise op after it, where inductor may split addmm back into mm + add."""
    from tests.ops.graph_check import check_compile_and_cuda_graph
    from torchforge.ops import awq_quantize, w4a16_linear
    from torchforge.ops.awq_mma import awq_mma_linear
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout

    torch.manual_seed(11)
    qw, s, z = [t.cuda() for t in awq_quantize(torch.randn(4096, 4096), 128, symmetric=False)]
    x = torch.randn(200, 4096, device="cuda", dtype=dtype)
    b = torch.randn(4096, device="cuda", dtype=dtype)
    s = s.to(dtype)
    post = torch.relu if then_relu else (lambda y: y)
    if layout == "awq":
        check_compile_and_cuda_graph(lambda x: post(w4a16_linear(x, qw, s, z, 128, b)), x)
    else:
        from torchforge.ops.awq_mma_cuda import mma_cuda_ok, wgmma_cuda_ok

        mma = awq_to_mma_layout(qw)
        assert not wgmma_cuda_ok(x, mma, s, z, 128, b) and not mma_cuda_ok(x, mma, s, z, 128, b)
        check_compile_and_cuda_graph(lambda x: post(awq_mma_linear(x, mma, s, z, 128, b)), x)
