"""Optional tensor arguments on another device than x are errors that name them (a meta bias gave garbage on the
CPU path; on CUDA a CPU bias would reach the kernel as a host pointer), and the messages name the right op / value."""
import pytest
import torch

from torchforge.ops import (awq_moe_gemm, awq_quantize, gptq_unpack, nvfp4_linear, nvfp4_quantize,
                            qmeta4_build, qmeta4_mse_refine, w4a16_gptq_linear, w4a16_linear)
from torchforge.ops.gptq import gptq_pack, gptq_pack_zeros, trivial_g_idx

META = torch.device("meta")


def test_bias_input_scale_and_grid_on_another_device():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    x = torch.randn(3, 64, generator=g)
    q, s, z = awq_quantize(w, 32)
    with pytest.raises(ValueError, match="w4a16_linear: bias is on meta but x is on cpu"):
        w4a16_linear(x, q, s, z, 32, torch.ones(32, device=META))
    codes = torch.randint(0, 16, (64, 32), generator=g).to(torch.uint8)
    gq, gs, gz = gptq_pack(codes), torch.rand(2, 32, generator=g).half() + 0.01, torch.full((2, 4), 0x77777777)
    gz = gz.to(torch.int32)
    with pytest.raises(ValueError, match="w4a16_gptq_linear: bias is on meta but x is on cpu"):
        w4a16_gptq_linear(x, gq, gs, gz, trivial_g_idx(64, 32), torch.ones(32, device=META))
    with pytest.raises(TypeError, match="w4a16_gptq_linear: bias must be float16/bfloat16/float32, got torch.int64"):
        w4a16_gptq_linear(x, gq, gs, gz, trivial_g_idx(64, 32), torch.ones(32, dtype=torch.long))
    packed, scales, ws2 = nvfp4_quantize(w)
    with pytest.raises(ValueError, match="nvfp4_linear: input_scale is on meta but x is on cpu"):
        nvfp4_linear(x, packed, scales, ws2, torch.tensor(0.01, device=META))
    with pytest.raises(ValueError, match="nvfp4_linear: bias is on meta but x is on cpu"):
        nvfp4_linear(x, packed, scales, ws2, None, torch.ones(32, device=META))
    qm = qmeta4_build(w, 16, 4, True)
    with pytest.raises(ValueError, match="qmeta4_mse_refine: grid is on meta but weight is on cpu"):
        qmeta4_mse_refine(w, qm, 16, 4, grid=torch.linspace(0.5, 1, 4, device=META), norm=2.0)


def test_messages_name_the_op_and_a_bad_value():
    g = torch.Generator().manual_seed(1)
    q, s, z = awq_quantize(torch.randn(3, 32, 64, generator=g), 32)
    with pytest.raises(ValueError, match=r"awq_moe_gemm: expert_ids has 1 values outside \[0, 3\) \(e\.g\. 5\)"):
        awq_moe_gemm(torch.randn(2, 64, generator=g), torch.tensor([0, 5]), q, s, z, 32, 1)
    with pytest.raises(ValueError, match=r"1 of 3 values are not \(e\.g\. -0\.0199"):  # quoted the first, valid one
        nvfp4_quantize(torch.randn(3, 32, 64, generator=g), torch.tensor([0.01, -0.02, 0.03]))


def test_gptq_layout_checks():
    with pytest.raises(ValueError, match=r"gptq_unpack: qweight must be \[\.\.\., IC // 8, OC\], got shape \(4,\)"):
        gptq_unpack(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="gptq_pack_zeros: zeros must be .* OC divisible by 8"):
        gptq_pack_zeros(torch.full((4, 4), 8, dtype=torch.uint8))


def test_zero_input_features_give_zeros_plus_bias(monkeypatch):
    import torchforge.ops.awq as awq

    monkeypatch.setattr(awq, "_kernel_ok", lambda x, g: True)  # as on CUDA: its dispatch divided by IC
    x = torch.zeros(3, 0)
    q, s, z = torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, 32).half(), torch.zeros(0, 4, dtype=torch.int32)
    bias = torch.arange(32.0)
    assert torch.equal(w4a16_linear(x, q, s, z, 32, bias), bias.expand(3, 32))
