"""`save_pretrained` / `push_to_hub` on a model holding torchforge modules: refused, with the call to use instead.

transformers would write the packed tensors under their in-memory names beside a config.json without a
quantization_config, and `from_pretrained` of that folder initialises every quantized layer at random (a load
report is all it prints). `torchforge.save_quantized` writes the formats vLLM and transformers read."""


def _refused(*args, **kwargs):
    raise RuntimeError("save_pretrained / push_to_hub would write a folder that reloads with random weights in place "
                       "of the quantized layers: use torchforge.save_quantized(model, out_dir[, format=...]) (reload "
                       "it with torchforge.load_quantized, or serve it with vLLM)")


def refuse_hf_save(model) -> None:
    """Shadows the instance's save_pretrained and push_to_hub (a module-level function: the model still pickles)."""
    model.save_pretrained = _refused
    model.push_to_hub = _refused
