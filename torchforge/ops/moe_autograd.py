"""Gradients of the quantized MoE expert ops, as torchforge.ops.linear_autograd gives the dense ones: a model with frozen
4-bit experts can be differentiated with respect to its activations (LoRA on the attention of a quantized MoE model).

Every routed row r reads expert e = expert_ids[r]: grad_x[r] = grad_y[r] @ W_e, W_e the dequantized weight. The packed
weights, scales and zero points get no gradient. The router weights of the ops that multiply by them (the down_combine
halves and awq_mma_moe_experts) get theirs: grad_w[t, j] = <grad_out[t], down[t * k + j]>, so a trainable router
learns through them. Rows whose expert id lies outside [0, E) (E counting a shared expert) contribute no gradient: CPU
forwards raise on them and CUDA forwards write NaN rows, which must not leak into the gradient of x or of the weights.

The backward multiplies with the dequantized experts [E, N, K] (all of a layer's experts, transiently: a copy of the
layer's weights in bf16 / fp32; on CUDA one Triton launch straight into that dtype, 28x faster than the reference's
chunks on a DeepSeek-V3 layer, BENCHMARKS.md twenty-eighth session; on CPU the reference, a bounded chunk of experts at a
time) through one grouped GEMM over the rows sorted by expert (`torch._grouped_mm`): no Python
loop over experts and no per-row copy of a weight; the sort needs no host sync. fp32 on CUDA runs a Triton grouped GEMM
(grouped_mm_triton.py): PyTorch's own grouped GEMM takes non-bf16 inputs (and GPUs before Hopper) through a fallback
that reads the offsets on the host and loops over the experts. bf16 activations multiply in bf16 as
their forward does; other dtypes in fp32. The pre-activations of SiLU(gate) * up and the down rows that the router
gradient needs are recomputed from the saved input (one grouped GEMM) instead of being kept from the forward: the input
is alive anyway (the router reads it), the [T * k, 2I] pre-activations would be one more tensor per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchforge.ops._chunks import map_leading_chunks
from torchforge.ops._triton import use_triton
from torchforge.ops.grouped_mm_triton import launch_grouped_rows_mm


def _rows_times_experts(rows: Tensor, expert_ids: Tensor, weight: Tensor) -> Tensor:
    """out[r] = rows[r] @ weight[expert_ids[r]] for rows [R, A] and weight [E, A, B]: [R, B] in fp32, zero for rows
    whose expert id is outside [0, E)."""
    num_experts = weight.shape[0]
    ids = expert_ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    ids = torch.where(valid, ids, 0)
    rows = torch.where(valid[:, None], rows.to(weight.dtype), 0)  # where, not a product: NaN rows become 0
    order = torch.argsort(ids, stable=True)
    offs = torch.searchsorted(ids[order], torch.arange(num_experts, device=ids.device), right=True)
    mm = torch._grouped_mm if weight.dtype == torch.bfloat16 else _grouped_mm_any_dtype
    out = mm(rows[order], weight, offs=offs.to(torch.int32))
    return torch.empty_like(out).index_copy_(0, order, out).float()


# custom_op, not triton_op: compile must not trace into torch._grouped_mm, whose fake takes bf16 only
@torch.library.custom_op("torchforge::_grouped_mm_any_dtype", mutates_args=())
def _grouped_mm_any_dtype(rows: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """torch._grouped_mm for fp32 / fp16, whose aten fake takes bf16 only: a shape-only fake instead of a gather of
    one [A, B] weight per row under torch.compile. fp32 on CUDA: a Triton grouped GEMM (grouped_mm_triton.py), since
    PyTorch's fallback for it syncs with the host and loops over the experts."""
    if use_triton(rows) and rows.dtype == weight.dtype == torch.float32:
        return launch_grouped_rows_mm(rows, weight, offs)
    return torch._grouped_mm(rows, weight, offs=offs)


@_grouped_mm_any_dtype.register_fake
def _(rows, weight, offs):
    return rows.new_empty((rows.shape[0], weight.shape[-1]))


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def _input_grad(grad_rows: Tensor, expert_ids: Tensor, weight: Tensor, x: Tensor, rows_per_x: int) -> Tensor:
    """grad_x [T, K] from the routed rows' output gradients [T * rows_per_x, N] (row r read x[r // rows_per_x])."""
    g = _rows_times_experts(grad_rows, expert_ids, weight)
    return g.view(x.shape[0], rows_per_x, weight.shape[-1]).sum(1).to(x.dtype)


def _rows_forward(x: Tensor, expert_ids: Tensor, weight: Tensor, rows_per_x: int) -> Tensor:
    """The forward's routed rows x[r // rows_per_x] @ W_e.T [R, N], rounded to x.dtype as the forward rounds them."""
    rows = x.repeat_interleave(rows_per_x, dim=0) if rows_per_x > 1 else x
    return _rows_times_experts(rows, expert_ids, weight.transpose(1, 2)).to(x.dtype).float()


def _silu_mul_grad(grad_h: Tensor, gate_up: Tensor) -> Tensor:
    """Gradient of SiLU(gate) * up with respect to [gate, up] (fp32)."""
    gate, up = gate_up.chunk(2, dim=-1)
    g, sig = grad_h.float(), torch.sigmoid(gate)
    return torch.cat([g * up * sig * (1 + gate * (1 - sig)), g * gate * sig], dim=-1)


def _combine_grads(needs_h: bool, needs_w: bool, grad_out: Tensor, h: Tensor, expert_ids: Tensor, weights: Tensor,
                   w_down: Tensor) -> tuple:
    """(grad_h, grad_weights) of out[t] = sum_j weights[t, j] * (h[t * k + j] @ W_down_e.T)."""
    tokens, k = weights.shape
    g = grad_out.float()
    grad_h = grad_w = None
    if needs_h:
        rows = (g[:, None, :] * weights.float()[..., None]).reshape(tokens * k, g.shape[-1])
        grad_h = _rows_times_experts(rows, expert_ids, w_down).to(h.dtype)
    if needs_w:
        down = _rows_forward(h, expert_ids, w_down, 1)
        grad_w = (down.view(tokens, k, -1) * g[:, None, :]).sum(-1).to(weights.dtype)
    return grad_h, grad_w


# ------------------------------------------------------------------------------------ dequantized experts [E, N, K]
# Experts dequantized at a time: the reference dequantization holds about 20 bytes a weight of temporaries (a whole
# DeepSeek-V3 layer's gate_up at once: about 150 GB), the result 2 (bf16) or 4.
_CHUNK_WEIGHTS = 1 << 26


def _all_experts(fn, tensors: tuple, out_shape: tuple, dtype: torch.dtype) -> Tensor:
    """fn (a dequantization into `dtype`) over all experts of `tensors`: one call on CUDA (a Triton launch, no
    temporaries), bounded chunks of experts through the reference elsewhere."""
    per_matrix = out_shape[0] * out_shape[1]
    chunk = tensors[0].shape[0] * per_matrix if use_triton(tensors[0]) else _CHUNK_WEIGHTS
    return map_leading_chunks(fn, tensors, out_shape, per_matrix, chunk, dtype)


def _awq(qweight, scales, qzeros, group_size, dtype):
    from torchforge.ops import awq_dequantize

    ic, oc = qweight.shape[1], qweight.shape[2] * 8
    return _all_experts(lambda q, s, z: awq_dequantize(q, s, z, group_size, dtype), (qweight, scales, qzeros),
                        (oc, ic), dtype)


def _awq_mma(qweight_mma, scales, qzeros, group_size, dtype, shared=(None, None, None)):
    """The mma-layout experts, with a shared expert (when given) appended as expert E, as the forward routes it."""
    from torchforge.ops.awq_mma import _with_shared
    from torchforge.ops.awq_mma_layout import mma_layout_to_awq

    q, s, z = _with_shared(qweight_mma, scales, qzeros, None if shared[0] is None else shared)
    return _awq(mma_layout_to_awq(q), s, z, group_size, dtype)


def _nvfp4(packed, scales, weight_scale_2, dtype):
    from torchforge.ops import nvfp4_dequantize

    n, k = packed.shape[1], packed.shape[2] * 2
    return _all_experts(lambda p, s, s2: nvfp4_dequantize(p, s, s2, dtype), (packed, scales, weight_scale_2),
                        (n, k), dtype)


# --------------------------------------------------------------------------------------------------- backwards
# Each takes (ctx, grad_out, *the op's inputs) and returns {input index: gradient}.
def _grouped_linear_grads(ctx, grad_y, x, ids, q, s, z, group_size, x_row_div=1):
    if not ctx.needs_input_grad[0]:
        return {}  # e.g. scales marked trainable: they get None, and nothing is computed
    w = _awq(q, s, z, group_size, _compute_dtype(x))
    return {0: _input_grad(grad_y, ids, w, x, x_row_div)}


def _nvfp4_grouped_grads(ctx, grad_y, x, ids, packed, scales, ws2, input_scale, x_row_div):
    # W4A4 (input_scale given): the activation quantization passes the gradient straight through, as for nvfp4_linear
    if not ctx.needs_input_grad[0]:
        return {}
    w = _nvfp4(packed, scales, ws2, _compute_dtype(x))
    return {0: _input_grad(grad_y, ids, w, x, x_row_div)}


def _gate_up_silu_grads(ctx, grad_h, x, ids, w_gate_up, top_k):
    gate_up = _rows_forward(x, ids, w_gate_up, top_k)
    return {0: _input_grad(_silu_mul_grad(grad_h, gate_up), ids, w_gate_up, x, top_k)}


def _awq_gate_up_grads(ctx, grad_h, x, ids, q, s, z, group_size, top_k):
    if not ctx.needs_input_grad[0]:
        return {}
    return _gate_up_silu_grads(ctx, grad_h, x, ids, _awq(q, s, z, group_size, _compute_dtype(x)), top_k)


def _mma_gate_up_grads(ctx, grad_h, x, ids, q, s, z, group_size, top_k, *shared):
    if not ctx.needs_input_grad[0]:
        return {}
    return _gate_up_silu_grads(ctx, grad_h, x, ids, _awq_mma(q, s, z, group_size, _compute_dtype(x), shared), top_k)


def _down_combine_grads(ctx, grad_out, h, ids, weights, w_down):
    grad_h, grad_w = _combine_grads(ctx.needs_input_grad[0], ctx.needs_input_grad[2], grad_out, h, ids, weights, w_down)
    return {0: grad_h, 2: grad_w}


def _awq_down_grads(ctx, grad_out, h, ids, weights, q, s, z, group_size):
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[2]):
        return {}
    return _down_combine_grads(ctx, grad_out, h, ids, weights, _awq(q, s, z, group_size, _compute_dtype(h)))


def _mma_down_grads(ctx, grad_out, h, ids, weights, q, s, z, group_size, *shared):
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[2]):
        return {}
    w_down = _awq_mma(q, s, z, group_size, _compute_dtype(h), shared)
    return _down_combine_grads(ctx, grad_out, h, ids, weights, w_down)


def _mma_experts_grads(ctx, grad_out, x, ids, weights, gu_q, gu_s, gu_z, dn_q, dn_s, dn_z, group_size, top_k,
                       *shared):
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[2]):
        return {}
    dtype = _compute_dtype(x)
    w_gate_up = _awq_mma(gu_q, gu_s, gu_z, group_size, dtype, shared[:3])
    w_down = _awq_mma(dn_q, dn_s, dn_z, group_size, dtype, shared[3:])
    gate_up = _rows_forward(x, ids, w_gate_up, top_k)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate.to(x.dtype)) * up.to(x.dtype)  # the forward's h, in x.dtype
    needs_x = ctx.needs_input_grad[0]
    grad_h, grad_w = _combine_grads(needs_x, ctx.needs_input_grad[2], grad_out, h, ids, weights, w_down)
    grad_x = _input_grad(_silu_mul_grad(grad_h, gate_up), ids, w_gate_up, x, top_k) if needs_x else None
    return {0: grad_x, 2: grad_w}


# ------------------------------------------------------------------------------------------------ registration
_SAVED = object()  # placeholder of a tensor input kept by save_for_backward (None is a valid input: no shared expert)


def _register(name: str, grads) -> None:
    n_inputs = len(getattr(torch.ops.torchforge, name).default._schema.arguments)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*[t for t in inputs if isinstance(t, Tensor)])
        ctx.inputs = [_SAVED if isinstance(t, Tensor) else t for t in inputs]  # tensors: saved above

    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if t is _SAVED else t for t in ctx.inputs]
        out = [None] * n_inputs
        for i, g in grads(ctx, grad_out, *args).items():
            out[i] = g if ctx.needs_input_grad[i] else None
        return tuple(out)

    torch.library.register_autograd(f"torchforge::{name}", backward, setup_context=setup_context)


def register() -> None:
    _register("awq_grouped_linear", _grouped_linear_grads)  # (x, expert_ids, qweight, scales, qzeros, group_size)
    _register("awq_moe_gemm", _grouped_linear_grads)  # ... group_size, x_row_div)
    _register("nvfp4_grouped_linear", _nvfp4_grouped_grads)
    _register("awq_moe_gate_up_silu", _awq_gate_up_grads)
    _register("awq_moe_down_combine", _awq_down_grads)
    _register("awq_mma_moe_gate_up_silu", _mma_gate_up_grads)
    _register("awq_mma_moe_down_combine", _mma_down_grads)
    _register("awq_mma_moe_experts", _mma_experts_grads)
