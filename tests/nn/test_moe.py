"""ForgeMoE keeps HF's routing exactly; ForgeAWQExperts computes what HF's experts compute on the dequantized weights."""
import copy

import pytest
import torch

from tests import models
from torchforge.nn import ForgeAWQExperts, ForgeMoE


@pytest.mark.parametrize("arch", sorted(models.MOE_BUILDERS))
def test_forge_moe_with_hf_experts_equals_hf_block(arch):
    model = models.build(arch)
    for name, block in models.moe_blocks(model):
        x = torch.randn(3, 5, model.config.hidden_size)
        wrapped = ForgeMoE.from_hf(copy.deepcopy(block))
        torch.testing.assert_close(wrapped(x), block(x), rtol=0, atol=0)
        # same state-dict keys as the HF block, so checkpoints keep their names
        assert sorted(wrapped.state_dict()) == sorted(block.state_dict())


def _hf_reference_experts(experts, gate_up, down):
    ref = copy.deepcopy(experts)
    ref.gate_up_proj.data.copy_(gate_up)
    ref.down_proj.data.copy_(down)
    return ref


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("symmetric", [True, False])
@torch.no_grad()
def test_awq_experts_match_hf_experts_on_dequantized_weights(arch, symmetric):
    model = models.build(arch)
    _, block = models.moe_blocks(model)[0]
    q = ForgeAWQExperts.from_hf(block.experts, group_size=32, symmetric=symmetric)
    gu, dn = q.dequantized_weights()
    ref = _hf_reference_experts(block.experts, gu.float(), dn.float())
    x = torch.randn(11, model.config.hidden_size)
    _, w, ids = block.gate(x)
    out, expected = q(x, ids, w), ref(x, ids, w)
    rel = (out - expected).norm() / expected.norm()
    assert rel < 1e-5, rel
    # and quantization error against the original float experts is that of 4-bit RTN, not garbage
    orig = block.experts(x, ids, w)
    assert 1e-4 < (out - orig).norm() / orig.norm() < 0.2


@torch.no_grad()
def test_awq_experts_bf16_and_every_expert_used():
    model = models.build("deepseek_v3")
    _, block = models.moe_blocks(model)[0]
    q = ForgeAWQExperts.from_hf(block.experts, group_size=32)
    E = q.num_experts
    x = torch.randn(E, model.config.hidden_size)
    ids = torch.stack([torch.arange(E), (torch.arange(E) + 3) % E], 1)  # every expert twice
    w = torch.rand(E, 2)
    gu, dn = q.dequantized_weights()
    expected = _hf_reference_experts(block.experts, gu.float(), dn.float())(x, ids, w)
    out = q(x.bfloat16(), ids, w)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).norm() / expected.norm() < 2e-2


def test_awq_experts_meta_and_shapes():
    q = ForgeAWQExperts(4, 64, 32, group_size=32, device="meta")
    shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in q.state_dict().items()}
    assert shapes == {
        "gate_up_qweight": ((4, 64, 8), "torch.int32"), "gate_up_scales": ((4, 2, 64), "torch.float16"),
        "gate_up_qzeros": ((4, 2, 8), "torch.int32"), "down_qweight": ((4, 32, 8), "torch.int32"),
        "down_scales": ((4, 1, 64), "torch.float16"), "down_qzeros": ((4, 1, 8), "torch.int32")}


def test_awq_experts_bad_dims():
    with pytest.raises(ValueError, match="intermediate_size=48 is not divisible by group_size=32"):
        ForgeAWQExperts(4, 64, 48, group_size=32, device="meta")
