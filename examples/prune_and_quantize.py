"""Prune half of the routed experts of a small DeepSeek-V3-architecture model from a hit map, then quantize.

    python examples/prune_and_quantize.py
The hit map here is made up (router probability mass summed over some random tokens); issue 5's
calibration streamer produces it from real data.
"""
import tempfile

import torch
from transformers import AutoModelForCausalLM

import torchforge
from torchforge.demo import tiny_deepseek_v3_config
from torchforge.prune import build_expert_map, prune_experts


def main():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(), dtype=torch.bfloat16).eval()
    moe_layers = [l for l in model.model.layers if hasattr(l.mlp, "experts")]
    x = torch.randn(512, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():  # sigmoid router mass per expert: the hit map's definition (seed 000 section 1.3)
        hit = torch.stack([torch.sigmoid(l.mlp.gate.weight.float() @ x.float().T).sum(1) for l in moe_layers])
    E = hit.shape[1]
    keep = E // 2
    # The export keeps group-limited routing only when every group keeps the same number of experts;
    # otherwise it says so and writes n_group = 1 (see torchforge.prune.export).
    expert_map = build_expert_map(hit, keep_k=keep)
    prune_experts(model, expert_map, mode="reroute")
    torchforge.quantize(model, "w4a16-rtn")
    out = tempfile.mkdtemp(prefix="torchforge-pruned-")
    torchforge.save_quantized(model, out)
    print(f"kept {keep}/{E} routed experts per layer; exported to {out}")


if __name__ == "__main__":
    main()
