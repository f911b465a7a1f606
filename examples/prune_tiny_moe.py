"""Does calibration-driven pruning keep what a domain needs? The experiment of issue 5 on the trained tiny MoE.

    python examples/prune_tiny_moe.py [--keep-ratio 0.5] [--seeds 5] [--eval-chars 16384]

Calibrates router statistics on held-out math (calib_math.txt, disjoint from the eval text) with the
layer-wise streamer in its exact and approximate (seed 000 section 1.4: routed experts skipped) modes, keeps
the top half of the experts of every MoE layer by hit mass (sum of sigmoid probabilities), and measures
the held-out perplexity increase per domain for `drop` and `reroute` pruning, against pruning the same number
of random experts (mean of `--seeds` seeds). Prints markdown tables: the pruning results and the per-layer
rank correlation (Spearman) of the approximate hit map against the exact one.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from torchforge.calibration import LayerwiseStreamer
from torchforge.prune import build_expert_map, prune_experts
from torchforge.testing.tiny_moe import DOMAINS, TINY_MOE_DIR, encode, load_text, load_tiny_moe, perplexity, windows


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def random_map(num_layers: int, num_experts: int, keep_ratio: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return build_expert_map(torch.rand(num_layers, num_experts, generator=g), keep_ratio=keep_ratio)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep-ratio", type=float, default=0.5)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--eval-chars", type=int, default=16384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    t0 = time.time()

    model = load_tiny_moe(device=a.device)
    texts = {d: load_text(f"eval_{d}")[: a.eval_chars] for d in DOMAINS}
    base = {d: perplexity(model, texts[d], a.seq) for d in DOMAINS}
    print(f"unpruned held-out perplexity: " + ", ".join(f"{d} {v:.3f}" for d, v in base.items()), flush=True)

    calib = windows(encode(load_text("calib_math")), a.seq).split(16)
    hit_maps = {}
    for mode in ("exact", "approx"):
        streamer = LayerwiseStreamer(TINY_MOE_DIR, device=a.device, dtype=torch.float32)
        hit_maps[mode] = streamer.collect_router_stats(calib, mode=mode).hit_map
    num_layers, num_experts = hit_maps["exact"].shape

    def deltas(expert_map, mode):
        pruned = prune_experts(copy.deepcopy(model), expert_map, mode=mode)
        return {d: perplexity(pruned, texts[d], a.seq) - base[d] for d in DOMAINS}

    rows = []
    for prune_mode in ("drop", "reroute"):
        rand = [deltas(random_map(num_layers, num_experts, a.keep_ratio, s), prune_mode) for s in range(a.seeds)]
        rand_mean = {d: sum(r[d] for r in rand) / len(rand) for d in DOMAINS}
        for calib_mode in ("exact", "approx"):
            got = deltas(build_expert_map(hit_maps[calib_mode], keep_ratio=a.keep_ratio), prune_mode)
            rows.append((prune_mode, calib_mode, got, rand_mean))
            print(f"  {prune_mode}/{calib_mode} done ({time.time() - t0:.0f}s)", flush=True)

    kept = round(a.keep_ratio * num_experts)
    print(f"\nPruning {num_experts - kept} of {num_experts} routed experts in each of {num_layers} MoE layers, "
          f"calibrated on math ({sum(c.numel() for c in calib):,} tokens); held-out perplexity increase "
          f"(unpruned: " + ", ".join(f"{d} {v:.3f}" for d, v in base.items()) + f"); random = mean of {a.seeds} seeds.\n")
    print("| prune mode | calibration | Δ math | Δ prose | Δ code | Δ math, random | Δ prose, random | "
          "math Δ / random Δ (goal ≤ 0.33) | Δ math < Δ prose |")
    print("|---|---|---|---|---|---|---|---|---|")
    for prune_mode, calib_mode, got, rnd in rows:
        ratio = got["math"] / rnd["math"] if rnd["math"] > 0 else float("nan")
        print(f"| {prune_mode} | {calib_mode} | {got['math']:+.3f} | {got['prose']:+.3f} | {got['code']:+.3f} | "
              f"{rnd['math']:+.3f} | {rnd['prose']:+.3f} | {ratio:.3f} | {'yes' if got['math'] < got['prose'] else 'NO'} |")

    print("\nApproximate vs exact calibration, per MoE layer: Spearman rank correlation of the hit maps, and how many "
          f"of the {kept} experts each keeps are the same.\n")
    print("| MoE layer | Spearman | same kept experts |")
    print("|---|---|---|")
    for layer in range(num_layers):
        ex, ap = hit_maps["exact"][layer], hit_maps["approx"][layer]
        same = len(set(ex.topk(kept).indices.tolist()) & set(ap.topk(kept).indices.tolist()))
        print(f"| {layer} | {spearman(ex, ap):.3f} | {same}/{kept} |")
    print(f"\n({time.time() - t0:.0f}s on {a.device})")


if __name__ == "__main__":
    main()
