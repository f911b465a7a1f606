"""The whole pipeline on the trained tiny MoE: calibrate router statistics on math text layer by layer, prune
half of the routed experts and quantize with GPTQ in one `torchforge.quantize` call, export for vLLM, reload.

    python examples/prune_and_quantize.py            # about a minute on a 2-core CPU

Prints held-out math perplexity before and after, and the checkpoint sizes.
"""
import os
import tempfile

import torch

import torchforge
from torchforge.calibration import LayerwiseStreamer
from torchforge.testing.tiny_moe import TINY_MOE_DIR, encode, load_text, load_tiny_moe, perplexity, windows


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")) / 1e6


def main():
    work = tempfile.mkdtemp(prefix="torchforge-example-")
    calib = windows(encode(load_text("calib_math")), 256)  # [128, 256] byte ids, disjoint from the eval text
    eval_math = load_text("eval_math")[:4096]

    # 1. Router statistics, one decoder layer at a time (a 671B checkpoint works the same way, on one GPU).
    stats = LayerwiseStreamer(TINY_MOE_DIR, dtype=torch.float32, device="cpu").collect_router_stats(
        calib.split(16), mode="exact")
    hits = stats.save(os.path.join(work, "hits.pt"))

    # 2. Prune (reroute: a standard smaller checkpoint; balance_groups: 4 of 8 experts kept in each routing group,
    #    so the export keeps DeepSeek's group-limited routing) and quantize (GPTQ, group 64) in one call.
    model = load_tiny_moe(dtype=torch.bfloat16)  # the dtype load_quantized gives back
    before = perplexity(model, eval_math)
    recipe = {"scheme": "w4a16-gptq", "group_size": 64,
              "prune": {"hit_map": hits, "keep_ratio": 0.5, "mode": "reroute", "balance_groups": True}}
    torchforge.quantize(model, recipe, calib_data=calib[:32])
    after = perplexity(model, eval_math)

    # 3. Export for vLLM (GPTQ layout) and reload in transformers with identical logits.
    out = os.path.join(work, "pruned-gptq")
    torchforge.save_quantized(model, out, format="vllm-gptq")
    reloaded = torchforge.load_quantized(out)
    ids = calib[:2]
    with torch.no_grad():
        same = torch.equal(reloaded(ids).logits, model(ids).logits)
    print(f"routed experts per MoE layer: {stats.hit_map.shape[1]} -> {reloaded.config.n_routed_experts}")
    print(f"held-out math perplexity (per byte): {before:.4f} -> {after:.4f} (pruned + GPTQ 4-bit)")
    print(f"checkpoint: {folder_mb(TINY_MOE_DIR):.1f} MB (bf16) -> {folder_mb(out):.1f} MB in {out}")
    print(f"reloaded logits identical: {same}")


if __name__ == "__main__":
    main()
