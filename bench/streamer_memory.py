"""Memory and time of the layer-by-layer calibration streamer (seed 000 section 1) on DeepSeek-V3 layer shapes.

    python bench/streamer_memory.py [--experts 16] [--layers 8] [--tokens 4096] [--seq 1024] [--bf16] [--json out.json]
    python bench/streamer_memory.py --tiny        # CPU-sized check that the script works (not a measurement)

Writes (torchforge.testing.make_checkpoint, values drawn on the GPU when there is one) an 8-layer checkpoint with
DeepSeek-V3's layer shapes: hidden 7168, MLA (128 heads, q_lora 1536, kv_lora 512, qk 128+64, v 128), routed
experts of moe_intermediate 2048 but only --experts of them (256 in the real model), one shared expert,
first_k_dense_replace=1 with a dense intermediate of 4096 (18432 in the real model), vocabulary 32000; FP8
(DeepSeek's 128x128 block layout) unless --bf16. About 8.5 GB on disk with FP8 and 16 experts (16 GB bf16).

Then runs LayerwiseStreamer in "exact" and "approx" mode with each layer's attention and MLP halves as separate
stages (the default), and "exact" with whole layers (split_layers=False) as the baseline, each in a fresh process
(so that its peak RSS is its own), on --tokens random tokens in batches of [1, --seq], with offload on: the host budget for hidden states
is 2 batches, the rest is spilled to a folder next to the checkpoint. Prints, per mode: largest layer weight
bytes (both halves; for approx without the routed experts, which it never reads), the most weight bytes on the
device at once (one stage), bytes of one batch's hidden states, peak GPU bytes (torch.cuda.max_memory_allocated),
peak / (layer + chunk) against the checkpoint's largest full layer (what the goal names) and against the layer
the mode reads, peak host RSS and the activation bytes held against the budget, spill count, median
seconds per layer, and for approx how many of each layer's top-k experts by hit_map agree with exact mode.
Runtime on an H100: about 1-2 minutes, most of it writing the checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _write(path: str, args) -> float:
    from torchforge.testing.checkpoint_factory import DEEPSEEK_V3_ATTENTION, make_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        shapes = dict(hidden_size=256, moe_intermediate_size=128, vocab_size=512, intermediate_size=512)
    else:
        shapes = dict(hidden_size=7168, moe_intermediate_size=2048, vocab_size=32000, intermediate_size=4096,
                      **DEEPSEEK_V3_ATTENTION)
    start = time.perf_counter()
    make_checkpoint(path, "deepseek_v3", num_layers=args.layers, n_routed_experts=args.experts, fp8=not args.bf16,
                    first_k_dense_replace=1, shard_size_bytes=2 * 2**30, device=device, **shapes)
    return time.perf_counter() - start


def _config(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "config.json")) as f:
        return json.load(f)


def _child(args) -> None:
    """One streamer run; prints its measurements as one JSON line."""
    from torchforge.calibration import LayerwiseStreamer

    g = torch.Generator().manual_seed(0)
    vocab = _config(args.ckpt)["vocab_size"]
    batches = [torch.randint(0, vocab, (1, args.seq), generator=g) for _ in range(max(1, args.tokens // args.seq))]
    streamer = LayerwiseStreamer(args.ckpt, args.offload, host_budget_bytes=args.budget,
                                 split_layers=not args.whole)
    if streamer.device.type == "cuda":  # cuBLAS's workspace (a fixed cost per process) before the measurement
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    start = time.perf_counter()
    stats = streamer.collect_router_stats(batches, mode=args.child)
    total = time.perf_counter() - start
    if not args.whole:
        stats.save(os.path.join(args.offload, f"stats_{args.child}.pt"))
    print(json.dumps({
        "mode": args.child + (" (whole layers)" if args.whole else ""), "device": str(streamer.device),
        "layer_bytes": streamer.largest_layer_bytes, "stage_bytes": streamer.largest_stage_bytes,
        "chunk_bytes": streamer.max_chunk_bytes, "peak_gpu_bytes": streamer.peak_gpu_bytes,
        "host_activation_bytes": streamer.peak_host_activation_bytes, "budget": args.budget,
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "spills": streamer.spills,
        "s_per_layer": statistics.median(streamer.layer_seconds), "total_s": total, "tokens": stats.tokens,
        "spill_files_left": len([f for f in os.listdir(args.offload) if f.startswith("hs_")]),
    }))


def _mb(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e3:,.1f} kB" if n < 1e6 else f"{n / 1e6:,.1f} MB"


def _topk_agreement(offload: str, k: int) -> str:
    from torchforge.calibration import RouterStats

    exact, approx = (RouterStats.load(os.path.join(offload, f"stats_{m}.pt")) for m in ("exact", "approx"))
    same = [len(set(e.topk(k).indices.tolist()) & set(a.topk(k).indices.tolist())) / k
            for e, a in zip(exact.hit_map, approx.hit_map)]
    return f"{statistics.mean(same):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on whatever device there is (a smoke test)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--bf16", action="store_true", help="bf16 checkpoint instead of DeepSeek FP8")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (a temporary folder inside)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=("exact", "approx"), help=argparse.SUPPRESS)
    ap.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--offload", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    if args.tiny:
        args.layers, args.experts, args.tokens, args.seq = min(args.layers, 4), min(args.experts, 8), 256, 64

    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="streamer-bench-", dir=args.workdir) as work:
        ckpt, offload = os.path.join(work, "ckpt"), os.path.join(work, "offload")
        os.makedirs(offload)
        write_s = _write(ckpt, args)
        disk = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        hidden = _config(ckpt)["hidden_size"]
        budget = 2 * args.seq * hidden * 2  # two bf16 batches: the rest spills
        rows = []
        for mode, whole in (("exact", True), ("exact", False), ("approx", False)):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--ckpt", ckpt, "--offload", offload,
                   "--budget", str(budget), "--tokens", str(args.tokens), "--seq", str(args.seq)] + ["--whole"] * whole
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
            if r.returncode != 0:
                sys.exit(f"{mode} run failed:\n{r.stderr[-4000:]}")
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        top_k = _config(ckpt)["num_experts_per_tok"]
        agreement = _topk_agreement(offload, top_k)

    print(f"checkpoint: {args.layers} layers, {args.experts} routed experts, hidden {hidden}, "
          f"{'bf16' if args.bf16 else 'FP8 (128x128 blocks)'}, {_mb(disk)} written in {write_s:.1f} s; "
          f"{rows[0]['tokens']} tokens in batches of [1, {args.seq}]; device {rows[0]['device']}, "
          f"torch {torch.__version__}")
    full_layer = rows[0]["layer_bytes"]
    header = ["mode", "largest layer weights", "most weights at once", "activation chunk", "peak GPU",
              "peak / (full layer + chunk)", "peak / (layer read + chunk)", "peak RSS", "activations on host (peak) / budget", "spills", "s / layer", f"top-{top_k} agreement"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        peak = r["peak_gpu_bytes"]
        ratio = "n/a" if peak is None else f"{peak / (full_layer + r['chunk_bytes']):.2f}"
        ratio_read = "n/a" if peak is None else f"{peak / (r['layer_bytes'] + r['chunk_bytes']):.2f}"
        cells = [r["mode"], _mb(r["layer_bytes"]), _mb(r["stage_bytes"]), _mb(r["chunk_bytes"]),
                 _mb(r["peak_gpu_bytes"]), ratio, ratio_read,
                 _mb(r["rss_bytes"]), f"{_mb(r['host_activation_bytes'])} / {_mb(r['budget'])}", r["spills"],
                 f"{r['s_per_layer']:.3f}", "1 (reference)" if r["mode"].startswith("exact") else agreement]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        if r["spill_files_left"]:
            sys.exit(f"{r['mode']}: {r['spill_files_left']} spill files were not cleaned up")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "disk_bytes": disk, "write_s": write_s, "topk_agreement": agreement}, f, indent=2)


if __name__ == "__main__":
    main()
