"""torchforge.quantize on every supported architecture built from its HF config."""
import pytest
import torch
from expecttest import assert_expected_inline

import torchforge
from tests import models
from torchforge.nn import ForgeAWQExperts, ForgeAWQLinear, ForgeMoE

RECIPE = {"scheme": "w4a16-rtn", "group_size": 32}


def _kinds(model):
    out = []
    for n, m in model.named_modules():
        if isinstance(m, (ForgeAWQLinear, ForgeAWQExperts, ForgeMoE, torch.nn.Linear)) or type(m).__name__.endswith("Experts"):
            out.append(f"{n}: {type(m).__name__}")
    return "\n".join(out)


def test_deepseek_v3_swapped_modules_pinned():
    model = models.build("deepseek_v3")
    torchforge.quantize(model, RECIPE)
    assert_expected_inline(_kinds(model), """\
model.layers.0.self_attn.q_a_proj: ForgeAWQLinear
model.layers.0.self_attn.q_b_proj: ForgeAWQLinear
model.layers.0.self_attn.kv_a_proj_with_mqa: ForgeAWQLinear
model.layers.0.self_attn.kv_b_proj: Linear
model.layers.0.self_attn.o_proj: ForgeAWQLinear
model.layers.0.mlp.gate_proj: ForgeAWQLinear
model.layers.0.mlp.up_proj: ForgeAWQLinear
model.layers.0.mlp.down_proj: ForgeAWQLinear
model.layers.1.self_attn.q_a_proj: ForgeAWQLinear
model.layers.1.self_attn.q_b_proj: ForgeAWQLinear
model.layers.1.self_attn.kv_a_proj_with_mqa: ForgeAWQLinear
model.layers.1.self_attn.kv_b_proj: Linear
model.layers.1.self_attn.o_proj: ForgeAWQLinear
model.layers.1.mlp: ForgeMoE
model.layers.1.mlp.experts: ForgeAWQExperts
model.layers.1.mlp.shared_experts.gate_proj: ForgeAWQLinear
model.layers.1.mlp.shared_experts.up_proj: ForgeAWQLinear
model.layers.1.mlp.shared_experts.down_proj: ForgeAWQLinear
lm_head: Linear""")


@pytest.mark.parametrize("arch", sorted(models.ALL_BUILDERS))
def test_quantized_logits_close_to_float(arch):
    model = models.build(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        torchforge.quantize(model, RECIPE)
        out = model(ids).logits
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-3 < rel < 0.35, rel  # 4-bit RTN error on random weights: present, bounded
    n_quant = sum(isinstance(m, (ForgeAWQLinear, ForgeAWQExperts)) for m in model.modules())
    assert n_quant > 0
    if arch in models.MOE_BUILDERS:
        assert any(isinstance(m, ForgeAWQExperts) for m in model.modules())


def test_ignore_experts_keeps_hf_experts():
    model = models.build("qwen3_moe")
    torchforge.quantize(model, {**RECIPE, "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*mlp\\.experts$"]})
    assert not any(isinstance(m, (ForgeMoE, ForgeAWQExperts)) for m in model.modules())
    assert isinstance(model.model.layers[0].self_attn.q_proj, ForgeAWQLinear)


def test_unpaired_mla_projection_is_an_error():
    model = models.build("deepseek_v3")
    with pytest.raises(ValueError, match="kv_a_proj_with_mqa"):
        torchforge.quantize(model, {**RECIPE, "ignore": ["lm_head", "re:.*kv_b_proj$", "re:.*q_a_proj$"]})


def test_indivisible_layer_names_the_module():
    model = models.build("llama", vocab_size=96)
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 60, bias=False)  # OC=60: not a multiple of 8
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj.*out_features=60"):
        torchforge.quantize(model, RECIPE)


@pytest.mark.parametrize("scheme", ["w4a16-rtn", "nvfp4"])
def test_failed_quantize_leaves_the_model_unchanged(scheme):
    # qwen3_moe's experts have I = 32, which group 64 does not divide; the attention layers before them do fit. A
    # half-quantized model would make a retry with group 32 mix group sizes (an export error later).
    model = models.build("qwen3_moe")
    before = {n: type(m) for n, m in model.named_modules()}
    recipe = {"scheme": scheme, "group_size": 64} if scheme == "w4a16-rtn" else "nvfp4"
    if scheme == "nvfp4":  # NVFP4's blocks are 16 wide: make one layer's IC indivisible instead
        layer = model.model.layers[1].self_attn
        layer.o_proj = torch.nn.Linear(layer.o_proj.in_features - 8, layer.o_proj.out_features, bias=False)
    with pytest.raises(ValueError, match="the model is unchanged"):
        torchforge.quantize(model, recipe)
    assert {n: type(m) for n, m in model.named_modules()} == before
    # a NaN weight in the last layer: found before anything is swapped too
    model = models.build("qwen3_moe")
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[1, 2, 3] = float("nan")
    op = "awq_quantize" if scheme == "w4a16-rtn" else "nvfp4_quantize"  # the scheme's quantizer, not always AWQ's
    with pytest.raises(ValueError, match=rf"cannot quantize model\.layers\.1\.mlp\.experts: {op}: .*NaN.*unchanged"):
        torchforge.quantize(model, {"scheme": scheme, "group_size": 32} if scheme == "w4a16-rtn" else "nvfp4")
    assert {n: type(m) for n, m in model.named_modules()} == before


@pytest.mark.parametrize("scheme", ["w4a16-rtn", "nvfp4", "w4a16-gptq"])
def test_moe_block_with_a_router_not_named_gate_is_refused_before_any_swap(scheme):
    # PhiMoE (like GraniteMoE, Jamba, Llama4) names its router `router`: ForgeMoE cannot wrap the block. Found at the
    # swap, the attention layers before it were already quantized.
    model = models.phimoe()
    before = {n: type(m) for n, m in model.named_modules()}
    recipe = {"scheme": scheme, "group_size": 16, **({"export_format": "modelopt-nvfp4"} if scheme == "nvfp4" else {})}
    calib = torch.randint(0, 96, (2, 8)) if scheme == "w4a16-gptq" else None
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.mlp\.experts: PhimoeSparseMoeBlock .*"
                                         r"`router`.*'re:\.\*mlp\\\\\.experts\$'.*quantize_experts=False.*unchanged"):
        torchforge.quantize(model, recipe, calib_data=calib)
    assert {n: type(m) for n, m in model.named_modules()} == before


@pytest.mark.parametrize("scheme", ["w4a16-rtn", "nvfp4", "w4a16-gptq"])
def test_a_router_named_router_is_never_quantized(scheme):
    # PhiMoE's `mlp.router` is an nn.Linear subclass: "Linear" targets it; the default ignores keep it (a quantized
    # router returns a tensor where the block unpacks (logits, weights, ids)).
    model = models.phimoe()
    ids = torch.randint(0, 96, (1, 8))
    recipe = {"scheme": scheme, "group_size": 16, "quantize_experts": False,
              **({"export_format": "modelopt-nvfp4"} if scheme == "nvfp4" else {})}
    torchforge.quantize(model, recipe, calib_data=ids if scheme == "w4a16-gptq" else None)
    assert type(model.model.layers[0].mlp.router).__name__ == "PhimoeTopKRouter"
    assert type(model.model.layers[0].self_attn.q_proj).__module__.startswith("torchforge")
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_from_hf_refuses_a_block_without_gate_with_a_value_error():
    block = models.phimoe().model.layers[0].mlp
    with pytest.raises(ValueError, match=r"PhimoeSparseMoeBlock .* no `gate` router module \(its router is `router`\)"):
        ForgeMoE.from_hf(block)


class _PerExpertMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(64, 32, bias=False)
        self.down_proj = torch.nn.Linear(32, 64, bias=False)


class _PerExpertMoE(torch.nn.Module):  # remote-code style: experts as a ModuleList of Linear MLPs
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([_PerExpertMLP() for _ in range(2)])
        self.shared_experts = _PerExpertMLP()


@pytest.mark.parametrize("scheme", ["w4a16-rtn", "nvfp4"])
def test_quantize_experts_false_keeps_per_expert_linears(scheme):
    model = _PerExpertMoE()
    recipe = torchforge.Recipe.from_preset(scheme).replace(quantize_experts=False)
    torchforge.quantize(model, recipe.replace(group_size=32) if scheme == "w4a16-rtn" else recipe)
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n.count(".") >= 1}
    quantized = "ForgeAWQLinear" if scheme == "w4a16-rtn" else "NVFP4Linear"
    assert kinds == {"experts.0": "_PerExpertMLP", "experts.0.gate_proj": "Linear", "experts.0.down_proj": "Linear",
                     "experts.1": "_PerExpertMLP", "experts.1.gate_proj": "Linear", "experts.1.down_proj": "Linear",
                     "shared_experts.gate_proj": quantized, "shared_experts.down_proj": quantized}


def test_compiled_moe_forward_has_no_graph_break():
    model = models.build("deepseek_v3")
    torchforge.quantize(model, RECIPE)
    block = model.model.layers[1].mlp
    x = torch.randn(1, 4, model.config.hidden_size)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)  # fullgraph: any graph break raises
    torch.testing.assert_close(compiled(x), block(x), rtol=1e-4, atol=1e-5)


def test_prune_then_quantize_equals_quantize_then_prune():
    """Quantization is per expert, so the two orders give bit-identical models; pruning survives quantize."""
    from torchforge.prune import build_expert_map, prune_experts
    from torchforge.prune.apply import PrunedMoE

    a, b = models.build("deepseek_v3"), models.build("deepseek_v3")
    hit = torch.arange(8, dtype=torch.float32).flip(0)[None]  # keep experts 0..3
    emap = build_expert_map(hit, keep_k=4)
    prune_experts(a, emap, mode="reroute")
    torchforge.quantize(a, RECIPE)
    torchforge.quantize(b, RECIPE)
    prune_experts(b, emap, mode="reroute")
    assert isinstance(a.model.layers[1].mlp, PrunedMoE) and isinstance(a.model.layers[1].mlp.experts, ForgeAWQExperts)
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_recipe_prune_section_prunes_then_quantizes(tmp_path):
    """One quantize call with a `prune` section equals prune_experts + quantize done by hand."""
    from torchforge.prune import build_expert_map, prune_experts

    hit = torch.rand(1, 8)
    torch.save({"hit_map": hit}, tmp_path / "hit.pt")
    recipe = torchforge.Recipe.from_dict({**RECIPE, "prune": {"hit_map": str(tmp_path / "hit.pt"), "keep_k": 4,
                                                              "mode": "drop"}})
    a, b = models.build("deepseek_v3"), models.build("deepseek_v3")
    torchforge.quantize(a, recipe)
    prune_experts(b, build_expert_map(hit, keep_k=4), mode="drop")
    torchforge.quantize(b, RECIPE)
    assert a.model.layers[1].mlp.experts.num_experts == 4
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_recipe_file_prune_paths_are_relative_to_the_file(tmp_path, monkeypatch):
    """A recipe file's hit_map was looked up relative to the working directory, not to the file."""
    (tmp_path / "cfg").mkdir()
    torch.save({"hit_map": torch.rand(1, 8)}, tmp_path / "cfg" / "hit.pt")
    (tmp_path / "cfg" / "r.yaml").write_text("scheme: w4a16-rtn\ngroup_size: 32\n"
                                             "prune:\n  hit_map: hit.pt\n  keep_k: 4\n  mode: drop\n")
    monkeypatch.chdir(tmp_path)
    model = torchforge.quantize(models.build("deepseek_v3"), "cfg/r.yaml")
    assert model.model.layers[1].mlp.experts.num_experts == 4


@pytest.mark.parametrize("scheme", ["w4a16-rtn", "w4a16-gptq", "nvfp4"])
def test_a_refused_quantize_leaves_the_model_unpruned(scheme, tmp_path):
    """The prune section runs after the scheme's checks: an error (here a group size the layers do not divide, or
    GPTQ without calibration data) leaves the model as it was, not pruned and unquantized."""
    from torchforge.nn.pruned_moe import PrunedMoE

    torch.save(torch.rand(1, 8), tmp_path / "hit.pt")
    base = {"w4a16-rtn": {"scheme": "w4a16-rtn", "group_size": 128},
            "w4a16-gptq": {"scheme": "w4a16-gptq", "group_size": 32},  # shapes pass; no calib_data
            "nvfp4": {"scheme": "nvfp4", "group_size": 16, "export_format": "modelopt-nvfp4"}}[scheme]
    model = models.build("deepseek_v3")
    if scheme == "nvfp4":  # NaN in one attention weight: its check fails
        model.model.layers[0].self_attn.o_proj.weight.data[0, 0] = float("nan")
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        before = model(ids).logits if scheme != "nvfp4" else None
    with pytest.raises(ValueError, match="the model is unchanged|needs calib_data|is not divisible"):
        torchforge.quantize(model, {**base, "prune": {"hit_map": str(tmp_path / "hit.pt"), "keep_k": 4}})
    assert not any(isinstance(m, PrunedMoE) for m in model.modules())
    if before is not None:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before)


def test_recipe_prune_section_bad_hit_map(tmp_path):
    torch.save(torch.rand(3, 8), tmp_path / "hit.pt")  # the model has one MoE layer, not 3
    recipe = {**RECIPE, "prune": {"hit_map": str(tmp_path / "hit.pt"), "keep_ratio": 0.5}}
    with pytest.raises(ValueError, match="hit"):
        torchforge.quantize(models.build("deepseek_v3"), recipe)


def test_recipe_prune_balance_groups_keeps_group_limited_routing(tmp_path):
    """balance_groups: as many experts kept in each routing group, so the reroute export keeps n_group."""
    hit = torch.tensor([[9.0, 8, 7, 6, 1, 2, 3, 0.5]])  # a plain top-4 would keep group 0 only
    torch.save(hit, tmp_path / "hit.pt")
    recipe = {**RECIPE, "prune": {"hit_map": str(tmp_path / "hit.pt"), "keep_k": 4, "balance_groups": True}}
    model = torchforge.quantize(models.build("deepseek_v3"), recipe)
    block = model.model.layers[1].mlp
    assert sorted(block.kept_original_ids().tolist()) == [0, 1, 5, 6]
    from torchforge.prune import pruned_config_changes

    assert pruned_config_changes(model) == {"n_routed_experts": 4}  # n_group / topk_group kept as they are
    plain = {**RECIPE, "prune": {"hit_map": str(tmp_path / "hit.pt"), "keep_k": 4}}
    assert pruned_config_changes(torchforge.quantize(models.build("deepseek_v3"), plain))["n_group"] == 1
    from torchforge.recipe import RecipeError

    with pytest.raises(RecipeError, match="balance_groups applies"):
        torchforge.Recipe.from_dict({**RECIPE, "prune": {"expert_map": "m.pt", "balance_groups": True}})


def test_failed_prune_leaves_the_model_unpruned_and_a_retry_prunes_every_layer():
    from torchforge.prune import build_expert_map, prune_experts

    model = models.build("qwen3_moe")  # two MoE layers, top-2
    blocks = lambda: [type(b).__name__ for _, b in models.moe_blocks(model)]  # noqa: E731
    before = blocks()
    bad = build_expert_map(torch.rand(2, 8), keep_k=[4, 1])  # reroute needs top_k = 2 kept in every layer
    with pytest.raises(ValueError, match=r"cannot prune model\.layers\.1\.mlp \(expert-map row 1\).*unchanged"):
        prune_experts(model, bad, mode="reroute")
    assert blocks() == before  # layer 0 was swapped before layer 1 failed
    prune_experts(model, build_expert_map(torch.rand(2, 8), keep_k=4), mode="reroute")
    assert blocks() == ["PrunedMoE", "PrunedMoE"]


def test_recipe_prune_on_a_pruned_model_needs_the_same_map(tmp_path):
    torch.save(torch.rand(1, 8), tmp_path / "hit.pt")
    prune = {"hit_map": str(tmp_path / "hit.pt"), "keep_k": 4, "mode": "drop"}
    from torchforge.prune import build_expert_map, prune_experts

    model = models.build("deepseek_v3")
    with pytest.raises(ValueError, match="the model is unchanged"):  # the experts' I = 32: group 64 fails the checks
        torchforge.quantize(model, {**RECIPE, "prune": prune, "group_size": 64})
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"  # checked before pruning: not pruned either
    prune_experts(model, build_expert_map(torch.load(tmp_path / "hit.pt"), keep_k=4), mode="drop")
    torchforge.quantize(model, {**RECIPE, "prune": prune})  # pruned by hand with the same map: kept as it is
    assert model.model.layers[1].mlp.experts.num_experts == 4
    assert isinstance(model.model.layers[1].mlp.experts, ForgeAWQExperts)
    other = prune_experts(models.build("deepseek_v3"), build_expert_map(torch.load(tmp_path / "hit.pt"), keep_k=4),
                          mode="drop")
    with pytest.raises(ValueError, match=r"already pruned \(model\.layers\.1\.mlp is a PrunedMoE, 1 of 1 MoE blocks\) "
                                         "with another expert map or mode"):
        torchforge.quantize(other, {**RECIPE, "prune": {**prune, "keep_k": 3}})


def test_a_second_quantize_is_refused(tmp_path):
    """A second recipe was a no-op on the swapped modules, yet it replaced the recorded recipe the exports describe;
    on a model from load_quantized (which records no recipe) it quantized the rest with other settings."""
    model = torchforge.quantize(models.build("llama"), {**RECIPE, "ignore": ["lm_head", "re:.*mlp.*"]})
    with pytest.raises(ValueError, match="already quantized \\(scheme 'w4a16-rtn'\\); quantize a fresh model"):
        torchforge.quantize(model, {**RECIPE, "group_size": 64})
    torchforge.save_quantized(model, str(tmp_path))
    reloaded = torchforge.load_quantized(str(tmp_path))
    with pytest.raises(ValueError, match=r"already quantized \(model\.layers\.0\.self_attn\.q_proj is a "
                                         r"ForgeAWQLinear\)"):
        torchforge.quantize(reloaded, {**RECIPE, "group_size": 64})


def test_a_tied_head_is_refused_in_both_paths(tmp_path):
    """lm_head tied to embed_tokens cannot be quantized apart: the in-memory export wrote lm_head.qweight that vLLM
    drops when it re-ties, and the streamed one left lm_head out without a word."""
    from torchforge.export.stream_quantize import quantize_checkpoint
    from torchforge.recipe import RecipeError

    recipe = {**RECIPE, "ignore": ["re:.*embed_tokens$"]}  # lm_head no longer ignored
    model = models.build("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(RecipeError, match="lm_head shares its weight with the input embeddings"):
        torchforge.quantize(model, recipe)
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    with pytest.raises(RecipeError, match="add 'lm_head' to the recipe's ignore list"):
        quantize_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"), recipe, device="cpu")
    assert not (tmp_path / "out").exists()
    torchforge.quantize(model, RECIPE)  # the default ignore list keeps lm_head
    assert isinstance(model.model.layers[0].mlp.up_proj, ForgeAWQLinear) and type(model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("scheme", ["w4a16-rtn", "w4a16-gptq", "nvfp4"])
def test_meta_weights_are_refused_before_any_swap(scheme):
    """A model whose weights are on the meta device (an empty skeleton, or accelerate's offload, whose hooks keep the
    weights) has nothing to quantize: refused with the fix, the model unchanged, instead of meta modules that fail at
    the first forward."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 256))
    model[2].to_empty(device="meta")
    with pytest.raises(ValueError, match=r"quantize: 2 parameters are on the meta device, e\.g\. 2\.weight, 2\.bias; "
                                         r"load the weights onto CPU or GPU first .* --stream"):
        torchforge.quantize(model, scheme)
    assert isinstance(model[0], torch.nn.Linear) and isinstance(model[2], torch.nn.Linear)
    model[2]._hf_hook = object()  # what accelerate's add_hook_to_module sets
    with pytest.raises(ValueError, match=r"accelerate hooks: it was loaded with device_map offload"):
        torchforge.quantize(model, scheme)
