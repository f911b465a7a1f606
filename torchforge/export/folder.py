"""What every export format writes besides its tensors, and pieces of the state dict they share."""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
from torch import nn

from torchforge.io import atomic_write_json
from torchforge.io.save import _atomic_write, _fsync_dir, _fsync_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
TORCHFORGE_META = "torchforge.json"


def keep_fp32(model: nn.Module) -> tuple[str, ...]:
    """Name fragments of tensors transformers keeps in fp32 (e.g. DeepSeek-V3's e_score_correction_bias)."""
    return tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) + tuple(
        getattr(model, "_keep_in_fp32_modules", None) or ())


def restore_fp32(model: nn.Module) -> nn.Module:
    """Casts the tensors named by `keep_fp32` back to fp32 (meta tensors too). `from_config(dtype=bf16)` casts
    everything, while `from_pretrained` and our exports keep them fp32: a skeleton must match what was saved, or
    e.g. a bf16-rounded router bias changes expert choices."""
    keep = keep_fp32(model)
    if keep:
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if any(k in name for k in keep) and t.is_floating_point():
                t.data = t.data.float()
    return model


def hf_experts_tensors(name: str, experts: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Unquantized HF fused experts -> the per-expert `{name}.{e}.{gate,up,down}_proj.weight` that checkpoints
    and vLLM use (gate_up_proj holds gate rows first)."""
    out = {}
    I = experts.gate_up_proj.shape[1] // 2
    for e in range(experts.gate_up_proj.shape[0]):
        out[f"{name}.{e}.gate_proj.weight"] = experts.gate_up_proj[e, :I].to(dtype)
        out[f"{name}.{e}.up_proj.weight"] = experts.gate_up_proj[e, I:].to(dtype)
        out[f"{name}.{e}.down_proj.weight"] = experts.down_proj[e].to(dtype)
    return out


def copy_tokenizer_files(src: str | None, out_dir: str) -> list[str]:
    copied = []
    if src and os.path.isdir(src):
        for f in TOKENIZER_FILES:
            p = os.path.join(src, f)
            if os.path.isfile(p):
                # as every other file of the export: a unique fsynced temporary (removed where the copy fails, e.g. a
                # full disk) renamed into place, so a durable config.json never sits beside a truncated tokenizer
                _atomic_write(os.path.join(out_dir, f), lambda tmp, p=p: shutil.copyfile(p, tmp))
                copied.append(f)
    return copied


def save_tokenizer(tokenizer, out_dir: str) -> list[str]:
    """`tokenizer.save_pretrained(out_dir)`, each file atomically: transformers writes straight into the folder, so a
    crash could leave a half-written tokenizer.json that looks complete. It saves into a private hidden folder of
    `out_dir` instead, whose files are fsynced and then renamed into place; returns the paths (relative) moved."""
    tmp_dir = tempfile.mkdtemp(prefix=".tokenizer.tmp.", dir=out_dir)
    try:
        tokenizer.save_pretrained(tmp_dir)
        rel = sorted(os.path.relpath(os.path.join(d, f), tmp_dir) for d, _, files in os.walk(tmp_dir) for f in files)
        for r in rel:  # all durable before the first rename
            _fsync_file(os.path.join(tmp_dir, r))
        dirs = set()
        for r in rel:
            dst = os.path.join(out_dir, r)
            dirs.add(os.path.dirname(dst))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(os.path.join(tmp_dir, r), dst)
        for d in sorted(dirs):
            _fsync_dir(d)
        return rel
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


# Side files of an earlier export that this one may not write again: a ModelOpt hf_quant_config.json (vLLM reads it
# where config.json has no quantization_config, and load_quantized checks the two agree) and a drop-pruned model's
# expert_map.pt (load_quantized would re-prune).
STALE_SIDE_FILES = ("hf_quant_config.json", "expert_map.pt", TORCHFORGE_META)


def tokenizer_source(model: nn.Module, source_dir: str | None) -> str | None:
    """The folder whose tokenizer files an export copies: `source_dir`, else the one the model was loaded from."""
    return source_dir or getattr(model, "name_or_path", None)


def _same_folder(a: str | None, b: str) -> bool:
    try:
        return bool(a) and os.path.isdir(a) and os.path.samefile(a, b)
    except OSError:
        return False


def refuse_source_folder(model: nn.Module, out_dir: str) -> None:
    """Raises where `out_dir` is the folder the model was loaded from (`name_or_path`): an export there replaces that
    checkpoint's config and shards (the CLI refuses OUT = SRC for the same reason)."""
    if _same_folder(getattr(model, "name_or_path", None), out_dir):
        raise ValueError(f"{out_dir} is the folder this model was loaded from: an export there would replace that "
                         "checkpoint; write it to another folder")


def _has_tokenizer_files(folder: str | None) -> bool:
    return bool(folder) and os.path.isdir(folder) and any(
        os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def begin_folder(out_dir: str, tokenizer_from: str | None = None, *, tokenizer=None) -> None:
    """Before an export writes anything into `out_dir`: create it, and take away a config.json an earlier save left
    (and its generation_config.json, which finish_folder only writes where none exists). A folder with a config.json
    counts as complete, so a re-save that dies after its new shards must not leave the old one beside them. The
    earlier save's side files go too (STALE_SIDE_FILES), and its tokenizer files (TOKENIZER_FILES: another model's
    tokenizer.json or chat template must not stay beside this one's) where this export writes a tokenizer of its own
    (a `tokenizer` object, or files in the folder `tokenizer_from`, unless that is `out_dir`): a tokenizer the user
    saved into `out_dir` first, for an export with none to copy, stays."""
    os.makedirs(out_dir, exist_ok=True)
    replaced = tokenizer is not None or (_has_tokenizer_files(tokenizer_from)
                                         and not _same_folder(tokenizer_from, out_dir))
    for name in ("config.json", "generation_config.json", *(TOKENIZER_FILES if replaced else ()), *STALE_SIDE_FILES):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            os.remove(path)


def write_side_files(model: nn.Module, out_dir: str, meta: dict, *, tokenizer=None, source_dir=None) -> None:
    """torchforge.json, tokenizer files (`tokenizer`, else copied from `tokenizer_source`) and generation_config.json
    (the source's, else the model's): what every export writes besides its tensors and config.json."""
    atomic_write_json(os.path.join(out_dir, TORCHFORGE_META), meta)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out_dir)
    copy_tokenizer_files(tokenizer_source(model, source_dir), out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None and not os.path.exists(os.path.join(out_dir, "generation_config.json")):
        atomic_write_json(os.path.join(out_dir, "generation_config.json"), gen.to_dict())


def finish_folder(model: nn.Module, out_dir: str, quantization_config: dict, dtype: torch.dtype, meta: dict, *,
                  tokenizer=None, source_dir=None, edit_config=None) -> str:
    """After the tensors: torchforge.json, tokenizer files, generation_config.json, and config.json LAST, so a
    folder with a config.json is a complete checkpoint. `edit_config(cfg)` may change the config dict."""
    write_side_files(model, out_dir, meta, tokenizer=tokenizer, source_dir=source_dir)
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["quantization_config"] = quantization_config
    # transformers 5 writes `dtype`; older readers (and vLLM versions) look for `torch_dtype`.
    cfg["dtype"] = cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    if edit_config is not None:
        edit_config(cfg)
    atomic_write_json(os.path.join(out_dir, "config.json"), cfg)
    return out_dir
