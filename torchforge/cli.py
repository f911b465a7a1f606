"""The `torchforge` command line."""
from __future__ import annotations

import argparse
import json
import sys


def _demo(args) -> int:
    from torchforge.demo import format_table, run_demo

    result = run_demo(out_dir=args.out, device=args.device)
    print(format_table(result))
    return 0 if result["reload matches"] else 1


def _inspect(args) -> int:
    from torchforge.io import format_inspect_report, inspect_checkpoint

    summary = inspect_checkpoint(args.checkpoint)
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(format_inspect_report(summary, max_rows=args.max_rows))
    return 0


def _plot_hitmap(args) -> int:
    import torch

    from torchforge.prune import build_expert_map, load_expert_map
    from torchforge.prune.heatmap import save_hitmap_png

    obj = torch.load(args.hit_map, map_location="cpu", weights_only=True)
    hit = obj.get("hit_map") if isinstance(obj, dict) else obj
    if args.expert_map:
        emap = load_expert_map(args.expert_map)
    elif args.keep_k or args.keep_ratio:
        emap = build_expert_map(hit, keep_k=args.keep_k, keep_ratio=args.keep_ratio)
    else:
        emap = None
    print(save_hitmap_png(args.out, hit, emap, cell=args.cell))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchforge", description="4-bit compression of dense and MoE LLMs")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="quantize a small DeepSeek-V3-architecture model, generate, export, reload")
    d.add_argument("--out", default=None, help="keep the exported checkpoint in this folder")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.set_defaults(func=_demo)
    i = sub.add_parser("inspect", help="list the tensors, formats and sizes of a checkpoint folder")
    i.add_argument("checkpoint")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--max-rows", type=int, default=50)
    i.set_defaults(func=_inspect)
    h = sub.add_parser("plot-hitmap", help="PNG heatmap of a hit_map [layers, experts], kept experts marked")
    h.add_argument("hit_map", help="a torch-saved [L, E] tensor, or a dict with a 'hit_map' tensor")
    h.add_argument("--out", default="hitmap.png")
    h.add_argument("--expert-map", default=None, help="expert_map.pt (or its folder) whose kept experts to mark")
    h.add_argument("--keep-k", type=int, default=None, help="mark the top-k experts of each layer")
    h.add_argument("--keep-ratio", type=float, default=None)
    h.add_argument("--cell", type=int, default=8, help="pixels per heatmap cell")
    h.set_defaults(func=_plot_hitmap)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"torchforge {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
