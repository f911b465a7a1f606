"""The split-K decode kernel, launched under TRITON_INTERPRET=1 on CPU, against an independent dequantization."""
import pytest
import torch

from tests.ops.awq_oracle import dequant_independent
from torchforge.ops import awq_quantize
from torchforge.ops._triton import can_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not can_launch(torch.empty(0, device=DEVICE)),
                                reason="needs triton (CUDA, or the interpreter on CPU)")


@pytest.mark.parametrize("m,ic,oc,G,split,bias", [(1, 256, 64, 128, 2, False), (3, 512, 40, 64, 4, True),
                                                  (16, 256, 136, 32, 1, True), (1, 128, 16, 16, 8, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_splitk_kernel_matches_dequantized_matmul(m, ic, oc, G, split, bias, dtype):
    from torchforge.ops.awq_splitk_triton import launch_w4a16_splitk

    torch.manual_seed(m * 1000 + oc)
    qw, s, z = (t.to(DEVICE) for t in awq_quantize(torch.randn(oc, ic), G, symmetric=oc % 16 == 0))
    x = torch.randn(m, ic, device=DEVICE).to(dtype)
    b = torch.randn(oc, device=DEVICE).to(dtype) if bias else None
    w = dequant_independent(qw, s, z, G).to(dtype).float()  # the kernel rounds the weight to x.dtype
    expected = x.float() @ w.T + (b.float() if bias else 0)
    out = launch_w4a16_splitk(x, qw, s, z, G, b, block_n=32, block_k=min(G, 32), split_k=split)
    assert out.dtype == dtype and out.shape == (m, oc)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert ((out.float() - expected).norm() / expected.norm()) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_splitk_on_cuda(m, dtype):
    """bf16 only here: the Triton interpreter has no bf16 arithmetic."""
    from torchforge.ops.awq_splitk_triton import launch_w4a16_splitk

    torch.manual_seed(m)
    qw, s, z = (t.cuda() for t in awq_quantize(torch.randn(512, 1024), 128, symmetric=m != 5))
    x = torch.randn(m, 1024, device="cuda").to(dtype)
    expected = x.float() @ dequant_independent(qw, s, z, 128).T
    out = launch_w4a16_splitk(x, qw, s, z, 128)
    err = ((out.float() - expected).norm() / expected.norm()).item()
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), err


def test_splitk_rejects_large_m():
    from torchforge.ops.awq_splitk_triton import launch_w4a16_splitk

    qw, s, z = awq_quantize(torch.randn(16, 128), 64)
    with pytest.raises(ValueError, match="M=17 rows"):
        launch_w4a16_splitk(torch.randn(17, 128), qw, s, z, 64)


@pytest.mark.parametrize("G", [32, 128])
def test_dequant_t_kernel_matches_independent_dequantization(G):
    from torchforge.ops.awq_dequant_triton import launch_awq_dequantize_t

    qw, s, z = (t.to(DEVICE) for t in awq_quantize(torch.randn(40, 256), G, symmetric=False))
    w_t = launch_awq_dequantize_t(qw, s, z, G, torch.float32)
    assert torch.equal(w_t, dequant_independent(qw, s, z, G).T.contiguous())


@pytest.mark.parametrize("lead,ic,oc,G", [((), 256, 40, 128), ((3,), 128, 136, 32), ((5,), 64, 16, 64)])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_dequant_kernel_is_the_reference_op(lead, ic, oc, G, dtype):
    """awq_dequantize's CUDA path (one launch for a stack of matrices, W [.., OC, IC] straight in `dtype`) gives the
    reference's bits: (q - z) * s in fp32, rounded once; and its W^T form on a stack is the stack of W^T."""
    from torchforge.ops.awq_dequant_triton import launch_awq_dequantize, launch_awq_dequantize_t
    from torchforge.ops.awq_reference import awq_dequantize_ref

    torch.manual_seed(ic + oc)
    qw, s, z = (t.to(DEVICE) for t in awq_quantize(torch.randn(*lead, oc, ic), G, symmetric=False))
    want32 = awq_dequantize_ref(qw, s.float(), z, G)
    want = want32.to(s.dtype if dtype is None else dtype)
    if want.dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter truncates fp32 -> bf16 (GPUs round)
        want = (want32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    out = launch_awq_dequantize(qw, s, z, G, want.dtype)
    assert out.dtype == want.dtype and out.is_contiguous() and torch.equal(out, want)
    assert torch.equal(launch_awq_dequantize_t(qw, s, z, G, want.dtype), want.transpose(-1, -2))


def test_dequant_launches_bound_every_input_in_int32(monkeypatch):
    """The stack is split so that each launch's qweight, scales and qzeros stay below _MAX_LAUNCH_ELEMS elements (the
    tiles index them in int32). Scales hold 8 / G of qweight's words: with G = 4 twice as many, which a bound on the
    qweight words alone let past the limit (2^31 - 1 on a GPU, 100 here); the split launches give the reference."""
    import torchforge.ops.awq_dequant_triton as D
    from torchforge.ops.awq_reference import awq_dequantize_ref

    limit = 100
    monkeypatch.setattr(D, "_MAX_LAUNCH_ELEMS", limit)
    real, sizes = D.torch.library.wrap_triton, []

    def recording(kernel):
        launcher = real(kernel)

        class Grid:
            def __getitem__(self, grid):
                def launch(q, s, z, *args, **kw):
                    sizes.append((q.numel(), s.numel(), z.numel()))
                    return launcher[grid](q, s, z, *args, **kw)
                return launch
        return Grid()

    monkeypatch.setattr(D.torch.library, "wrap_triton", recording)
    torch.manual_seed(0)
    qw, s, z = (t.to(DEVICE) for t in awq_quantize(torch.randn(5, 8, 16), 4, symmetric=False))  # 16 words, 32 scales
    out = D.launch_awq_dequantize(qw, s, z, 4, torch.float32)
    assert len(sizes) > 1 and all(max(n) <= limit for n in sizes), sizes
    assert torch.equal(out, awq_dequantize_ref(qw, s.float(), z, 4))
