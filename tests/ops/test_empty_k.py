"""IC = K = 0 (an empty sum: zeros, plus the bias) on the kernel paths, as the references and w4a16_linear (which
routes IC = 0 to the reference) return it. The ops' bodies run as on CUDA (use_triton patched to can_launch: the
interpreter on CPU). These used to raise: the grouped AWQ GEMV's split-K (0 groups) and the NVFP4 GEMV's K slices
divided by zero, and GPTQ / nvfp4_linear reshaped x to (-1, 0)."""
import pytest
import torch

pytest.importorskip("triton")

import torchforge.ops.awq_moe as awq_moe  # noqa: E402
import torchforge.ops.gptq as gptq  # noqa: E402
import torchforge.ops.nvfp4 as nvfp4  # noqa: E402
from torchforge.ops._triton import can_launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not can_launch(torch.empty(0, device=DEVICE)),
                                reason="needs triton (CUDA, or the interpreter on CPU)")


def test_awq_moe_gemm_empty_k(monkeypatch):
    monkeypatch.setattr(awq_moe, "use_triton", can_launch)
    E, N, G, T, k = 3, 16, 32, 2, 2
    qw = torch.zeros(E, 0, N // 8, dtype=torch.int32, device=DEVICE)
    s = torch.zeros(E, 0, N, dtype=torch.float16, device=DEVICE)
    z = torch.zeros(E, 0, N // 8, dtype=torch.int32, device=DEVICE)
    x = torch.zeros(T, 0, device=DEVICE)
    ids = torch.tensor([0, 2, 1, 1], device=DEVICE)
    out = awq_moe.awq_moe_gemm(x, ids, qw, s, z, G, k)  # 4 routed rows: the grouped GEMV
    assert out.shape == (T * k, N) and bool((out == 0).all())


def test_gptq_linear_empty_k(monkeypatch):
    monkeypatch.setattr(gptq, "use_triton", can_launch)
    N = 16
    qw = torch.zeros(0, N, dtype=torch.int32, device=DEVICE)
    s = torch.ones(1, N, dtype=torch.float16, device=DEVICE)
    z = torch.zeros(1, N // 8, dtype=torch.int32, device=DEVICE)
    g_idx = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    x = torch.zeros(2, 3, 0, device=DEVICE)
    bias = torch.randn(N, device=DEVICE)
    out = gptq.w4a16_gptq_linear(x, qw, s, z, g_idx, bias)
    assert out.shape == (2, 3, N)
    torch.testing.assert_close(out, bias.expand(2, 3, N))


@pytest.mark.parametrize("rows", [1, 5])  # the GEMV (rows <= E), the sorted grouped GEMM
def test_nvfp4_empty_k(monkeypatch, rows):
    monkeypatch.setattr(nvfp4, "use_triton", can_launch)
    E, N = 1, 16
    p = torch.zeros(E, N, 0, dtype=torch.uint8, device=DEVICE)
    s = torch.zeros(E, N, 0, device=DEVICE).to(torch.float8_e4m3fn)
    ws2 = torch.ones(E, device=DEVICE)
    x = torch.zeros(rows, 0, device=DEVICE)
    ids = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    out = nvfp4.nvfp4_grouped_linear(x, ids, p, s, ws2)
    assert out.shape == (rows, N) and bool((out == 0).all())
    out = nvfp4.nvfp4_linear(x, p[0], s[0], ws2[0])
    assert out.shape == (rows, N) and bool((out == 0).all())
