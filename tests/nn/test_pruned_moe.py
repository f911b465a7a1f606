"""PrunedMoE: identity maps reproduce the HF block exactly, reroute picks only kept experts, drop gives pruned
picks weight 0, select_experts slices HF and AWQ experts, prune_experts swaps every block; clear errors."""
import copy

import pytest
import torch

import torchforge
from tests import models
from torchforge.nn import ForgeAWQExperts, ForgeMoE
from torchforge.nn.pruned_moe import PrunedMoE, select_experts, storage_order
from torchforge.prune import build_expert_map

RECIPE = {"scheme": "w4a16-rtn", "group_size": 32}


def _num_experts(model):
    return models.moe_blocks(model)[0][1].gate.weight.shape[0]


@pytest.mark.parametrize("mode", ["reroute", "drop"])
@pytest.mark.parametrize("arch", sorted(models.MOE_BUILDERS))
@torch.no_grad()
def test_identity_map_equals_hf_block(arch, mode):
    model = models.build(arch)
    E, blocks = _num_experts(model), models.moe_blocks(model)
    identity = torch.arange(E, dtype=torch.int32).repeat(len(blocks), 1)
    pruned = torchforge.prune_experts(copy.deepcopy(model), identity, mode=mode)
    pruned_blocks = models.moe_blocks(pruned)
    x = torch.randn(3, 5, model.config.hidden_size)
    for (_, block), (_, pb) in zip(blocks, pruned_blocks):
        assert isinstance(pb, PrunedMoE) and pb.mode == mode
        assert torch.equal(pb(x), block(x))
        assert sorted(pb.state_dict()) == sorted(block.state_dict())  # same checkpoint names
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    assert torch.equal(pruned(ids).logits, model(ids).logits)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
@torch.no_grad()
def test_all_kept_in_another_compact_order(arch):
    """reroute stores experts by original id: exact. drop stores them in the map's compact order, so HF's
    grouped experts kernel sums in another order: equal up to rounding."""
    model = models.build(arch)
    E, (_, block) = _num_experts(model), models.moe_blocks(model)[-1]
    row = build_expert_map(torch.rand(1, E), keep_k=E)[0]
    assert not torch.equal(row, torch.arange(E, dtype=torch.int32))
    x = torch.randn(4, 6, model.config.hidden_size)
    assert torch.equal(PrunedMoE.from_block(block, row, "reroute")(x), block(x))
    torch.testing.assert_close(PrunedMoE.from_block(block, row, "drop")(x), block(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", sorted(models.MOE_BUILDERS))
@torch.no_grad()
def test_reroute_picks_only_kept_experts(arch):
    model = models.build(arch)
    E, (_, block) = _num_experts(model), models.moe_blocks(model)[-1]
    top_k = block.gate.top_k
    row = build_expert_map(torch.rand(1, E), keep_k=max(top_k, E // 2))[0]
    pb = PrunedMoE.from_block(block, row, "reroute")
    x = torch.randn(40, model.config.hidden_size)
    ids, w = pb.route(x)
    assert bool((row[ids] >= 0).all())
    assert all(len(set(r)) == top_k for r in ids.tolist())
    slots, w2 = pb.remap(ids, w)
    assert torch.equal(w2, w) and bool((slots < pb.num_kept).all())
    # row j of the experts module is original expert kept_original_ids()[j]
    assert torch.equal(pb.kept_original_ids()[slots], ids)
    assert torch.equal(pb.experts.gate_up_proj, block.experts.gate_up_proj[pb.kept_original_ids()])


def _hf_with_masked_weights(block, x, row, renormalize=False):
    """Reference for drop: HF's router and experts over ALL experts, pruned picks' weights set to 0."""
    x2 = x.reshape(-1, x.shape[-1])
    _, w, ids = block.gate(x2)
    pruned = row.long()[ids] < 0
    w_kept = w.masked_fill(pruned, 0)
    if renormalize:
        s = w_kept.sum(-1, keepdim=True)
        w_kept = torch.where(s > 0, w_kept * (w.sum(-1, keepdim=True) / s.clamp_min(1e-30)), 0)
    out = block.experts(x2, ids, w_kept)
    if getattr(block, "shared_experts", None) is not None:
        out = out + block.shared_experts(x2)
    return out.reshape(x.shape), ids, w, w_kept


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral"])
@torch.no_grad()
def test_drop_gives_pruned_picks_weight_zero(arch, renormalize):
    model = models.build(arch)
    E, (_, block) = _num_experts(model), models.moe_blocks(model)[-1]
    row = build_expert_map(torch.rand(1, E), keep_k=max(1, E // 4))[0]
    pb = PrunedMoE.from_block(block, row, "drop", renormalize=renormalize)
    x = torch.randn(2, 30, model.config.hidden_size)
    expected, ids, w, w_kept = _hf_with_masked_weights(block, x, row, renormalize)
    got_ids, got_w = pb.remap(*pb.route(x.reshape(-1, x.shape[-1])))
    pruned = row.long()[ids] < 0
    assert bool(pruned.any()) and bool((~pruned).any())
    assert bool((got_w[pruned] == 0).all()) and bool((got_ids[pruned] == 0).all())
    torch.testing.assert_close(got_w, w_kept, rtol=1e-6, atol=0)
    if renormalize:  # kept weights carry the total of all picks; all-pruned tokens get nothing
        some = (~pruned).any(-1)
        torch.testing.assert_close(got_w.sum(-1)[some], w.sum(-1)[some])
        assert bool((got_w.sum(-1)[~some] == 0).all())
    torch.testing.assert_close(pb(x), expected, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_prune_after_quantize():
    model = torchforge.quantize(models.build("deepseek_v3"), RECIPE)
    _, block = models.moe_blocks(model)[0]
    assert isinstance(block, ForgeMoE) and isinstance(block.experts, ForgeAWQExperts)
    x = torch.randn(2, 7, model.config.hidden_size)
    for mode in ("reroute", "drop"):
        pb = PrunedMoE.from_block(block, torch.arange(8, dtype=torch.int32), mode)
        assert torch.equal(pb(x), block(x))
    row = torch.tensor([-1, 0, -1, 1, 2, -1, -1, 3], dtype=torch.int32)
    pb = PrunedMoE.from_block(block, row, "reroute")
    assert isinstance(pb.experts, ForgeAWQExperts) and pb.experts.num_experts == 4
    assert torch.equal(pb.experts.down_qweight, block.experts.down_qweight[[1, 3, 4, 7]])


def test_select_experts_hf_and_awq():
    model = models.build("qwen3_moe")
    experts = models.moe_blocks(model)[0][1].experts
    before = experts.gate_up_proj.detach().clone()
    sel = select_experts(experts, [5, 0, 2])
    assert sel.num_experts == 3 and type(sel) is type(experts)
    assert torch.equal(sel.gate_up_proj, before[[5, 0, 2]])
    assert torch.equal(sel.down_proj, experts.down_proj[[5, 0, 2]])
    assert isinstance(sel.gate_up_proj, torch.nn.Parameter)
    assert sel.config is experts.config  # shared: HF reads _experts_implementation from it
    assert experts.num_experts == 8 and torch.equal(experts.gate_up_proj, before)  # original untouched
    q = ForgeAWQExperts.from_hf(experts, group_size=32)
    qs = select_experts(q, torch.tensor([7, 1]))
    assert qs.num_experts == 2 and torch.equal(qs.gate_up_scales, q.gate_up_scales[[7, 1]])
    with pytest.raises(ValueError, match=r"original_ids \[8\] must lie in \[0, 8\)"):
        select_experts(experts, [8])
    with pytest.raises(ValueError, match="duplicates"):
        select_experts(experts, [1, 1])


def test_storage_order():
    row = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    assert storage_order(row, "drop").tolist() == [2, 3, 0]  # compact id order
    assert storage_order(row, "reroute").tolist() == [0, 2, 3]  # ascending original id


def test_meta_construction_and_to_empty():
    """load_quantized builds PrunedMoE on the meta device and then calls to_empty: the map must survive."""
    with torch.device("meta"):
        model = models.deepseek_v3()
    row = torch.tensor([-1, 0, -1, 1, 2, -1, -1, 3], dtype=torch.int32)
    torchforge.prune_experts(model, row[None], mode="reroute")
    model.to_empty(device="cpu")
    pb = models.moe_blocks(model)[0][1]
    assert torch.equal(pb.expert_map_row, row) and pb.slot_map.tolist() == [-1, 0, -1, 1, 2, -1, -1, 3]
    assert pb.kept.ids.tolist() == [1, 3, 4, 7] and pb.experts.gate_up_proj.shape[0] == 4


def test_errors():
    model = models.build("deepseek_v3")
    _, block = models.moe_blocks(model)[0]
    row = torch.tensor([0, -1, -1, -1, -1, -1, -1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="mode='reroute' needs at least top_k=2 kept experts per layer, the map "
                                         "keeps 1"):
        PrunedMoE.from_block(block, row, "reroute")
    PrunedMoE.from_block(block, row, "drop")  # drop works with a single expert
    with pytest.raises(ValueError, match="renormalize=True applies to mode='drop'"):
        PrunedMoE.from_block(block, torch.arange(8, dtype=torch.int32), "reroute", renormalize=True)
    with pytest.raises(ValueError, match="mode='keep'; choose 'reroute'"):
        PrunedMoE.from_block(block, torch.arange(8, dtype=torch.int32), "keep")
    with pytest.raises(ValueError, match="the expert-map row has 4 entries but the block has 8 routed experts"):
        PrunedMoE.from_block(block, torch.arange(4, dtype=torch.int32), "drop")
    with pytest.raises(ValueError, match=r"expert_map has shape \(2, 8\) but the model has 1 MoE blocks "
                                         r"\(model.layers.1.mlp, ...\) with 8 routed experts: expected \(1, 8\)"):
        torchforge.prune_experts(model, torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="compact ids are"):
        torchforge.prune_experts(model, torch.zeros(1, 8, dtype=torch.int32))
    torchforge.prune_experts(model, torch.arange(8, dtype=torch.int32)[None], mode="drop")
    with pytest.raises(ValueError, match="already pruned"):
        torchforge.prune_experts(model, torch.arange(8, dtype=torch.int32)[None])
    with pytest.raises(ValueError, match="has no MoE blocks"):
        torchforge.prune_experts(models.build("llama"), torch.zeros(1, 8, dtype=torch.int32))


@pytest.mark.parametrize("mode", ["drop", "reroute"])
def test_pruned_moe_traces_without_graph_breaks(mode):
    """Dynamo captures the whole pruned block (backend="eager": the trace is the test, no inductor compile)."""
    from torchforge.prune import prune_experts

    model = models.build("deepseek_v3")
    prune_experts(model, torch.tensor([[0, 1, -1, -1, 2, 3, -1, -1]], dtype=torch.int32), mode=mode)
    block = model.model.layers[1].mlp
    x = torch.randn(1, 5, 64)
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), block(x))


@pytest.mark.parametrize("mode", ["drop", "reroute"])
def test_pruned_moe_backward_and_compile_with_grad(mode):
    """With autograd on (the router's weights require grad), eager backward and torch.compile both work: moe_remap
    has an autograd formula (it had none: compiling outside no_grad failed)."""
    from torchforge.prune import prune_experts

    model = models.build("deepseek_v3")
    prune_experts(model, torch.tensor([[0, 1, -1, -1, 2, 3, -1, -1]], dtype=torch.int32), mode=mode)
    block = model.model.layers[1].mlp
    x = torch.randn(1, 5, 64, requires_grad=True)
    block(x).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    assert grads and x.grad is not None
    block.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    torch.compile(block, backend="eager")(x2).square().sum().backward()
    for n, p in block.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-6)


def test_reroute_router_hooks_fire():
    """Reroute routing reads the router's weights without calling it: its hooks (a user's hook, transformers'
    capture for output_router_logits) never ran, so the aux loss raised IndexError and router stats were zeros."""
    from torchforge.calibration import collect_router_stats
    from torchforge.prune import build_expert_map, prune_experts

    model = models.build("qwen3_moe")
    prune_experts(model, build_expert_map(torch.rand(2, 8), keep_k=4), mode="reroute")
    ids = torch.randint(0, 96, (2, 5))
    seen = []
    handle = models.moe_blocks(model)[0][1].gate.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    model(ids)
    handle.remove()
    assert seen == [10]
    out = model(ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (10, 8)  # all original experts
    assert torch.isfinite(out.aux_loss)
    # the hooked router's picks are HF's over all original experts, not the block's: router stats refuse them
    with pytest.raises(ValueError, match="is a PrunedMoE .*Collect router statistics on the unpruned model"):
        collect_router_stats(model, [ids])
