"""The grouped NVFP4 GEMV kernel (MoE decode path) launched directly, and the op's shape rule that picks it.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on CPU tensors. Tolerance: the
weights are dequantized exactly, so the only error is fp32 summation (and one rounding of the output in fp16 /
bf16). It is checked against a float64 oracle with the standard bound for K fp32 additions,
``|out - ref| <= K * 2**-24 * (|W| @ |x|) + 2**-24 * |ref|`` (plus 2**-7 or 2**-11 of |ref| for a bf16 / fp16
output: one ulp for bf16, which the interpreter truncates), elementwise; against the reference op and the grouped GEMM kernel with rtol = 1e-5, atol = 1e-5 *
max |ref| as in test_nvfp4_triton.py."""
import pytest
import torch

pytest.importorskip("triton")

from torchforge.ops import nvfp4_dequantize, nvfp4_grouped_linear, nvfp4_quantize  # noqa: E402
from torchforge.ops._triton import can_launch  # noqa: E402
from torchforge.ops.nvfp4 import _launch_grouped  # noqa: E402
from torchforge.ops.nvfp4_gemv_triton import gemv_config, launch_nvfp4_grouped_gemv, use_grouped_gemv  # noqa: E402
from torchforge.ops.nvfp4_triton import launch_nvfp4_grouped_linear  # noqa: E402

if not can_launch(torch.empty(0)) and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# one rounding of the output; bf16: one ulp, since the interpreter truncates fp32 -> bf16 (GPUs round to nearest)
OUT_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-7}


def on_device(*tensors):
    return tuple(t.to(DEVICE) for t in tensors)


def case(e, n, k, r, seed, dtype=torch.float32, x_row_div=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) * torch.logspace(-1, 1, e).view(e, 1, 1)
    p, s, ws2 = nvfp4_quantize(w)
    x = torch.randn(r // x_row_div, k, generator=g).to(dtype)
    ids = torch.randint(0, e, (r,), generator=g)
    return x, ids, p, s, ws2


def check_against_oracle(out, x, ids, p, s, ws2, x_row_div=1):
    """float64 oracle on the exactly dequantized weights, with the fp32 summation bound of the module doc."""
    w = nvfp4_dequantize(p, s, ws2, torch.float64)[ids.long()]  # [R, N, K]
    xr = x.double().repeat_interleave(x_row_div, 0)  # [R, K]
    ref = torch.einsum("rnk,rk->rn", w, xr)
    mag = torch.einsum("rnk,rk->rn", w.abs(), xr.abs())
    k = x.shape[1]
    tol = k * 2.0**-24 * mag + (2.0**-24 + OUT_ULP[out.dtype]) * ref.abs() + 1e-30
    err = (out.cpu().double() - ref).abs()
    assert bool((err <= tol).all()), f"max err / bound = {float((err / tol).max()):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,tiles", [
    ((4, 48, 64, 1), dict(block_n=32, block_k=32)),  # R = 1, N tail (48 = 32 + 16)
    ((3, 80, 256, 3), dict(block_n=32, block_k=64)),  # R = 3, N tail, 4 K tiles
    ((5, 40, 128, 17), dict(block_n=16, block_k=128)),  # R = 17 > E: duplicate experts, N tail
    ((1, 16, 32, 1), dict()),  # one expert, the default config (BLOCK_K halved to 32)
])
def test_gemv_matches_reference(dtype, shape, tiles):
    e, n, k, r = shape
    x, ids, p, s, ws2 = case(e, n, k, r, seed=sum(shape), dtype=dtype)
    out = launch_nvfp4_grouped_gemv(*on_device(x, ids, p, s, ws2), **tiles).cpu()
    assert out.dtype == dtype and out.shape == (r, n)
    check_against_oracle(out, x, ids, p, s, ws2)
    ref = nvfp4_grouped_linear(x, ids, p, s, ws2)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("x_row_div,r", [(1, 6), (3, 12), (3, 3)])
def test_gemv_x_row_div(x_row_div, r):
    x, ids, p, s, ws2 = case(4, 32, 64, r, seed=14 + r, x_row_div=x_row_div)
    out = launch_nvfp4_grouped_gemv(*on_device(x, ids, p, s, ws2), x_row_div=x_row_div, block_n=16,
                                    block_k=32).cpu()
    check_against_oracle(out, x, ids, p, s, ws2, x_row_div)
    grouped = launch_nvfp4_grouped_linear(*on_device(x, ids, p, s, ws2), x_row_div=x_row_div).cpu()
    torch.testing.assert_close(out, grouped, rtol=1e-5, atol=1e-5 * float(grouped.abs().max()))


def test_gemv_duplicate_ids():
    x, _, p, s, ws2 = case(3, 24, 64, 5, seed=21)
    ids = torch.tensor([2, 2, 0, 2, 2])
    out = launch_nvfp4_grouped_gemv(*on_device(x, ids, p, s, ws2), block_n=16, block_k=32).cpu()
    check_against_oracle(out, x, ids, p, s, ws2)
    # the same expert and the same input row give the same bits
    x2 = x[:1].expand(5, -1).contiguous()
    out2 = launch_nvfp4_grouped_gemv(*on_device(x2, ids, p, s, ws2), block_n=16, block_k=32).cpu()
    assert torch.equal(out2[0], out2[1]) and torch.equal(out2[0], out2[3])


@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_bad_ids_are_nan_rows_and_empty(split_k):
    x, ids, p, s, ws2 = case(3, 40, 64, 6, seed=13)
    ids[2] = 3
    ids[4] = -1
    x, ids, p, s, ws2 = on_device(x, ids, p, s, ws2)
    out = launch_nvfp4_grouped_gemv(x, ids, p, s, ws2, block_n=32, block_k=16, split_k=split_k).cpu()
    assert out[2].isnan().all() and out[4].isnan().all()
    good = [0, 1, 3, 5]
    assert not out[good].isnan().any()
    check_against_oracle(out[good], x.cpu()[good], ids.cpu()[good], p.cpu(), s.cpu(), ws2.cpu())
    assert launch_nvfp4_grouped_gemv(x[:0], ids[:0], p, s, ws2).shape == (0, 40)


@pytest.mark.parametrize("split_k,block_k", [(2, 64), (3, 32), (8, 64)])  # 4 tiles / 2; 8 tiles as 3+3+2; cap 4
def test_gemv_split_k_deterministic(split_k, block_k):
    x, ids, p, s, ws2 = case(3, 24, 256, 3, seed=31, dtype=torch.bfloat16)
    args = on_device(x, ids, p, s, ws2)
    out = launch_nvfp4_grouped_gemv(*args, block_n=16, block_k=block_k, split_k=split_k).cpu()
    again = launch_nvfp4_grouped_gemv(*args, block_n=16, block_k=block_k, split_k=split_k).cpu()
    assert torch.equal(out, again)
    check_against_oracle(out, x, ids, p, s, ws2)


def test_gemv_default_config_splits_k():
    bn, bk, split, _ = gemv_config(1, 24, 1024)
    assert (bn, bk, split) == (64, 256, 4)  # one program otherwise: 4 tiles of K in 4 slices
    x, ids, p, s, ws2 = case(2, 24, 1024, 1, seed=41)
    out = launch_nvfp4_grouped_gemv(*on_device(x, ids, p, s, ws2)).cpu()
    check_against_oracle(out, x, ids, p, s, ws2)


@pytest.mark.parametrize("tiles", [dict(block_n=16, block_k=32), dict(block_n=32, block_k=64, split_k=2)])
def test_gemv_w4a4(tiles):
    x, ids, p, s, ws2 = case(5, 40, 128, 7, seed=11)
    ins = torch.rand(5, generator=torch.Generator().manual_seed(12)) * 1e-3 + 2e-4
    ref = nvfp4_grouped_linear(x, ids, p, s, ws2, ins)
    out = launch_nvfp4_grouped_gemv(*on_device(x, ids, p, s, ws2, ins), **tiles).cpu()
    # same activation codes and scales as the reference (exact fp8/E2M1 rounding in the kernel)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_dispatch_rule_is_shape_only():
    assert use_grouped_gemv(8, 256) and use_grouped_gemv(64, 256) and use_grouped_gemv(256, 256)
    assert not use_grouped_gemv(257, 256) and not use_grouped_gemv(4096, 256)
    assert use_grouped_gemv(1, 1) and not use_grouped_gemv(2, 1)  # nvfp4_linear: one row only
    assert use_grouped_gemv(8, 8) and not use_grouped_gemv(9, 8)
    assert not use_grouped_gemv(0, 256)


@pytest.mark.parametrize("r", [2, 9])  # 2 <= E = 4: GEMV; 9: grouped GEMM
def test_op_dispatch_both_paths(r):
    x, ids, p, s, ws2 = case(4, 24, 64, r, seed=51 + r)
    ref = nvfp4_grouped_linear(x, ids, p, s, ws2)
    out = _launch_grouped(*on_device(x, ids, p, s, ws2), None).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [dict(), dict(block_n=32, block_k=512, split_k=2, num_warps=4),
                                 dict(block_n=128, block_k=128, split_k=4, num_warps=8)])
def test_cuda_gemv_matches_grouped_gemm_deepseek_down(cfg):
    """DeepSeek-V3 down-projection rows (N 7168, K 2048) of 8 experts, fp32 activations (ieee dot in the GEMM)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    p, s, ws2 = nvfp4_quantize(torch.randn(8, 7168, 2048, device="cuda", generator=g) * 0.02)
    x = torch.randn(16, 2048, device="cuda", generator=g)
    ids = torch.randint(0, 8, (16,), device="cuda", generator=g)
    ref = launch_nvfp4_grouped_linear(x, ids, p, s, ws2)
    out = launch_nvfp4_grouped_gemv(x, ids, p, s, ws2, **cfg)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.cuda
def test_cuda_gemv_compile_and_graph():
    """The op takes the GEMV at decode (8 rows, 32 experts) under torch.compile(fullgraph) and in a CUDA graph."""
    torch._dynamo.reset()
    p, s, ws2 = nvfp4_quantize(torch.randn(32, 256, 512, device="cuda") * 0.02)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(32, device="cuda")[:8]
    assert use_grouped_gemv(ids.shape[0], 32)
    ref = nvfp4_grouped_linear(x.cpu(), ids.cpu(), p.cpu(), s.cpu(), ws2.cpu(), x_row_div=8).float()
    f = torch.compile(lambda x, ids: nvfp4_grouped_linear(x, ids, p, s, ws2, x_row_div=8), fullgraph=True)
    torch.testing.assert_close(f(x, ids).cpu().float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    eager = nvfp4_grouped_linear(x, ids, p, s, ws2, x_row_div=8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4_grouped_linear(x, ids, p, s, ws2, x_row_div=8)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
