"""`awq_mma_linear`: W4A16 linear with the weight in the mma layout (`torchforge.ops.awq_mma_layout`).

Dispatch: CUDA tensors with the compiled extension and 1..128 rows of x (decode) run the tensor-core kernel of
csrc/awq_mma.cu; on an sm_90 (Hopper) GPU, 32..512 rows run the warpgroup-MMA kernel of csrc/awq_wgmma.cu instead
where a time model fitted on the H100 has it faster than that kernel (up to 128 rows) or dequantize + cuBLAS
(awq_mma_cuda.wgmma_rows_ok, awq_wgmma_cost). Other CUDA calls (prefill, fp32,
no extension) dequantize the mma layout once with Triton and call cuBLAS. CPU tensors convert the weight back to
vLLM's AWQ layout (exact) and run the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from torchforge.ops._check import check_type, check_value
from torchforge.ops._gemm import matmul_bias
from torchforge.ops._triton import HAS_TRITON, use_triton
from torchforge.ops.awq import _check_w4a16_args
from torchforge.ops.awq_mma_cuda import (_aligned16, launch_awq_mma_cuda, launch_awq_mma_moe_cuda,
                                         launch_awq_wgmma_cuda, mma_cuda_ok, mma_moe_cuda_ok, wgmma_cuda_ok)
from torchforge.ops.awq_mma_dequant_triton import launch_awq_mma_dequantize_t
from torchforge.ops.awq_mma_layout import awq_mma_linear_ref, mma_layout_to_awq
from torchforge.ops.qmeta4_reference import _is_traced
from torchforge.ops.zero_points import check_symmetric

if HAS_TRITON:
    from torch.library import triton_op as _define_kernel_op
else:  # importing torchforge must work without triton
    _define_kernel_op = custom_op

__all__ = ["awq_mma_linear", "awq_mma_moe_gate_up_silu", "awq_mma_moe_down_combine"]


def _check_mma_args(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                    bias: Optional[Tensor]) -> None:
    check_type(qweight_mma.dtype == torch.int32 and qweight_mma.dim() == 2,
               lambda: f"awq_mma_linear: qweight_mma must be a 2-D int32 tensor [OC / 64, IC * 8], got "
                       f"{qweight_mma.dtype} {tuple(qweight_mma.shape)}")
    check_value(x.dim() >= 1 and qweight_mma.shape[1] == x.shape[-1] * 8,
                lambda: f"awq_mma_linear: qweight_mma {tuple(qweight_mma.shape)} is not [OC / 64, IC * 8] for x with "
                        f"IC = {x.shape[-1] if x.dim() else None} features")
    check_value(x.shape[-1] % 64 == 0, lambda: f"awq_mma_linear: IC = {x.shape[-1]} must be a multiple of 64")
    # the rest (dtypes, devices, scales / qzeros / bias shapes, group size) as for the AWQ layout, on a view of
    # the same words with the AWQ shape [IC, OC / 8]
    awq_view = qweight_mma.reshape(x.shape[-1], qweight_mma.shape[0] * 8)
    _check_w4a16_args(x, awq_view, scales, qzeros, group_size, bias, op="awq_mma_linear")


def _check_act_perm(x: Tensor, act_perm: Optional[Tensor]) -> None:
    if act_perm is None:
        return
    check_type(act_perm.dtype == torch.int32,
               lambda: f"awq_mma_linear: act_perm must be int32 (the order of x's features), got {act_perm.dtype}; "
                       "pass act_perm.to(torch.int32)")
    check_value(act_perm.dim() == 1 and act_perm.shape[0] == x.shape[-1] and act_perm.device == x.device,
                lambda: f"awq_mma_linear: act_perm must be [IC] = [{x.shape[-1]}] on {x.device}, got "
                        f"{tuple(act_perm.shape)} on {act_perm.device} (move it with the layer: .to(x.device))")
    if not act_perm.is_cuda and act_perm.numel() and not _is_traced(act_perm):  # on CUDA a host sync: see below
        bad = (act_perm < 0) | (act_perm >= x.shape[-1])
        if bool(bad.any()):
            raise ValueError(f"awq_mma_linear: act_perm has {int(bad.sum())} values outside [0, {x.shape[-1]}); it "
                             "must be a permutation of x's features (torchforge.ops.gptq.act_order_perm)")


def _kernel_perm(act_perm: Tensor) -> Optional[Tensor]:
    """act_perm as the CUDA kernels read it (contiguous, 16-byte aligned: int4 loads), or None where it is not."""
    return act_perm if act_perm.is_contiguous() and _aligned16(act_perm) else None


@_define_kernel_op("torchforge::awq_mma_linear", mutates_args=())
def _awq_mma_linear(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                    bias: Optional[Tensor], tickets: Optional[Tensor] = None,
                    act_perm: Optional[Tensor] = None, symmetric: bool = False) -> Tensor:
    _check_mma_args(x, qweight_mma, scales, qzeros, group_size, bias)
    _check_act_perm(x, act_perm)
    check_symmetric("awq_mma_linear", symmetric, qzeros)
    ok = (tickets is not None and tickets.device == x.device and tickets.dtype == torch.int32
          and tickets.is_contiguous())
    perm = None if act_perm is None else _kernel_perm(act_perm)
    if act_perm is None or perm is not None:  # the CUDA kernels take the permutation themselves
        if wgmma_cuda_ok(x, qweight_mma, scales, qzeros, group_size, bias):
            return launch_awq_wgmma_cuda(x, qweight_mma, scales, qzeros, group_size, bias,
                                         tickets=tickets if ok else None, perm=perm)
        if mma_cuda_ok(x, qweight_mma, scales, qzeros, group_size, bias):
            return launch_awq_mma_cuda(x, qweight_mma, scales, qzeros, group_size, bias,
                                       tickets=tickets if ok else None, perm=perm, symmetric=symmetric)
    if use_triton(x) and (group_size % 64 == 0 or group_size == 32):  # with act_perm, W^T in x's feature order
        w_t = launch_awq_mma_dequantize_t(qweight_mma.contiguous(), scales, qzeros, group_size, x.dtype, act_perm)
        return matmul_bias(x, w_t, bias)
    if act_perm is not None:
        x = x.index_select(-1, act_perm)
    return awq_mma_linear_ref(x, qweight_mma, scales, qzeros, group_size, bias)


@_awq_mma_linear.register_fake
def _(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
      bias: Optional[Tensor], tickets: Optional[Tensor] = None, act_perm: Optional[Tensor] = None,
      symmetric: bool = False) -> Tensor:
    _check_mma_args(x, qweight_mma, scales, qzeros, group_size, bias)
    _check_act_perm(x, act_perm)
    return x.new_empty((*x.shape[:-1], qweight_mma.shape[0] * 64))


def awq_mma_linear(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int = 128,
                   bias: Optional[Tensor] = None, tickets: Optional[Tensor] = None,
                   act_perm: Optional[Tensor] = None, symmetric: bool = False) -> Tensor:
    """``x [..., IC] @ dequant(W).T (+ bias) -> [..., OC]`` in ``x.dtype``, W's codes in the mma layout
    ``[OC / 64, IC * 8]`` and ``scales`` / ``qzeros`` in AWQ layout. Same numbers as `w4a16_linear` on the AWQ
    tensors within the kernels' tolerance (the CUDA kernel applies scale and zero point in fp32 per group).

    `tickets` (optional, `torchforge.ops.awq_mma_cuda.mma_tickets(OC)`): a zeroed int32 buffer the K slices of the
    decode kernel and of the Hopper kernel meet on. The kernels leave it zero, so the op does not count as mutating
    it; a module keeps one to save a memset kernel per call. Tickets on another device than `x` are not passed: on
    the meta device they would send the whole call to the op's fake (uninitialised memory).

    `act_perm` (optional, int32 [IC], a permutation of the features): the weight's input rows are stored in this
    order, so the op computes ``x[..., act_perm] @ dequant(W).T``: an act-order GPTQ layer, whose rows were sorted by
    group so that groups are contiguous (`torchforge.ops.gptq.act_order_perm`). On CUDA with the extension the
    wgmma kernel's x image reads x through it (no extra pass), and the decode kernel follows a gather kernel of the
    op's own (it launches during the gather: PDL); dequantize + cuBLAS writes the weight in x's feature order; the
    reference gathers x with index_select first. It must be a permutation: values outside [0, IC) raise on the CPU;
    on CUDA (no host sync) the gathers read them as NaN and the dequantization skips them (rows of W^T left
    unwritten), so the output is wrong but nothing is read or written out of bounds.

    `symmetric`: every zero point is 8 (symmetric codes), so the decode kernel does not read qzeros (about 10% fewer
    instructions; torchforge.ops.zero_points). A promise the modules make after checking once (use_mma_layout); CPU
    calls check it, CUDA calls trust it, and every path but that kernel reads qzeros anyway."""
    if tickets is not None and tickets.device != x.device:
        tickets = None
    return torch.ops.torchforge.awq_mma_linear(x, qweight_mma, scales, qzeros, group_size, bias, tickets, act_perm,
                                               symmetric)


# ------------------------------------------------------------------------------------------ MoE experts
# The two halves of ForgeAWQExperts' forward (torchforge.ops.awq_moe_fused) with the experts' codes in the mma layout
# [E, OC / 64, IC * 8]. CUDA with the extension: the grouped kernel of csrc/awq_mma_moe.cu writes fp32 sums per K slice
# and the existing reduce kernels add them with the epilogue fused (SiLU * up; router-weighted combine). Elsewhere
# the codes go back to the AWQ layout (exact; a copy of the experts per call: the CPU and no-extension path).
def _moe_args(op: str, x: Tensor, expert_ids: Tensor, qweight_mma: Tensor) -> None:
    check_type(qweight_mma.dtype == torch.int32 and qweight_mma.dim() == 3,
               lambda: f"{op}: qweight_mma must be an int32 tensor [E, OC / 64, IC * 8], got {qweight_mma.dtype} "
                       f"{tuple(qweight_mma.shape)}")
    check_value(x.dim() == 2 and qweight_mma.shape[2] == x.shape[1] * 8,
                lambda: f"{op}: qweight_mma {tuple(qweight_mma.shape)} is not [E, OC / 64, IC * 8] for x "
                        f"{tuple(x.shape)} = [rows, IC]")


def _check_shared(op: str, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, shared_qweight: Optional[Tensor],
                  shared_scales: Optional[Tensor], shared_qzeros: Optional[Tensor]) -> bool:
    """Whether a shared expert (routed as expert id E) is passed; its tensors must be one routed expert's."""
    given = [t is not None for t in (shared_qweight, shared_scales, shared_qzeros)]
    check_value(all(given) or not any(given),
                lambda: f"{op}: pass all three of shared_qweight, shared_scales and shared_qzeros, or none")
    if not all(given):
        return False
    for name, t, ref in (("shared_qweight", shared_qweight, qweight_mma), ("shared_scales", shared_scales, scales),
                         ("shared_qzeros", shared_qzeros, qzeros)):
        check_value(t.shape == ref.shape[1:] and t.dtype == ref.dtype and t.device == ref.device,
                    lambda: f"{op}: {name} must be one expert of the stacked tensor: {tuple(ref.shape[1:])} "
                            f"{ref.dtype} on {ref.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    return True


def _with_shared(qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, shared: Optional[tuple]) -> tuple:
    """The stacked tensors with the shared expert appended as expert E (a copy: the reference path only)."""
    if shared is None:
        return qweight_mma, scales, qzeros
    return tuple(torch.cat([t, s[None]]) for t, s in zip((qweight_mma, scales, qzeros), shared))


def _awq_view(qweight_mma: Tensor) -> Tensor:
    """The same words viewed with the AWQ shape [E, IC, OC / 8] (for the shape checks of the AWQ ops)."""
    e, nb, k8 = qweight_mma.shape
    return qweight_mma.reshape(e, k8 // 8, nb * 8)


def _gate_up_silu(x: Tensor, expert_ids: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                  top_k: int, shared: Optional[tuple], alignment: Optional[tuple] = None,
                  symmetric: bool = False) -> Tensor:
    from torchforge.ops.awq_moe_fused import awq_moe_gate_up_silu
    from torchforge.ops.moe_epilogue_triton import launch_silu_mul_reduce

    if mma_moe_cuda_ok(x, qweight_mma, scales, group_size, shared):
        part = launch_awq_mma_moe_cuda(x, expert_ids, qweight_mma, scales, qzeros, group_size, top_k, shared, alignment,
                                       symmetric=symmetric)
        return launch_silu_mul_reduce(part, x.dtype)
    q, s, z = _with_shared(qweight_mma, scales, qzeros, shared)
    return awq_moe_gate_up_silu(x, expert_ids, mma_layout_to_awq(q), s, z, group_size, top_k)


def _down_combine(h: Tensor, expert_ids: Tensor, weights: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor,
                  group_size: int, shared: Optional[tuple], alignment: Optional[tuple] = None,
                  symmetric: bool = False) -> Tensor:
    from torchforge.ops.awq_moe_fused import awq_moe_down_combine
    from torchforge.ops.moe_epilogue_triton import launch_combine_reduce

    if mma_moe_cuda_ok(h, qweight_mma, scales, group_size, shared):
        part = launch_awq_mma_moe_cuda(h, expert_ids, qweight_mma, scales, qzeros, group_size, 1, shared, alignment,
                                       symmetric=symmetric)
        return launch_combine_reduce(part, weights, h.dtype)
    q, s, z = _with_shared(qweight_mma, scales, qzeros, shared)
    return awq_moe_down_combine(h, expert_ids, weights, mma_layout_to_awq(q), s, z, group_size)


def _shared_or_none(op: str, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, shared_qweight: Optional[Tensor],
                    shared_scales: Optional[Tensor], shared_qzeros: Optional[Tensor]) -> Optional[tuple]:
    has = _check_shared(op, qweight_mma, scales, qzeros, shared_qweight, shared_scales, shared_qzeros)
    return (shared_qweight, shared_scales, shared_qzeros) if has else None


@_define_kernel_op("torchforge::awq_mma_moe_gate_up_silu", mutates_args=())
def _awq_mma_moe_gate_up_silu(x: Tensor, expert_ids: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor,
                              group_size: int, top_k: int, shared_qweight: Optional[Tensor] = None,
                              shared_scales: Optional[Tensor] = None, shared_qzeros: Optional[Tensor] = None,
                              symmetric: bool = False) -> Tensor:
    from torchforge.ops.awq_moe_fused import _check_gate_up

    op = "awq_mma_moe_gate_up_silu"
    _moe_args(op, x, expert_ids, qweight_mma)
    _check_gate_up(x, expert_ids, _awq_view(qweight_mma), scales, qzeros, group_size, top_k)
    shared = _shared_or_none(op, qweight_mma, scales, qzeros, shared_qweight, shared_scales, shared_qzeros)
    check_symmetric(op, symmetric, qzeros, shared_qzeros)
    return _gate_up_silu(x, expert_ids, qweight_mma, scales, qzeros, group_size, top_k, shared, symmetric=symmetric)


@_awq_mma_moe_gate_up_silu.register_fake
def _(x, expert_ids, qweight_mma, scales, qzeros, group_size, top_k, shared_qweight=None, shared_scales=None,
      shared_qzeros=None, symmetric=False):
    from torchforge.ops.awq_moe_fused import _check_gate_up

    _moe_args("awq_mma_moe_gate_up_silu", x, expert_ids, qweight_mma)
    _check_shared("awq_mma_moe_gate_up_silu", qweight_mma, scales, qzeros, shared_qweight, shared_scales,
                  shared_qzeros)
    inter = _check_gate_up(x, expert_ids, _awq_view(qweight_mma), scales, qzeros, group_size, top_k)
    return x.new_empty((expert_ids.shape[0], inter))


@_define_kernel_op("torchforge::awq_mma_moe_down_combine", mutates_args=())
def _awq_mma_moe_down_combine(h: Tensor, expert_ids: Tensor, weights: Tensor, qweight_mma: Tensor, scales: Tensor,
                              qzeros: Tensor, group_size: int, shared_qweight: Optional[Tensor] = None,
                              shared_scales: Optional[Tensor] = None, shared_qzeros: Optional[Tensor] = None,
                              symmetric: bool = False) -> Tensor:
    from torchforge.ops.awq_moe_fused import _check_combine

    op = "awq_mma_moe_down_combine"
    _moe_args(op, h, expert_ids, qweight_mma)
    _check_combine(h, expert_ids, weights, _awq_view(qweight_mma), scales, qzeros, group_size)
    shared = _shared_or_none(op, qweight_mma, scales, qzeros, shared_qweight, shared_scales, shared_qzeros)
    check_symmetric(op, symmetric, qzeros, shared_qzeros)
    return _down_combine(h, expert_ids, weights, qweight_mma, scales, qzeros, group_size, shared, symmetric=symmetric)


@_awq_mma_moe_down_combine.register_fake
def _(h, expert_ids, weights, qweight_mma, scales, qzeros, group_size, shared_qweight=None, shared_scales=None,
      shared_qzeros=None, symmetric=False):
    from torchforge.ops.awq_moe_fused import _check_combine

    _moe_args("awq_mma_moe_down_combine", h, expert_ids, qweight_mma)
    _check_shared("awq_mma_moe_down_combine", qweight_mma, scales, qzeros, shared_qweight, shared_scales,
                  shared_qzeros)
    tokens, oc = _check_combine(h, expert_ids, weights, _awq_view(qweight_mma), scales, qzeros, group_size)
    return h.new_empty((tokens, oc))


def awq_mma_moe_gate_up_silu(x: Tensor, expert_ids: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor,
                             group_size: int = 128, top_k: int = 1,
                             shared: Optional[tuple[Tensor, Tensor, Tensor]] = None, symmetric: bool = False) -> Tensor:
    """`awq_moe_gate_up_silu` with the experts' codes in the mma layout: ``SiLU(gate) * up`` ``[len(expert_ids), I]``.

    `shared`: (qweight_mma [OC / 64, IC * 8], scales, qzeros) of a shared expert, which `expert_ids` address as
    expert E (one past the stacked ones): a DeepSeek shared expert then costs no kernel launch of its own.
    `symmetric`: every zero point (the shared expert's too) is 8, as for `awq_mma_linear`."""
    return torch.ops.torchforge.awq_mma_moe_gate_up_silu(x, expert_ids, qweight_mma, scales, qzeros, group_size, top_k,
                                                         *(shared or (None, None, None)), symmetric)


def awq_mma_moe_down_combine(h: Tensor, expert_ids: Tensor, weights: Tensor, qweight_mma: Tensor, scales: Tensor,
                             qzeros: Tensor, group_size: int = 128,
                             shared: Optional[tuple[Tensor, Tensor, Tensor]] = None, symmetric: bool = False) -> Tensor:
    """`awq_moe_down_combine` with the experts' codes in the mma layout: ``[T, OC]``. `shared` as for
    `awq_mma_moe_gate_up_silu` (its pick's weight, usually 1, comes with `weights` like any other)."""
    return torch.ops.torchforge.awq_mma_moe_down_combine(h, expert_ids, weights, qweight_mma, scales, qzeros,
                                                         group_size, *(shared or (None, None, None)), symmetric)
