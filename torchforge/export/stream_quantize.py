"""Round-to-nearest W4A16 of a whole checkpoint, one tensor at a time (`torchforge quantize --stream`).

Neither host nor GPU memory ever holds more than one tensor and one output shard, so a 671B checkpoint (bf16, or
DeepSeek's block FP8, dequantized per tensor) is quantized on one GPU. The output is the checkpoint
`torchforge.quantize(model, recipe)` + `save_quantized(model, out, "vllm-awq")` would write, tensor for tensor:
the same module selection (the recipe matched against a meta-device skeleton of the model), the same
`quantization_config`, per-expert names, fp32 for the tensors transformers keeps in fp32. RTN needs no
activations; calibrated schemes (GPTQ, NVFP4 input scales) and pruning need the model and are refused.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from torchforge.export.folder import begin_folder, finish_folder, keep_fp32
from torchforge.export.gptq_export import _w4_modules, check_vllm_kernels
from torchforge.export.load import _build_skeleton, _swap_quantized_modules
from torchforge.export.naming import EXPERT_KEY, from_checkpoint_name, to_checkpoint_name
from torchforge.export.vllm_awq import vllm_awq_quantization_config
from torchforge.io import iter_checkpoint
from torchforge.io.checkpoint import CheckpointError
from torchforge.io.shard_writer import ShardWriter
from torchforge.matching import is_fused_experts
from torchforge.ops import awq_quantize
from torchforge.quantize import check_selection
from torchforge.recipe import Recipe

log = logging.getLogger(__name__)


def _targets(model: nn.Module, recipe: Recipe) -> tuple[set[str], set[str]]:
    """(Linear module names, fused-experts module names) that `torchforge.quantize` would quantize."""
    selected = recipe.select(model, check_fused=False)
    check_selection(model, selected, recipe)  # before any shard is written, as quantize does
    linears = {n for n, m in selected if isinstance(m, nn.Linear)}
    experts = {n for n, m in selected if is_fused_experts(m)} if recipe.quantize_experts else set()
    return linears, experts


class _ExpectedTensors:
    """The tensors the model holds (the meta skeleton's state dict, fused experts as their per-expert checkpoint
    tensors): which streamed tensors to keep, and which never came. from_pretrained ignores the others (e.g.
    `_keys_to_ignore_on_load_unexpected`: DeepSeek-V3's multi-token-prediction layer), so the in-memory path never
    exports them; a missing one would only fail at load, after a complete-looking folder was written."""

    def __init__(self, model: nn.Module):
        self.fused = {n: m.gate_up_proj.shape[0] for n, m in model.named_modules() if is_fused_experts(m)}
        fused_params = {f"{n}.{p}" for n in self.fused for p in ("gate_up_proj", "down_proj")}
        self.missing = set(model.state_dict().keys()) - fused_params
        self.missing |= {(n, e, proj) for n, num in self.fused.items() for e in range(num)
                         for proj in ("gate_proj", "up_proj", "down_proj")}
        self.skipped: list[str] = []

    def take(self, name: str) -> bool:
        m = EXPERT_KEY.match(name)
        if m and m["module"] in self.fused:
            if int(m["e"]) >= self.fused[m["module"]]:
                # from_pretrained refuses it (the stacked experts do not fit); skipping it would write a checkpoint
                # missing experts the source has, under a config.json that disagrees with the source's shards
                raise CheckpointError(f"quantize_checkpoint: the source holds {name}, but its config.json gives "
                                      f"{m['module']} {self.fused[m['module']]} routed experts (ids 0.."
                                      f"{self.fused[m['module']] - 1}); fix the config's expert count or the shards; "
                                      "nothing was written")
            if m["kind"] == "weight":
                self.missing.discard((m["module"], int(m["e"]), m["proj"]))
                return True
        elif name in self.missing:
            self.missing.discard(name)
            return True
        self.skipped.append(name)
        return False

    def check_complete(self, src: str, tied: bool) -> None:
        missing = sorted(str(k) for k in self.missing if not (tied and k == "lm_head.weight"))
        if missing:
            raise CheckpointError(f"quantize_checkpoint: {src} lacks {len(missing)} tensors of the model, e.g. "
                                  f"{', '.join(missing[:5])}; the checkpoint is incomplete (a missing shard or an "
                                  "index that does not list it); nothing was written")


def quantize_checkpoint(src: str, out: str, recipe: Recipe | str | dict = "w4a16-rtn", *, device=None,
                        max_shard_bytes: int = 5 * 2**30) -> str:
    """Streams `src` (an HF checkpoint folder) into a vllm-awq checkpoint at `out`; returns `out`."""
    recipe = Recipe.coerce(recipe)
    if recipe.scheme != "w4a16-rtn" or recipe.prune is not None:
        raise ValueError(f"streamed quantization does round-to-nearest W4A16 only (recipe scheme {recipe.scheme!r}"
                         f"{', with a prune section' if recipe.prune is not None else ''}); calibrated schemes and "
                         "pruning need the model in memory: use torchforge.quantize + save_quantized")
    if recipe.export_format != "vllm-awq":
        raise ValueError(f"streamed quantization writes vllm-awq; the recipe asks for {recipe.export_format!r}")
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise FileNotFoundError(f"{src} has no config.json: pass an HF checkpoint folder")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, recipe.dtype)
    model, _ = _build_skeleton(src, dtype)  # meta device: names, module types, config
    linears, experts = _targets(model, recipe)
    expected = _ExpectedTensors(model)
    G, sym = recipe.group_size, recipe.symmetric
    # the skeleton as quantize() would leave it, for the quantization_config (module names only, still meta)
    _swap_quantized_modules(model, {f"{n}.qweight" for n in linears} | {f"{n}.0.gate_proj.qweight" for n in experts},
                            G, sym)
    qcfg = vllm_awq_quantization_config(model)
    check_vllm_kernels(_w4_modules(model), "vllm-awq")  # as save_quantized: e.g. group 16 needs --dtype float16
    mt = model.config.model_type
    fp32_keys = keep_fp32(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    writer = ShardWriter(out, max_shard_bytes, metadata={"torchforge": "vllm-awq"})  # refuses a folder with shards
    try:
        # what a killed earlier export may have left beside no shards: its side files (a stale expert_map.pt made
        # load_quantized read this checkpoint as drop-pruned), generation config and tokenizer files
        begin_folder(out, src)
        # FP8 weights are dequantized straight to bf16 only for a bf16 recipe: another dtype reads them in fp32 and
        # casts once, as from_pretrained(dtype=...) holds them (bf16 first would round them twice)
        read_dtype = None if dtype == torch.bfloat16 else torch.float32
        for ck_name, t in iter_checkpoint(src, dequantize_fp8=True, dtype=read_dtype):
            name = from_checkpoint_name(ck_name, mt)
            if not expected.take(name):
                continue  # not a tensor of the model (e.g. DeepSeek-V3's multi-token-prediction layer 61)
            owner, _, leaf = name.rpartition(".")
            if t.is_floating_point():  # as from_pretrained(dtype=...) would hold it
                t = t.float() if any(k in name for k in fp32_keys) else t.to(dtype)
            m = EXPERT_KEY.match(name)
            if (m and m["module"] in experts and m["kind"] == "weight") or (owner in linears and leaf == "weight"):
                try:
                    qweight, scales, qzeros = awq_quantize(t.to(device), G, symmetric=sym)
                except ValueError as e:
                    raise ValueError(f"quantize_checkpoint: cannot quantize {ck_name} (in {src}): {e}") from e
                for kind, q in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
                    writer.add(to_checkpoint_name(f"{owner}.{kind}", mt), q)
                continue
            if tied and name == "lm_head.weight":
                continue  # tied to embed_tokens; HF and vLLM re-tie at load
            writer.add(to_checkpoint_name(name, mt), t)
        expected.check_complete(src, tied)
        if expected.skipped:
            log.info("quantize_checkpoint: skipped %d tensors the model does not hold (as from_pretrained does), "
                     "e.g. %s", len(expected.skipped), expected.skipped[0])
        writer.close()
    except BaseException:
        writer.abort()
        raise
    meta = {"format": "vllm-awq", "recipe": recipe.to_dict(), "symmetric": [sym], "streamed": True}
    return finish_folder(model, out, qcfg, dtype, meta, source_dir=src)
