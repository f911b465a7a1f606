"""A checkpoint whose shards disagree with its config.json or expert_map.pt about the routed experts is refused,
naming the tensor, instead of loading other experts; a refused export leaves an earlier checkpoint intact."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchforge
from tests import models
from torchforge.io import CheckpointError
from torchforge.prune import EXPERT_MAP_FILE, prune_experts, save_expert_map

RTN = {"scheme": "w4a16-rtn", "group_size": 32}
IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))


def _add_expert_copy(folder, src_e: int, new_e: int):
    """Writes a copy of expert `src_e` of every MoE layer as expert `new_e` into the (single) shard."""
    path = os.path.join(folder, "model.safetensors")
    sd = load_file(path)
    sd.update({k.replace(f".experts.{src_e}.", f".experts.{new_e}."): v.clone()
               for k, v in sd.items() if f".experts.{src_e}." in k})
    save_file(sd, path, metadata={"format": "pt"})


@pytest.mark.parametrize("scheme,fmt", [(RTN, "vllm-awq"), (RTN, "vllm-gptq"), ("nvfp4", "modelopt-nvfp4")])
def test_an_expert_id_beyond_the_configs_count_is_refused(tmp_path, scheme, fmt):
    """Expert 8 of an 8-expert config was silently dropped by every loader (transformers refuses it)."""
    model = torchforge.quantize(models.build("deepseek_v3", dtype=torch.bfloat16), scheme)
    torchforge.save_quantized(model, str(tmp_path), format=fmt)
    with torch.no_grad():  # the intact checkpoint reloads to the in-memory model
        assert torch.equal(torchforge.load_quantized(str(tmp_path))(IDS).logits, model(IDS).logits)
    assert json.load(open(tmp_path / "config.json"))["n_routed_experts"] == 8
    _add_expert_copy(str(tmp_path), 7, 8)
    with pytest.raises(CheckpointError, match=r"holds model\.layers\.1\.mlp\.experts\.8 \(experts \[8\]\) but the "
                                              r"model has 8 routed experts"):
        torchforge.load_quantized(str(tmp_path))


def test_a_drop_checkpoint_whose_expert_map_disagrees_with_its_shards_is_refused(tmp_path):
    model = models.build("deepseek_v3", dtype=torch.bfloat16)
    prune_experts(model, torch.tensor([[0, 1, -1, -1, 2, 3, -1, -1]], dtype=torch.int32), mode="drop")
    torchforge.quantize(model, RTN)
    torchforge.save_quantized(model, str(tmp_path))
    with torch.no_grad():
        assert torch.equal(torchforge.load_quantized(str(tmp_path))(IDS).logits, model(IDS).logits)
    # a map keeping 3 experts beside shards holding 4: compact expert 3 was dropped without a word
    good_map = (tmp_path / EXPERT_MAP_FILE).read_bytes()
    save_expert_map(torch.tensor([[0, 1, -1, -1, 2, -1, -1, -1]], dtype=torch.int32), tmp_path)
    with pytest.raises(CheckpointError, match=r"holds model\.layers\.1\.mlp\.experts\.3 .*has 3 routed experts"):
        torchforge.load_quantized(str(tmp_path))
    # a corrupt map: named, not a struct / unpickling error
    (tmp_path / EXPERT_MAP_FILE).write_bytes(good_map[: len(good_map) // 3])
    with pytest.raises(ValueError, match=r"load_expert_map: .*expert_map\.pt cannot be read by torch\.load"):
        torchforge.load_quantized(str(tmp_path))
    # no map at all: torchforge.json says drop, so the map is named (was "experts [4, 5, 6, 7] have no ...")
    os.remove(tmp_path / EXPERT_MAP_FILE)
    with pytest.raises(CheckpointError, match="describes a drop-pruned checkpoint but expert_map.pt is missing"):
        torchforge.load_quantized(str(tmp_path))


def test_a_refused_vllm_awq_export_leaves_an_earlier_checkpoint_intact(tmp_path):
    """export_state_dict refuses scales fp16 cannot hold; it ran after begin_folder had removed config.json."""
    from torchforge.nn.awq_linear import ForgeAWQLinear

    good = torchforge.quantize(models.build("qwen3_moe", dtype=torch.bfloat16), RTN)
    torchforge.save_quantized(good, str(tmp_path))
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    bad = torchforge.quantize(models.build("qwen3_moe", dtype=torch.bfloat16, seed=1), RTN)
    name, mod = next((n, m) for n, m in bad.named_modules() if isinstance(m, ForgeAWQLinear))
    mod.scales = mod.scales.to(torch.bfloat16)
    mod.scales[0, 0] = 1e5  # above float16's maximum
    with pytest.raises(ValueError, match=rf"{name}\.scales: 1 bfloat16 scales are not float16 values"):
        torchforge.save_quantized(bad, str(tmp_path))
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before
    with torch.no_grad():
        assert torch.equal(torchforge.load_quantized(str(tmp_path))(IDS).logits, good(IDS).logits)
