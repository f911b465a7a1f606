"""Input gradients of the quantized linear ops: grad_x = grad_y @ W (W dequantized in fp32), grad_bias = sum grad_y,
against autograd through a plain F.linear on the dequantized weight."""
import pytest
import torch
import torch.nn.functional as F

import torchforge
from torchforge import ops
from torchforge.nn import ForgeAWQLinear, ForgeGPTQLinear, NVFP4Linear


def _modules():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 128)  # the mma layout takes multiples of 64 (dims and group size)
    awq = ForgeAWQLinear.from_linear(lin, group_size=64)
    mma = ForgeAWQLinear.from_linear(lin, group_size=64)
    assert mma.use_mma_layout()
    return {"w4a16_linear": awq, "awq_mma_linear": mma, "w4a16_gptq_linear": ForgeGPTQLinear.from_linear(lin, group_size=64),
            "nvfp4_linear": NVFP4Linear.from_linear(lin)}


@pytest.mark.parametrize("name", ["w4a16_linear", "awq_mma_linear", "w4a16_gptq_linear", "nvfp4_linear"])
def test_input_and_bias_gradients(name):
    mod = _modules()[name]
    dtype = mod.bias.dtype
    x = torch.randn(2, 3, 128, dtype=dtype, requires_grad=True)
    bias = mod.bias.detach().clone().requires_grad_(True)
    mod.bias = bias  # a trainable bias beside the frozen codes
    y = mod(x)
    g = torch.randn_like(y)
    y.backward(g)
    w = mod.dequantized_weight(torch.float32)
    xr = x.detach().float().requires_grad_(True)
    br = bias.detach().float().requires_grad_(True)
    F.linear(xr, w, br).backward(g.float())
    torch.testing.assert_close(x.grad, xr.grad.to(dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad, br.grad.to(dtype), rtol=1e-5, atol=1e-5)


def test_a_model_with_quantized_layers_backpropagates_to_its_inputs():
    from tests import models

    model = torchforge.quantize(models.build("llama"), {"scheme": "w4a16-rtn", "group_size": 32})
    emb = model.model.embed_tokens(torch.randint(0, 96, (2, 6))).detach().requires_grad_(True)
    model(inputs_embeds=emb).logits.sum().backward()
    assert emb.grad is not None and torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0


def test_no_gradient_for_the_packed_weights():
    mod = _modules()["w4a16_linear"]
    x = torch.randn(4, 128, requires_grad=True)
    out = ops.w4a16_linear(x, mod.qweight, mod.scales.float().requires_grad_(True), mod.qzeros, 64, None)
    out.sum().backward()  # scales marked trainable get None, not an error
    assert x.grad is not None
