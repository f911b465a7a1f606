"""The AWQ Triton kernels launched directly. Without a GPU they run under TRITON_INTERPRET=1 (set by
tests/conftest.py) on CPU tensors, fp32 and fp16 (numpy has no bf16), small shapes; tails in M, OC
and multi-tile K are covered. Compared with an fp32 oracle built from the format description."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from torchforge.ops import awq_pack  # noqa: E402
from torchforge.ops._triton import can_launch  # noqa: E402
from torchforge.ops.awq_triton import launch_awq_grouped_linear, launch_w4a16_linear  # noqa: E402

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

if not can_launch(torch.empty(0)) and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def unpack_np(words: torch.Tensor) -> np.ndarray:
    u = words.cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    ic, ocp = u.shape
    out = np.zeros((ic, ocp * 8), dtype=np.int64)
    for k in range(8):
        out[:, np.arange(ocp) * 8 + ORDER[k]] = (u >> (4 * k)) & 0xF
    return out


def oracle(x, qweight, scales, qzeros, group_size, bias=None):
    """fp32 (q - z) * s weight, rounded to x.dtype, multiplied in fp32 (float64 here), bias, cast."""
    q = unpack_np(qweight)
    z = np.repeat(unpack_np(qzeros), group_size, axis=0)
    s = np.repeat(scales.float().cpu().numpy(), group_size, axis=0)
    w = torch.from_numpy((q - z).astype(np.float32) * s).to(x.dtype).double()  # [IC, OC]
    out = x.cpu().double() @ w
    if bias is not None:
        out = out + bias.cpu().double()
    return out.to(x.dtype)


def random_awq(ic, oc, group_size, seed, experts=None):
    g = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    codes = torch.randint(0, 16, (*lead, ic, oc), dtype=torch.uint8, generator=g)
    zeros = torch.randint(0, 16, (*lead, ic // group_size, oc), dtype=torch.uint8, generator=g)
    scales = (torch.rand(*lead, ic // group_size, oc, generator=g) * 0.02 + 0.005).half()
    return awq_pack(codes).to(DEVICE), scales.to(DEVICE), awq_pack(zeros).to(DEVICE)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=4e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, ic, oc, group_size, blocks",
    [
        (1, 64, 16, 32, dict(block_n=16)),  # decode row, exact tiles
        (3, 128, 72, 64, dict(block_n=32, block_k=32)),  # OC tail (72 = 2 * 32 + 8), 2 K tiles per group
        (17, 256, 40, 128, dict(block_m=16, block_n=32)),  # M tail (17 = 16 + 1), OC tail, 128-group
        (5, 64, 24, 32, dict()),  # default block sizes
    ],
)
def test_w4a16_kernel_vs_oracle(dtype, m, ic, oc, group_size, blocks):
    qweight, scales, qzeros = random_awq(ic, oc, group_size, seed=m * oc)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, ic, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(oc, generator=g).to(dtype).to(DEVICE)
    for b in (None, bias):
        out = launch_w4a16_linear(x, qweight, scales, qzeros, group_size, b, **blocks)
        assert out.shape == (m, oc) and out.dtype == dtype
        torch.testing.assert_close(out.cpu(), oracle(x, qweight, scales, qzeros, group_size, b), **TOL[dtype])


def test_w4a16_kernel_leading_dims_and_strided_x():
    qweight, scales, qzeros = random_awq(64, 16, 32, seed=1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    out = launch_w4a16_linear(x, qweight, scales, qzeros, 32, block_n=16)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out.cpu(), oracle(x.reshape(6, 64), qweight, scales, qzeros, 32).reshape(2, 3, 16))
    for xs in (
        torch.randn(5, 128, generator=g).to(DEVICE)[:, ::2],  # [5, 64], strides (128, 2)
        torch.randn(64, 5, generator=g).to(DEVICE).T,  # [5, 64], strides (1, 5)
    ):
        out = launch_w4a16_linear(xs, qweight, scales, qzeros, 32, block_n=16)
        torch.testing.assert_close(out.cpu(), oracle(xs.contiguous(), qweight, scales, qzeros, 32), rtol=1e-5, atol=1e-4)


def test_w4a16_kernel_empty():
    qweight, scales, qzeros = random_awq(64, 16, 32, seed=2)
    assert launch_w4a16_linear(torch.randn(0, 64, device=DEVICE), qweight, scales, qzeros, 32).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_grouped_kernel_vs_oracle(dtype, id_dtype):
    E, ic, oc, G = 3, 128, 40, 64
    qweight, scales, qzeros = random_awq(ic, oc, G, seed=3, experts=E)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, ic, generator=g).to(dtype).to(DEVICE)
    ids = torch.tensor([2, 0, 2, 1, 0, 2], dtype=id_dtype, device=DEVICE)
    out = launch_awq_grouped_linear(x, ids, qweight, scales, qzeros, G, block_n=32, block_k=32)
    assert out.shape == (6, oc) and out.dtype == dtype
    for r in range(6):
        e = int(ids[r])
        ref = oracle(x[r : r + 1], qweight[e], scales[e], qzeros[e], G)
        torch.testing.assert_close(out[r : r + 1].cpu(), ref, **TOL[dtype])


def test_grouped_kernel_out_of_range_id_gives_nan_row_and_empty():
    qweight, scales, qzeros = random_awq(64, 16, 32, seed=4, experts=2)
    x = torch.randn(3, 64, device=DEVICE)
    out = launch_awq_grouped_linear(x, torch.tensor([1, 2, -1], device=DEVICE), qweight, scales, qzeros, 32)
    assert not out[0].isnan().any() and out[1:].isnan().all()
    torch.testing.assert_close(out[:1].cpu(), oracle(x[:1], qweight[1], scales[1], qzeros[1], 32))
    empty = launch_awq_grouped_linear(x[:0], torch.zeros(0, dtype=torch.int64, device=DEVICE), qweight, scales, qzeros, 32)
    assert empty.shape == (0, 16)
