"""Does calibration-driven pruning keep what a domain needs? The experiment of issue 5 on the trained tiny MoE.

    python examples/prune_tiny_moe.py [--rank-by all|probability|count|weight] [--keep-ratio 0.5] [--seeds 5]
                                      [--eval-chars 16384] [--calib-chars 32768]

Calibrates router statistics on math (calib_math.txt, generated from its own seed: disjoint from the eval text)
with the layer-wise streamer in its exact and approximate (seed 000 section 1.4: routed experts skipped) modes,
keeps the top half of the experts of every MoE layer by a router statistic (`--rank-by`, see
torchforge.prune.RANK_BY: "probability" = hit map, the summed sigmoid probabilities, the default ranking;
"count" = top-k picks; "weight" = routed weight received; "all" = one table each), and measures the held-out
perplexity increase per domain for `drop` and `reroute` pruning, against pruning the same number of random
experts (mean of `--seeds` seeds, the same random maps for every statistic). Prints markdown tables: the
pruning results per statistic, a summary of the math ratios, and the per-layer agreement (Spearman, kept
experts in common) of the approximate statistics with the exact ones. `--calib-chars` above 32768 continues
the calibration text from the same generator seed (corpus.math_text("calib", n)).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from torchforge.calibration import LayerwiseStreamer
from torchforge.prune import RANK_BY, build_expert_map, prune_experts, ranking_statistic
from torchforge.testing import corpus
from torchforge.testing.tiny_moe import DOMAINS, TINY_MOE_DIR, encode, load_text, load_tiny_moe, perplexity, windows

GOAL = 1 / 3  # issue 5: math increase at most a third of the random pruning's


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def random_map(num_layers: int, num_experts: int, keep_ratio: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return build_expert_map(torch.rand(num_layers, num_experts, generator=g), keep_ratio=keep_ratio)


def kept(stat: torch.Tensor, k: int) -> set[int]:
    return set(torch.sort(-stat.double(), stable=True).indices[:k].tolist())  # build_expert_map's order and ties


def calibration_text(n_chars: int) -> str:
    text = load_text("calib_math")
    return text[:n_chars] if n_chars <= len(text) else corpus.math_text("calib", n_chars)[:n_chars]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank-by", choices=("all", *RANK_BY), default="all")
    p.add_argument("--keep-ratio", type=float, default=0.5)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--eval-chars", type=int, default=16384)
    p.add_argument("--calib-chars", type=int, default=32768)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    stats_names = list(RANK_BY) if a.rank_by == "all" else [a.rank_by]
    t0 = time.time()

    model = load_tiny_moe(device=a.device)
    texts = {d: load_text(f"eval_{d}")[: a.eval_chars] for d in DOMAINS}
    base = {d: perplexity(model, texts[d], a.seq) for d in DOMAINS}
    print(f"unpruned held-out perplexity: " + ", ".join(f"{d} {v:.3f}" for d, v in base.items()), flush=True)

    calib = windows(encode(calibration_text(a.calib_chars)), a.seq).split(16)
    stats = {}
    for mode in ("exact", "approx"):
        streamer = LayerwiseStreamer(TINY_MOE_DIR, device=a.device, dtype=torch.float32)
        stats[mode] = streamer.collect_router_stats(calib, mode=mode)
    num_layers, num_experts = stats["exact"].hit_map.shape

    def deltas(expert_map, mode):
        pruned = prune_experts(copy.deepcopy(model), expert_map, mode=mode)
        return {d: perplexity(pruned, texts[d], a.seq) - base[d] for d in DOMAINS}

    rand = {m: [deltas(random_map(num_layers, num_experts, a.keep_ratio, s), m) for s in range(a.seeds)]
            for m in ("drop", "reroute")}
    rand_mean = {m: {d: sum(r[d] for r in rs) / len(rs) for d in DOMAINS} for m, rs in rand.items()}
    print(f"  random baselines done ({time.time() - t0:.0f}s)", flush=True)
    rows = {}
    for name in stats_names:
        for prune_mode in ("drop", "reroute"):
            for calib_mode in ("exact", "approx"):
                emap = build_expert_map(stats[calib_mode], keep_ratio=a.keep_ratio, rank_by=name)
                rows[name, prune_mode, calib_mode] = deltas(emap, prune_mode)
        print(f"  rank by {name} done ({time.time() - t0:.0f}s)", flush=True)

    k = round(a.keep_ratio * num_experts)
    print(f"\nPruning {num_experts - k} of {num_experts} routed experts in each of {num_layers} MoE layers, "
          f"calibrated on math ({sum(c.numel() for c in calib):,} tokens); held-out perplexity increase "
          f"(unpruned: " + ", ".join(f"{d} {v:.3f}" for d, v in base.items()) + f"); random = mean of {a.seeds} "
          "seeds, per seed (math): " + "; ".join(f"{m} " + ", ".join(f"{r['math']:+.3f}" for r in rs)
                                                   for m, rs in rand.items()) + ".")
    ratio = {}
    for name in stats_names:
        print(f"\nRanked by {name} (RouterStats.{RANK_BY[name]}):\n")
        print("| prune mode | calibration | Δ math | Δ prose | Δ code | Δ math, random | Δ prose, random | "
              "math Δ / random Δ (goal ≤ 0.33) | Δ math < Δ prose |")
        print("|---|---|---|---|---|---|---|---|---|")
        for prune_mode in ("drop", "reroute"):
            rnd = rand_mean[prune_mode]
            for calib_mode in ("exact", "approx"):
                got = rows[name, prune_mode, calib_mode]
                r = got["math"] / rnd["math"] if rnd["math"] > 0 else float("nan")
                ratio[name, prune_mode, calib_mode] = r
                print(f"| {prune_mode} | {calib_mode} | {got['math']:+.3f} | {got['prose']:+.3f} | {got['code']:+.3f} | "
                      f"{rnd['math']:+.3f} | {rnd['prose']:+.3f} | {r:.3f} | "
                      f"{'yes' if got['math'] < got['prose'] else 'NO'} |")

    cells = [(pm, cm) for pm in ("drop", "reroute") for cm in ("exact", "approx")]
    print("\nSummary: math Δ / random Δ per ranking statistic (goal ≤ 0.33; ✗ misses it).\n")
    print("| rank by | " + " | ".join(f"{pm}/{cm}" for pm, cm in cells) + " |")
    print("|---|" + "---|" * len(cells))
    for name in stats_names:
        print(f"| {name} | " + " | ".join(f"{ratio[name, pm, cm]:.3f}{'' if ratio[name, pm, cm] <= GOAL else ' ✗'}"
                                         for pm, cm in cells) + " |")

    print("\nApproximate vs exact calibration, per MoE layer and statistic: Spearman rank correlation, and how many "
          f"of the {k} experts each keeps are the same.\n")
    print("| MoE layer | " + " | ".join(f"{n}: Spearman | {n}: same kept" for n in stats_names) + " |")
    print("|---|" + "---|---|" * len(stats_names))
    for layer in range(num_layers):
        cols = []
        for name in stats_names:
            ex, ap = (ranking_statistic(stats[m], name)[layer] for m in ("exact", "approx"))
            cols.append(f"{spearman(ex, ap):.3f} | {len(kept(ex, k) & kept(ap, k))}/{k}")
        print(f"| {layer} | " + " | ".join(cols) + " |")
    print(f"\n({time.time() - t0:.0f}s on {a.device})")


if __name__ == "__main__":
    main()
