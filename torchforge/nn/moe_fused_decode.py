"""What ForgeMoE.use_fused_decode needs: which blocks qualify, and the shared expert's gate_up as one expert.

A DeepSeek MoE block runs, per decode step, HF's router (about ten small kernels: sigmoid, two top-k's, scatter,
masked fill, gather, normalization) and its shared expert as a separate MLP (three GEMMs, SiLU * up, an add). The
fused decode path routes with one kernel (`torchforge::sigmoid_group_topk`) that also appends the shared expert as
one more pick (id E, weight 1), and the grouped expert kernels compute it with the routed ones. The grouped kernel
reads the shared expert's down projection where it is; its gate and up projections are concatenated once into the
experts' gate_up layout (a copy of 2/3 of one expert per layer, refreshed when weights are loaded).
"""
from __future__ import annotations

import torch
from torch import nn

from torchforge.nn.awq_experts import ForgeAWQExperts, _is_silu
from torchforge.nn.awq_linear import ForgeAWQLinear

# Tokens up to which a block takes the fused path. Beyond, the shared expert's rows would go through the grouped
# kernel in sorted blocks of 8 or 16 rows instead of the dense prefill kernels (wgmma, dequantize + cuBLAS).
# `bench/moe_block.py` (one block of the end-to-end model: 64 experts of 1408 + the shared one), CUDA-graph time of the
# fused path over the unfused one (BENCHMARKS.md, sixteenth and seventeenth sessions):
#   tokens    1     8     16    32    64    96    128   192   256   512
#   H200    0.50  1.07  0.94  0.86  0.93  0.90  0.90  0.91  0.94  1.01
#   H100    0.51  0.71  0.80  0.81  1.03  0.89  0.89  0.90  0.93  1.00
# and eager (host time included) the fused block was faster at every T on both. At 512 the two are even.
FUSED_DECODE_MAX_TOKENS = 256


def _mma_linear(m, in_features: int, out_features: int, group_size: int, scales_dtype) -> bool:
    return (isinstance(m, ForgeAWQLinear) and m.weight_layout == "mma" and m.bias is None
            and (m.in_features, m.out_features, m.group_size) == (in_features, out_features, group_size)
            and m.scales.dtype == scales_dtype)


def fold_reason(experts: nn.Module, shared: nn.Module | None, shared_expert_gate: nn.Module | None) -> str | None:
    """Why the shared expert cannot be folded into the routed experts' kernels (None: it can)."""
    if not isinstance(experts, ForgeAWQExperts) or experts.weight_layout != "mma":
        return "the routed experts are not a ForgeAWQExperts on the mma layout (torchforge.use_mma_layout)"
    if not _is_silu(experts.act_fn):
        return "the routed experts' activation is not SiLU"
    if shared is None:
        return "the block has no shared expert"
    if shared_expert_gate is not None:
        return "the shared expert is gated (Qwen2-MoE style)"
    H, I, G = experts.hidden_size, experts.intermediate_size, experts.group_size
    dt = experts.gate_up_scales.dtype
    parts = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not (_mma_linear(parts[0], H, I, G, dt) and _mma_linear(parts[1], H, I, G, dt)
            and _mma_linear(parts[2], I, H, G, dt)):
        return (f"the shared expert is not three bias-free ForgeAWQLinear on the mma layout with one routed expert's "
                f"shapes (hidden {H}, intermediate {I}, group {G}, {dt} scales)")
    if not _is_silu(getattr(shared, "act_fn", None)):
        return "the shared expert's activation is not SiLU"
    return None


@torch.no_grad()
def shared_gate_up(shared: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight_mma [2I / 64, H * 8], scales [H / G, 2I], qzeros [H / G, 2I / 8]): gate rows then up rows, the
    experts' gate_up order. The mma layout keeps 64 output columns per row of qweight, and AWQ's scales and zero
    words run along the output columns, so concatenating along them is exact."""
    g, u = shared.gate_proj, shared.up_proj
    return (torch.cat([g.qweight, u.qweight], 0), torch.cat([g.scales, u.scales], 1),
            torch.cat([g.qzeros, u.qzeros], 1))


def _find_output_collector():
    """transformers' collector of the outputs a forward records (5.23+), or None where it has none."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector if all(hasattr(_active_collector, a) for a in ("get", "compiling", "global_var")) else None


_COLLECTOR: list = []  # [collector or None], looked up on first use (importing transformers here costs a second)


def _recording_router_logits() -> bool:
    """Whether transformers' output-capture hooks (5.23+) record router logits now. The hooks are installed on every
    router once router logits are requested and stay, but record only while a forward's collector asks for them
    (`output_router_logits=True`). Read from transformers' internals; where they are not as expected, say yes (the
    block then calls the router, which is always correct)."""
    if not _COLLECTOR:
        _COLLECTOR.append(_find_output_collector())
    collector = _COLLECTOR[0]
    if collector is None:
        return True
    if torch.compiler.is_compiling():
        # dynamo cannot trace ContextVar.get; a compiled forward of the model sets the collector as a global
        # (transformers' CompileableContextVar). Where only this block is compiled and the model's forward runs eager,
        # the block cannot see the collector: say yes, so the router runs (and its logits are recorded if asked for).
        if not collector.compiling:
            return True
        collected = collector.global_var
    else:
        collected = collector.get()
    return collected is not None and "router_logits" in collected


def router_is_hooked(gate: nn.Module) -> bool:
    """Whether someone watches the router's forward (torchforge's own router statistics, a user's hook, transformers
    recording router logits for `output_router_logits=True`), in which case the block calls it instead of the fused
    routing op. transformers' output-capture hook, which stays on every router once router logits were requested,
    counts only while it records (`_recording_router_logits`)."""
    from torch.nn.modules import module as nn_module

    hooks = [*gate._forward_hooks.values(), *gate._forward_pre_hooks.values(),
             *nn_module._global_forward_hooks.values(), *nn_module._global_forward_pre_hooks.values()]
    return any(getattr(h, "__name__", "") != "output_capturing_hook" or _recording_router_logits() for h in hooks)
