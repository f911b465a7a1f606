"""vllm-awq export: names, config, dtypes, and a reload that reproduces the saved model's logits exactly."""
import json
import os

import pytest
import torch
from expecttest import assert_expected_inline

import torchforge
from tests import models
from torchforge.export.vllm_awq import export_state_dict
from torchforge.io import iter_checkpoint

RECIPE = {"scheme": "w4a16-rtn", "group_size": 32}


def _quantized(arch, dtype=torch.bfloat16, recipe=RECIPE):
    model = models.build(arch, dtype=dtype)
    return torchforge.quantize(model, recipe)


@pytest.mark.parametrize("arch", sorted(models.ALL_BUILDERS))
def test_round_trip_logits_equal(arch, tmp_path):
    model = _quantized(arch)
    torchforge.save_quantized(model, str(tmp_path))
    reloaded = torchforge.load_quantized(str(tmp_path))
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reload_takes_the_saved_dtype(dtype, tmp_path):
    """The unquantized tensors come back in the dtype the checkpoint was written in (config.json), not bf16."""
    model = _quantized("llama", dtype=dtype, recipe={**RECIPE, "dtype": str(dtype).removeprefix("torch.")})
    torchforge.save_quantized(model, str(tmp_path))
    reloaded = torchforge.load_quantized(str(tmp_path))
    assert reloaded.model.embed_tokens.weight.dtype == dtype
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert torchforge.load_quantized(str(tmp_path), dtype=torch.bfloat16).model.embed_tokens.weight.dtype == \
        torch.bfloat16


def test_deepseek_v3_config_pinned(tmp_path):
    model = _quantized("deepseek_v3")
    torchforge.save_quantized(model, str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert_expected_inline(json.dumps(cfg["quantization_config"], indent=1), """\
{
 "quant_method": "awq",
 "bits": 4,
 "group_size": 32,
 "zero_point": true,
 "version": "gemm",
 "modules_to_not_convert": [
  "model.layers.0.self_attn.kv_b_proj",
  "model.layers.1.self_attn.kv_b_proj",
  "lm_head"
 ]
}""")


def test_deepseek_v3_tensor_names_and_layouts(tmp_path):
    model = _quantized("deepseek_v3")
    torchforge.save_quantized(model, str(tmp_path))
    tensors = dict(iter_checkpoint(str(tmp_path)))
    # the router weight as the model holds it: bf16 up to transformers 5.2x, fp32 where transformers keeps it so
    # (DeepSeek-V3's _keep_in_fp32_modules_strict has "gate.weight" in 5.24); vLLM casts it on load either way
    gate = "model.layers.1.mlp.gate.weight"
    assert tensors[gate].dtype == model.get_submodule(gate.removesuffix(".weight")).weight.dtype
    layer1 = "\n".join(f"{k} {tuple(v.shape)} {'as the model' if k == gate else str(v.dtype)[6:]}"
                       for k, v in sorted(tensors.items())
                       if k.startswith("model.layers.1.") and (".experts.0." in k or ".experts." not in k))
    assert_expected_inline(layer1, """\
model.layers.1.input_layernorm.weight (64,) bfloat16
model.layers.1.mlp.experts.0.down_proj.qweight (32, 8) int32
model.layers.1.mlp.experts.0.down_proj.qzeros (1, 8) int32
model.layers.1.mlp.experts.0.down_proj.scales (1, 64) float16
model.layers.1.mlp.experts.0.gate_proj.qweight (64, 4) int32
model.layers.1.mlp.experts.0.gate_proj.qzeros (2, 4) int32
model.layers.1.mlp.experts.0.gate_proj.scales (2, 32) float16
model.layers.1.mlp.experts.0.up_proj.qweight (64, 4) int32
model.layers.1.mlp.experts.0.up_proj.qzeros (2, 4) int32
model.layers.1.mlp.experts.0.up_proj.scales (2, 32) float16
model.layers.1.mlp.gate.e_score_correction_bias (8,) float32
model.layers.1.mlp.gate.weight (8, 64) as the model
model.layers.1.mlp.shared_experts.down_proj.qweight (32, 8) int32
model.layers.1.mlp.shared_experts.down_proj.qzeros (1, 8) int32
model.layers.1.mlp.shared_experts.down_proj.scales (1, 64) float16
model.layers.1.mlp.shared_experts.gate_proj.qweight (64, 4) int32
model.layers.1.mlp.shared_experts.gate_proj.qzeros (2, 4) int32
model.layers.1.mlp.shared_experts.gate_proj.scales (2, 32) float16
model.layers.1.mlp.shared_experts.up_proj.qweight (64, 4) int32
model.layers.1.mlp.shared_experts.up_proj.qzeros (2, 4) int32
model.layers.1.mlp.shared_experts.up_proj.scales (2, 32) float16
model.layers.1.post_attention_layernorm.weight (64,) bfloat16
model.layers.1.self_attn.kv_a_layernorm.weight (32,) bfloat16
model.layers.1.self_attn.kv_a_proj_with_mqa.qweight (64, 5) int32
model.layers.1.self_attn.kv_a_proj_with_mqa.qzeros (2, 5) int32
model.layers.1.self_attn.kv_a_proj_with_mqa.scales (2, 40) float16
model.layers.1.self_attn.kv_b_proj.weight (64, 32) bfloat16
model.layers.1.self_attn.o_proj.qweight (32, 8) int32
model.layers.1.self_attn.o_proj.qzeros (1, 8) int32
model.layers.1.self_attn.o_proj.scales (1, 64) float16
model.layers.1.self_attn.q_a_layernorm.weight (32,) bfloat16
model.layers.1.self_attn.q_a_proj.qweight (64, 4) int32
model.layers.1.self_attn.q_a_proj.qzeros (2, 4) int32
model.layers.1.self_attn.q_a_proj.scales (2, 32) float16
model.layers.1.self_attn.q_b_proj.qweight (32, 6) int32
model.layers.1.self_attn.q_b_proj.qzeros (1, 6) int32
model.layers.1.self_attn.q_b_proj.scales (1, 48) float16""")


def test_per_expert_split_is_exact():
    """gate/up halves of the fused packed tensors are the per-expert quantization of gate/up alone."""
    model = models.build("deepseek_v3")
    _, block = models.moe_blocks(model)[0]
    gate_up = block.experts.gate_up_proj.detach().clone()
    I = gate_up.shape[1] // 2
    torchforge.quantize(model, RECIPE)
    sd = export_state_dict(model)
    for e in (0, 5):
        qw, sc, qz = torchforge.ops.awq_quantize(gate_up[e, I:], group_size=32)  # up alone
        assert torch.equal(sd[f"model.layers.1.mlp.experts.{e}.up_proj.qweight"], qw)
        assert torch.equal(sd[f"model.layers.1.mlp.experts.{e}.up_proj.scales"], sc)
        assert torch.equal(sd[f"model.layers.1.mlp.experts.{e}.up_proj.qzeros"], qz)


def test_unquantized_experts_are_written_per_expert(tmp_path):
    model = _quantized("mixtral", recipe={**RECIPE, "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*experts$"]})
    torchforge.save_quantized(model, str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    assert "model.layers.0.block_sparse_moe.experts" in cfg["quantization_config"]["modules_to_not_convert"]
    names = set(dict(iter_checkpoint(str(tmp_path))))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert not any(".experts." in n and n.endswith("qweight") for n in names)


def test_save_refuses_unquantized_model(tmp_path):
    with pytest.raises(ValueError, match="no torchforge quantized modules"):
        torchforge.save_quantized(models.build("llama"), str(tmp_path))
    assert not os.path.exists(tmp_path / "config.json")


def test_load_rejects_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        torchforge.load_quantized(str(tmp_path))


@pytest.mark.parametrize("first,second", [("vllm-gptq", "vllm-awq"), ("vllm-awq", "compressed-tensors")])
def test_resave_that_dies_leaves_no_config(tmp_path, first, second):
    # a folder with a config.json counts as complete: a re-save that dies after its new shards must not leave the
    # earlier save's config.json (another format's) beside them
    from unittest import mock

    import torchforge.export.folder as folder

    model = _quantized("llama")
    out = str(tmp_path / "out")
    torchforge.save_quantized(model, out, format=first)
    with mock.patch.object(folder, "atomic_write_json", side_effect=OSError("simulated crash")):
        with pytest.raises(OSError, match="simulated crash"):
            torchforge.save_quantized(model, out, format=second)
    assert not os.path.exists(os.path.join(out, "config.json"))
    with pytest.raises(ValueError, match="no config.json"):
        torchforge.load_quantized(out)
    torchforge.save_quantized(model, out, format=second)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        assert torch.equal(torchforge.load_quantized(out)(ids).logits, model(ids).logits)


def test_mixtral_uses_checkpoint_names(tmp_path):
    """transformers 5 keeps Mixtral's experts as mlp.experts in memory; checkpoints (and vLLM) use
    block_sparse_moe.experts.E.w1 / w3 / w2 for gate / up / down."""
    model = _quantized("mixtral")
    torchforge.save_quantized(model, str(tmp_path))
    names = set(dict(iter_checkpoint(str(tmp_path))))
    assert "model.layers.0.block_sparse_moe.experts.2.w1.qweight" in names
    assert "model.layers.0.block_sparse_moe.experts.2.w3.scales" in names
    assert "model.layers.0.block_sparse_moe.experts.2.w2.qzeros" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)
    reloaded = torchforge.load_quantized(str(tmp_path))
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("scheme,fmt", [("w4a16-rtn", "vllm-gptq"), ("w4a16-rtn", "compressed-tensors"),
                                        ("nvfp4", "modelopt-nvfp4"), ("nvfp4", "compressed-tensors")])
def test_mixtral_config_lists_use_checkpoint_names(tmp_path, scheme, fmt):
    """vLLM matches the config's module lists against its own names, which are the checkpoint names: the lists said
    mlp.experts / mlp.gate for Mixtral in every format but vllm-awq."""
    recipe = {"scheme": scheme, "quantize_experts": False}
    recipe.update({"group_size": 32} if scheme == "w4a16-rtn" else {"group_size": 16, "export_format": fmt})
    model = _quantized("mixtral", recipe=recipe)
    torchforge.save_quantized(model, str(tmp_path), format=fmt)
    q = json.load(open(tmp_path / "config.json"))["quantization_config"]
    lists = [q.get("ignore", []), q.get("exclude_modules", []), q.get("modules_in_block_to_quantize", []),
             list(q.get("dynamic", {})), q.get("quantization", {}).get("exclude_modules", [])]
    flat = [n.replace("\\.", ".") for lst in lists for n in lst]  # vllm-gptq's dynamic keys are escaped regexes
    assert any("model.layers.0.block_sparse_moe.experts" in n for n in flat), flat
    assert not any(".mlp." in n for n in flat), flat


def test_a_resave_in_another_format_leaves_no_side_file_of_the_first(tmp_path):
    """A drop-pruned export's expert_map.pt made load_quantized re-prune the next (unpruned) export written there, and
    an NVFP4 export's hf_quant_config.json (which vLLM reads first) stayed beside a vllm-awq one."""
    from torchforge.nn.pruned_moe import PrunedMoE
    from torchforge.prune import build_expert_map

    out = str(tmp_path)
    nv = torchforge.quantize(models.build("qwen3_moe", dtype=torch.bfloat16), "nvfp4")
    torchforge.prune_experts(nv, build_expert_map(torch.rand(2, 8), keep_k=4), mode="drop")
    torchforge.save_quantized(nv, out, format="modelopt-nvfp4")
    assert {"hf_quant_config.json", "expert_map.pt"} <= set(os.listdir(out))
    model = _quantized("qwen3_moe")
    torchforge.save_quantized(model, out)
    assert not {"hf_quant_config.json", "expert_map.pt"} & set(os.listdir(out))
    reloaded = torchforge.load_quantized(out)
    assert not any(isinstance(m, PrunedMoE) for m in reloaded.modules())
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_save_pretrained_is_refused_and_generation_config_comes_back(tmp_path):
    """transformers' save_pretrained wrote the packed tensors beside a config without quantization_config: the folder
    reloaded with random weights in the quantized layers. And load_quantized dropped generation_config.json (EOS ids:
    generate no longer stopped)."""
    import copy
    import io

    model = _quantized("llama")
    with pytest.raises(RuntimeError, match="use torchforge.save_quantized"):
        model.save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(RuntimeError, match="use torchforge.save_quantized"):
        model.push_to_hub("nowhere")
    assert not (tmp_path / "hf").exists()
    buf = io.BytesIO()
    torch.save(model, buf)  # the guard pickles (a module-level function)
    copy.deepcopy(model)
    model.generation_config.eos_token_id = [5, 7]
    model.generation_config.pad_token_id = 3
    torchforge.save_quantized(model, str(tmp_path / "q"))
    reloaded = torchforge.load_quantized(str(tmp_path / "q"))
    assert reloaded.generation_config.eos_token_id == [5, 7] and reloaded.generation_config.pad_token_id == 3
    with pytest.raises(RuntimeError, match="use torchforge.save_quantized"):
        reloaded.save_pretrained(str(tmp_path / "hf"))


@pytest.mark.parametrize("fmt", ["vllm-awq", "vllm-gptq"])
def test_scales_are_written_fp16_after_a_bf16_cast(fmt, tmp_path):
    """model.to(bf16) holds the scales in bf16 (the bf16 kernels read them so); the AWQ / GPTQ formats store fp16."""
    model = _quantized("qwen3_moe", recipe={**RECIPE, "scheme": "w4a16-rtn"})
    model.to(torch.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.scales.dtype == torch.bfloat16
    torchforge.save_quantized(model, str(tmp_path), format=fmt)
    scales = {k: v for k, v in iter_checkpoint(str(tmp_path)) if k.endswith(".scales")}
    assert scales and {v.dtype for v in scales.values()} == {torch.float16}
    reloaded = torchforge.load_quantized(str(tmp_path))
    a, b = reloaded.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.q_proj
    assert torch.equal(a.dequantized_weight(), b.dequantized_weight())  # the same values, held in fp16 now


def test_save_without_format_writes_the_recipes_export_format(tmp_path):
    """save_quantized(model, out) follows the export_format of the recipe quantize recorded (was always vllm-awq)."""
    model = _quantized("llama", recipe={**RECIPE, "export_format": "compressed-tensors"})
    torchforge.save_quantized(model, str(tmp_path / "ct"))
    with open(tmp_path / "ct" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"
    torchforge.save_quantized(model, str(tmp_path / "awq"), format="vllm-awq")  # an explicit format still wins
    with open(tmp_path / "awq" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "awq"
    torchforge.save_quantized(torchforge.load_quantized(str(tmp_path / "ct")), str(tmp_path / "re"))  # no recipe
    with open(tmp_path / "re" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "awq"


@pytest.mark.parametrize("fmt", ["vllm-awq", "compressed-tensors"])
def test_a_resave_of_another_model_leaves_none_of_its_tokenizer_files(fmt, tmp_path):
    """Re-exporting model B into a folder that held model A's export kept A's tokenizer.json and chat template."""
    from transformers import AutoModelForCausalLM

    for name, seed in (("A", 0), ("B", 1)):
        models.build("llama", seed=seed, dtype=torch.bfloat16).save_pretrained(tmp_path / name)
    (tmp_path / "A" / "tokenizer.json").write_text('{"model A": true}')
    (tmp_path / "A" / "chat_template.jinja").write_text("MODEL A {{ messages }}")
    (tmp_path / "B" / "tokenizer_config.json").write_text('{"chat_template": "MODEL B"}')
    out = tmp_path / "out"
    for name in ("A", "B"):
        model = torchforge.quantize(AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.bfloat16), RECIPE)
        torchforge.save_quantized(model, str(out), format=fmt, source_dir=str(tmp_path / name))
        if name == "A":
            assert {"tokenizer.json", "chat_template.jinja"} <= set(os.listdir(out))
    files = set(os.listdir(out))
    assert not {"tokenizer.json", "chat_template.jinja"} & files, files
    assert (out / "tokenizer_config.json").read_text() == '{"chat_template": "MODEL B"}'


def test_a_tokenizer_saved_into_the_folder_first_stays_when_the_export_has_none(tmp_path):
    """tok.save_pretrained(out) then save_quantized(model, out), the model from a hub id (nothing to copy): the
    export's clearing of an earlier model's tokenizer files took the user's own with it."""
    model = torchforge.quantize(models.build("llama"), RECIPE)
    model.name_or_path = "org/some-model"  # what from_pretrained of a hub id records
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("T")
    torchforge.save_quantized(model, str(tmp_path))
    assert (tmp_path / "tokenizer.json").read_text() == "{}" and (tmp_path / "chat_template.jinja").read_text() == "T"


def test_a_save_into_the_folder_the_model_came_from_is_refused(tmp_path):
    """save_quantized(model, <its source folder>) replaced the bf16 checkpoint (the CLI already refused OUT = SRC)."""
    from transformers import AutoModelForCausalLM

    models.build("llama", dtype=torch.bfloat16).save_pretrained(tmp_path)
    before = sorted(os.listdir(tmp_path))
    model = torchforge.quantize(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16), RECIPE)
    with pytest.raises(ValueError, match="is the folder this model was loaded from"):
        torchforge.save_quantized(model, str(tmp_path / "."))
    assert sorted(os.listdir(tmp_path)) == before
    assert b"qweight" not in (tmp_path / "model.safetensors").read_bytes()[:4096]  # the bf16 header is intact


def test_a_save_whose_tokenizer_source_is_its_own_folder_keeps_the_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    model = torchforge.quantize(models.build("llama"), RECIPE)
    torchforge.save_quantized(model, str(tmp_path), source_dir=str(tmp_path))
    assert (tmp_path / "tokenizer.json").read_text() == "{}"


def test_tokenizer_copy_that_fails_leaves_no_temporary(tmp_path, monkeypatch):
    """copy_tokenizer_files copied to a fixed `.{name}.tmp`, not fsynced, and left it where the copy failed (a full
    disk), unlike every other file of an export."""
    import shutil

    from torchforge.export import folder

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "tokenizer.json").write_text('{"v": 1}')
    (src / "merges.txt").write_text("a b\n" * 100)
    real = shutil.copyfile

    def full_disk(a, b, *args, **kw):
        if os.path.basename(a) == "merges.txt":
            with open(b, "w") as f:
                f.write("a b\n")  # a part, then the disk is full
            raise OSError(28, "No space left on device")
        return real(a, b, *args, **kw)

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    with pytest.raises(OSError, match="No space left"):
        folder.copy_tokenizer_files(str(src), str(out))
    assert sorted(os.listdir(out)) == ["tokenizer.json"]  # no .merges.txt temporary, no partial merges.txt
    assert (out / "tokenizer.json").read_text() == '{"v": 1}'
