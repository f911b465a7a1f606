"""torchforge: PyTorch-native 4-bit compression for dense and MoE LLMs.

    model = torchforge.quantize(model, "w4a16-rtn")
    torchforge.save_quantized(model, "out/")          # the recipe's export_format: here vLLM's AWQ layout
    model = torchforge.load_quantized("out/")
"""
__version__ = "0.1.0"

from torchforge import ops  # noqa: F401  (registers the torchforge:: ops)
from torchforge.export import load_quantized, save_quantized
from torchforge.export.stream_quantize import quantize_checkpoint
from torchforge.nn.awq_linear import use_mma_layout
from torchforge.prune import build_expert_map, prune_experts
from torchforge.quantize import quantize
from torchforge.recipe import Recipe

__all__ = ["Recipe", "build_expert_map", "load_quantized", "ops", "prune_experts", "quantize", "quantize_checkpoint",
           "save_quantized", "use_mma_layout"]
