"""`save_pretrained` / `push_to_hub` on a model holding torchforge modules: refused, with the call to use instead.

transformers would write the packed tensors under their in-memory names beside a config.json without a
quantization_config, and `from_pretrained` of that folder initialises every quantized layer at random (a load
report is all it prints). `torchforge.save_quantized` writes the formats vLLM and transformers read. A pruned model's
config.json would keep the original routed-expert count beside fewer experts per layer (`from_pretrained` fails, or
loads random experts with ignore_mismatched_sizes): `torchforge.prune.save_pruned` writes the smaller config."""
from __future__ import annotations

from functools import partial

QUANTIZED = ("save_pretrained / push_to_hub would write a folder that reloads with random weights in place of the "
             "quantized layers: use torchforge.save_quantized(model, out_dir[, format=...]) (reload it with "
             "torchforge.load_quantized, or serve it with vLLM)")


def _refused(message: str, *args, **kwargs):
    raise RuntimeError(message)


def refuse_hf_save(model, message: str | None = None) -> None:
    """Shadows the instance's save_pretrained and push_to_hub with a partial of a module-level function (the model
    still pickles) that raises `message` (default: the quantized-model one)."""
    refusal = partial(_refused, QUANTIZED if message is None else message)
    model.save_pretrained = refusal
    model.push_to_hub = refusal


def hf_save_refused(model) -> bool:
    """Whether `refuse_hf_save` was applied to this instance."""
    return getattr(vars(model).get("save_pretrained"), "func", None) is _refused
