"""Exporting pruned models: reroute -> a standard smaller checkpoint stock transformers loads with identical
logits; drop -> expert_map.pt beside the checkpoint, restored by torchforge.load_quantized."""
import json
import logging
import os

import pytest
import torch
from expecttest import assert_expected_inline
from safetensors import safe_open

import torchforge
from tests import models
from torchforge.nn import ForgeMoE
from torchforge.nn.pruned_moe import PrunedMoE
from torchforge.prune import EXPERT_MAP_FILE, load_expert_map, pruned_config_changes, save_pruned
from torchforge.prune.export import _prune_meta

RECIPE = {"scheme": "w4a16-rtn", "group_size": 32}


def _map(kept_per_layer, E=8):
    rows = []
    for kept in kept_per_layer:
        row = torch.full((E,), -1, dtype=torch.int32)
        row[list(kept)] = torch.arange(len(kept), dtype=torch.int32)  # compact ids in the given (hit) order
        rows.append(row)
    return torch.stack(rows)


def _tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("arch, kept", [
    ("deepseek_v3", [[6, 1, 3, 4]]),  # 2 experts in each group of 4: n_group=2 survives
    ("qwen3_moe", [[7, 0, 2, 5], [1, 6, 3, 4]]),
])
@torch.no_grad()
def test_reroute_export_loads_in_stock_transformers_with_identical_logits(arch, kept, tmp_path):
    from transformers import AutoModelForCausalLM

    model = models.build(arch)
    gate = models.moe_blocks(model)[0][1].gate
    weight, bias = gate.weight.detach().clone(), getattr(gate, "e_score_correction_bias", None)
    torchforge.prune_experts(model, _map(kept), mode="reroute")
    save_pruned(model, str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    key = "n_routed_experts" if arch == "deepseek_v3" else "num_local_experts"
    assert cfg[key] == 4
    if arch == "deepseek_v3":
        assert (cfg["n_group"], cfg["topk_group"]) == (2, 1)
    tensors = _tensors(str(tmp_path))
    name = models.moe_blocks(model)[0][0]
    order = sorted(kept[0])  # exported experts: ascending original id
    assert torch.equal(tensors[f"{name}.gate.weight"], weight[order])
    if bias is not None:
        assert torch.equal(tensors[f"{name}.gate.e_score_correction_bias"], bias[order])
    I = model.config.moe_intermediate_size
    block = models.moe_blocks(model)[0][1]
    assert torch.equal(tensors[f"{name}.experts.1.down_proj.weight"], block.experts.down_proj[1])
    assert f"{name}.experts.4.down_proj.weight" not in tensors
    assert tensors[f"{name}.experts.0.gate_proj.weight"].shape == (I, model.config.hidden_size)
    meta = json.load(open(tmp_path / "torchforge.json"))["prune"]
    assert meta["mode"] == "reroute" and meta["kept_original_ids"] == [sorted(k) for k in kept]

    stock = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert not any(isinstance(m, PrunedMoE) for m in stock.modules())
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    assert torch.equal(stock(ids).logits, model(ids).logits)


def test_unequal_groups_fall_back_to_plain_top_k(tmp_path, caplog):
    model = models.build("deepseek_v3")
    torchforge.prune_experts(model, _map([[0, 1, 2, 5]]), mode="reroute")  # groups keep 3 and 1
    assert pruned_config_changes(model) == {"n_routed_experts": 4, "n_group": 1, "topk_group": 1}
    with caplog.at_level(logging.WARNING, logger="torchforge.prune.export"):
        save_pruned(model, str(tmp_path))
    assert "group-limited routing changed: groups keep unequal expert counts" in caplog.text
    cfg = json.load(open(tmp_path / "config.json"))
    assert (cfg["n_routed_experts"], cfg["n_group"], cfg["topk_group"]) == (4, 1, 1)
    assert "n_group 2 -> 1" in json.load(open(tmp_path / "torchforge.json"))["prune"]["group_routing"]


@torch.no_grad()
def test_fallback_config_with_more_than_32_kept_experts_in_one_group(tmp_path):
    """DeepSeek-V3's routing shape (256 experts in 8 groups of 32, topk_group 4, top_k 8) pruned to 200 experts in
    unequal groups: the export writes n_group = topk_group = 1, ONE group of 200 experts. vLLM runs that as plain
    top-k (no per-group size limit in its grouped_topk, fused or not: module docstring); so does transformers,
    checked here on the exported checkpoint. Equal groups of 25 keep n_group=8 (25 <= 32, the original's size)."""
    from transformers import AutoModelForCausalLM

    def build():
        return models.build("deepseek_v3", n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8)

    uniform = torchforge.prune_experts(build(), _map([[e for g in range(8) for e in range(32 * g, 32 * g + 25)]],
                                                     E=256), mode="reroute")
    model = build()
    kept = [e for g in range(8) for e in range(32 * g, 32 * g + (32 if g < 4 else 18))]  # 4 x 32 + 4 x 18
    torchforge.prune_experts(model, _map([kept], E=256), mode="reroute")
    save_pruned(model, str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    written = {k: cfg[k] for k in ("n_routed_experts", "n_group", "topk_group", "num_experts_per_tok")}
    assert_expected_inline("\n".join([
        f"uniform: {pruned_config_changes(uniform)}, {_prune_meta(uniform)['group_routing']}",
        f"unequal: {pruned_config_changes(model)}",
        f"config.json: {written}",
        f"group_routing: {json.load(open(tmp_path / 'torchforge.json'))['prune']['group_routing']}",
    ]), """\
uniform: {'n_routed_experts': 200}, preserved: n_group=8, topk_group=4, 25 experts per group
unequal: {'n_routed_experts': 200, 'n_group': 1, 'topk_group': 1}
config.json: {'n_routed_experts': 200, 'n_group': 1, 'topk_group': 1, 'num_experts_per_tok': 8}
group_routing: groups keep unequal expert counts [(32, 32, 32, 32, 18, 18, 18, 18)]; n_group 8 -> 1, topk_group 4 -> 1 (routing is no longer group-limited)""")

    # the exported router is plain top-k over the 200 experts: sigmoid, + bias for the choice, top 8, unbiased
    # weights renormalized and scaled
    gate = models.moe_blocks(AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32))[0][1].gate
    x = torch.randn(64, model.config.hidden_size)
    _, weights, ids = gate(x)
    scores = (x @ gate.weight.T).sigmoid()
    want_ids = (scores + gate.e_score_correction_bias).topk(8, dim=-1).indices.sort(dim=-1).values
    want = scores.gather(1, want_ids)
    want = want / (want.sum(-1, keepdim=True) + 1e-20) * model.config.routed_scaling_factor
    ids, order = ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, order), want)


@torch.no_grad()
def test_reroute_quantized_round_trip(tmp_path):
    model = torchforge.quantize(models.build("deepseek_v3", dtype=torch.bfloat16), RECIPE)
    torchforge.prune_experts(model, _map([[3, 0, 5, 6]]), mode="reroute")
    torchforge.save_quantized(model, str(tmp_path))
    assert not os.path.exists(tmp_path / EXPERT_MAP_FILE)
    cfg = json.load(open(tmp_path / "config.json"))
    assert (cfg["n_routed_experts"], cfg["n_group"]) == (4, 2)
    reloaded = torchforge.load_quantized(str(tmp_path))
    block = models.moe_blocks(reloaded)[0][1]
    assert type(block) is ForgeMoE and block.experts.num_experts == 4  # a standard smaller model
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert torch.equal(reloaded(ids).logits, model(ids).logits)


@torch.no_grad()
def test_drop_quantized_round_trip_with_per_layer_budgets(tmp_path):
    model = torchforge.quantize(models.build("qwen3_moe", dtype=torch.bfloat16), RECIPE)
    expert_map = _map([[5, 2, 7], [0, 1, 2, 3, 4, 6]])
    torchforge.prune_experts(model, expert_map, mode="drop", renormalize=True)
    torchforge.save_quantized(model, str(tmp_path))
    assert torch.equal(load_expert_map(tmp_path), expert_map)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["num_local_experts"] == 8  # the router keeps all its experts
    meta = json.load(open(tmp_path / "torchforge.json"))["prune"]
    assert meta["mode"] == "drop" and meta["renormalize"] is True and meta["num_kept"] == [3, 6]
    names = set(_tensors(str(tmp_path)))
    assert "model.layers.0.mlp.experts.2.down_proj.qweight" in names  # compact ids 0..2
    assert "model.layers.0.mlp.experts.3.down_proj.qweight" not in names
    reloaded = torchforge.load_quantized(str(tmp_path))
    blocks = [b for _, b in models.moe_blocks(reloaded)]
    assert all(isinstance(b, PrunedMoE) and b.mode == "drop" and b.renormalize for b in blocks)
    assert [b.num_kept for b in blocks] == [3, 6]
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_export_errors(tmp_path):
    model = models.build("qwen3_moe")
    assert pruned_config_changes(model) == {}
    torchforge.prune_experts(model, _map([[0, 1, 2], [0, 1, 2, 3]]), mode="reroute")
    with pytest.raises(ValueError, match=r"layers keep different expert counts \[3, 4\] but an HF config has one"):
        save_pruned(model, str(tmp_path))
    drop = torchforge.prune_experts(models.build("qwen3_moe"), _map([[0, 1]] * 2), mode="drop")
    with pytest.raises(ValueError, match="save_pruned: writes reroute-pruned models \\(this one is drop\\)"):
        save_pruned(drop, str(tmp_path))
    assert not os.path.exists(tmp_path / "config.json")


@pytest.mark.parametrize("how", ["save_pruned", "vllm-awq", "vllm-gptq", "modelopt-nvfp4"])
def test_refused_reroute_export_leaves_an_earlier_checkpoint_intact(how, tmp_path):
    """The checks run before the folder is touched: begin_folder would remove config.json and the shards would be
    overwritten, destroying the checkpoint already there."""
    good = models.build("qwen3_moe", dtype=torch.bfloat16)
    torchforge.prune_experts(good, _map([[0, 1, 2, 3]] * 2), mode="reroute")
    save_pruned(good, str(tmp_path))
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    bad = models.build("qwen3_moe", dtype=torch.bfloat16)
    if how != "save_pruned":
        bad = torchforge.quantize(bad, "nvfp4" if how == "modelopt-nvfp4" else RECIPE)
    torchforge.prune_experts(bad, _map([[0, 1, 2], [0, 1, 2, 3]]), mode="reroute")
    with pytest.raises(ValueError, match=r"layers keep different expert counts \[3, 4\]"):
        if how == "save_pruned":
            save_pruned(bad, str(tmp_path))
        else:
            torchforge.save_quantized(bad, str(tmp_path), format=how)
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before


def test_deepseek_v3_reroute_keeping_one_expert_is_refused(tmp_path):
    # HF's (and vLLM's) V3 router takes each group's top-2: a 1-expert checkpoint could not run after the export
    model = models.build("deepseek_v3", dtype=torch.bfloat16, num_experts_per_tok=1)
    torchforge.prune_experts(model, _map([[5]]), mode="reroute")
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, 5)))  # the in-memory PrunedMoE runs
    with pytest.raises(ValueError, match="scores a group by its top-2 experts"):
        save_pruned(model, str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode, instead", [("reroute", "use torchforge.prune.save_pruned"),
                                           ("drop", "quantize it .*and use torchforge.save_quantized")])
def test_save_pretrained_of_a_pruned_model_is_refused(mode, instead, tmp_path):
    """save_pretrained wrote config.json with the original n_routed_experts beside fewer experts per layer:
    from_pretrained failed, or loaded random experts with ignore_mismatched_sizes."""
    import copy
    import io

    model = torchforge.prune_experts(models.build("deepseek_v3"), _map([[6, 1, 3, 4]]), mode=mode)
    for save in (model.save_pretrained, model.push_to_hub):
        with pytest.raises(RuntimeError, match=f"original routed-expert count.*{instead}"):
            save(str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    torch.save(model, io.BytesIO())  # the guard pickles
    copy.deepcopy(model)
    if mode == "reroute":  # the savers named do not go through the refused method
        save_pruned(model, str(tmp_path / "pruned"))
        assert json.load(open(tmp_path / "pruned" / "config.json"))["n_routed_experts"] == 4
    torchforge.quantize(model, RECIPE)
    with pytest.raises(RuntimeError, match="use torchforge.save_quantized"):
        model.save_pretrained(str(tmp_path / "hf"))
    torchforge.save_quantized(model, str(tmp_path / "q"))
    reloaded = torchforge.load_quantized(str(tmp_path / "q"))
    with pytest.raises(RuntimeError, match="use torchforge.save_quantized"):
        reloaded.save_pretrained(str(tmp_path / "hf"))


def test_a_quantized_model_keeps_its_refusal_when_pruned(tmp_path):
    model = torchforge.quantize(models.build("deepseek_v3"), RECIPE)
    torchforge.prune_experts(model, _map([[6, 1, 3, 4]]), mode="reroute")
    with pytest.raises(RuntimeError, match="reloads with random weights in place of the quantized layers: use "
                                           "torchforge.save_quantized"):
        model.save_pretrained(str(tmp_path / "hf"))


def test_save_pruned_writes_the_generation_config(tmp_path):
    """save_pruned wrote no generation_config.json (and begin_folder removed an existing one): sampling settings
    and eos were lost on reload."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = models.build("deepseek_v3")
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.6
    model.generation_config.eos_token_id = 7
    torchforge.prune_experts(model, _map([[6, 1, 3, 4]]), mode="reroute")
    GenerationConfig(eos_token_id=3).save_pretrained(tmp_path)  # an earlier one in the folder: replaced
    save_pruned(model, str(tmp_path))
    gen = AutoModelForCausalLM.from_pretrained(tmp_path).generation_config
    assert (gen.do_sample, gen.temperature, gen.eos_token_id) == (True, 0.6, 7)
