"""Checkpoint I/O: streaming reads of safetensors/.bin checkpoints (with DeepSeek block-FP8
dequantization), atomic sharded writes, and header-only inspection."""
from .checkpoint import CheckpointError, check_checkpoint_files, checkpoint_tensor_names, iter_checkpoint, load_state_dict
from .fp8 import dequantize_fp8_block
from .inspect import format_inspect_report, inspect_checkpoint
from .save import atomic_write_json, atomic_write_text, save_sharded

__all__ = [
    "iter_checkpoint",
    "save_sharded",
    "load_state_dict",
    "checkpoint_tensor_names",
    "dequantize_fp8_block",
    "inspect_checkpoint",
    "format_inspect_report",
    "CheckpointError",
    "check_checkpoint_files",
    "atomic_write_text",
    "atomic_write_json",
]
