"""ForgeMoE.use_fused_decode: the shared expert as expert id E of the grouped expert kernels, DeepSeek-V3 routing in
one op; same output as the unfused block (the fused path sums the shared expert with the routed ones in fp32)."""
import copy

import pytest
import torch

from tests import models
from torchforge.nn import ForgeAWQExperts, ForgeAWQLinear, ForgeMoE
from torchforge.ops._ext import has_cuda_ext

G = 64  # the mma layout folds groups of 64 or 128; hidden 64 and expert intermediate 64 fit


def quantized_block(arch: str, seed: int = 0, dtype=torch.float32, device="cpu", **cfg):
    model = models.build(arch, seed=seed, dtype=dtype, moe_intermediate_size=64, **cfg)
    _, block = models.moe_blocks(model)[0]
    block = block.to(device)
    shared = block.shared_experts
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(shared, name, ForgeAWQLinear.from_linear(getattr(shared, name), group_size=G))
    return ForgeMoE.from_hf(block, ForgeAWQExperts.from_hf(block.experts, group_size=G)), model.config


def fused_copy(block):
    import torchforge

    fused = copy.deepcopy(block)
    torchforge.use_mma_layout(fused, fused_moe=False)
    return fused, fused.use_fused_decode()


@pytest.mark.parametrize("arch,router", [("deepseek_v3", True), ("deepseek_v2", False)])
@torch.no_grad()
def test_fused_decode_equals_the_block(arch, router):
    block, cfg = quantized_block(arch)
    fused, ok = fused_copy(block)
    assert ok and fused.fused_decode and fused.fused_router == router
    # symmetric codes (from_linear / from_hf default): the kernels are told not to read the zero points
    assert fused.fused_shared_gate_up_zeros_are_8 and fused.experts.zeros_are_8
    assert fused.fused_shared_gate_up_qweight.shape == (2 * 64 // 64, cfg.hidden_size * 8)
    assert sorted(fused.state_dict()) == sorted(block.state_dict())  # the fused copy is not saved
    for T in (1, 7):
        x = torch.randn(2, T, cfg.hidden_size)
        torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-6)



@torch.no_grad()
def test_shared_down_loaded_alone_with_other_zero_points():
    """The fused path reads the shared expert's down projection in place: asymmetric zero points loaded into it alone
    reach the kernels as zeros read (on the CPU a wrong symmetric=True would raise), and the block still matches."""
    block, cfg = quantized_block("deepseek_v3")
    fused, _ = fused_copy(block)
    down = fused.shared.down_proj
    asym = ForgeAWQLinear.from_linear(torch.nn.Linear(down.in_features, down.out_features, bias=False), group_size=G,
                                      symmetric=False)
    down.load_state_dict(asym.state_dict())
    block.shared.down_proj.load_state_dict(asym.state_dict())
    assert not down.zeros_are_8 and fused.fused_shared_gate_up_zeros_are_8
    x = torch.randn(3, cfg.hidden_size)
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_when_the_block_runs_unfused(monkeypatch):
    """Autograd, prefill-size token counts and a hooked router (router statistics) keep the unfused path or HF's
    router call, with the same results."""
    from torchforge.nn.moe_fused_decode import FUSED_DECODE_MAX_TOKENS

    block, cfg = quantized_block("deepseek_v3")
    fused, _ = fused_copy(block)
    x = torch.randn(3, cfg.hidden_size)
    expected = block(x)
    real = fused._forward_fused
    monkeypatch.setattr(fused, "_forward_fused", lambda *a: pytest.fail("fused path taken"))
    with torch.enable_grad():  # the fused ops have no backward
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-6)
    big = torch.randn(FUSED_DECODE_MAX_TOKENS + 1, cfg.hidden_size)
    torch.testing.assert_close(fused(big), block(big), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(fused, "_forward_fused", real)
    seen = []
    handle = fused.gate.register_forward_hook(lambda mod, inp, out: seen.append(out[2].shape))
    try:
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-6)
    finally:
        handle.remove()
    assert seen == [(3, cfg.num_experts_per_tok)]  # the hook saw HF's router output


@torch.no_grad()
def test_pruned_block_folds_the_shared_expert():
    from torchforge.nn import PrunedMoE

    block, cfg = quantized_block("deepseek_v3")
    row = torch.tensor([0, 1, -1, 2, 3, -1, 4, 5], dtype=torch.int32)  # 6 of 8 experts kept, 3 per group
    for mode in ("reroute", "drop"):
        pruned = PrunedMoE.from_block(block, row, mode=mode)
        fused, ok = fused_copy(pruned)
        assert ok and not fused.fused_router  # PrunedMoE keeps its own routing
        x = torch.randn(5, cfg.hidden_size)
        torch.testing.assert_close(fused(x), pruned(x), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_blocks_that_do_not_qualify_are_unchanged():
    block, _ = quantized_block("deepseek_v3")
    assert not copy.deepcopy(block).use_fused_decode()  # AWQ layout: use_mma_layout first
    qwen = ForgeMoE.from_hf(models.moe_blocks(models.build("qwen3_moe", moe_intermediate_size=64))[0][1])
    assert not qwen.use_fused_decode() and not qwen.fused_decode  # HF experts, no shared expert
    from torchforge.nn.moe_fused_decode import fold_reason

    fused, _ = fused_copy(block)
    assert fold_reason(fused.experts, None, None) == "the block has no shared expert"
    fused.shared_experts.down_proj = torch.nn.Linear(64, 64, bias=False)
    assert "three bias-free ForgeAWQLinear" in fold_reason(fused.experts, fused.shared_experts, None)


@torch.no_grad()
def test_loading_weights_refreshes_the_fused_shared_expert():
    block, cfg = quantized_block("deepseek_v3", seed=0)
    other, _ = quantized_block("deepseek_v3", seed=1)
    fused, _ = fused_copy(block)
    fused.load_state_dict(other.state_dict())
    x = torch.randn(4, cfg.hidden_size)
    torch.testing.assert_close(fused(x), other(x), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda_ext(), reason="needs the compiled extension (csrc/) and a GPU")
@torch.no_grad()
def test_fused_decode_on_cuda_compiles_and_matches():
    """bf16 block on the GPU: the grouped kernels with the shared expert and the routing kernel, decode (direct) and
    sorted row counts; torch.compile(fullgraph=True) and CUDA-graph replay give the eager result."""
    from tests.ops.graph_check import check_compile_and_cuda_graph

    block, cfg = quantized_block("deepseek_v3", dtype=torch.bfloat16, device="cuda", hidden_size=256,
                                 n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    fused, ok = fused_copy(block)
    assert ok and fused.fused_router
    for T in (1, 3, 40):  # 40 tokens x 5 picks > 17 experts: rows sorted by expert
        x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
        out, ref = fused(x), block(x)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    check_compile_and_cuda_graph(fused, torch.randn(2, 256, device="cuda", dtype=torch.bfloat16))
    check_compile_and_cuda_graph(fused, torch.randn(40, 256, device="cuda", dtype=torch.bfloat16))  # sorted rows


@torch.no_grad()
def test_transformers_output_capture_hook_does_not_count():
    """transformers (5.23) installs an output-capture hook on every router once router logits are requested, and
    keeps it (inactive) afterwards; that alone must not turn the fused routing off."""
    from torchforge.nn.moe_fused_decode import router_is_hooked

    model = models.build("deepseek_v3")
    model(torch.randint(0, 96, (1, 4)), output_router_logits=True)  # installs the capture hooks
    gate = models.moe_blocks(model)[0][1].gate
    names = [getattr(h, "__name__", "") for h in gate._forward_hooks.values()]
    assert set(names) <= {"output_capturing_hook"}  # transformers 5.23 installs it here; 5.17 installs none
    assert not router_is_hooked(gate)
    handle = gate.register_forward_pre_hook(lambda *a: None)
    assert router_is_hooked(gate)
    handle.remove()


@torch.no_grad()
def test_fused_blocks_return_router_logits():
    """output_router_logits=True on a model whose MoE blocks are fused: transformers' capture hook is recording, so
    the block calls HF's router and the model returns every MoE layer's router logits, as the unfused model does;
    afterwards the (kept, inactive) hook leaves the fused routing on."""
    import torchforge
    from torchforge.nn.moe_fused_decode import router_is_hooked

    model = models.build("deepseek_v3", moe_intermediate_size=64, intermediate_size=128, q_lora_rank=64,
                         kv_lora_rank=64, v_head_dim=32)
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 64})
    ids = torch.randint(0, 96, (1, 5))
    expected = getattr(model(ids, output_router_logits=True), "router_logits", None)
    torchforge.use_mma_layout(model)
    blocks = [m for _, m in models.moe_blocks(model)]
    assert blocks and all(b.fused_decode and b.fused_router for b in blocks)
    out = model(ids, output_router_logits=True)
    if expected is None:  # transformers 5.17 records no router logits, fused or not
        assert getattr(out, "router_logits", None) is None
        return
    assert len(expected) == len(blocks) and len(out.router_logits) == len(blocks)
    for got, ref in zip(out.router_logits, expected):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert not any(router_is_hooked(b.gate) for b in blocks)  # outside a recording forward
    # compiled, the collector is a global that dynamo can read (ContextVar.get it cannot trace)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    got = compiled(ids, output_router_logits=True).router_logits
    assert len(got) == len(expected)
    for g, ref in zip(got, expected):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-4)
    assert compiled(ids).router_logits is None


@torch.no_grad()
def test_whole_model_after_use_mma_layout_generates_the_same():
    """torchforge.quantize then use_mma_layout on a tiny DeepSeek-V3: every MoE block fused, logits as before, and the
    greedy tokens of HF generate unchanged."""
    import torchforge

    model = models.build("deepseek_v3", moe_intermediate_size=64, intermediate_size=128, q_lora_rank=64,
                         kv_lora_rank=64, v_head_dim=32)
    torchforge.quantize(model, {"scheme": "w4a16-rtn", "group_size": 64})
    ids = torch.randint(0, 96, (2, 6))
    logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    torchforge.use_mma_layout(model)
    blocks = [m for _, m in models.moe_blocks(model)]
    assert blocks and all(isinstance(b, ForgeMoE) and b.fused_decode and b.fused_router for b in blocks)
    torch.testing.assert_close(model(ids).logits, logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
