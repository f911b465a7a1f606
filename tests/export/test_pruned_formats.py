"""Pruned MoE models in every quantized format: NVFP4 (ModelOpt, compressed-tensors) and GPTQ (vllm-gptq,
compressed-tensors) checkpoints of reroute- and drop-pruned models reload with identical logits."""
import json
import os

import pytest
import torch

import torchforge
from tests import models
from torchforge.prune import EXPERT_MAP_FILE, prune_experts

# two experts kept in each of the two groups, so reroute keeps valid group-limited routing
EXPERT_MAP = torch.tensor([[0, 1, -1, -1, 2, 3, -1, -1]], dtype=torch.int32)
GPTQ = {"scheme": "w4a16-gptq", "group_size": 32}


@pytest.mark.parametrize("mode", ["reroute", "drop"])
@pytest.mark.parametrize("scheme,fmt", [("nvfp4", "modelopt-nvfp4"), ("nvfp4", "compressed-tensors"),
                                        (GPTQ, "vllm-gptq"), (GPTQ, "compressed-tensors")])
def test_pruned_quantized_reloads_identically(tmp_path, scheme, fmt, mode):
    model = models.build("deepseek_v3", dtype=torch.bfloat16)
    prune_experts(model, EXPERT_MAP, mode=mode)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    torchforge.quantize(model, scheme, calib_data=ids)
    with torch.no_grad():
        expected = model(ids).logits
    torchforge.save_quantized(model, str(tmp_path), format=fmt)
    cfg = json.load(open(tmp_path / "config.json"))
    meta = json.load(open(tmp_path / "torchforge.json"))
    assert meta["prune"]["mode"] == mode
    if mode == "reroute":  # a standard smaller checkpoint
        assert cfg["n_routed_experts"] == 4 and not os.path.exists(tmp_path / EXPERT_MAP_FILE)
    else:  # original config, expert map beside it
        assert cfg["n_routed_experts"] == 8 and os.path.exists(tmp_path / EXPERT_MAP_FILE)
    loaded = torchforge.load_quantized(str(tmp_path))
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32  # as from_pretrained keeps it
    with torch.no_grad():
        got = loaded(ids).logits
    assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()


@pytest.mark.parametrize("balanced,keep_k,n_group,warning", [
    (False, 6, 1, "6 routed experts per layer is not a multiple of 4"),
    # EXPERT_MAP: 2 of each group's 4 kept, so n_group 2 stays; topk_group 1, top_k 2: 1 x 4 / 2 = 2 = top_k (the
    # unpruned model's 1 x 8 / 2 = 4 passes)
    (True, 4, 2, "top_k = 2 is not below topk_group x experts / n_group = 1 x 4 / 2"),
    # 4 of 8 kept in one group (n_group becomes 1): 1 x 4 / 1 = 4 > top_k = 2, a multiple of 4, more than top_k
    (False, 4, 1, None),
])
def test_nvfp4_export_warns_on_an_expert_count_flashinfer_refuses(tmp_path, caplog, balanced, keep_k, n_group,
                                                                   warning):
    """vLLM's FlashInfer TRT-LLM MoE kernels (NVFP4 on Blackwell) need a multiple of 4 routed experts, more than top_k,
    and top_k < topk_group x experts / n_group: a reroute export that breaks one says which, and one that keeps them
    says nothing."""
    from torchforge.prune import build_expert_map

    model = models.build("deepseek_v3", dtype=torch.bfloat16)
    hits = torch.arange(8, dtype=torch.float32).unsqueeze(0)  # one MoE layer (layer 0 is dense)
    prune_experts(model, EXPERT_MAP if balanced else build_expert_map(hits, keep_k=keep_k), mode="reroute")
    torchforge.quantize(model, "nvfp4", calib_data=torch.randint(0, 96, (2, 16)))
    with caplog.at_level("WARNING", logger="torchforge.export.nvfp4"):
        torchforge.save_quantized(model, str(tmp_path), format="modelopt-nvfp4")
    flashinfer = [r.getMessage() for r in caplog.records if "FlashInfer" in r.getMessage()]
    if warning is None:
        assert not flashinfer, flashinfer
    else:
        assert len(flashinfer) == 1 and warning in flashinfer[0], flashinfer
        assert ("not a multiple of 4" in flashinfer[0]) == (keep_k % 4 != 0)
    cfg = json.load(open(tmp_path / "config.json"))
    assert (cfg["n_routed_experts"], cfg["n_group"]) == (keep_k, n_group)
