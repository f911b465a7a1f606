from torchforge.export.load import load_quantized
from torchforge.export.vllm_awq import export_state_dict, save_quantized, vllm_awq_quantization_config

__all__ = ["export_state_dict", "load_quantized", "save_quantized", "vllm_awq_quantization_config"]
