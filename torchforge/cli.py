"""The `torchforge` command line."""
from __future__ import annotations

import argparse
import json
import sys


def _torch_load(path: str, what: str, fix: str):
    """torch.load(path) on the CPU (weights only); a file it cannot read (truncated, foreign: pickle, zip and unpickler
    errors of every kind) is a ValueError naming `what` and the `fix`. A missing file raises as it is."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        raise ValueError(f"{what} cannot be read by torch.load ({type(e).__name__}: {e}); {fix}") from e


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_device(device: str | None) -> None:
    """A --device torch cannot parse, or CUDA on a machine without it: named here, not a traceback later."""
    import torch

    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device} is not a torch device ({e}); pass cpu or cuda (cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA device; pass --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: torchforge runs on cpu or cuda; pass one of them")


def _check_out_dir(out: str) -> None:
    """OUT, or a folder on its way, that is a file: refused before the model is loaded (os.makedirs would fail only
    after the whole quantization)."""
    import os

    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise ValueError(f"OUT {out}: {path} is a file, not a folder; pass a folder path")


def _demo(args) -> int:
    from torchforge.demo import format_table, run_demo

    _check_device(args.device)
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

    obj = _torch_load(args.hit_map, args.hit_map, "pass a torch-saved [L, E] tensor or a dict with a 'hit_map' tensor")
    hit = obj.get("hit_map") if isinstance(obj, dict) else obj
    if not isinstance(hit, torch.Tensor):
        what = (f"a dict without a 'hit_map' tensor (keys: {', '.join(map(str, list(obj)[:6]))})"
                if isinstance(obj, dict) else f"a {type(obj).__name__}")
        raise ValueError(f"{args.hit_map} holds {what}; pass a torch-saved [L, E] tensor or a dict with a "
                         "'hit_map' tensor (RouterStats.save writes one)")
    # hit counts rank and plot as their float values: float64, exact for integer counts past 2^24, as the library ranks
    hit = hit if hit.is_floating_point() else hit.double()
    if args.expert_map:
        emap = load_expert_map(args.expert_map)
    elif args.keep_k is not None or args.keep_ratio is not None:  # --keep-k 0 is an error, not "mark nothing"
        emap = build_expert_map(hit, keep_k=args.keep_k, keep_ratio=args.keep_ratio)
    else:
        emap = None
    print(save_hitmap_png(args.out, hit, emap, cell=args.cell))
    return 0


def _quantize(args) -> int:
    """Whole-checkpoint quantization: loaded with transformers, quantized by the recipe, exported; or with --stream
    (RTN only) one tensor at a time (torchforge.export.stream_quantize)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    import torchforge

    if not os.path.isfile(os.path.join(args.src, "config.json")):
        raise FileNotFoundError(f"{args.src} has no config.json: pass an HF checkpoint folder")
    if os.path.exists(args.out) and os.path.samefile(args.out, args.src):
        raise ValueError(f"OUT {args.out} is SRC: the export would replace the source checkpoint's files; pass "
                         "another folder")
    recipe = torchforge.Recipe.coerce(args.recipe)
    if args.format is not None:  # a format the scheme cannot take fails here, with the recipe's message, not after
        try:  # the whole model was loaded and quantized
            recipe = recipe.replace(export_format=args.format)
        except ValueError as e:
            raise ValueError(f"--format {args.format} does not fit recipe {args.recipe}: {e}") from None
    _check_device(args.device)
    _check_out_dir(args.out)
    if args.stream and (args.format not in (None, "vllm-awq") or args.calib_ids):
        raise ValueError("--stream writes vllm-awq by round-to-nearest, one tensor at a time: it takes no "
                         f"{'--calib-ids' if args.calib_ids else f'--format {args.format}'} (drop --stream to load the "
                         "whole model)")
    if args.stream:
        from torchforge.export.stream_quantize import quantize_checkpoint

        out = quantize_checkpoint(args.src, args.out, recipe, device=args.device)
        print(f"{args.src} -> {out} (vllm-awq, streamed tensor by tensor, group {recipe.group_size})")
        return 0
    calib = None
    if args.calib_ids:
        calib = _torch_load(args.calib_ids, f"--calib-ids {args.calib_ids}",
                            "save the input_ids with torch.save(tensor, path)")
        if not isinstance(calib, torch.Tensor) or calib.dim() != 2 or calib.is_floating_point():
            raise ValueError(f"--calib-ids {args.calib_ids}: expected a saved integer input_ids tensor [N, S]")
        _check_calib_ids(calib, args.calib_ids, args.src)
    elif recipe.scheme == "w4a16-gptq":
        print("torchforge quantize: no --calib-ids; GPTQ falls back to RTN for every module", file=sys.stderr)
    from torchforge.io import check_checkpoint_files

    check_checkpoint_files(args.src)  # a damaged shard named before transformers reads it (its errors name no file)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(args.src, dtype=getattr(torch, recipe.dtype),
                                                           output_loading_info=True)
    except ImportError as e:  # e.g. a block-FP8 (DeepSeek-V3) source: transformers' FP8 loader wants accelerate
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{args.src}: transformers cannot load this checkpoint ({first}); for a round-to-nearest "
                         "recipe pass --stream, which reads it tensor by tensor (block FP8 dequantized); nothing "
                         "was written") from e
    except RuntimeError as e:  # e.g. fused experts assembled from a shard set missing one expert: a size mismatch
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{args.src}: transformers cannot load this checkpoint ({first}); nothing was written "
                         "(torchforge quantize --stream names a missing tensor)") from e
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers initialises them at random and goes on: an export of those would look complete
        raise ValueError(f"{args.src}: the checkpoint lacks {len(missing)} tensor(s) the model needs "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); nothing was written")
    model = model.to(args.device).eval()
    torchforge.quantize(model, recipe, calib_data=calib)
    fmt = recipe.export_format
    out = torchforge.save_quantized(model, args.out, format=fmt, source_dir=args.src)
    print(f"{args.src} -> {out} ({fmt}, recipe {recipe.scheme}, group {recipe.group_size})")
    return 0


def _check_calib_ids(calib, path: str, src: str) -> None:
    """Token ids outside [0, vocab_size): an IndexError deep in the embedding after the model was loaded."""
    import os

    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if calib.numel() == 0:
        raise ValueError(f"--calib-ids {path} is empty (shape {tuple(calib.shape)}); save at least one sequence")
    lo, hi = int(calib.min()), int(calib.max())
    if lo < 0 or (isinstance(vocab, int) and hi >= vocab):
        vocab_range = f"[0, {vocab}) ({src}/config.json vocab_size)" if isinstance(vocab, int) else "(ids >= 0)"
        raise ValueError(f"--calib-ids {path}: token ids span [{lo}, {hi}], outside the model's vocabulary "
                         f"{vocab_range}; tokenize with the model's tokenizer")


def _non_negative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is negative")
    return v


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not positive")
    return v


def build_parser() -> argparse.ArgumentParser:
    from torchforge.recipe import EXPORT_FORMATS

    p = argparse.ArgumentParser(prog="torchforge", description="4-bit compression of dense and MoE LLMs")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="quantize a small DeepSeek-V3-architecture model, generate, export, reload")
    d.add_argument("--out", default=None, help="keep the exported checkpoint in this folder")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.set_defaults(func=_demo)
    i = sub.add_parser("inspect", help="list the tensors, formats and sizes of a checkpoint folder")
    i.add_argument("checkpoint")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--max-rows", type=_non_negative, default=50)
    i.set_defaults(func=_inspect)
    q = sub.add_parser("quantize", help="quantize an HF checkpoint folder with a recipe and export it")
    q.add_argument("src", help="HF checkpoint folder (config.json + safetensors)")
    q.add_argument("out", help="output folder")
    q.add_argument("--recipe", default="w4a16-rtn", help="preset name or a YAML/JSON recipe file")
    q.add_argument("--format", default=None, choices=EXPORT_FORMATS,
                   help="export format (default: the recipe's export_format)")
    q.add_argument("--calib-ids", default=None, help="torch-saved input_ids [N, S] for calibrated schemes")
    q.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    q.add_argument("--stream", action="store_true", help="round-to-nearest recipes: one tensor at a time, any model "
                   "size (the default loads the whole model)")
    q.set_defaults(func=_quantize)
    h = sub.add_parser("plot-hitmap", help="PNG heatmap of a hit_map [layers, experts], kept experts marked")
    h.add_argument("hit_map", help="a torch-saved [L, E] tensor, or a dict with a 'hit_map' tensor")
    h.add_argument("--out", default="hitmap.png")
    h.add_argument("--expert-map", default=None, help="expert_map.pt (or its folder) whose kept experts to mark")
    h.add_argument("--keep-k", type=int, default=None, help="mark the top-k experts of each layer")
    h.add_argument("--keep-ratio", type=float, default=None)
    h.add_argument("--cell", type=_positive, default=8, help="pixels per heatmap cell")
    h.set_defaults(func=_plot_hitmap)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"torchforge {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
