"""An AWQ dequantization written independently of the ops' reference, for the W4A16 kernel tests."""
from torchforge.ops import awq_unpack


def dequant_independent(qw, s, z, G):
    """(code - zero) * scale from unpacked nibbles, [OC, IC] fp32."""
    codes = awq_unpack(qw).float()
    zeros = awq_unpack(z).float().repeat_interleave(G, 0)
    return ((codes - zeros) * s.float().repeat_interleave(G, 0)).T
