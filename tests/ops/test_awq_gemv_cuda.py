"""torch.ops.torchforge.awq_gemv_cuda (csrc/awq_gemv.cu), the batch-1 W4A16 GEMV of the compiled extension, against
an independent dequantization; its dispatch from w4a16_linear, torch.compile and CUDA-graph capture."""
import pytest
import torch

from tests.ops.awq_oracle import dequant_independent
from torchforge.ops import awq_quantize
from torchforge.ops._ext import has_cuda_ext

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not has_cuda_ext(), reason="needs the compiled extension (csrc/) and a GPU")]
TOL = {torch.float16: 1e-3, torch.bfloat16: 4e-3}


def _case(k, n, G, sym=True, seed=0):
    torch.manual_seed(seed)
    return [t.cuda() for t in awq_quantize(torch.randn(n, k) * 3, G, symmetric=sym)]


@pytest.mark.parametrize("k,n,G,splits,rows,sym", [
    (256, 64, 128, 1, 32, True),      # a quarter of one column tile
    (384, 288, 64, 3, 16, False),     # two tiles, the second partial; 3 slices of 8 items
    (1024, 2080, 128, 5, 32, True),   # 9 tiles; 32 items over 5 slices (uneven)
    (2048, 512, 128, 2, 64, False),
    (7168, 2048, 128, 7, 32, True),   # DeepSeek-V3 width, one item per k-lane
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_dequantized_matvec(k, n, G, splits, rows, sym, dtype, with_bias):
    from torchforge.ops.awq_gemv_cuda import launch_awq_gemv_cuda

    qw, s, z = _case(k, n, G, sym, seed=k + n)
    x = torch.randn(1, k, device="cuda").to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    expected = x.double() @ dequant_independent(qw, s, z, G).T.double()
    if with_bias:
        expected += b.double()
    out = launch_awq_gemv_cuda(x, qw, s, z, G, b, splits=splits, rows=rows)
    assert out.dtype == dtype and out.shape == (1, n)
    assert ((out.double() - expected).norm() / expected.norm()) < TOL[dtype]
    again = launch_awq_gemv_cuda(x, qw, s, z, G, b, splits=splits, rows=rows)
    assert torch.equal(out, again)  # the K slices are summed in a fixed order


def test_default_config_and_opcheck():
    from torchforge.ops.awq_gemv_cuda import cuda_gemv_config, launch_awq_gemv_cuda

    qw, s, z = _case(7168, 1024, 128)
    x = torch.randn(7168, device="cuda", dtype=torch.bfloat16)
    assert cuda_gemv_config(7168, 18432, 128) == (7, 32)  # the sweep's best: one 32-row item per k-lane
    assert cuda_gemv_config(7168, 7168, 128) == (14, 16)  # 32 rows would give 196 blocks, 16 rows give 392
    splits, rows = cuda_gemv_config(7168, 1024, 128)
    assert (splits, rows) == (14, 16)
    out = launch_awq_gemv_cuda(x, qw, s, z, 128)
    expected = x.double() @ dequant_independent(qw, s, z, 128).T.double()
    assert ((out.double() - expected).norm() / expected.norm()) < TOL[torch.bfloat16]
    torch.library.opcheck(torch.ops.torchforge.awq_gemv_cuda, (x, qw, s, z, 128, None, splits, rows))


def test_errors_name_the_problem():
    qw, s, z = _case(256, 64, 128)
    x = torch.randn(256, device="cuda", dtype=torch.float16)
    op = torch.ops.torchforge.awq_gemv_cuda
    with pytest.raises(RuntimeError, match="rows must be 16, 32 or 64"):
        op(x, qw, s, z, 128, None, 1, 8)
    with pytest.raises(RuntimeError, match=r"splits must be in \[1, K / rows = 8\]"):
        op(x, qw, s, z, 128, None, 9, 32)
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float16"):
        op(x.float(), qw, s, z, 128, None, 1, 32)
    with pytest.raises(RuntimeError, match="bias must be .* in x's dtype"):
        op(x, qw, s, z, 128, torch.zeros(64, device="cuda"), 1, 32)
    with pytest.raises(RuntimeError, match="group_size must be positive, got 0"):
        op(x, qw, s, z, 0, None, 1, 32)
    qw2, s2, z2 = _case(256, 40, 128)
    with pytest.raises(RuntimeError, match="N = 40 must be a multiple of 32"):
        op(x, qw2, s2, z2, 128, None, 1, 32)


def test_no_output_columns_gives_an_empty_result():
    """N = 0 (qweight [K, 0]): an empty output, not a launch of a grid of 0 blocks."""
    x = torch.randn(256, device="cuda", dtype=torch.float16)
    qw = torch.empty(256, 0, dtype=torch.int32, device="cuda")
    s = torch.empty(2, 0, dtype=torch.float16, device="cuda")
    z = torch.empty(2, 0, dtype=torch.int32, device="cuda")
    out = torch.ops.torchforge.awq_gemv_cuda(x, qw, s, z, 128, None, 1, 32)
    assert out.shape == (0,) and out.dtype == torch.float16


def _big_case(k=7168, n=7168, G=128):
    """A matrix large enough for the dispatch (two blocks per SM), quantized on the GPU."""
    torch.manual_seed(1)
    return awq_quantize(torch.randn(n, k, device="cuda") * 3, G)


def test_w4a16_linear_dispatches_one_large_row_here(monkeypatch):
    import torchforge
    import torchforge.ops.awq as awq

    qw, s, z = _big_case()
    calls = []
    real = awq.launch_awq_gemv_cuda
    monkeypatch.setattr(awq, "launch_awq_gemv_cuda", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    out = torchforge.ops.w4a16_linear(x, qw, s, z, 128)
    assert calls == [1]
    torch.testing.assert_close(out, real(x, qw, s, z, 128))
    torchforge.ops.w4a16_linear(x.float(), qw, s, z, 128)  # fp32: the Triton GEMV
    torchforge.ops.w4a16_linear(x, qw, s, z, 128, torch.zeros(7168, device="cuda"))  # fp32 bias: Triton too
    small = _case(1024, 512, 128)  # 2 column tiles x 4 slices: too few blocks, the Triton GEMV
    torchforge.ops.w4a16_linear(x[:, :1024], *small, 128)
    # bf16 scales (a module cast with .to(torch.bfloat16)): the op reads fp16 ones, so the Triton GEMV
    bf16_scales = torchforge.ops.w4a16_linear(x, qw, s.to(torch.bfloat16), z, 128)
    assert calls == [1]
    assert ((bf16_scales.float() - out.float()).norm() / out.float().norm()) < 1e-2  # scales rounded to bf16


def test_compile_and_cuda_graph():
    import torchforge

    qw, s, z = _big_case()
    x = torch.randn(1, 7168, device="cuda", dtype=torch.float16)
    b = torch.randn(7168, device="cuda", dtype=torch.float16)
    eager = torchforge.ops.w4a16_linear(x, qw, s, z, 128, b)
    compiled = torch.compile(lambda x: torchforge.ops.w4a16_linear(x, qw, s, z, 128, b), fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torchforge.ops.w4a16_linear(x, qw, s, z, 128, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    graph.replay()
    torch.testing.assert_close(captured, torchforge.ops.w4a16_linear(x, qw, s, z, 128, b), rtol=0, atol=0)
