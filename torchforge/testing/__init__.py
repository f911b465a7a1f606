"""Test and benchmark helpers: synthetic checkpoints of real architectures and the trained tiny MoE fixture."""
from torchforge.testing.checkpoint_factory import make_checkpoint
from torchforge.testing.tiny_moe import load_tiny_moe

__all__ = ["make_checkpoint", "load_tiny_moe"]
