"""torchforge: PyTorch-native 4-bit compression for dense and MoE LLMs."""
__version__ = "0.1.0"
