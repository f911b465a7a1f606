"""The group size check the W4A16 modules run before using it as a divisor and in buffer shapes."""
from __future__ import annotations


def check_group_size(owner: str, group_size) -> int:
    """`group_size` as an int >= 1, else a ValueError naming `owner` (0 failed as a ZeroDivisionError and -1 as a
    negative buffer size). Per-channel quantization (AWQ's group_size=-1) is not supported: pass in_features."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{owner}: group_size={group_size!r} must be a positive int (weights per quantization group "
                         "along the input dimension, typically 32, 64 or 128; for one group per row pass in_features)")
    return group_size
