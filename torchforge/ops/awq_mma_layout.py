"""AWQ codes in tensor-core fragment order ("mma layout"), read by the CUDA kernel in csrc/awq_mma.cu.

vLLM's AWQ word holds 8 neighbouring output columns of one input row, an order built for unpacking along N.
An MMA A fragment (m16n8k16, the weight as the 16-row operand: output columns x k) needs, per lane, pairs
along k. This layout stores, for every 64 output columns (block `cb`), 64-k chunk `c` and 16-k step `s`, one
uint4 per lane L = 4g + t of a warp: word T (column tile of 16) holds the lane's whole A fragment, nibble
`p = 4 hi + 2 e + h` being the code of

    column 64 cb + 16 T + g + 8 h,   input row 64 c + 16 t + 4 s + 2 e + hi.

The kernel maps MMA k-index 2t + hi to row 16t + 4s + hi and 2t + 8 + hi to 16t + 4s + 2 + hi (A and B alike):
lane t then reads 16 consecutive elements of x per chunk, and fragment register r is nibbles (r, r + 4), one
shift and one mask away. Scales and zero points keep their AWQ layout; the conversion is exact both ways, so
checkpoints are written in vLLM's layout whatever a module runs with.

Shape: int32 `[OC / 64, IC * 8]` (OC and IC multiples of 64), `[E, OC / 64, IC * 8]` for stacked experts. Groups of
32 fit too: lane t's 16 rows of a chunk, 64 c + 16 t .. + 15, lie in group 2 c + t / 2.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._chunks import map_leading_chunks
from torchforge.ops.awq_reference import awq_pack_ref, awq_unpack_ref, w4a16_linear_ref

__all__ = ["awq_to_mma_layout", "mma_layout_to_awq", "awq_mma_linear_ref", "check_mma_layout_shape",
           "mma_layout_fits"]

# view of the codes [OC, IC] as [cb, T, h, g, c, t, s, e, hi] -> word order [cb, c, s, g, t, T] x nibble (hi, e, h)
_TO_MMA = (0, 4, 6, 3, 5, 1, 8, 7, 2)
_FROM_MMA = (0, 5, 8, 3, 1, 4, 2, 7, 6)


def mma_layout_fits(ic: int, oc: int, group_size: int) -> bool:
    """Whether a layer can run on the mma layout: 64-multiples, and groups of whole 64-row chunks (the kernels apply
    scales and zero points per chunk) or of 32 (lane t's 16 rows of a chunk, 16 t .. 16 t + 15, lie in one group of
    32: the decode kernels dequantize each register, csrc/awq_mma.cuh item_dq; the Hopper kernels, which do that
    anyway, read two rows of scales per chunk)."""
    return ic % 64 == 0 and oc % 64 == 0 and (group_size % 64 == 0 or group_size == 32)


def check_mma_layout_shape(ic: int, oc: int, what: str) -> None:
    if oc % 64 or ic % 64:
        raise ValueError(f"{what}: the mma layout needs OC and IC to be multiples of 64 (4 MMA tiles of 16 output "
                         f"columns, 64-row chunks of k), got OC={oc}, IC={ic}; keep the AWQ layout for this layer")


_CHUNK_WEIGHTS = 1 << 27  # matrices converted at a time along the leading dims: ~1 GB of temporaries


def _by_chunks(fn, t: Tensor, out_shape: tuple, weights_per_matrix: int) -> Tensor:
    """fn over the leading dims of t in chunks (load time, not a hot path): the temporaries stay bounded whatever
    the number of experts (all 256 experts of a DeepSeek-V3 layer at once needed 28 GB)."""
    flat = t.reshape(-1, *t.shape[-2:])
    out = map_leading_chunks(fn, (flat,), out_shape, weights_per_matrix, _CHUNK_WEIGHTS, torch.int32)
    return out.reshape(*t.shape[:-2], *out_shape)


def awq_to_mma_layout(qweight: Tensor) -> Tensor:
    """AWQ qweight int32 ``[..., IC, OC // 8]`` -> mma layout int32 ``[..., OC // 64, IC * 8]`` (exact, any device;
    a leading dim holds experts)."""
    if qweight.dtype != torch.int32 or qweight.dim() < 2:
        raise ValueError(f"awq_to_mma_layout: qweight must be an int32 AWQ tensor [..., IC, OC // 8], got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    *lead, ic, ocp = qweight.shape
    oc = ocp * 8
    check_mma_layout_shape(ic, oc, "awq_to_mma_layout")
    if lead and qweight.numel() * 8 > max(_CHUNK_WEIGHTS, ic * oc):  # (one matrix a chunk at most: no recursion)
        return _by_chunks(awq_to_mma_layout, qweight, (oc // 64, ic * 8), ic * oc)
    codes = awq_unpack_ref(qweight).transpose(-1, -2)  # uint8 [..., OC, IC]
    nl = len(lead)
    q = codes.reshape(*lead, oc // 64, 4, 2, 8, ic // 64, 4, 4, 2, 2)
    q = q.permute(*range(nl), *(nl + d for d in _TO_MMA)).reshape(*lead, oc // 64, ic * 8, 8)
    words = torch.zeros(q.shape[:-1], dtype=torch.int64, device=qweight.device)
    for p in range(8):  # one nibble at a time: temporaries of one byte per weight, not eight
        words |= q[..., p].to(torch.int64) << (4 * p)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the unsigned word, wrapped


def mma_layout_to_awq(qweight_mma: Tensor) -> Tensor:
    """Exact inverse of :func:`awq_to_mma_layout`: int32 ``[..., OC // 64, IC * 8]`` -> AWQ ``[..., IC, OC // 8]``."""
    if qweight_mma.dtype != torch.int32 or qweight_mma.dim() < 2 or qweight_mma.shape[-1] % 512:
        raise ValueError(f"mma_layout_to_awq: expected an int32 [..., OC // 64, IC * 8] tensor with IC a multiple of "
                         f"64, got {qweight_mma.dtype} {tuple(qweight_mma.shape)}")
    *lead, nb, k8 = qweight_mma.shape
    oc, ic = nb * 64, k8 // 8
    if lead and qweight_mma.numel() * 8 > max(_CHUNK_WEIGHTS, ic * oc):
        return _by_chunks(mma_layout_to_awq, qweight_mma, (ic, oc // 8), ic * oc)
    nl = len(lead)
    shifts = 4 * torch.arange(8, device=qweight_mma.device, dtype=torch.int32)
    nib = ((qweight_mma.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # arithmetic shift: the mask drops the sign
    nib = nib.reshape(*lead, oc // 64, ic // 64, 4, 8, 4, 4, 2, 2, 2)
    codes = nib.permute(*range(nl), *(nl + d for d in _FROM_MMA)).reshape(*lead, oc, ic)
    return awq_pack_ref(codes.transpose(-1, -2), check=False)  # nibbles: 4-bit by construction


def awq_mma_linear_ref(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                       bias: Optional[Tensor] = None) -> Tensor:
    """The oracle: the AWQ reference on the weight converted back."""
    return w4a16_linear_ref(x, mma_layout_to_awq(qweight_mma), scales, qzeros, group_size, bias)
