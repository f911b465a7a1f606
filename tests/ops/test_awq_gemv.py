"""The batch-1 GEMV kernel (no tensor cores), under TRITON_INTERPRET=1 on CPU, against an independent dequantization."""
import pytest
import torch

from tests.ops.awq_oracle import dequant_independent
from torchforge.ops import awq_quantize
from torchforge.ops._triton import can_launch

pytestmark = pytest.mark.skipif(not can_launch(torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu")),
                                reason="needs triton (CUDA, or the interpreter on CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("ic,oc,G,split,bw,bk,sym", [(256, 64, 128, 2, 8, 16, True), (384, 72, 64, 3, 4, 32, False),
                                                     (128, 520, 32, 1, 16, 8, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.cuda)])  # interpreter: no bf16 math
def test_gemv_matches_dequantized_matvec(ic, oc, G, split, bw, bk, sym, dtype):
    from torchforge.ops.awq_gemv_triton import launch_w4a16_gemv

    torch.manual_seed(ic + oc)
    qw, s, z = (t.to(DEVICE) for t in awq_quantize(torch.randn(oc, ic) * 3, G, symmetric=sym))
    x = torch.randn(1, ic, device=DEVICE).to(dtype)
    b = torch.randn(oc, device=DEVICE).to(dtype)
    expected = x.float() @ dequant_independent(qw, s, z, G).T + b.float()
    out = launch_w4a16_gemv(x, qw, s, z, G, b, block_w=bw, block_k=bk, split_k=split)
    assert out.dtype == dtype and out.shape == (1, oc)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert ((out.float() - expected).norm() / expected.norm()) < tol


def test_gemv_rejects_bad_split_and_rows():
    from torchforge.ops.awq_gemv_triton import launch_w4a16_gemv

    qw, s, z = awq_quantize(torch.randn(64, 256), 128)
    with pytest.raises(ValueError, match="exactly one"):
        launch_w4a16_gemv(torch.randn(2, 256), qw, s, z, 128)
    with pytest.raises(ValueError, match="split_k=3 must divide the 2 groups"):
        launch_w4a16_gemv(torch.randn(1, 256), qw, s, z, 128, split_k=3)
