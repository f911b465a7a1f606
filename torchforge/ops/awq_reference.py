"""Pure-PyTorch reference of the AWQ W4 format and ops.

These functions are the CPU implementation of the `torchforge::awq_*` / `w4a16_linear` ops and the
oracle the Triton kernels are tested against. They are plain torch code, so they also run on CUDA
tensors (used for ops that have no dedicated GPU kernel yet).

Format (AutoAWQ / vLLM `AWQLinearMethod`), for a linear layer with IC input and OC output channels and
group size G:

* ``qweight`` int32 ``[IC, OC // 8]``: word ``[i, c]`` packs the 4-bit codes of output columns
  ``8c .. 8c+7`` of input row ``i``. Nibble ``k`` (bits ``4k .. 4k+3``) holds column
  ``8c + AWQ_PACK_ORDER[k]``, with ``AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``; equivalently column
  ``8c + j`` sits at nibble ``AWQ_NIBBLE_OF_COLUMN[j] = (j // 2) + 4 * (j % 2)``. The word is a signed
  int32: a code >= 8 in nibble 7 makes it negative.
* ``scales`` ``[IC // G, OC]`` (fp16 when produced by ``awq_quantize``).
* ``qzeros`` int32 ``[IC // G, OC // 8]``, packed exactly like ``qweight``.
* ``W[oc, ic] = (q[ic, oc] - z[ic // G, oc]) * s[ic // G, oc]`` where ``q`` and ``z`` are the UNSIGNED
  nibbles 0..15.

All functions accept leading batch dimensions (e.g. ``[E, ...]`` for the experts of one MoE layer).
Argument validation lives in ``torchforge.ops.awq``; the data checks (NaN/Inf weights, codes > 15,
expert ids out of range) are done here because they need the values (a host sync).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

AWQ_PACK_ORDER: Tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble ``k`` of a packed word holds logical column ``AWQ_PACK_ORDER[k]`` of its 8 columns."""

AWQ_NIBBLE_OF_COLUMN: Tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)
"""Inverse permutation: logical column ``j`` of a word sits at nibble ``AWQ_NIBBLE_OF_COLUMN[j]``."""

FP16_MAX = 65504.0
# Smallest positive fp16 (subnormal) value, 2**-24. A symmetric scale amax / 7 below it would be
# stored as 0 and every code would become w / 0; such groups (|w| < 4.2e-7) are given this scale
# instead, so they quantize to code 8 (weight 0) like an all-zero group.
FP16_TINY = 2.0**-24


def _nibble_shifts(device) -> Tensor:
    """4 * AWQ_NIBBLE_OF_COLUMN, computed on `device` (no host-to-device copy: CUDA-graph capturable)."""
    j = torch.arange(8, dtype=torch.int64, device=device)
    return 4 * (j // 2 + 4 * (j % 2))


def awq_pack_ref(codes: Tensor, check: bool = True) -> Tensor:
    """uint8 codes ``[..., IC, OC]`` (values 0..15) -> int32 ``[..., IC, OC // 8]`` in AWQ order. ``check=False``
    skips the range check (a host sync, untraceable) for codes that are 4-bit by construction."""
    *lead, ic, oc = codes.shape
    if check and codes.numel() > 0:
        bad = int((codes > 15).sum())
        if bad:
            raise ValueError(
                f"awq_pack: codes has {bad} values above 15; codes must be unsigned 4-bit values 0..15 "
                "(for signed int4 add 8 first)"
            )
    c = codes.to(torch.int64).reshape(*lead, ic, oc // 8, 8)
    # Column j of each 8-column block goes to bits 4 * NIBBLE_OF_COLUMN[j]. Summing disjoint nibbles in
    # int64 gives the unsigned 32-bit word, which is then wrapped to the signed int32 range.
    words = (c << _nibble_shifts(codes.device)).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def awq_unpack_ref(qweight: Tensor) -> Tensor:
    """int32 ``[..., IC, OC // 8]`` in AWQ order -> uint8 codes ``[..., IC, OC]`` (exact inverse)."""
    *lead, ic, ocp = qweight.shape
    # Arithmetic shift of a negative int32 sign-extends, but the 0xF mask keeps only the nibble.
    shifts = _nibble_shifts(qweight.device).to(torch.int32)
    codes = (qweight.unsqueeze(-1) >> shifts) & 0xF
    return codes.reshape(*lead, ic, ocp * 8).to(torch.uint8)


def check_finite_weight(weight: Tensor, op: str = "awq_quantize") -> None:
    """`op` names the quantizer in the error (torchforge.quantize checks every scheme's weights with this)."""
    bad = int((~torch.isfinite(weight)).sum()) if weight.numel() else 0
    if bad:
        raise ValueError(
            f"{op}: weight contains {bad} NaN/Inf values (of {weight.numel()}); "
            "fix the checkpoint or the layer producing them before quantizing"
        )


def _to_stored_scale(s: Tensor, what: str) -> Tensor:
    """fp32 scales -> the fp32 value of their fp16 storage; raises if they overflow fp16."""
    over = s > FP16_MAX
    if bool(over.any()):
        raise ValueError(
            f"awq_quantize: {int(over.sum())} group scales ({what}) exceed the fp16 maximum {FP16_MAX} "
            f"(largest {float(s.max()):.6g}); the weight is too large for fp16 AWQ scales, rescale the layer"
        )
    return s.to(torch.float16).to(torch.float32)


def awq_quantize_ref(
    weight: Tensor, group_size: int = 128, symmetric: bool = True
) -> Tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest AWQ quantization of ``weight [..., OC, IC]`` (nn.Linear layout).

    Returns ``(qweight int32 [..., IC, OC // 8], scales fp16 [..., IC // G, OC], qzeros int32
    [..., IC // G, OC // 8])``. Math is fp32; rounding is half-to-even (``torch.round``); codes use the
    scale as stored (rounded to fp16) and a true division ``w / s``.

    Symmetric: ``s = amax / 7`` (``1`` for an all-zero group), ``q = clamp(round(w / s), -8, 7) + 8``
    and every zero point is 8. The zero point must be 8, not 0: AWQ kernels (vLLM, AutoAWQ) decode
    ``(q - z) * s`` on UNSIGNED nibbles, so storing the signed code with a zero point of 0 would turn
    every negative weight into a large positive one.

    Asymmetric (AutoAWQ ``zero_point=True``): ``s = max(max - min, 1e-5) / 15``,
    ``z = clamp(round(-min / s), 0, 15)``, ``q = clamp(round(w / s) + z, 0, 15)``.
    """
    check_finite_weight(weight)
    *lead, oc, ic = weight.shape
    ng = ic // group_size
    w = weight.to(torch.float32).reshape(*lead, oc, ng, group_size)
    if symmetric:
        amax = w.abs().amax(dim=-1)
        s = amax / 7.0
        s = torch.where(amax == 0, torch.ones_like(s), s.clamp_min(FP16_TINY))
        s = _to_stored_scale(s, "amax / 7")
        q = torch.clamp(torch.round(w / s.unsqueeze(-1)), -8, 7) + 8
        z = torch.full_like(s, 8.0)
    else:
        wmax = w.amax(dim=-1)
        wmin = w.amin(dim=-1)
        s = (wmax - wmin).clamp_min(1e-5) / 15.0
        s = _to_stored_scale(s, "(max - min) / 15")
        z = torch.clamp(torch.round(-wmin / s), 0, 15)
        q = torch.clamp(torch.round(w / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, 15)
    codes = q.to(torch.uint8).reshape(*lead, oc, ic).transpose(-1, -2)  # [..., IC, OC]
    qweight = awq_pack_ref(codes)
    scales = s.transpose(-1, -2).to(torch.float16).contiguous()  # [..., IC // G, OC]
    qzeros = awq_pack_ref(z.to(torch.uint8).transpose(-1, -2))
    return qweight, scales, qzeros


def _dequantize_fp32(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int) -> Tensor:
    """fp32 ``(q - z) * s`` in AWQ layout ``[..., IC, OC]``."""
    q = awq_unpack_ref(qweight).to(torch.int32)
    z = awq_unpack_ref(qzeros).to(torch.int32).repeat_interleave(group_size, dim=-2)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=-2)
    return (q - z).to(torch.float32) * s


def awq_dequantize_ref(qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int) -> Tensor:
    """``W [..., OC, IC]`` (nn.Linear layout) in ``scales.dtype``: ``(q - z) * s`` in fp32, then cast."""
    w = _dequantize_fp32(qweight, scales, qzeros, group_size)
    return w.transpose(-1, -2).to(scales.dtype).contiguous()


def w4a16_linear_ref(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    qzeros: Tensor,
    group_size: int,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``x [..., IC] @ W.T (+ bias) -> [..., OC]`` in ``x.dtype``.

    The weight is dequantized in fp32 and rounded to ``x.dtype`` (what the kernel feeds its matmul),
    then the product is accumulated in fp32 and the bias is added in fp32 before the final cast.
    """
    w = _dequantize_fp32(qweight, scales, qzeros, group_size).to(x.dtype).to(torch.float32)
    out = x.to(torch.float32) @ w
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def _is_traced(*tensors: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or any(is_fake(t) for t in tensors)


def check_expert_ids(expert_ids: Tensor, num_experts: int, op: str = "awq_grouped_linear") -> None:
    """Eager range check of ``expert_ids`` (a host sync: not used on CUDA)."""
    if expert_ids.numel() == 0:
        return
    bad = (expert_ids < 0) | (expert_ids >= num_experts)
    nbad = int(bad.sum())
    if nbad:
        first = int(expert_ids[bad][0])
        raise ValueError(
            f"{op}: expert_ids has {nbad} values outside [0, {num_experts}) (e.g. {first}); "
            f"qweight holds {num_experts} experts, check the router output / expert offset"
        )


def awq_grouped_linear_ref(
    x: Tensor,
    expert_ids: Tensor,
    qweight: Tensor,
    scales: Tensor,
    qzeros: Tensor,
    group_size: int,
    op: str = "awq_grouped_linear",
) -> Tensor:
    """Row ``r`` of the ``[R, OC]`` result is ``x[r] @ W[expert_ids[r]].T`` (same math as
    ``w4a16_linear_ref``).

    Eager: range-checks the ids, then runs one matmul per expert present. When traced (torch.compile,
    fake tensors, opcheck) it uses a data-independent loop over all experts instead (E times the work,
    no data-dependent shapes).
    """
    num_experts = qweight.shape[0]
    oc = scales.shape[-1]
    ids = expert_ids.to(torch.int64)
    if _is_traced(x, expert_ids, qweight):
        out = x.new_zeros(x.shape[0], oc, dtype=torch.float32)
        xf = x.to(torch.float32)
        for e in range(num_experts):
            w = _dequantize_fp32(qweight[e], scales[e], qzeros[e], group_size).to(x.dtype)
            out = torch.where((ids == e).unsqueeze(-1), xf @ w.to(torch.float32), out)
        return out.to(x.dtype)
    check_expert_ids(ids, num_experts, op)  # `op`: the public op the caller ran, for the message
    out = x.new_empty(x.shape[0], oc)
    for e in torch.unique(ids).tolist():
        rows = (ids == e).nonzero().squeeze(-1)
        out[rows] = w4a16_linear_ref(x[rows], qweight[e], scales[e], qzeros[e], group_size)
    return out
