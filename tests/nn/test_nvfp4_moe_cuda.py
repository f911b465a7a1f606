"""NVFP4MoE on the GPU (marked `cuda`): the Triton path against the CPU reference, W4A4 emulation, and
torch.compile(fullgraph=True) of the MoE block."""
import copy

import pytest
import torch

import torchforge
from tests import models
from torchforge.nn import NVFP4MoE, emulate_w4a4

pytestmark = pytest.mark.cuda


@torch.no_grad()
@pytest.mark.parametrize("w4a4", [False, True])
def test_cuda_nvfp4_moe_matches_cpu(w4a4):
    model = models.build("deepseek_v3", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 96, (2, 12), generator=g) for _ in range(2)]
    torchforge.quantize(model, "nvfp4", calib_data=calib)
    emulate_w4a4(model, w4a4)
    gpu = copy.deepcopy(model).cuda()
    moe_cpu, moe_gpu = model.model.layers[1].mlp, gpu.model.layers[1].mlp
    assert isinstance(moe_gpu, NVFP4MoE)
    for tokens in (1, 8, 64, 300):
        x = torch.randn(tokens, 64, generator=g).bfloat16()
        ref = moe_cpu(x).float()
        out = moe_gpu(x.cuda()).float().cpu()
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    ids = torch.randint(0, 96, (2, 10), generator=g)
    torch.testing.assert_close(gpu(ids.cuda()).logits.float().cpu(), model(ids).logits.float(), rtol=5e-2, atol=5e-2)


@torch.no_grad()
def test_cuda_compile_nvfp4_moe_fullgraph():
    torch._dynamo.reset()
    model = models.build("qwen3_moe", dtype=torch.bfloat16)
    torchforge.quantize(model, "nvfp4")
    moe = model.model.layers[0].mlp.cuda()
    x = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(moe, fullgraph=True)
    torch.testing.assert_close(compiled(x), moe(x), rtol=1e-2, atol=1e-2)
