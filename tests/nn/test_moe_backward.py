"""A quantized MoE model backpropagates to its inputs through its quantized experts (LoRA on the attention of a quantized
DeepSeek model): the gradient equals that of the same model whose experts are HF's float experts holding the
dequantized weights."""
import copy

import pytest
import torch

import torchforge
from tests import models
from torchforge.nn.pruned_moe import PrunedMoE, select_experts

RECIPES = {"awq": {"scheme": "w4a16-rtn", "group_size": 32}, "awq-asym": {"scheme": "w4a16-rtn", "group_size": 32,
                                                                          "symmetric": False}, "nvfp4": "nvfp4"}


def _float_experts_reference(quantized, original):
    """`quantized` with the routed experts of every MoE block replaced by HF's experts module of `original` holding
    the dequantized weights (the kept experts only, for a pruned block)."""
    ref = copy.deepcopy(quantized)
    for (_, block), (_, hf_block) in zip(models.moe_blocks(ref), models.moe_blocks(original)):
        n = hf_block.experts.gate_up_proj.shape[0]
        kept = block.kept_original_ids() if isinstance(block, PrunedMoE) else torch.arange(n)
        hf = select_experts(hf_block.experts, kept)
        gate_up, down = block.experts.dequantized_weights(torch.float32)
        hf.gate_up_proj.data.copy_(gate_up)
        hf.down_proj.data.copy_(down)
        block.experts = hf
    return ref


def _embedding_grad(model, tokens):
    emb = model.model.embed_tokens(tokens).detach().requires_grad_(True)
    out = model(inputs_embeds=emb).logits
    out.float().square().mean().backward()
    return out.detach().float(), emb.grad.float()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _check_against_reference(quantized, original, dtype, device="cpu"):
    ref = _float_experts_reference(quantized, original).to(device)
    quantized = quantized.to(device)
    tokens = torch.randint(0, original.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    out, grad = _embedding_grad(quantized, tokens)
    ref_out, ref_grad = _embedding_grad(ref, tokens)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert _rel(out, ref_out) < tol, _rel(out, ref_out)
    assert _rel(grad, ref_grad) < tol, _rel(grad, ref_grad)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_deepseek_v3_backpropagates_through_its_experts(recipe, dtype):
    original = models.build("deepseek_v3", dtype=dtype)
    quantized = torchforge.quantize(copy.deepcopy(original), RECIPES[recipe])
    assert any(type(b.experts).__name__ in ("ForgeAWQExperts", "NVFP4Experts") for _, b in models.moe_blocks(quantized))
    _check_against_reference(quantized, original, dtype)


def test_mma_layout_backpropagates_through_the_fused_experts_op():
    """Experts on the mma layout (dims and group size multiples of 64) take awq_mma_moe_experts in training too: the
    same gradients, and no conversion of the experts to the AWQ layout on the way."""
    original = models.build("deepseek_v3", hidden_size=128, moe_intermediate_size=64)
    recipe = {"scheme": "w4a16-rtn", "group_size": 64, "ignore": ["lm_head", "re:.*self_attn.*"]}  # MLA dims of 32
    quantized = torchforge.quantize(copy.deepcopy(original), recipe)
    assert torchforge.use_mma_layout(quantized) > 0
    experts = [b.experts for _, b in models.moe_blocks(quantized)]
    assert all(e.weight_layout == "mma" for e in experts)
    calls = []
    for e in experts:
        e.awq_qweights = lambda real=e.awq_qweights: calls.append(1) or real()
    ref = _float_experts_reference(quantized, original)  # (reads the AWQ-layout weights once, before the check)
    calls.clear()
    tokens = torch.randint(0, original.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    out, grad = _embedding_grad(quantized, tokens)
    assert not calls
    ref_out, ref_grad = _embedding_grad(ref, tokens)
    assert _rel(out, ref_out) < 1e-4 and _rel(grad, ref_grad) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["awq", "nvfp4"])
def test_backpropagates_on_cuda(recipe):
    """The same on the GPU in bf16: the CUDA / Triton forwards of the expert ops, and the backward's bf16 grouped
    GEMM."""
    original = models.build("deepseek_v3", dtype=torch.bfloat16)
    quantized = torchforge.quantize(copy.deepcopy(original), RECIPES[recipe])
    _check_against_reference(quantized, original, torch.bfloat16, "cuda")


@pytest.mark.parametrize("mode", ["drop", "reroute"])
def test_pruned_quantized_model_backpropagates(mode):
    original = models.build("deepseek_v3")
    quantized = torchforge.quantize(copy.deepcopy(original), RECIPES["awq"])
    # keep 5 of 8 experts (two of each routing group at least, as reroute's group-limited top-k needs)
    row = torch.tensor([[0, -1, 1, 2, -1, 3, 4, -1]], dtype=torch.int32)
    torchforge.prune_experts(quantized, row, mode=mode)
    assert all(isinstance(b, PrunedMoE) for _, b in models.moe_blocks(quantized))
    _check_against_reference(quantized, original, torch.float32)


def test_router_gradient_flows_through_the_quantized_experts():
    """The router's weight gets the gradient that the float-experts reference gives it (top-k weights requiring grad)."""
    original = models.build("deepseek_v3")
    quantized = torchforge.quantize(copy.deepcopy(original), RECIPES["awq"])
    ref = _float_experts_reference(quantized, original)
    tokens = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    grads = []
    for m in (quantized, ref):
        m.zero_grad()
        m(tokens).logits.square().mean().backward()
        grads.append(models.moe_blocks(m)[0][1].gate.weight.grad)
    assert grads[0].abs().sum() > 0
    assert _rel(grads[0], grads[1]) < 1e-4
