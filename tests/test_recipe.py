import dataclasses
import json
import os
from pathlib import Path

import expecttest
import pytest
import torch
import yaml
from torch import nn

from torchforge.recipe import DEFAULT_IGNORE, SCHEMES, Recipe, RecipeError


def test_presets_load():
    # other schemes (nvfp4, issue 6) add their own presets after these
    assert Recipe.presets()[:3] == ["w4a16-rtn", "w4a16-rtn-asym", "w4a16-rtn-g64"]
    rtn = Recipe.from_preset("w4a16-rtn")
    assert (rtn.scheme, rtn.bits, rtn.group_size, rtn.symmetric) == ("w4a16-rtn", 4, 128, True)
    assert rtn == Recipe(scheme="w4a16-rtn")  # the preset is the defaults
    asym = Recipe.from_preset("w4a16-rtn-asym")
    assert (asym.group_size, asym.symmetric) == (128, False)
    g64 = Recipe.from_preset("w4a16-rtn-g64")
    assert (g64.group_size, g64.symmetric) == (64, True)
    for name in Recipe.presets():
        r = Recipe.from_preset(name)
        assert r.scheme in SCHEMES and r.ignore == DEFAULT_IGNORE and r.targets == ("Linear",)


def test_unknown_preset_lists_presets():
    with pytest.raises(RecipeError, match=r"unknown recipe preset 'w8a8'.*w4a16-rtn, w4a16-rtn-asym, w4a16-rtn-g64"):
        Recipe.from_preset("w8a8")


@pytest.mark.parametrize("name", Recipe.presets())
def test_dict_round_trip(name):
    r = Recipe.from_preset(name)
    d = r.to_dict()
    assert list(d) == [f.name for f in dataclasses.fields(Recipe)]
    assert isinstance(d["targets"], list) and isinstance(d["ignore"], list)
    assert json.loads(json.dumps(d)) == d  # plain JSON types only
    assert Recipe.from_dict(d) == r
    assert Recipe.from_dict(json.loads(json.dumps(d))) == r


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_file_round_trip(tmp_path, suffix):
    r = Recipe.from_preset("w4a16-rtn-asym").replace(
        ignore=list(DEFAULT_IGNORE) + [r"re:.*mlp\.experts$"], dtype="float16", quantize_experts=False
    )
    path = tmp_path / f"recipe{suffix}"
    assert r.to_file(path) == path
    assert Recipe.from_file(path) == r
    assert Recipe.from_file(str(path)) == r
    assert Recipe.coerce(path) == r and Recipe.coerce(str(path)) == r
    text = path.read_text()
    parsed = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    assert parsed == r.to_dict()
    # Atomic write leaves no temporary file behind, and overwriting works.
    r2 = r.replace(group_size=32)
    r2.to_file(path)
    assert Recipe.from_file(path) == r2
    assert sorted(os.listdir(tmp_path)) == [path.name]


def test_hand_written_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "scheme: w4a16-rtn\n"
        "group_size: 64\n"
        "ignore:\n"
        "  - lm_head\n"
        "  - 're:.*mlp\\.experts$'\n"
    )
    r = Recipe.from_file(path)
    assert r.group_size == 64 and r.ignore == ("lm_head", r"re:.*mlp\.experts$")
    assert r.targets == ("Linear",)


def test_file_errors(tmp_path):
    with pytest.raises(RecipeError, match=r"unsupported extension '\.toml'.*\.yaml, \.yml, \.json"):
        Recipe.from_preset("w4a16-rtn").to_file(tmp_path / "r.toml")
    with pytest.raises(RecipeError, match="cannot read recipe file"):
        Recipe.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RecipeError, match="not valid JSON"):
        Recipe.from_file(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- scheme\n")
    with pytest.raises(RecipeError, match="must be a mapping"):
        Recipe.from_file(lst)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("scheme: w4a16-rtn\ngroupsize: 64\n")
    with pytest.raises(RecipeError, match=r"unknown\.yaml.*unknown recipe key\(s\): 'groupsize'; valid keys: scheme, bits"):
        Recipe.from_file(unknown)


def test_unknown_keys_listed():
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({"scheme": "w4a16-rtn", "groupsize": 64, "zero_point": True})
    msg = str(e.value)
    assert "'groupsize', 'zero_point'" in msg
    assert "valid keys: scheme, bits, group_size, symmetric, targets, ignore, quantize_experts, export_format, dtype" in msg
    with pytest.raises(RecipeError, match="missing the required key 'scheme'"):
        Recipe.from_dict({"bits": 4})
    with pytest.raises(RecipeError, match="must be a mapping"):
        Recipe.from_dict(["scheme"])


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"scheme": "foo"}, r"Recipe\.scheme: invalid value 'foo' \(str\); allowed: one of 'w4a16-rtn'"),
        ({"scheme": "w4a16-awq"}, r"Recipe\.scheme: invalid value 'w4a16-awq'"),  # not implemented yet
        ({"bits": 3}, r"Recipe\.bits: invalid value 3 \(int\); allowed: 4 for scheme 'w4a16-rtn'"),
        ({"bits": 8}, r"Recipe\.bits: invalid value 8"),
        ({"bits": True}, r"Recipe\.bits: invalid value True \(bool\)"),
        ({"group_size": 100}, r"Recipe\.group_size: invalid value 100 \(int\); allowed: a power of two >= 16"),
        ({"group_size": 8}, r"Recipe\.group_size: invalid value 8"),
        ({"group_size": 0}, r"Recipe\.group_size: invalid value 0"),
        ({"group_size": -1}, r"Recipe\.group_size: invalid value -1 .*group_size=-1\) is not supported"),
        ({"group_size": "128"}, r"Recipe\.group_size: invalid value '128' \(str\)"),
        ({"group_size": 128.0}, r"Recipe\.group_size: invalid value 128\.0 \(float\)"),
        ({"symmetric": "yes"}, r"Recipe\.symmetric: invalid value 'yes' \(str\); allowed: True or False"),
        ({"symmetric": 1}, r"Recipe\.symmetric: invalid value 1 \(int\)"),
        ({"targets": ["Linear", 3]}, r"Recipe\.targets: invalid entry 3 \(int\) in \['Linear', 3\]"),
        ({"targets": "Linear"}, r"Recipe\.targets: invalid value 'Linear' \(str\); allowed: a list of strings"),
        ({"targets": []}, r"Recipe\.targets: invalid value \[\] .*\(at least one\)"),
        ({"targets": [""]}, r"Recipe\.targets: invalid entry ''"),
        ({"ignore": None}, r"Recipe\.ignore: invalid value None \(NoneType\)"),
        ({"ignore": ["re:(unclosed"]}, r"Recipe\.ignore: invalid regex in 're:\(unclosed'"),
        ({"quantize_experts": "false"}, r"Recipe\.quantize_experts: invalid value 'false'"),
        ({"export_format": "gguf"}, r"Recipe\.export_format: invalid value 'gguf' \(str\); allowed: one of 'vllm-awq'"),
        ({"dtype": "fp16"}, r"Recipe\.dtype: invalid value 'fp16' \(str\); allowed: one of 'bfloat16', 'float16', 'float32'"),
    ],
)
def test_bad_values(changes, pattern):
    base = Recipe.from_preset("w4a16-rtn")
    with pytest.raises(RecipeError, match=pattern):
        base.replace(**changes)
    with pytest.raises(RecipeError, match=pattern):
        Recipe.from_dict({**base.to_dict(), **changes})
    assert issubclass(RecipeError, ValueError)


@pytest.mark.parametrize("gs", [16, 32, 64, 128, 256, 1024])
def test_good_group_sizes(gs):
    assert Recipe(scheme="w4a16-rtn", group_size=gs).group_size == gs


def test_frozen_and_hashable():
    r = Recipe(scheme="w4a16-rtn", targets=["Linear"], ignore=["lm_head"])
    assert r.targets == ("Linear",) and r.ignore == ("lm_head",)  # lists stored as tuples
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.group_size = 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.targets = ("Embedding",)
    assert {r: 1}[Recipe(scheme="w4a16-rtn", targets=("Linear",), ignore=("lm_head",))] == 1


def test_replace():
    r = Recipe.from_preset("w4a16-rtn")
    r64 = r.replace(group_size=64)
    assert r64 == Recipe.from_preset("w4a16-rtn-g64") and r.group_size == 128
    assert r.replace(ignore=["lm_head"]).ignore == ("lm_head",)
    with pytest.raises(RecipeError, match=r"unknown recipe field\(s\): 'groupsize'; valid fields: scheme"):
        r.replace(groupsize=64)


def test_coerce(tmp_path):
    r = Recipe.from_preset("w4a16-rtn-g64")
    assert Recipe.coerce(r) is r
    assert Recipe.coerce("w4a16-rtn-g64") == r
    assert Recipe.coerce(r.to_dict()) == r
    assert Recipe.coerce({"scheme": "w4a16-rtn", "group_size": 64}) == r
    path = r.to_file(tmp_path / "r.json")
    assert Recipe.coerce(path) == r and Recipe.coerce(str(path)) == r
    with pytest.raises(RecipeError, match=r"'w4a16' is neither a recipe preset \(w4a16-rtn, "):
        Recipe.coerce("w4a16")
    with pytest.raises(RecipeError, match="cannot read recipe file"):
        Recipe.coerce(str(tmp_path / "nope.yaml"))
    with pytest.raises(RecipeError, match="cannot make a Recipe from int"):
        Recipe.coerce(4)


def test_torch_dtype():
    assert Recipe(scheme="w4a16-rtn").torch_dtype is torch.bfloat16
    assert Recipe(scheme="w4a16-rtn", dtype="float32").torch_dtype is torch.float32


class _MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)  # an old-style nn.Linear router
        self.shared_expert_gate = nn.Linear(8, 1, bias=False)
        self.experts = nn.ModuleList([nn.ModuleDict({"up_proj": nn.Linear(8, 16)}) for _ in range(2)])
        self.shared_expert = nn.ModuleDict({"up_proj": nn.Linear(8, 16)})


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 8)
        self.mlp = _MoEBlock()
        self.lm_head = nn.Linear(8, 10)


def test_recipe_matches_and_select():
    model = _Tiny()
    r = Recipe.from_preset("w4a16-rtn")
    names = [n for n, _ in r.select(model)]
    assert names == ["mlp.experts.0.up_proj", "mlp.experts.1.up_proj", "mlp.shared_expert.up_proj"]
    assert r.matches("mlp.shared_expert.up_proj", model.mlp.shared_expert.up_proj)
    assert not r.matches("mlp.gate", model.mlp.gate)
    assert not r.matches("lm_head", model.lm_head)
    no_experts = r.replace(quantize_experts=False)
    assert not no_experts.matches("mlp.experts.0.up_proj", model.mlp.experts[0].up_proj)
    assert [n for n, _ in no_experts.select(model)] == ["mlp.shared_expert.up_proj"]


class TestPinnedPreset(expecttest.TestCase):
    def test_preset_dict(self):
        self.assertExpectedInline(
            json.dumps(Recipe.from_preset("w4a16-rtn").to_dict(), indent=1),
            """\
{
 "scheme": "w4a16-rtn",
 "bits": 4,
 "group_size": 128,
 "symmetric": true,
 "targets": [
  "Linear"
 ],
 "ignore": [
  "lm_head",
  "re:.*embed_tokens$",
  "re:.*mlp\\\\.gate$",
  "re:.*\\\\.router$",
  "re:.*shared_expert_gate$",
  "re:.*self_attn\\\\.kv_b_proj$"
 ],
 "quantize_experts": true,
 "export_format": "vllm-awq",
 "dtype": "bfloat16",
 "prune": null
}""",
        )


def test_prune_section_round_trip_and_errors(tmp_path):
    from torchforge.recipe import PruneRecipe

    r = Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"hit_map": "hits.pt", "keep_ratio": 0.5}})
    assert isinstance(r.prune, PruneRecipe) and r.prune.mode == "reroute"
    path = tmp_path / "r.yaml"
    r.to_file(path)
    # a relative path in Python is relative to the working directory: to_file writes it absolute (in a file it
    # would be relative to the file's folder), which round-trips
    back = Recipe.from_file(path)
    assert back == r.replace(prune={**r.prune.to_dict(), "hit_map": str(Path.cwd() / "hits.pt")})
    assert Recipe.from_file(back.to_file(path)) == back
    with pytest.raises(RecipeError, match="unknown key"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"hit_map": "h.pt", "keep": 2}})
    with pytest.raises(RecipeError, match="exactly one of 'expert_map'"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"keep_k": 2}})
    with pytest.raises(RecipeError, match="keep_ratio"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"hit_map": "h.pt", "keep_ratio": 1.5}})
    with pytest.raises(RecipeError, match="prune.mode"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"expert_map": "m.pt", "mode": "zap"}})


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_prune_paths_in_a_recipe_file_are_relative_to_its_folder(tmp_path, monkeypatch, suffix):
    """They were used relative to the working directory, so a recipe file found its hit map or expert map only when
    run from the folder it was written for."""
    cfg, elsewhere = tmp_path / "cfg", tmp_path / "elsewhere"
    cfg.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    sections = {"hit": {"hit_map": "maps/hits.pt", "keep_k": 2}, "map": {"expert_map": "../em/expert_map.pt"},
                "absolute": {"hit_map": str(tmp_path / "h.pt"), "keep_k": 2}}
    for what, prune in sections.items():
        data = {"scheme": "w4a16-rtn", "prune": prune}
        path = cfg / f"{what}{suffix}"
        path.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
        given = prune.get("hit_map") or prune["expert_map"]
        for r in (Recipe.from_file(f"../cfg/{path.name}"), Recipe.coerce(path)):
            got = r.prune.hit_map or r.prune.expert_map
            assert os.path.isabs(got) and Path(got).resolve() == (cfg / given).resolve(), (what, got)
            assert r == Recipe.from_file(r.to_file(tmp_path / f"copy{suffix}"))  # absolute from here on
        assert (Recipe.from_dict(data).prune.hit_map or Recipe.from_dict(data).prune.expert_map) == given  # as given
    assert Recipe.from_file(cfg / f"absolute{suffix}").prune.hit_map == str(tmp_path / "h.pt")


def test_prune_section_rejects_settings_it_would_ignore_or_fail_on_later():
    # renormalize is a drop-mode setting: PrunedMoE rejects it for reroute, so the recipe does too, up front
    with pytest.raises(RecipeError, match="renormalize=True applies to mode='drop'"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"hit_map": "h.pt", "keep_k": 4, "renormalize": True}})
    assert Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"hit_map": "h.pt", "keep_k": 4, "mode": "drop",
                                                               "renormalize": True}}).prune.renormalize
    # a given expert map is used as it is: keep_k / keep_ratio beside it would be silently ignored
    for extra in ({"keep_k": 2}, {"keep_ratio": 0.5}):
        with pytest.raises(RecipeError, match="keep_k / keep_ratio apply when the map is built from 'hit_map'"):
            Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"expert_map": "m.pt", **extra}})


def test_patterns_that_match_nothing_are_reported(caplog):
    import logging

    from tests import models

    model = models.build("mixtral")
    with caplog.at_level(logging.WARNING, logger="torchforge.recipe"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "ignore": ["lm_head", r"re:.*block_sparse_moe\.experts$"]}).select(model)
        Recipe.from_dict({"scheme": "w4a16-rtn", "targets": ["linear"]}).select(model)
        Recipe.from_dict({"scheme": "w4a16-rtn"}).select(model)  # the defaults: no warning (they cover every arch)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert r"ignore pattern 're:.*block_sparse_moe\\.experts$' matches no module of MixtralForCausalLM" in msgs[0]
    assert "'model.layers.0.mlp.experts'" in msgs[0]  # the in-memory name to write instead
    assert "targets ['linear'] select no module of MixtralForCausalLM" in msgs[1]


def test_targets_that_select_only_non_linear_modules_are_reported(caplog):
    # ["MixtralDecoderLayer"] selects the layers themselves, not the Linear layers inside them: nothing is quantized
    import logging

    from tests import models

    model = models.build("mixtral")
    with caplog.at_level(logging.WARNING, logger="torchforge.recipe"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "targets": ["MixtralDecoderLayer"]}).select(model)
        Recipe.from_dict({"scheme": "w4a16-rtn", "targets": ["MixtralDecoderLayer", "Linear"]}).select(model)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert ("targets ['MixtralDecoderLayer'] select 2 module(s) of MixtralForCausalLM (e.g. 'model.layers.0') but no "
            "Linear layer or fused experts, so nothing is quantized") in msgs[0]


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "scheme: w4a16-rtn\ngroup_size: 64\ngroup_size: 32\n"),
    (".json", '{"scheme": "w4a16-rtn", "group_size": 64, "group_size": 32}'),
    (".yaml", "scheme: w4a16-rtn\nprune:\n  hit_map: h.pt\n  keep_k: 2\n  keep_k: 3\n"),
])
def test_a_key_given_twice_in_a_file_is_an_error(tmp_path, suffix, text):
    path = tmp_path / f"r{suffix}"
    path.write_text(text)
    key = "keep_k" if "keep_k" in text else "group_size"
    with pytest.raises(RecipeError, match=f"the key '{key}' is given twice"):
        Recipe.from_file(path)


def test_yaml_merge_keys_work(tmp_path):
    """`<<: *anchor` was refused as "not valid YAML" by the duplicate-key check; its keys merge, explicit ones win."""
    path = tmp_path / "r.yaml"
    path.write_text("base: &b {group_size: 64, symmetric: false}\n"
                    "recipe:\n  <<: *b\n  scheme: w4a16-rtn\n  group_size: 32\n")
    from torchforge.recipe import _load_yaml_unique

    data = _load_yaml_unique(path.read_text())["recipe"]
    assert Recipe.from_dict(data) == Recipe.from_dict({"scheme": "w4a16-rtn", "group_size": 32, "symmetric": False})


def test_nvfp4_dict_gets_the_scheme_defaults(tmp_path):
    # {"scheme": "nvfp4"} was refused with AWQ's dataclass defaults (group_size 128, export_format vllm-awq)
    r = Recipe.from_dict({"scheme": "nvfp4"})
    assert (r.group_size, r.export_format) == (16, "modelopt-nvfp4") and r == Recipe.from_preset("nvfp4")
    assert Recipe.coerce({"scheme": "nvfp4", "export_format": "compressed-tensors"}) == Recipe.from_preset("nvfp4-ct")
    path = tmp_path / "r.yaml"
    path.write_text("scheme: nvfp4\n")
    assert Recipe.from_file(path) == Recipe.from_preset("nvfp4")
    assert Recipe.from_dict({"scheme": "w4a16-rtn"}).group_size == 128  # other schemes keep the dataclass defaults
    with pytest.raises(RecipeError, match="group_size: invalid value 32 .*16 for scheme 'nvfp4'"):
        Recipe.from_dict({"scheme": "nvfp4", "group_size": 32})


def test_nvfp4_recipe_built_directly_gets_block_16():
    # Recipe(scheme="nvfp4") was refused on the dataclass defaults (AWQ's group_size 128, then export_format
    # vllm-awq), which only from_dict replaced; NVFP4 has blocks of 16 only
    r = Recipe(scheme="nvfp4")
    assert (r.group_size, r.export_format) == (16, "modelopt-nvfp4") and r == Recipe.from_preset("nvfp4")
    assert Recipe(scheme="nvfp4", export_format="compressed-tensors") == Recipe.from_preset("nvfp4-ct")
    assert r.to_dict() == Recipe.from_preset("nvfp4").to_dict() and Recipe.from_dict(r.to_dict()) == r
    assert Recipe(scheme="nvfp4", group_size=16) == r
    for gs in (32, 128):  # given explicitly, even AWQ's default, is refused with the field named
        with pytest.raises(RecipeError, match=rf"Recipe\.group_size: invalid value {gs} .*16 for scheme 'nvfp4'"):
            Recipe(scheme="nvfp4", group_size=gs)
    with pytest.raises(RecipeError, match=r"Recipe\.export_format: invalid value 'vllm-awq' .*for scheme 'nvfp4'"):
        Recipe(scheme="nvfp4", export_format="vllm-awq")
    for scheme in ("w4a16-rtn", "w4a16-gptq"):  # the other schemes keep AWQ's defaults
        other = Recipe(scheme=scheme)
        assert (other.group_size, other.export_format) == (128, "vllm-awq") and other == Recipe.from_preset(scheme)
    with pytest.raises(RecipeError, match=r"Recipe\.group_size: invalid value None"):
        Recipe(scheme="nvfp4", group_size=None)  # None is not "the default"


def test_a_user_ignore_list_that_selects_a_router_is_reported(caplog):
    # an ignore list replaces DEFAULT_IGNORE: an nn.Linear router (older / remote-code MoE models: mlp.gate) is then
    # selected by "Linear", which the defaults would have kept in bf16
    import logging

    from torch import nn

    mlp = nn.Module()
    mlp.gate, mlp.up_proj = nn.Linear(64, 4), nn.Linear(64, 128)
    layer = nn.Module()
    layer.mlp = mlp
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    with caplog.at_level(logging.WARNING, logger="torchforge.recipe"):
        assert [n for n, _ in Recipe.from_dict({"scheme": "w4a16-rtn"}).select(model)] == ["layers.0.mlp.up_proj"]
        picked = Recipe.from_dict({"scheme": "w4a16-rtn", "ignore": ["re:.*up_proj$"]}).select(model)
    assert [n for n, _ in picked] == ["layers.0.mlp.gate"]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert "1 MoE router layer(s) of Module are selected and will be quantized (e.g. 'layers.0.mlp.gate')" in msgs[0]
    assert r"'re:.*mlp\\.gate$'" in msgs[0]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_to_file_keeps_what_a_working_directory_relative_prune_path_means(tmp_path, monkeypatch, suffix):
    """A recipe built in Python (or from_dict) holds paths relative to the working directory; to_file wrote them as
    they were, and a file's relative paths are relative to its folder: read back, the recipe named another file."""
    (tmp_path / "work").mkdir()
    (tmp_path / "cfg").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    r = Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"hit_map": "maps/hits.pt", "keep_k": 2}})
    back = Recipe.from_file(r.to_file(tmp_path / "cfg" / f"r{suffix}"))
    assert Path(back.prune.hit_map).resolve() == (tmp_path / "work" / "maps" / "hits.pt").resolve()
    assert r.prune.hit_map == "maps/hits.pt"  # the recipe itself is unchanged
    em = Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"expert_map": "em", "mode": "drop"}})
    back = Recipe.from_file(em.to_file(tmp_path / "cfg" / f"m{suffix}"))
    assert Path(back.prune.expert_map).resolve() == (tmp_path / "work" / "em").resolve()


def test_an_empty_prune_path_is_refused(tmp_path):
    """from_file joined '' to the file's folder: `expert_map: ''` silently used the folder's expert_map.pt."""
    torch.save(torch.zeros(1, 2, dtype=torch.long), tmp_path / "expert_map.pt")
    (tmp_path / "r.yaml").write_text("scheme: w4a16-rtn\nprune:\n  expert_map: ''\n")
    with pytest.raises(RecipeError, match=r"prune\.expert_map: invalid value ''"):
        Recipe.from_file(tmp_path / "r.yaml")
    with pytest.raises(RecipeError, match=r"prune\.hit_map: invalid value ''"):
        Recipe.from_dict({"scheme": "w4a16-rtn", "prune": {"hit_map": "", "keep_k": 2}})
