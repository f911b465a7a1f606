"""bench/decode_e2e.py's model presets: the sizes its docstring and BENCHMARKS.md quote, and a CPU smoke run."""
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
sys.path.insert(0, BENCH)
from decode_e2e import make_config  # noqa: E402


def expected_params(c) -> int:
    """DeepSeek-V3's parameter count from its dimensions, counted by hand (not from the modules)."""
    h, heads = c.hidden_size, c.num_attention_heads
    attn = (h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
            + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
            + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * h)
    dense = 3 * h * c.intermediate_size
    moe = 3 * h * c.moe_intermediate_size * (c.n_routed_experts + c.n_shared_experts) + c.n_routed_experts * h
    n_dense = c.first_k_dense_replace
    layers = n_dense * (attn + dense) + (c.num_hidden_layers - n_dense) * (attn + moe) + 2 * h * c.num_hidden_layers
    return layers + 2 * c.vocab_size * h + h


@pytest.mark.parametrize("name, billions", [("h4096", 8.584), ("h7168", 32.215)])
def test_preset_sizes(name, billions):
    from transformers import DeepseekV3ForCausalLM

    cfg = make_config(name)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == expected_params(cfg)
    assert round(n / 1e9, 3) == billions


def test_overrides_and_their_checks():
    cfg = make_config("h7168", layers=4, experts=16)
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.hidden_size) == (4, 16, 7168)
    assert make_config(True).hidden_size == 256 and make_config(False).hidden_size == 4096
    with pytest.raises(ValueError, match="multiple of n_group=8"):
        make_config("h7168", experts=12)
    with pytest.raises(ValueError, match="at least 2"):
        make_config("h7168", experts=8)
    with pytest.raises(ValueError, match="expected one of"):
        make_config("h9999")


@pytest.mark.parametrize("group", [128, 32])
def test_tiny_smoke_run_prints_the_table(group):
    cmd = [sys.executable, os.path.join(BENCH, "decode_e2e.py"), "--model", "tiny", "--experts", "16", "--variants",
           "bf16", "w4a16-mma", "--batches", "1", "--new-tokens", "3", "--repeats", "1", "--no-compile",
           "--device", "cpu", "--group-size", str(group)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "16 experts of 128 (top-4)" in out.stdout
    assert f"quantized (w4a16-rtn, group {group})" in out.stdout
    assert f"modules' group sizes [{group}]" in out.stdout  # read back from the quantized modules
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| bf16 |", "| w4a16-mma |"))]
    assert len(rows) == 2 and "failed" not in out.stdout, out.stdout[-3000:]
    # generate() gets its cache under the installed transformers' name (5.24 renamed past_key_values to cache)
    assert "`past_key_values` is deprecated" not in out.stderr, out.stderr[-3000:]
