"""The tensor-core W4A16 kernel (every SWAP_AB / FACTORED / SPLIT_K combination) against an independent
dequantization: under TRITON_INTERPRET=1 on CPU in fp16 (the interpreter has no bf16), on CUDA in bf16 too."""
import itertools

import pytest
import torch

from tests.ops.awq_oracle import dequant_independent
from torchforge.ops import awq_quantize
from torchforge.ops._triton import can_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not can_launch(torch.empty(0, device=DEVICE)),
                                reason="needs triton (CUDA, or the interpreter on CPU)")


def _case(m, ic, oc, G, dtype, bias, symmetric, seed):
    torch.manual_seed(seed)
    qw, s, z = (t.to(DEVICE) for t in awq_quantize(torch.randn(oc, ic) * 0.1, G, symmetric=symmetric))
    x = torch.randn(m, ic, device=DEVICE).to(dtype)
    b = torch.randn(oc, device=DEVICE).to(dtype) if bias else None
    expected = x.float() @ dequant_independent(qw, s, z, G).T + (b.float() if bias else 0)
    return x, qw, s, z, b, expected


# Every (swap, factored, split) combination; prefetch on in half of them, paired with each value of every flag.
FLAGS = [(s, f, k, (s + f + (k == 2)) % 2 == 0) for s, f, k in itertools.product([False, True], [False, True], [1, 2])]


# Tails: M not a multiple of BLOCK_M (3, 17, 33), OC not a multiple of BLOCK_N (40, 200).
@pytest.mark.parametrize("m,ic,oc,G,bias", [(3, 256, 40, 128, False), (17, 128, 200, 64, True),
                                            (33, 256, 64, 32, True)])
@pytest.mark.parametrize("swap_ab,factored,split_k,prefetch", FLAGS)
def test_mma_kernel_matches_dequantized_matmul(m, ic, oc, G, bias, swap_ab, factored, split_k, prefetch):
    from torchforge.ops.awq_mma_triton import MmaConfig, launch_w4a16_mma

    x, qw, s, z, b, expected = _case(m, ic, oc, G, torch.float16, bias, symmetric=oc % 16 == 0, seed=m + oc)
    cfg = MmaConfig(16, 32, min(G, 32), split_k, swap_ab, factored, 4, 2, prefetch)
    out = launch_w4a16_mma(x, qw, s, z, G, b, config=cfg)
    assert out.dtype == torch.float16 and out.shape == (m, oc)
    # fp16 output rounding (~5e-4 relative) dominates; the unfactored kernel also rounds the weight to fp16.
    assert ((out.float() - expected).norm() / expected.norm()) < 1.5e-3


def test_mma_kernel_factored_bits_cover_every_code_and_zero():
    """All 16 codes against all 16 zero points in one weight, with a wide activation range: the c + q trick
    must be exact, so the factored result matches the fp32 product to fp16 output rounding."""
    from torchforge.ops import awq_pack
    from torchforge.ops.awq_mma_triton import MmaConfig, launch_w4a16_mma

    G, ic, oc = 32, 64, 256
    codes = torch.arange(ic * oc).reshape(ic, oc).remainder(16).to(torch.uint8)
    zeros = (torch.arange(oc) // 16).remainder(16).repeat(ic // G, 1).to(torch.uint8)
    qw, z = awq_pack(codes).to(DEVICE), awq_pack(zeros).to(DEVICE)
    s = torch.rand(ic // G, oc).add(0.5).to(torch.float16).to(DEVICE)
    x = (torch.randn(5, ic) * torch.logspace(-2, 2, ic)).to(torch.float16).to(DEVICE)
    expected = x.float() @ dequant_independent(qw, s, z, G).T
    out = launch_w4a16_mma(x, qw, s, z, G, config=MmaConfig(16, 64, 32, 1, True, True, 4, 2))
    assert ((out.float() - expected).norm() / expected.norm()) < 1e-3


def test_mma_kernel_rejects_fp32_and_bad_split():
    from torchforge.ops.awq_mma_triton import MmaConfig, launch_w4a16_mma

    qw, s, z = awq_quantize(torch.randn(32, 128), 64)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        launch_w4a16_mma(torch.randn(2, 128), qw, s, z, 64)
    with pytest.raises(ValueError, match="split_k\\*block_k=192 must divide IC=128"):
        launch_w4a16_mma(torch.randn(2, 128).half(), qw, s, z, 64, config=MmaConfig(16, 32, 64, 3, False, True, 4, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 16, 64, 200, 1024])
def test_mma_default_configs_on_cuda(m, dtype):
    from torchforge.ops.awq_mma_triton import launch_w4a16_mma

    x, qw, s, z, b, expected = _case(m, 2048, 1536, 128, dtype, True, symmetric=m % 2 == 0, seed=m)
    out = launch_w4a16_mma(x, qw, s, z, 128, b)
    err = ((out.float() - expected).norm() / expected.norm()).item()
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), err


def test_mma_kernel_program_swizzle_over_several_row_groups():
    """5 row blocks in groups of 2 (a partial last group): every output tile is computed exactly once."""
    from torchforge.ops.awq_mma_triton import MmaConfig, launch_w4a16_mma

    x, qw, s, z, b, expected = _case(80, 128, 96, 64, torch.float16, True, symmetric=False, seed=7)
    out = launch_w4a16_mma(x, qw, s, z, 64, b, config=MmaConfig(16, 32, 64, 1, False, True, 4, 2, True), group_m=2)
    assert ((out.float() - expected).norm() / expected.norm()) < 1.5e-3


def test_w4a16_linear_kernel_dispatch_takes_non_contiguous_weights(monkeypatch):
    """The op's CUDA dispatch (forced here onto the interpreter) with strided scales and bias, 32 fp16 rows: the
    tensor-core kernel indexes dense arrays, so the op must make them contiguous first."""
    from torchforge.ops import awq, w4a16_linear

    monkeypatch.setattr(awq, "use_triton", can_launch)
    x, qw, s, z, b, expected = _case(32, 256, 64, 128, torch.float16, True, symmetric=False, seed=3)
    s_strided = torch.empty(s.shape[0], 2 * s.shape[1], dtype=s.dtype, device=DEVICE)[:, ::2]
    s_strided.copy_(s)
    b_strided = torch.empty(2 * b.shape[0], dtype=b.dtype, device=DEVICE)[::2]
    b_strided.copy_(b)
    assert not s_strided.is_contiguous() and not b_strided.is_contiguous()
    out = w4a16_linear(x, qw, s_strided, z, 128, b_strided)
    assert ((out.float() - expected).norm() / expected.norm()) < 1.5e-3


def test_w4a16_linear_dequant_cublas_branch_keeps_x_dtype_with_fp32_bias(monkeypatch):
    """Above the tensor-core kernel's rows the op dequantizes and calls matmul; an fp32 bias must not promote the
    output (the fake and the reference return x.dtype)."""
    from torchforge.ops import awq, w4a16_linear

    monkeypatch.setattr(awq, "use_triton", can_launch)
    x, qw, s, z, b, expected = _case(awq.MMA_MAX_M + 1, 128, 32, 64, torch.float16, True, symmetric=True, seed=4)
    out = w4a16_linear(x, qw, s, z, 64, b.float())
    assert out.dtype == torch.float16
    assert ((out.float() - expected).norm() / expected.norm()) < 1.5e-3
