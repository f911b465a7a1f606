"""Quantize a small DeepSeek-V3-architecture model to W4A16 (vLLM AWQ layout), export, reload.

    python examples/quantize_and_export.py [--out OUT_DIR] [--recipe w4a16-rtn|recipe.yaml]
With a real checkpoint, replace the model construction by AutoModelForCausalLM.from_pretrained(path).
"""
import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM

import torchforge
from torchforge.demo import tiny_deepseek_v3_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--recipe", default="w4a16-rtn")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 256, (1, 16))
    torchforge.quantize(model, args.recipe)
    print(model.model.layers[1].mlp)
    out = args.out or tempfile.mkdtemp(prefix="torchforge-example-")
    torchforge.save_quantized(model, out)  # config.json + sharded safetensors that vLLM's AWQ loader reads
    reloaded = torchforge.load_quantized(out)
    with torch.no_grad():
        same = torch.equal(reloaded(ids).logits, model(ids).logits)
    print(f"exported to {out}; reloaded logits identical: {same}")


if __name__ == "__main__":
    main()
