"""Pure-PyTorch reference of the GPTQ W4 checkpoint layout (AutoGPTQ / vLLM ``quant_method: gptq``).

For a linear layer with IC input and OC output channels, group size G:

* ``qweight`` int32 ``[IC // 8, OC]``: word ``[r, o]`` packs the 4-bit codes of input rows ``8r .. 8r+7``
  of output column ``o``, row ``8r + j`` in bits ``4j .. 4j+3`` (sequential along IC; AWQ instead packs 8
  *output* columns per word in the order 0, 2, 4, 6, 1, 3, 5, 7).
* ``qzeros`` int32 ``[IC // G, OC // 8]``: word ``[g, c]`` packs the zero points of outputs
  ``8c .. 8c+7`` (output ``8c + j`` in bits ``4j``), stored as ``z - 1`` (see below).
* ``scales`` fp16 ``[IC // G, OC]``.
* ``g_idx`` int32 ``[IC]``: the group of each input row (``k // G`` without act-order; a permutation-
  dependent map with act-order, which this layout can hold and the kernels read).
* ``W[o, k] = (q[k, o] - (qzeros[g_idx[k], o] + 1)) * scales[g_idx[k], o]`` on unsigned nibbles.

Why ``z - 1`` (the "v1" zero convention): AutoGPTQ's packer subtracted 1 from every zero point before
packing and its CUDA kernels (and exllama / exllamav2, which vLLM's ``gptq`` method runs as
``gptq_gemm`` for ``checkpoint_format == "gptq"``) add the 1 back when unpacking. Every "gptq" checkpoint
in the wild follows it, so symmetric 4-bit models carry ``qzeros`` words ``0x77777777`` (zero point 8).
The fix, GPTQModel's ``gptq_v2`` format (true zero points), is only understood by some vLLM kernels, so
torchforge writes v1. Consequence: a true zero point of 0 cannot be stored (``0 - 1`` would read back as
16); packing raises instead of writing a wrong checkpoint (it can only happen with asymmetric
quantization of an all non-negative group).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "gptq_pack_ref",
    "gptq_unpack_ref",
    "gptq_pack_zeros_ref",
    "gptq_unpack_zeros_ref",
    "gptq_dequantize_ref",
    "w4a16_gptq_linear_ref",
    "trivial_g_idx",
    "act_order_perm",
]


def _wrap_int32(words: Tensor) -> Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _shifts(device) -> Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int64, device=device)


def trivial_g_idx(in_features: int, group_size: int, device=None) -> Tensor:
    """``g_idx`` without act-order: ``k // group_size``."""
    return (torch.arange(in_features, dtype=torch.int32, device=device) // group_size).to(torch.int32)


def act_order_perm(g_idx: Tensor, group_size: int) -> Optional[Tensor]:
    """The order of the input rows that makes an act-order ``g_idx`` contiguous: int64 ``perm [IC]`` with
    ``g_idx[perm] == k // group_size`` (rows of a group in their stored order), or None for ``g_idx`` already
    ``k // group_size``. A kernel for contiguous groups then computes ``x[:, perm] @ W[:, perm].T``, the same sum
    in another order; vLLM's gptq_marlin does the same (``g_idx_sort_indices``, ``permute_cols``). GPTQ's
    desc_act gives every group exactly ``group_size`` rows (group of the i-th row in activation order:
    i // G); ValueError for a ``g_idx`` where some group has another count, which no order makes contiguous."""
    ic = g_idx.shape[0]
    trivial = trivial_g_idx(ic, group_size, device=g_idx.device)
    g = g_idx.to(torch.int32)
    if torch.equal(g, trivial):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], trivial):
        ng = ic // group_size
        outside = int(((g < 0) | (g >= ng)).sum())
        if outside:
            raise ValueError(f"g_idx has {outside} values outside [0, {ng}) (the groups of {ic} input rows of "
                             f"{group_size})")
        counts = torch.bincount(g.long(), minlength=ng)
        raise ValueError(f"g_idx: groups of {counts.min().item()}..{counts.max().item()} input rows, not "
                         f"{group_size} each, so no order of the rows makes them contiguous")
    return perm


def gptq_pack_ref(codes: Tensor) -> Tensor:
    """uint8 codes ``[..., IC, OC]`` (0..15) -> int32 ``[..., IC // 8, OC]``, 8 consecutive input rows per
    word, row ``8r + j`` in bits ``4j``."""
    *lead, ic, oc = codes.shape
    if codes.numel() and int((codes > 15).sum()):
        raise ValueError(f"gptq_pack: codes has {int((codes > 15).sum())} values above 15; codes are unsigned "
                         "4-bit values 0..15")
    c = codes.to(torch.int64).reshape(*lead, ic // 8, 8, oc)
    words = (c << _shifts(codes.device).view(8, 1)).sum(dim=-2)
    return _wrap_int32(words)


def gptq_unpack_ref(qweight: Tensor) -> Tensor:
    """Exact inverse of :func:`gptq_pack_ref`: int32 ``[..., IC // 8, OC]`` -> uint8 ``[..., IC, OC]``."""
    *lead, icp, oc = qweight.shape
    codes = (qweight.unsqueeze(-2) >> _shifts(qweight.device).to(torch.int32).view(8, 1)) & 0xF
    return codes.reshape(*lead, icp * 8, oc).to(torch.uint8)


def gptq_pack_zeros_ref(zeros: Tensor) -> Tensor:
    """True zero points ``[..., NG, OC]`` (1..15) -> int32 ``[..., NG, OC // 8]`` holding ``z - 1`` (v1),
    output ``8c + j`` in bits ``4j``."""
    *lead, ng, oc = zeros.shape
    z = zeros.to(torch.int64)
    if z.numel():
        if int((z == 0).sum()):
            raise ValueError(f"gptq_pack_zeros: {int((z == 0).sum())} zero points are 0, which the GPTQ (v1) "
                             "format cannot store (it stores z - 1); use symmetric quantization or export these "
                             "weights as vllm-awq / compressed-tensors")
        if int(((z < 0) | (z > 15)).sum()):
            raise ValueError("gptq_pack_zeros: zero points must be 1..15 for 4-bit GPTQ")
    z = (z - 1).reshape(*lead, ng, oc // 8, 8)
    return _wrap_int32((z << _shifts(zeros.device)).sum(dim=-1))


def gptq_unpack_zeros_ref(qzeros: Tensor) -> Tensor:
    """int32 ``[..., NG, OC // 8]`` (v1, ``z - 1``) -> true zero points uint8 ``[..., NG, OC]`` (1..16)."""
    *lead, ng, ocp = qzeros.shape
    z = ((qzeros.unsqueeze(-1) >> _shifts(qzeros.device).to(torch.int32)) & 0xF) + 1
    return z.reshape(*lead, ng, ocp * 8).to(torch.uint8)


def _dequantize_fp32(qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor) -> Tensor:
    """fp32 ``(q - z) * s`` in GPTQ layout ``[..., IC, OC]``."""
    q = gptq_unpack_ref(qweight).to(torch.float32)
    gi = g_idx.to(torch.int64)
    z = gptq_unpack_zeros_ref(qzeros).to(torch.float32).index_select(-2, gi)
    s = scales.to(torch.float32).index_select(-2, gi)
    return (q - z) * s


def gptq_dequantize_ref(qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor) -> Tensor:
    """``W [..., OC, IC]`` (nn.Linear layout) in ``scales.dtype``."""
    return _dequantize_fp32(qweight, scales, qzeros, g_idx).transpose(-1, -2).to(scales.dtype).contiguous()


def w4a16_gptq_linear_ref(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, g_idx: Tensor,
                          bias: Optional[Tensor] = None) -> Tensor:
    """``x [..., IC] @ W.T (+ bias)`` in ``x.dtype``: the fp32 dequantized weight rounded to ``x.dtype``,
    the product accumulated in fp32 (same contract as the AWQ ``w4a16_linear``)."""
    w = _dequantize_fp32(qweight, scales, qzeros, g_idx).to(x.dtype).to(torch.float32)
    out = x.to(torch.float32) @ w
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)
