"""The trained fixture loads, has learned its domains, and its held-out text never enters training."""
import json
import os

import pytest
import torch

from torchforge.testing import corpus
from torchforge.testing.tiny_moe import TINY_MOE_DIR, encode, load_text, load_tiny_moe, perplexity, windows


@pytest.fixture(scope="module")
def model():
    return load_tiny_moe()


def test_loads_as_trained_deepseek_v3(model):
    cfg = model.config
    assert (cfg.model_type, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (
        "deepseek_v3", 32, 4, 1)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().max() > 0  # aux-loss-free balancing moved it
    size = sum(os.path.getsize(os.path.join(TINY_MOE_DIR, f)) for f in os.listdir(TINY_MOE_DIR)
               if f.endswith(".safetensors"))
    assert size <= 20 * 2**20


def test_learned_math_better_than_prose(model):
    # Two windows per domain keep this fast; the full held-out numbers are in metrics.json.
    ppl = {d: perplexity(model, load_text(f"eval_{d}")[:512]) for d in ("math", "prose")}
    assert ppl["math"] < 1.6 < ppl["prose"] < 40, ppl
    metrics = json.load(open(os.path.join(TINY_MOE_DIR, "metrics.json")))
    assert metrics["ppl_math"] < metrics["ppl_code"] < metrics["ppl_prose"] < 256


def test_heldout_split_is_disjoint():
    train = {p for p, _ in corpus.stdlib_files("train")}
    held = {p for p, _ in corpus.stdlib_files("eval")}
    assert train and held and not train & held
    assert corpus.math_text("eval", 2000) != corpus.math_text("train", 2000)
    assert corpus.math_text("eval", 2000) == corpus.math_text("eval", 2000)  # deterministic


def test_encode_and_windows():
    ids = encode("abc" * 100)
    assert ids.dtype == torch.int64 and ids[:3].tolist() == [97, 98, 99]
    assert windows(ids, 64).shape == (4, 64)
    with pytest.raises(ValueError, match="shorter than one window"):
        windows(ids[:10], 64)
