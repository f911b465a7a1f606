"""NVFP4 ops on the GPU (marked `cuda`; skipped without one): quantization bit-exact with the CPU, the
grouped Triton kernel against the reference on MoE-like shapes, torch.compile."""
import pytest
import torch

from torchforge.ops import nvfp4_grouped_linear, nvfp4_linear, nvfp4_quantize

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_quantize_bit_exact_with_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4, 256, 512, generator=g) * torch.logspace(-2, 1, 512)).to(dtype)
    cpu = nvfp4_quantize(w)
    gpu = nvfp4_quantize(w.cuda())
    assert torch.equal(gpu[0].cpu(), cpu[0])
    assert torch.equal(gpu[1].cpu().view(torch.uint8), cpu[1].view(torch.uint8))
    assert torch.equal(gpu[2].cpu(), cpu[2])


@pytest.mark.parametrize("rows", [1, 8, 64, 512, 3000])
@pytest.mark.parametrize("w4a4", [False, True])
def test_cuda_grouped_linear_matches_reference(rows, w4a4):
    g = torch.Generator().manual_seed(rows)
    E, N, K = 32, 384, 1024
    p, s, ws2 = nvfp4_quantize(torch.randn(E, N, K, generator=g) * 0.02)
    x = torch.randn(rows, K, generator=g).bfloat16()
    ids = torch.randint(0, E, (rows,), generator=g)
    ins = torch.full((E,), float(x.float().abs().max()) / 2688) if w4a4 else None
    ref = nvfp4_grouped_linear(x, ids, p, s, ws2, ins)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    out = nvfp4_grouped_linear(x.cuda(), ids.cuda(), p.cuda(), s.cuda(), ws2.cuda(), cuda(ins)).cpu()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2 * float(ref.float().abs().max()))


def test_cuda_grouped_linear_bad_id_gives_nan_rows():
    p, s, ws2 = nvfp4_quantize(torch.randn(4, 64, 128, device="cuda"))
    ids = torch.tensor([0, 9, 3], device="cuda")
    out = nvfp4_grouped_linear(torch.randn(3, 128, device="cuda", dtype=torch.bfloat16), ids, p, s, ws2)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_cuda_linear_and_compile():
    torch._dynamo.reset()
    p, s, ws2 = nvfp4_quantize(torch.randn(512, 1024, device="cuda") * 0.02)
    b = torch.randn(512, device="cuda")
    x = torch.randn(7, 1024, device="cuda", dtype=torch.bfloat16)
    ref = nvfp4_linear(x.cpu(), p.cpu(), s.cpu(), ws2.cpu(), bias=b.cpu())
    f = torch.compile(lambda x: nvfp4_linear(x, p, s, ws2, bias=b), fullgraph=True)
    torch.testing.assert_close(f(x).cpu().float(), ref.float(), rtol=1e-2, atol=1e-2 * float(ref.float().abs().max()))
