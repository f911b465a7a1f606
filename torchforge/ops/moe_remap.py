"""`torchforge::moe_remap`: original expert ids -> compact (pruned) expert ids, for MoE expert pruning.

    ids, weights = moe_remap(topk_ids, topk_weights, layer_map)

`layer_map` is one row of an expert map (`torchforge.prune.build_expert_map`): int32 `[E]` over the
router's original experts, `layer_map[e]` = the compact id of a kept expert, `-1` (any negative value)
for a pruned one. For every routed pick:

    ids[i]     = layer_map[topk_ids[i]]   if that is >= 0
    weights[i] = topk_weights[i]
    pruned pick (layer_map[...] < 0)  ->  ids[i] = 0, weights[i] = 0  (seed 000 section 5.3)

so the result never holds a negative id, and compact id 0 exists in every layer (an expert map keeps at
least one expert per layer). `ids` has `topk_ids`' dtype (int64 from HF routers, int32 from vLLM's),
`weights` `topk_weights`' dtype; both have `topk_ids`' shape.

Input ids outside `[0, E)`: on CPU (eager) the op raises ValueError. On CUDA it does not check (that
would be a host sync): the Triton kernel treats them like pruned picks (id 0, weight 0), and so does the
PyTorch reference that runs on CUDA without triton. Under torch.compile / fake tensors nothing is
checked either; the clamping semantics apply.

Dispatch follows `torchforge.ops.awq`: a `triton_op` when triton imports; CUDA tensors run the
elementwise Triton kernel (one program per BLOCK picks, no host sync), CPU tensors the reference.
Tests launch `launch_moe_remap` directly on CPU under TRITON_INTERPRET=1.
"""
from typing import Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from torchforge.ops._check import check_type, check_value
from torchforge.ops._triton import HAS_TRITON, tl, triton, use_triton
from torchforge.ops.awq_reference import _is_traced

if HAS_TRITON:
    from torch.library import triton_op as _define_kernel_op
else:  # importing torchforge must work without triton
    _define_kernel_op = custom_op

__all__ = ["moe_remap", "moe_remap_ref", "launch_moe_remap"]

_INT_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_args(topk_ids: Tensor, topk_weights: Tensor, layer_map: Tensor) -> None:
    op = "moe_remap"
    check_type(
        topk_ids.dtype in _INT_DTYPES,
        lambda: f"{op}: topk_ids must be int32 or int64 (the router's expert ids), got {topk_ids.dtype}",
    )
    check_type(
        topk_weights.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: topk_weights must be float32/float16/bfloat16, got {topk_weights.dtype}",
    )
    check_type(
        layer_map.dtype in _INT_DTYPES,
        lambda: f"{op}: layer_map must be int32 (one row of the expert map), got {layer_map.dtype}",
    )
    check_value(
        layer_map.dim() == 1 and layer_map.shape[0] > 0,
        lambda: f"{op}: layer_map must be [E] with E >= 1 (one row of expert_map[L, E]), got shape "
        f"{tuple(layer_map.shape)}; pass expert_map[layer]",
    )
    check_value(
        topk_weights.dim() == topk_ids.dim() and all(a == b for a, b in zip(topk_weights.shape, topk_ids.shape)),
        lambda: f"{op}: topk_weights has shape {tuple(topk_weights.shape)} but topk_ids has "
        f"{tuple(topk_ids.shape)}; they must match (one weight per routed pick)",
    )
    for name, t in (("topk_weights", topk_weights), ("layer_map", layer_map)):
        check_value(
            t.device == topk_ids.device,
            lambda: f"{op}: {name} is on {t.device} but topk_ids is on {topk_ids.device}; move them to one device",
        )


def check_ids_in_range(topk_ids: Tensor, num_experts: int) -> None:
    """Eager range check of the router's ids (a host sync: CPU only)."""
    if topk_ids.numel() == 0:
        return
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    nbad = int(bad.sum())
    if nbad:
        first = int(topk_ids[bad][0])
        raise ValueError(
            f"moe_remap: topk_ids has {nbad} values outside [0, {num_experts}) (e.g. {first}); layer_map has "
            f"{num_experts} entries, one per ORIGINAL expert of the router. Pass the router's original ids "
            "(not already remapped ones) and the expert-map row of the same layer"
        )


def moe_remap_ref(topk_ids: Tensor, topk_weights: Tensor, layer_map: Tensor) -> Tuple[Tensor, Tensor]:
    """Pure PyTorch semantics (no checks): pruned picks and ids outside `[0, E)` -> id 0, weight 0."""
    num_experts = layer_map.shape[0]
    ids = topk_ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < num_experts)
    mapped = layer_map.to(torch.int64)[torch.where(in_range, ids, 0)]
    keep = in_range & (mapped >= 0)
    out_ids = torch.where(keep, mapped, 0).to(topk_ids.dtype)
    out_w = torch.where(keep, topk_weights, torch.zeros((), dtype=topk_weights.dtype, device=topk_weights.device))
    return out_ids, out_w


if HAS_TRITON:

    @triton.jit
    def _moe_remap_kernel(ids_ptr, w_ptr, map_ptr, out_ids_ptr, out_w_ptr, N, E, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int64)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        in_range = (ids >= 0) & (ids < E)
        # Never dereference an out-of-range id: read the map at 0 instead and drop the pick below.
        m = tl.load(map_ptr + tl.where(in_range, ids, 0), mask=mask, other=-1).to(tl.int64)
        keep = in_range & (m >= 0)
        tl.store(out_ids_ptr + offs, tl.where(keep, m, 0).to(out_ids_ptr.dtype.element_ty), mask=mask)
        tl.store(out_w_ptr + offs, tl.where(keep, w, 0.0).to(out_w_ptr.dtype.element_ty), mask=mask)


def launch_moe_remap(topk_ids: Tensor, topk_weights: Tensor, layer_map: Tensor, *, block: int = 1024
                     ) -> Tuple[Tensor, Tensor]:
    """Runs the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1). Arguments are assumed validated."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge moe_remap Triton kernel needs triton; install it or use CPU tensors")
    ids = topk_ids.contiguous()
    w = topk_weights.contiguous()
    m = layer_map.contiguous()
    out_ids = torch.empty(ids.shape, dtype=ids.dtype, device=ids.device)
    out_w = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    n = ids.numel()
    if n == 0:
        return out_ids, out_w
    grid = (triton.cdiv(n, block),)
    torch.library.wrap_triton(_moe_remap_kernel)[grid](ids, w, m, out_ids, out_w, n, m.shape[0], BLOCK=block)
    return out_ids, out_w


@_define_kernel_op("torchforge::moe_remap", mutates_args=())
def _moe_remap(topk_ids: Tensor, topk_weights: Tensor, layer_map: Tensor) -> Tuple[Tensor, Tensor]:
    _check_args(topk_ids, topk_weights, layer_map)
    if use_triton(topk_ids):
        return launch_moe_remap(topk_ids, topk_weights, layer_map)
    if topk_ids.device.type == "cpu" and not _is_traced(topk_ids, layer_map):
        check_ids_in_range(topk_ids, layer_map.shape[0])
    ids, weights = moe_remap_ref(topk_ids, topk_weights, layer_map)
    return ids.contiguous(), weights.contiguous()  # the fake's (and the kernel's) layout for any input strides


@_moe_remap.register_fake
def _(topk_ids: Tensor, topk_weights: Tensor, layer_map: Tensor) -> Tuple[Tensor, Tensor]:
    _check_args(topk_ids, topk_weights, layer_map)
    return torch.empty_like(topk_ids, memory_format=torch.contiguous_format), torch.empty_like(
        topk_weights, memory_format=torch.contiguous_format)


def _kept_picks(topk_ids: Tensor, layer_map: Tensor) -> Tensor:
    """Where a pick keeps its weight: an in-range id of a kept expert (the forward's `keep`)."""
    ids = topk_ids.long()
    e = layer_map.shape[0]
    in_range = (ids >= 0) & (ids < e)
    return in_range & (layer_map.long()[ids.clamp(0, max(e - 1, 0))] >= 0)


def _setup_context(ctx, inputs, output) -> None:
    topk_ids, _, layer_map = inputs
    ctx.save_for_backward(topk_ids, layer_map)


def _backward(ctx, grad_ids, grad_weights):
    # weights pass through for kept picks and are zeroed for pruned ones: the gradient follows the same mask (the
    # router's weights require grad in training mode, and torch.compile traces the backward whenever they do)
    topk_ids, layer_map = ctx.saved_tensors
    if grad_weights is None:
        return None, None, None
    keep = _kept_picks(topk_ids, layer_map)
    return None, torch.where(keep, grad_weights, torch.zeros((), dtype=grad_weights.dtype,
                                                             device=grad_weights.device)), None


_moe_remap.register_autograd(_backward, setup_context=_setup_context)


def moe_remap(topk_ids: Tensor, topk_weights: Tensor, layer_map: Tensor) -> Tuple[Tensor, Tensor]:
    """Router picks over the original experts -> picks over the kept (compact) experts.

    `topk_ids [..., k]` int32/int64 in `[0, E)`, `topk_weights [..., k]` float, `layer_map [E]` int32
    (compact id, or -1 for a pruned expert). Returns `(ids, weights)`: `ids = layer_map[topk_ids]` with
    pruned picks sent to compact id 0 with weight 0, so no id is negative or out of range. Out-of-range
    input ids raise ValueError on CPU; on CUDA they are not checked and come out as id 0, weight 0.
    """
    if not torch.compiler.is_compiling():
        _check_args(topk_ids, topk_weights, layer_map)
    return torch.ops.torchforge.moe_remap(topk_ids, topk_weights, layer_map)
