"""The NVFP4 Triton kernels launched directly. Without a GPU they run under TRITON_INTERPRET=1 (set by
tests/conftest.py) on CPU tensors; compared with the reference op (fp32: to rounding of the accumulation
order; W4A4 emulation: the same codes and scales)."""
import pytest
import torch

pytest.importorskip("triton")

from torchforge.ops import (  # noqa: E402
    nvfp4_dequantize,
    nvfp4_grouped_linear,
    nvfp4_quantize,
    nvfp4_quantize_activation,
)
from torchforge.ops._triton import can_launch  # noqa: E402
from torchforge.ops.nvfp4_triton import launch_nvfp4_align, launch_nvfp4_grouped_linear, max_sorted_rows  # noqa: E402

if not can_launch(torch.empty(0)) and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors):
    """The kernels' inputs on DEVICE: with a GPU TRITON_INTERPRET is unset, so they must be CUDA tensors."""
    return tuple(t.to(DEVICE) for t in tensors)


def case(e, n, k, r, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) * torch.logspace(-1, 1, e).view(e, 1, 1)
    p, s, ws2 = nvfp4_quantize(w)
    x = torch.randn(r, k, generator=g).to(dtype)
    ids = torch.randint(0, e, (r,), generator=g)
    return x, ids, p, s, ws2


def test_align_groups_rows_by_expert():
    ids = torch.tensor([3, 1, 3, 0, 3, 1, 5, 3, 3, 9, 3], dtype=torch.int64)  # 9 is out of range for E=6
    sorted_rows = launch_nvfp4_align(ids.to(DEVICE), 6, 4).cpu()
    assert sorted_rows.shape[0] == max_sorted_rows(11, 7, 4)
    blocks = sorted_rows[: (sorted_rows.shape[0] // 4) * 4].view(-1, 4)
    seen = []
    for blk in blocks.tolist():
        rows = [r for r in blk if r >= 0]
        if not rows:
            continue
        assert blk[0] >= 0  # a block starts with a real row, padding only at its end
        assert blk[: len(rows)] == rows
        experts_of_block = {min(int(ids[r]), 6) for r in rows}
        assert len(experts_of_block) == 1
        seen += rows
    assert sorted(seen) == list(range(11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 48, 64, 10), (3, 80, 256, 37), (1, 16, 32, 1), (2, 136, 128, 40)])  # last: >= 16 rows per expert
def test_grouped_kernel_matches_reference(dtype, shape):
    e, n, k, r = shape
    x, ids, p, s, ws2 = case(e, n, k, r, seed=sum(shape), dtype=dtype)
    ref = nvfp4_grouped_linear(x, ids, p, s, ws2)
    out = launch_nvfp4_grouped_linear(x.to(DEVICE), ids.to(DEVICE), p.to(DEVICE), s.to(DEVICE), ws2.to(DEVICE)).cpu()
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    else:  # one rounding of the output in dtype, accumulation order aside
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("tiles", [dict(block_m=16, block_n=16, block_k=16), dict(block_m=32, block_n=32, block_k=64)])
def test_grouped_kernel_tiles_and_w4a4(tiles):
    x, ids, p, s, ws2 = case(5, 40, 128, 23, seed=11)
    ins = torch.rand(5, generator=torch.Generator().manual_seed(12)) * 1e-3 + 2e-4
    ref = nvfp4_grouped_linear(x, ids, p, s, ws2, ins)
    out = launch_nvfp4_grouped_linear(*on_device(x, ids, p, s, ws2, ins), **tiles).cpu()
    # same activation codes and scales as the reference (exact fp8/E2M1 rounding in the kernel)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_grouped_kernel_bad_ids_are_nan_rows_and_empty():
    x, ids, p, s, ws2 = case(3, 16, 32, 6, seed=13)
    ids[2] = 3
    ids[4] = -1
    x, ids, p, s, ws2 = on_device(x, ids, p, s, ws2)
    out = launch_nvfp4_grouped_linear(x, ids, p, s, ws2).cpu()
    assert out[2].isnan().all() and out[4].isnan().all()
    good = [0, 1, 3, 5]
    assert not out[good].isnan().any()
    assert launch_nvfp4_grouped_linear(x[:0], ids[:0], p, s, ws2).shape == (0, 16)


def test_grouped_kernel_int64_ids_past_int32_are_bad_ids():
    """An int64 id of 2**32 + 1 is out of range: the align kernel must not truncate it to int32 (expert 1) before
    the range check. It was sorted into expert 1's block, so it came out as expert 1's product instead of NaN, and
    a block that it led was all NaN, the real expert-1 rows included."""
    x, ids, p, s, ws2 = case(3, 16, 32, 6, seed=14)
    ids[:] = torch.tensor([1, 1, 0, 2, 1, 0])
    good = ids.clone()
    ids[2] = 2**32 + 1  # a row after real expert-1 rows
    ids[0] = 2**32 + 1  # the first row of its block
    ref = nvfp4_grouped_linear(x, good, p, s, ws2)
    out = launch_nvfp4_grouped_linear(*on_device(x, ids, p, s, ws2), block_m=16, block_n=16, block_k=32).cpu()
    assert out[0].isnan().all() and out[2].isnan().all()
    rows = [1, 3, 4, 5]
    torch.testing.assert_close(out[rows], ref[rows], rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_grouped_kernel_x_row_div():
    x, ids, p, s, ws2 = case(4, 32, 64, 12, seed=14)
    ref = nvfp4_grouped_linear(x[:4].repeat_interleave(3, 0), ids, p, s, ws2)
    out = launch_nvfp4_grouped_linear(*on_device(x[:4], ids, p, s, ws2), x_row_div=3).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _decoded_activation(x, input_scale):
    """float64 E2M1 * fp8 scale * input_scale of the NVFP4-quantized rows of x (checked bit for bit against vLLM's
    rules in test_nvfp4_format.py)."""
    packed, scales = nvfp4_quantize_activation(x, input_scale)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(x.shape).long()
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    return e2m1[codes] * scales.double().repeat_interleave(16, -1) * float(input_scale)


@pytest.mark.parametrize("w4a4", [False, True])
def test_grouped_kernel_fp16_exact_for_small_block_scales(w4a4):
    """fp16 activations: the in-register weight was E2M1 * scale * 2**-22, which fp16 cannot hold below 2**-14 (a
    block scale under 4 lost bits or flushed to 0: 9% error on these rows). Checked against a float64 oracle on the
    exactly dequantized weights (and activations, W4A4): the fp32 summation bound plus one fp16 rounding."""
    g = torch.Generator().manual_seed(15)
    e, n, k, r = 2, 32, 64, 40
    w = torch.randn(e, n, k, generator=g)
    w[:, 1:] *= 1e-3  # row 0 sets the global scale: the other rows' block scales are < 1
    p, s, ws2 = nvfp4_quantize(w)
    assert float(s[:, 1:].float().max()) < 4
    x = torch.randn(r, k, generator=g).half()
    ids = torch.randint(0, e, (r,), generator=g)
    ins = torch.full((e,), float(x.float().abs().max()) / 2688) if w4a4 else None
    out = launch_nvfp4_grouped_linear(*on_device(x, ids, p, s, ws2), None if ins is None else ins.to(DEVICE)).cpu()
    a = torch.stack([_decoded_activation(x[i], ins[ids[i]]) for i in range(r)]) if w4a4 else x.double()
    wq = nvfp4_dequantize(p, s, ws2, torch.float64)[ids]
    exact = torch.einsum("rnk,rk->rn", wq, a)
    mag = torch.einsum("rnk,rk->rn", wq.abs(), a.abs())
    tol = k * 2.0**-24 * mag + (4 * 2.0**-24 + 2.0**-11) * exact.abs() + 1e-30
    err = (out.double() - exact).abs()
    assert bool((err[:, 1:] <= tol[:, 1:]).all()), float((err[:, 1:] / tol[:, 1:]).max())


@pytest.mark.parametrize("lead,n,k", [((), 40, 48), ((3,), 72, 128), ((2,), 64, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequant_kernel_is_the_reference_op(lead, n, k, dtype):
    """nvfp4_dequantize's CUDA path (one launch for a stack of experts) gives the reference's bits: E2M1 * scale
    (exact) times weight_scale_2 in fp32, rounded once to `dtype`; N not a multiple of the tile, K of 16 only."""
    from torchforge.ops.nvfp4_reference import dequantize_fp32, nvfp4_dequantize_ref
    from torchforge.ops.nvfp4_triton import launch_nvfp4_dequantize

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(*lead, n, k, generator=g) * 3
    p, s, ws2 = on_device(*nvfp4_quantize(w))
    want = nvfp4_dequantize_ref(p, s, ws2, dtype)
    if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter truncates fp32 -> bf16 (GPUs round)
        want = (dequantize_fp32(p, s, ws2).view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    out = launch_nvfp4_dequantize(p, s, ws2, dtype)
    assert out.dtype == dtype and out.shape == want.shape and torch.equal(out, want)


def test_dequant_kernel_splits_stacks_past_the_grid_limit(monkeypatch):
    """The matrices go on grid dimension 2, which CUDA caps at 65535: a larger stack must take several launches
    (a single one fails on a GPU with 'invalid argument'). With the cap lowered to 2, the launches give the
    reference's bits on a stack of 5 (and 2 x 3)."""
    import torchforge.ops.nvfp4_triton as T
    from torchforge.ops.nvfp4_reference import nvfp4_dequantize_ref

    real, grids = T.torch.library.wrap_triton, []

    def recording(kernel):
        launcher = real(kernel)

        class Grid:
            def __getitem__(self, grid):
                grids.append(tuple(grid))
                return launcher[grid]
        return Grid()

    monkeypatch.setattr(T.torch.library, "wrap_triton", recording)
    monkeypatch.setattr(T, "_MAX_GRID_Z", 2)
    g = torch.Generator().manual_seed(5)
    p, s, ws2 = on_device(*nvfp4_quantize(torch.randn(6, 40, 32, generator=g)))
    for lead in ((5,), (2, 3)):
        b = 1
        for d in lead:
            b *= d
        pl, sl, wl = p[:b].reshape(*lead, 40, 16), s[:b].reshape(*lead, 40, 2), ws2[:b].reshape(lead)
        grids.clear()
        out = T.launch_nvfp4_dequantize(pl, sl, wl, torch.float32)
        assert len(grids) == (b + 1) // 2 and all(gr[2] <= 2 for gr in grids), grids
        assert torch.equal(out, nvfp4_dequantize_ref(pl, sl, wl, torch.float32))


def test_dequant_kernel_grid_within_cuda_limits(monkeypatch):
    """70000 small matrices (a stack the op accepts): every launch's grid within CUDA's (2^31 - 1, 65535, 65535).
    The launches are recorded, not run (the interpreter would take minutes)."""
    import torchforge.ops.nvfp4_triton as T

    grids = []

    class Grid:
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return lambda *a, **kw: None

    monkeypatch.setattr(T.torch.library, "wrap_triton", lambda kernel: Grid())
    e = 70000
    p = torch.zeros(e, 1, 8, dtype=torch.uint8)
    s = torch.zeros(e, 1, 1, dtype=torch.float8_e4m3fn)
    T.launch_nvfp4_dequantize(p, s, torch.ones(e), torch.bfloat16)
    assert grids and all(g[1] <= 65535 and g[2] <= 65535 for g in grids), grids
    assert sum(g[2] for g in grids) == e
