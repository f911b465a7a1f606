"""Checkpoint summary behind ``torchforge inspect``: reads safetensors headers only, never tensor data."""
from __future__ import annotations

import json
import os
import re

import torch

from .checkpoint import _resolve, _torch_load, read_safetensors_header

__all__ = ["inspect_checkpoint", "format_inspect_report"]


def _natural_key(name: str):
    # layers.2 before layers.10
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _detect_formats(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> list[str]:
    """Quantization formats recognizable from tensor names (and dtypes)."""
    dtype_of = {name: dtype for name, dtype, _, _ in tensors}
    suffixes = {name.rsplit(".", 1)[-1] for name in dtype_of}
    formats = []
    if "g_idx" in suffixes:  # GPTQ writes qweight/qzeros/scales too, plus the act-order permutation
        formats.append("gptq")
    elif {"qweight", "qzeros", "scales"} <= suffixes:
        formats.append("awq")
    if "weight_scale_inv" in suffixes:
        formats.append("fp8-block")  # DeepSeek-V3/R1 128x128 block scales
    if "weight_scale_2" in suffixes:
        formats.append("nvfp4")  # ModelOpt NVFP4: fp8 block scales + fp32 global scale
    if "weight_packed" in suffixes:
        formats.append("compressed-tensors")
    if any(
        dtype.startswith("float8") and name.endswith(".weight")
        and name + "_scale" in dtype_of and name + "_scale_inv" not in dtype_of
        for name, dtype in dtype_of.items()
    ):
        formats.append("fp8")  # per-tensor / per-channel FP8 (weight + weight_scale)
    return formats


def _quantization_config(root: str):
    for fname, key in (("config.json", "quantization_config"), ("quantize_config.json", None), ("quant_config.json", None)):
        path = os.path.join(root, fname)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            continue
        qc = cfg.get(key) if key and isinstance(cfg, dict) else cfg
        if qc:
            return qc
    return None


def inspect_checkpoint(model_dir: str | os.PathLike) -> dict:
    """Summarize a checkpoint from its headers.

    Returns a dict with ``model_dir``, ``layout`` ("safetensors" or "pytorch-bin"), ``index_file``
    (or None), ``files`` (``[{"name", "bytes"}]``), ``total_bytes`` (on disk), ``num_tensors``,
    ``tensor_bytes``, ``dtypes`` (``{dtype: {"count", "bytes"}}``, largest first), ``formats``
    (detected quantization formats: "awq", "gptq", "fp8-block", "nvfp4", "compressed-tensors", "fp8";
    empty for a dense checkpoint), ``quantization_config`` (from config.json, or None) and
    ``tensors``: ``[(name, dtype, shape, bytes)]`` in natural name order, dtypes spelled as in torch.
    ``.bin`` checkpoints have to be unpickled (memory-mapped where possible) to be inspected.
    """
    layout = _resolve(model_dir)
    files = [{"name": f, "bytes": os.path.getsize(os.path.join(layout.root, f))} for f in layout.files]
    tensors: list[tuple[str, str, tuple[int, ...], int]] = []
    for fname in layout.files:
        path = os.path.join(layout.root, fname)
        if layout.kind == "safetensors":
            infos, _ = read_safetensors_header(path)
            tensors += [(i.name, i.torch_dtype_name, i.shape, i.nbytes) for i in infos.values()]
        else:
            for name, t in _torch_load(path).items():
                if isinstance(t, torch.Tensor):
                    dtype = str(t.dtype).removeprefix("torch.")
                    tensors.append((name, dtype, tuple(t.shape), t.numel() * t.element_size()))
    tensors.sort(key=lambda r: _natural_key(r[0]))
    dtypes: dict[str, dict[str, int]] = {}
    for _, dtype, _, nbytes in tensors:
        d = dtypes.setdefault(dtype, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += nbytes
    dtypes = dict(sorted(dtypes.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])))
    return {
        "model_dir": os.path.abspath(layout.root),
        "layout": "safetensors" if layout.kind == "safetensors" else "pytorch-bin",
        "index_file": layout.index_file,
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files),
        "num_tensors": len(tensors),
        "tensor_bytes": sum(r[3] for r in tensors),
        "dtypes": dtypes,
        "formats": _detect_formats(tensors),
        "quantization_config": _quantization_config(layout.root),
        "tensors": tensors,
    }


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def format_inspect_report(summary: dict, max_rows: int | None = 50) -> str:
    """Human-readable table of :func:`inspect_checkpoint`'s summary (at most ``max_rows`` tensors)."""
    files = summary["files"]
    layout = summary["layout"]
    if summary["index_file"]:
        layout += f", {len(files)} shards (index {summary['index_file']})"
    else:
        layout += f", single file {files[0]['name']}" if files else ""
    qc = summary["quantization_config"]
    lines = [
        f"checkpoint  {summary['model_dir']}",
        f"layout      {layout}",
        f"size        {_human_bytes(summary['total_bytes'])} on disk, "
        f"{summary['num_tensors']} tensors, {_human_bytes(summary['tensor_bytes'])} of tensor data",
        f"formats     {', '.join(summary['formats']) or 'none detected (dense)'}",
        f"quant cfg   {json.dumps(qc, sort_keys=True) if qc is not None else '-'}",
        "",
    ]
    lines += _table(
        ["dtype", "tensors", "bytes"],
        [[d, str(v["count"]), _human_bytes(v["bytes"])] for d, v in summary["dtypes"].items()],
        right={1, 2},
    )
    lines.append("")
    tensors = summary["tensors"]
    shown = tensors if max_rows is None else tensors[:max_rows]
    lines += _table(
        ["name", "dtype", "shape", "bytes"],
        [[n, d, "[" + ", ".join(map(str, s)) + "]", _human_bytes(b)] for n, d, s, b in shown],
        right={3},
    )
    if len(shown) < len(tensors):
        lines.append(f"... {len(tensors) - len(shown)} more tensors (showing {len(shown)} of {len(tensors)})")
    return "\n".join(lines) + "\n"
