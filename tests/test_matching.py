import expecttest
import pytest
import torch
from torch import nn

from torchforge.matching import (
    is_fused_experts,
    is_routed_expert,
    is_target,
    match_class,
    match_name,
    paired_modules_error,
    select_modules,
)
from torchforge.recipe import DEFAULT_IGNORE, Recipe, RecipeError


# --------------------------------------------------------------------- unit-level


def test_match_name_exact_and_regex():
    assert match_name("lm_head", "lm_head")
    assert not match_name("model.lm_head", "lm_head")  # exact names are full names
    assert match_name("model.layers.0.mlp.gate", r"re:.*mlp\.gate$")
    assert not match_name("model.layers.0.mlp.gate_proj", r"re:.*mlp\.gate$")
    # re.match: anchored at the start only ...
    assert not match_name("model.layers.0.mlp", "re:mlp")
    assert match_name("model.layers.0.mlp", "re:model")
    # ... so without `$` a regex also matches longer names.
    assert match_name("model.layers.0.mlp.down_proj", r"re:.*mlp")
    assert not match_name("model.layers.0.mlp.down_proj", r"re:.*mlp$")
    # A non-regex pattern is not a regex.
    assert not match_name("lm_head", "lm_.*")


class MyLinear(nn.Linear):
    pass


class LinearBase(nn.Module):  # stands in for vLLM's LinearBase
    pass


class RowParallelLinear(LinearBase):
    pass


def test_match_class_through_mro():
    lin, mine = nn.Linear(4, 4), MyLinear(4, 4)
    assert match_class(lin, "Linear") and match_class(mine, "Linear")
    assert match_class(mine, "MyLinear") and not match_class(lin, "MyLinear")
    assert match_class(lin, "Module")
    assert not match_class(lin, "object")  # only nn.Module classes count
    assert not match_class(nn.Embedding(4, 4), "Linear")
    assert match_class(RowParallelLinear(), "Linear")  # vLLM's LinearBase counts as Linear
    assert not match_class(lin, "re:.*")  # a regex never matches a class


class FakeExperts(nn.Module):
    def __init__(self, experts=4, hidden=8, inter=16):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, inter))


def test_fused_experts():
    experts = FakeExperts()
    assert is_fused_experts(experts)
    assert is_target("mlp.experts", experts, ["Linear"], [])
    assert not match_class(experts, "Linear")  # plain compressed-tensors semantics stay intact
    assert not is_target("mlp.experts", experts, ["Linear"], [r"re:.*mlp\.experts$"])
    assert not is_target("mlp.experts", experts, ["Linear"], ["Linear"])
    assert is_target("mlp.experts", experts, ["FakeExperts"], [])
    # A 2-D look-alike (an MLP with gate_up_proj/down_proj Linear children) is not fused experts.
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj = nn.Linear(8, 32), nn.Linear(16, 8)
    assert not is_fused_experts(mlp)
    assert not is_fused_experts(nn.Linear(4, 4))
    assert is_routed_expert("mlp.experts", experts)
    assert is_routed_expert("model.layers.1.mlp.experts.7.up_proj", nn.Linear(4, 4))
    assert not is_routed_expert("model.layers.1.mlp.shared_experts.up_proj", nn.Linear(4, 4))
    assert not is_routed_expert("model.layers.1.mlp.experts_norm", nn.Linear(4, 4))


def test_is_target_accepts_single_strings():
    lin = nn.Linear(4, 4)
    assert is_target("a.b", lin, "Linear", "re:x")
    assert not is_target("a.b", lin, "Linear", "a.b")
    assert not is_target("a.b", lin, [], [])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.custom = MyLinear(8, 8)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)


def _names(selected):
    return [n for n, _ in selected]


def test_select_modules_patterns():
    net = Net()
    every_linear = [
        f"layers.{i}.{leaf}" for i in range(2) for leaf in ("q_proj", "k_proj", "v_proj", "custom")
    ] + ["head"]
    assert _names(select_modules(net, ["Linear"])) == every_linear
    # Class patterns through the MRO: only the subclass.
    assert _names(select_modules(net, ["MyLinear"])) == ["layers.0.custom", "layers.1.custom"]
    # Exact names.
    assert _names(select_modules(net, ["head", "layers.1.k_proj"])) == ["layers.1.k_proj", "head"]
    # re: targets and ignores.
    assert _names(select_modules(net, [r"re:layers\.\d+\.(q|k)_proj$"])) == [
        "layers.0.q_proj", "layers.0.k_proj", "layers.1.q_proj", "layers.1.k_proj",
    ]
    assert _names(select_modules(net, ["Linear"], [r"re:layers\.0\.", "head", "MyLinear"])) == [
        "layers.1.q_proj", "layers.1.k_proj", "layers.1.v_proj",
    ]
    # Ignoring a parent does not ignore its children.
    assert "layers.0.q_proj" in _names(select_modules(net, ["Linear"], ["layers.0"]))
    # The root is never selected, even by "Module"; order is named_modules() order.
    assert _names(select_modules(net, ["Module"])) == [n for n, _ in net.named_modules() if n]
    # predicate
    assert _names(select_modules(net, ["Linear"], [], predicate=lambda n, m: n.endswith("v_proj"))) == [
        "layers.0.v_proj", "layers.1.v_proj",
    ]


def test_paired_modules_error_qkv():
    net = Net()
    all_names = [n for n, _ in net.named_modules()]
    assert paired_modules_error(_names(select_modules(net, ["Linear"])), all_names) is None
    err = paired_modules_error(_names(select_modules(net, ["Linear"], ["layers.1.v_proj"])), all_names)
    assert "layers.1.qkv_proj: quantized layers.1.q_proj, layers.1.k_proj; not quantized layers.1.v_proj" in err
    assert "layers.0" not in err


# -------------------------------------------------------------- tiny DeepSeek-V3


def tiny_deepseek_v3():
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=128,
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config)


@pytest.fixture(scope="module")
def deepseek():
    return tiny_deepseek_v3()


# What the default recipe quantizes in DeepSeek-V3, reasoned from the architecture:
# every MLA projection except kv_b_proj (dequantized by vLLM at load), the dense MLP of
# layer 0 (first_k_dense_replace=1), and in the MoE layer 1 the fused routed experts and
# the shared experts -- but not the router (mlp.gate, a DeepseekV3TopkRouter, and ignored
# anyway), the embeddings or lm_head.
_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
EXPECTED_DEEPSEEK = (
    [f"model.layers.0.self_attn.{p}" for p in _MLA]
    + [f"model.layers.0.mlp.{p}" for p in _MLP]
    + [f"model.layers.1.self_attn.{p}" for p in _MLA]
    + ["model.layers.1.mlp.experts"]
    + [f"model.layers.1.mlp.shared_experts.{p}" for p in _MLP]
)


def test_deepseek_default_selection(deepseek):
    recipe = Recipe.from_preset("w4a16-rtn")
    selected = recipe.select(deepseek)
    assert _names(selected) == EXPECTED_DEEPSEEK
    assert _names(select_modules(deepseek, recipe.targets, recipe.ignore)) == EXPECTED_DEEPSEEK
    experts = deepseek.get_submodule("model.layers.1.mlp.experts")
    assert type(experts).__name__ == "DeepseekV3Experts" and is_fused_experts(experts)
    for name, module in deepseek.named_modules():
        assert recipe.matches(name, module) == (name in EXPECTED_DEEPSEEK), name
    assert paired_modules_error(_names(selected), [n for n, _ in deepseek.named_modules()]) is None


def test_deepseek_without_experts(deepseek):
    by_flag = Recipe.from_preset("w4a16-rtn").replace(quantize_experts=False)
    by_ignore = Recipe.from_preset("w4a16-rtn").replace(ignore=list(DEFAULT_IGNORE) + [r"re:.*mlp\.experts$"])
    expected = [n for n in EXPECTED_DEEPSEEK if n != "model.layers.1.mlp.experts"]
    assert _names(by_flag.select(deepseek)) == expected
    assert _names(by_ignore.select(deepseek)) == expected


def test_deepseek_patterns(deepseek):
    all_names = [n for n, _ in deepseek.named_modules()]
    # Class names through the MRO: the router is its own class.
    assert _names(select_modules(deepseek, ["DeepseekV3TopkRouter"])) == ["model.layers.1.mlp.gate"]
    assert _names(select_modules(deepseek, ["Embedding"])) == ["model.embed_tokens"]
    # "Linear" without ignore: every nn.Linear plus the fused experts, lm_head and kv_b_proj included.
    everything = _names(select_modules(deepseek, ["Linear"]))
    assert "lm_head" in everything and "model.layers.0.self_attn.kv_b_proj" in everything
    assert "model.layers.1.mlp.experts" in everything and "model.layers.1.mlp.gate" not in everything
    # re: patterns.
    assert _names(select_modules(deepseek, [r"re:.*\.o_proj$"])) == [
        "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
    ]
    assert _names(select_modules(deepseek, ["Linear"], [r"re:model\.layers\.0\.", r"re:.*shared_experts", "lm_head"])) == [
        "model.layers.1.self_attn.q_a_proj", "model.layers.1.self_attn.q_b_proj",
        "model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.1.self_attn.kv_b_proj",
        "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.experts",
    ]
    # Exact names.
    assert _names(select_modules(deepseek, ["model.layers.1.mlp.experts", "lm_head"])) == [
        "model.layers.1.mlp.experts", "lm_head",
    ]
    assert set(everything) <= set(all_names)


def test_deepseek_pairing_error(deepseek):
    recipe = Recipe.from_preset("w4a16-rtn").replace(
        ignore=list(DEFAULT_IGNORE) + ["model.layers.0.self_attn.q_a_proj"]
    )
    selected = _names(select_modules(deepseek, recipe.targets, recipe.ignore))
    err = paired_modules_error(selected, [n for n, _ in deepseek.named_modules()])
    assert err is not None
    assert "model.layers.0.self_attn.q_a_proj" in err and "model.layers.0.self_attn.kv_a_proj_with_mqa" in err
    assert "model.layers.1" not in err
    with pytest.raises(RecipeError) as e:
        recipe.select(deepseek)
    assert str(e.value) == err
    # Ignoring both (here with the regex the message suggests) is consistent again.
    both = recipe.replace(ignore=list(DEFAULT_IGNORE) + [r"re:.*\.(kv_a_proj_with_mqa|q_a_proj)$"])
    names = _names(both.select(deepseek))
    assert not any("q_a_proj" in n or "kv_a_proj" in n for n in names)


class TestPinned(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_deepseek_v3()

    def test_default_selection_pinned(self):
        selected = Recipe.from_preset("w4a16-rtn").select(self.model)
        self.assertExpectedInline(
            "\n".join(f"{n}  {type(m).__name__}" for n, m in selected),
            """\
model.layers.0.self_attn.q_a_proj  Linear
model.layers.0.self_attn.q_b_proj  Linear
model.layers.0.self_attn.kv_a_proj_with_mqa  Linear
model.layers.0.self_attn.o_proj  Linear
model.layers.0.mlp.gate_proj  Linear
model.layers.0.mlp.up_proj  Linear
model.layers.0.mlp.down_proj  Linear
model.layers.1.self_attn.q_a_proj  Linear
model.layers.1.self_attn.q_b_proj  Linear
model.layers.1.self_attn.kv_a_proj_with_mqa  Linear
model.layers.1.self_attn.o_proj  Linear
model.layers.1.mlp.experts  DeepseekV3Experts
model.layers.1.mlp.shared_experts.gate_proj  Linear
model.layers.1.mlp.shared_experts.up_proj  Linear
model.layers.1.mlp.shared_experts.down_proj  Linear""",
        )

    def test_pairing_error_pinned(self):
        recipe = Recipe.from_preset("w4a16-rtn").replace(
            ignore=list(DEFAULT_IGNORE) + ["model.layers.0.self_attn.q_a_proj"]
        )
        selected = [n for n, _ in select_modules(self.model, recipe.targets, recipe.ignore)]
        self.assertExpectedInline(
            paired_modules_error(selected, [n for n, _ in self.model.named_modules()]),
            """\
modules that vLLM loads into one fused layer (one quantization method for all of them) must be quantized together or skipped together:
  - model.layers.0.self_attn.fused_qkv_a_proj: quantized model.layers.0.self_attn.kv_a_proj_with_mqa; not quantized model.layers.0.self_attn.q_a_proj. Either add model.layers.0.self_attn.kv_a_proj_with_mqa to `ignore` too, or make sure `targets` matches and `ignore` does not match model.layers.0.self_attn.q_a_proj.
To skip these groups in every layer, add to `ignore`: 're:.*\\.(kv_a_proj_with_mqa|q_a_proj)$'""",
        )
