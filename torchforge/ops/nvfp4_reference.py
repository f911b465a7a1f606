"""Pure-PyTorch reference of the NVFP4 format (NVIDIA ModelOpt semantics) and ops.

These functions are the CPU implementation of the `torchforge::nvfp4_*` ops and the oracle the Triton
kernels are tested against. They are plain torch code, so they also run on CUDA tensors.

Format, for a weight ``W [N, K]`` (nn.Linear layout, ``K % 16 == 0``), exactly as NVIDIA ModelOpt writes it
(``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``, ``NVFP4QTensor``; read at Model-Optimizer HEAD
a2fbac7, 2026-06):

* ``weight_scale_2`` float32 scalar: ``amax(|W|) / (6 * 448)`` (``get_weights_scaling_factor_2``: the amax,
  cast to fp32, divided by ``E2M1_MAX * E4M3_MAX``). An all-zero tensor would give 0 and ModelOpt would then
  compute 0/0 block scales (NaN); torchforge uses ``1.0`` for it instead (every code is then 0 anyway).
* ``weight_scale`` float8_e4m3fn ``[N, K / 16]``: per block of 16 consecutive input channels,
  ``block_amax / (6 * weight_scale_2)`` in fp32 (``6 * weight_scale_2`` is rounded to fp32 first), all-zero
  blocks get ``1.0`` (``per_block_scale[per_block_scale == 0] = 1.0``), then clamped to ``[2**-9, 448]`` and
  rounded to e4m3 (``_cast_per_block_scale_to_fp8``, ModelOpt PR #1397: no underflow to 0, no NaN above
  448). With the default ``weight_scale_2`` every block scale is <= 448 before the clamp.
* codes: ``x = W / (fp32(weight_scale) * weight_scale_2)`` (the product rounded to fp32, then one fp32
  division), mapped to E2M1 (``_cast_fp4``): magnitude code = number of the bounds
  ``0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5`` strictly below ``|x|``, plus one when ``|x|`` equals 0.75, 1.75 or
  3.5. That is round-to-nearest with ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
  2.5 -> 2, 3.5 -> 4, 5 -> 4) and saturation at 6. Bit 3 is the sign and is set iff ``x < 0``: a negative
  value that rounds to zero is code 8 (-0), while an exact ``-0.0`` is code 0.
* ``weight`` uint8 ``[N, K / 2]``: byte ``j`` holds element ``2j`` in the low nibble and ``2j + 1`` in the high
  nibble (``(q[..., 1::2] << 4) | q[..., 0::2]``). compressed-tensors' ``pack_fp4_to_uint8`` uses the same
  nibble order and codes.
* dequantization: ``E2M1[code] * fp32(weight_scale) * weight_scale_2``, evaluated left to right: the first
  product is exact (2 x 4 significant bits), so the result is the correctly rounded fp32 value of the exact
  product. (ModelOpt's own ``dequantize`` multiplies ``E2M1[code]`` by the fp32-rounded product
  ``scale * weight_scale_2``, which can differ from this in the last fp32 bit.)

Activations (W4A4 emulation) follow vLLM's NVFP4 reference path
(``vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py``, ``ref_nvfp4_quant``), with
``global_scale = 1 / input_scale`` (vLLM: ``input_scale_inv`` for ModelOpt checkpoints,
``input_global_scale`` for compressed-tensors ones): per token and block of 16,
``scale = fp8(clamp(global_scale * (block_amax * fp32(1/6)), max=448))``,
``output_scale = 1 / (fp32(scale) * (1 / global_scale))`` (1e-8 for a zero scale, as vLLM's
``get_reciprocal``), codes = RNE-E2M1 of ``clamp(x * output_scale, -6, 6)``. Blackwell's block-scaled MMA
then multiplies ``E2M1[code_a] * scale_a`` (exact in bf16) by the weight's ``E2M1[code_w] * scale_w`` and
scales the fp32 sum by ``alpha = input_scale * weight_scale_2``; the grouped op emulates exactly that.

Scale swizzle (for Blackwell block-scaled GEMMs, CUTLASS ``SfAtom`` / FlashInfer ``layout_128x4``): scales
``[M, K/16]`` are zero-padded to ``[round_up(M, 128), round_up(K/16, 4)]`` and stored as 128x4 atoms,
atom ``(m_tile, k_tile)`` at offset ``(m_tile * k_tiles + k_tile) * 512``, element ``(r, c)`` of an atom at
``(r % 32) * 16 + (r // 32) * 4 + c``: ``reshape(Mt, 4, 32, Kt, 4).permute(0, 3, 2, 1, 4)``, as vLLM's
``swizzle_blockscale`` (and the inverse in ``nvfp4_emulation_utils.convert_swizzled_to_linear``).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E2M1_VALUES: Tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Magnitude bounds of the E2M1 rounding and the three bounds where a tie rounds up (to the even code).
_BOUNDS: Tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP: Tuple[float, ...] = (0.75, 1.75, 3.5)


def _values_table(device) -> Tensor:
    v = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([v, -v])  # codes 8..15: negative (code 8 is -0.0)


def check_finite(op: str, t: Tensor, what: str = "weight") -> None:
    if t.device.type == "meta":  # no values to check (reading one raised); the op's fake gives the shapes
        return
    bad = int((~torch.isfinite(t)).sum()) if t.numel() else 0
    if bad:
        raise ValueError(f"{op}: {what} contains {bad} NaN/Inf values (of {t.numel()}); NVFP4 scales are "
                         "computed from the amax, so fix the checkpoint or the layer producing them first")


def e2m1_codes(x: Tensor) -> Tensor:
    """fp32 values (already divided by their scales) -> uint8 E2M1 codes 0..15 (ModelOpt `_cast_fp4`)."""
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for b in _BOUNDS:
        mag += (a > b).to(torch.uint8)
    for t in _TIES_UP:
        mag += (a == t).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 codes -> fp32 values."""
    return _values_table(codes.device)[codes.long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes ``[..., K]`` -> bytes ``[..., K / 2]``: even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """bytes ``[..., K / 2]`` -> uint8 codes ``[..., K]`` (exact inverse of :func:`pack_nibbles`)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _fp32_on(like: Tensor, value: float) -> Tensor:
    """``value`` as an fp32 0-dim tensor on ``like``'s device.

    Divide by this, never by a Python float: CUDA torch computes ``t / python_scalar`` (any CPU scalar divisor)
    as ``t * fp32(1 / scalar)``, which differs from the correctly rounded fp32 quotient in the last bit for
    some ``t``; a divisor tensor on the same device gives IEEE division on CPU and CUDA alike."""
    return torch.full((), value, dtype=torch.float32, device=like.device)


def global_scale_ref(weight: Tensor) -> Tensor:
    """fp32 scalar ``amax(|W|) / (6 * 448)`` (1.0 for an all-zero tensor), ModelOpt's ``weight_scale_2``."""
    amax = weight.abs().amax().to(torch.float32) if weight.numel() else torch.zeros((), device=weight.device)
    g = amax / _fp32_on(amax, E2M1_MAX * E4M3_MAX)
    return torch.where(g == 0, torch.ones_like(g), g)


def block_scales_ref(weight: Tensor, weight_scale_2: Tensor) -> Tensor:
    """float8_e4m3fn ``[..., N, K / 16]`` block scales of ``weight [..., N, K]`` under ``weight_scale_2``
    (a scalar, or one value per leading index, broadcast as ``[..., 1, 1]``)."""
    *lead, n, k = weight.shape
    amax = weight.reshape(*lead, n, k // BLOCK, BLOCK).abs().amax(dim=-1).to(torch.float32)
    s = amax / (E2M1_MAX * weight_scale_2.to(device=amax.device, dtype=torch.float32))  # a device tensor: IEEE
    s = torch.where(s == 0, torch.ones_like(s), s)
    return s.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)


def _quantize_one(weight: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
    """``weight [N, K]`` and fp32 scalar ``g`` -> (packed uint8 [N, K/2], fp8 scales [N, K/16])."""
    n, k = weight.shape
    scales = block_scales_ref(weight, g)
    denom = scales.to(torch.float32) * g  # rounded to fp32 before the division, as ModelOpt does
    x = weight.to(torch.float32).reshape(n, k // BLOCK, BLOCK) / denom.unsqueeze(-1)
    return pack_nibbles(e2m1_codes(x.reshape(n, k))), scales


def nvfp4_quantize_ref(weight: Tensor, weight_scale_2: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``weight [N, K]`` or ``[E, N, K]`` -> ``(packed uint8 [..., N, K/2], scales fp8 [..., N, K/16],
    weight_scale_2 fp32 [] or [E])``.

    Batched weights get one global scale per leading index (one per expert) and are quantized one matrix at
    a time, so the fp32 temporaries stay the size of one expert. ``weight_scale_2`` (same shape as the output
    one) overrides the amax-derived value, e.g. to give gate and up one shared scale; its block scales then
    saturate at 448 if it is smaller than ``amax / 2688``.
    """
    check_finite("nvfp4_quantize", weight)
    if weight.dim() == 2:
        g = (global_scale_ref(weight) if weight_scale_2 is None
             else weight_scale_2.to(device=weight.device, dtype=torch.float32).reshape(()).clone())
        packed, scales = _quantize_one(weight, g)
        return packed, scales, g
    E, n, k = weight.shape
    packed = torch.empty(E, n, k // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(E, n, k // BLOCK, dtype=torch.float8_e4m3fn, device=weight.device)
    gs = torch.empty(E, dtype=torch.float32, device=weight.device)
    for e in range(E):
        g = (global_scale_ref(weight[e]) if weight_scale_2 is None
             else weight_scale_2[e].to(device=weight.device, dtype=torch.float32))
        packed[e], scales[e] = _quantize_one(weight[e], g)
        gs[e] = g
    return packed, scales, gs


def dequantize_fp32(packed: Tensor, scales: Tensor, weight_scale_2: Tensor) -> Tensor:
    """fp32 ``E2M1[code] * fp32(scale) * weight_scale_2`` (left to right) of shape ``[..., N, K]``."""
    *lead, n, kp = packed.shape
    k = kp * 2
    v = e2m1_decode(unpack_nibbles(packed)).reshape(*lead, n, k // BLOCK, BLOCK)
    w = v * scales.to(torch.float32).unsqueeze(-1)  # exact
    g = weight_scale_2.to(torch.float32).reshape(*lead, 1, 1, 1) if lead else weight_scale_2.to(torch.float32)
    return (w * g).reshape(*lead, n, k)


def nvfp4_dequantize_ref(packed: Tensor, scales: Tensor, weight_scale_2: Tensor, dtype: torch.dtype) -> Tensor:
    return dequantize_fp32(packed, scales, weight_scale_2).to(dtype)


def _scaled_weight(packed: Tensor, scales: Tensor) -> Tensor:
    """fp32 ``E2M1[code] * fp32(scale)`` ``[..., N, K]`` (exact; what the kernels build in registers)."""
    *lead, n, kp = packed.shape
    v = e2m1_decode(unpack_nibbles(packed)).reshape(*lead, n, kp // 8, BLOCK)
    return (v * scales.to(torch.float32).unsqueeze(-1)).reshape(*lead, n, kp * 2)


# ------------------------------------------------------------------------------------------ activations
def activation_scales_and_codes(x: Tensor, input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """vLLM's ``ref_nvfp4_quant`` on ``x [..., K]`` with ``global_scale = 1 / input_scale``.

    ``input_scale`` is a scalar or broadcasts against ``x.shape[:-1]``. Returns (uint8 codes [..., K], fp8
    block scales [..., K / 16])."""
    *lead, k = x.shape
    one = _fp32_on(x, 1.0)  # IEEE quotients on every device (see _fp32_on)
    gs = one / input_scale.to(device=x.device, dtype=torch.float32)
    gs = gs.reshape(*gs.shape, 1) if gs.dim() else gs  # broadcast over the block axis
    xb = x.to(torch.float32).reshape(*lead, k // BLOCK, BLOCK)
    vec_max = xb.abs().amax(dim=-1)
    scale = gs * (vec_max * (1.0 / E2M1_MAX))
    scale = scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf = scale.to(torch.float32)
    prod = sf * (one / gs)
    out_scale = one / (prod + (prod == 0).to(torch.float32) * 1e8)
    xs = (xb * out_scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    return e2m1_codes(xs).reshape(*lead, k), scale


def nvfp4_quantize_activation_ref(x: Tensor, input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """``x [..., K]`` -> (packed uint8 [..., K/2], fp8 scales [..., K/16]) as Blackwell's staging would."""
    codes, scales = activation_scales_and_codes(x, input_scale)
    return pack_nibbles(codes), scales


def _activation_scaled(x: Tensor, input_scale: Tensor) -> Tensor:
    """fp32 ``E2M1[code] * fp32(scale)`` of the quantized activation (exact)."""
    codes, scales = activation_scales_and_codes(x, input_scale)
    *lead, k = x.shape
    v = e2m1_decode(codes).reshape(*lead, k // BLOCK, BLOCK)
    return (v * scales.to(torch.float32).unsqueeze(-1)).reshape(*lead, k)


def nvfp4_fake_quantize_activation_ref(x: Tensor, input_scale: Tensor) -> Tensor:
    """Quantize-dequantize ``x``: ``E2M1[code] * fp32(scale) * input_scale`` in ``x.dtype``."""
    g = input_scale.to(torch.float32)
    g = g.reshape(*g.shape, 1) if g.dim() else g
    return (_activation_scaled(x, input_scale) * g).to(x.dtype)


# --------------------------------------------------------------------------------------------- matmuls
def _is_traced(*tensors: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or any(is_fake(t) for t in tensors)


def check_expert_ids(op: str, expert_ids: Tensor, num_experts: int) -> None:
    if expert_ids.numel() == 0:
        return
    bad = (expert_ids < 0) | (expert_ids >= num_experts)
    nbad = int(bad.sum())
    if nbad:
        raise ValueError(f"{op}: expert_ids has {nbad} values outside [0, {num_experts}) (e.g. "
                         f"{int(expert_ids[bad][0])}); packed holds {num_experts} experts")


def _linear_rows(x: Tensor, packed: Tensor, scales: Tensor, ws2: Tensor, input_scale: Optional[Tensor]) -> Tensor:
    """fp32 ``[rows, N]`` of one weight: ``(a . w_q) * alpha`` as the kernels compute it."""
    w = _scaled_weight(packed, scales).to(x.dtype).to(torch.float32)  # exact in bf16/fp16/fp32
    if input_scale is None:
        a, alpha = x.to(torch.float32), ws2.to(torch.float32)
    else:
        a = _activation_scaled(x, input_scale).to(x.dtype).to(torch.float32)  # exact
        alpha = input_scale.to(torch.float32) * ws2.to(torch.float32)
    return (a @ w.T) * alpha


def nvfp4_linear_ref(x: Tensor, packed: Tensor, scales: Tensor, weight_scale_2: Tensor,
                     input_scale: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
    """``x [..., K] -> [..., N]`` in ``x.dtype``: fp32 sum of ``x * (E2M1 * scale)`` (the weight factor exact in
    ``x.dtype``), times ``weight_scale_2`` (W4A16), or the same on NVFP4-quantized activations times
    ``input_scale * weight_scale_2`` (W4A4 emulation); bias added in fp32."""
    lead = x.shape[:-1]
    out = _linear_rows(x.reshape(-1, x.shape[-1]), packed, scales, weight_scale_2, input_scale)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*lead, packed.shape[0])


def nvfp4_grouped_linear_ref(x: Tensor, expert_ids: Tensor, packed: Tensor, scales: Tensor,
                             weight_scale_2: Tensor, input_scale: Optional[Tensor] = None) -> Tensor:
    """Row ``r`` of the ``[R, N]`` result is :func:`nvfp4_linear_ref` of ``x[r]`` with expert
    ``expert_ids[r]``'s weight (and input scale). Eager: range-checks the ids and runs one matmul per expert
    present; traced (torch.compile, fake tensors, opcheck): a data-independent loop over all experts."""
    num_experts, n = packed.shape[0], packed.shape[1]
    ids = expert_ids.to(torch.int64)

    def rows_of(e, rows_x):
        return _linear_rows(rows_x, packed[e], scales[e], weight_scale_2[e],
                            None if input_scale is None else input_scale[e])

    if _is_traced(x, expert_ids, packed):
        out = x.new_zeros(x.shape[0], n, dtype=torch.float32)
        for e in range(num_experts):
            out = torch.where((ids == e).unsqueeze(-1), rows_of(e, x), out)
        return out.to(x.dtype)
    check_expert_ids("nvfp4_grouped_linear", ids, num_experts)
    out = x.new_empty(x.shape[0], n)
    for e in torch.unique(ids).tolist():
        rows = (ids == e).nonzero().squeeze(-1)
        out[rows] = rows_of(e, x[rows]).to(x.dtype)
    return out


# --------------------------------------------------------------------------------------------- swizzle
def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def swizzle_scales_ref(scales: Tensor) -> Tensor:
    """fp8 ``[..., M, Kb]`` -> ``[..., round_up(M, 128), round_up(Kb, 4)]`` in 128x4 atoms (zero padded)."""
    *lead, m, kb = scales.shape
    mp, kp = _round_up(m, 128), _round_up(kb, 4)
    raw = scales.view(torch.uint8)
    padded = torch.zeros(*lead, mp, kp, dtype=torch.uint8, device=scales.device)
    padded[..., :m, :kb] = raw
    nl = len(lead)
    t = padded.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)
    t = t.permute(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    return t.reshape(*lead, mp, kp).contiguous().view(torch.float8_e4m3fn)


def unswizzle_scales_ref(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    """Inverse of :func:`swizzle_scales_ref`: ``[..., Mp, Kp]`` -> ``[..., rows, cols]``."""
    *lead, mp, kp = swizzled.shape
    nl = len(lead)
    t = swizzled.view(torch.uint8).reshape(*lead, mp // 128, kp // 4, 32, 4, 4)
    t = t.permute(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4).reshape(*lead, mp, kp)
    return t[..., :rows, :cols].contiguous().view(torch.float8_e4m3fn)
