"""ForgeMoE: the common MoE block that quantized (and later pruned / NVFP4) experts plug into."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchforge.nn.moe_fused_decode import (
    FUSED_DECODE_MAX_TOKENS,
    fold_reason,
    router_is_hooked,
    shared_gate_up,
)
from torchforge.ops.zero_points import zeros_are_8

# Attribute names HF transformers 5 uses for an always-on shared expert MLP.
_SHARED_NAMES = ("shared_experts", "shared_expert")


def unsupported_block_error(block: nn.Module, hf_experts: nn.Module | None = None) -> str | None:
    """Why ForgeMoE.from_hf cannot wrap `block` (whose fused experts module is `hf_experts`, when given), or None.
    ForgeMoE calls the block's `gate` as HF transformers 5's routers ((logits, weights, ids)); blocks that name their
    router otherwise (GraniteMoE, PhiMoE, Jamba, Llama4: `router`) route their own way and are not wrapped."""
    if isinstance(block, ForgeMoE):
        return None
    what = f"{type(block).__name__} is not an HF transformers 5 sparse-MoE block that ForgeMoE can wrap"
    if not isinstance(getattr(block, "gate", None), nn.Module):
        other = next((a for a in ("router", "gating") if isinstance(getattr(block, a, None), nn.Module)), None)
        return f"{what}: it has no `gate` router module" + (f" (its router is `{other}`)" if other else "")
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module) or (hf_experts is not None and experts is not hf_experts):
        return f"{what}: its fused experts are not its `experts` module"
    return None


class ForgeMoE(nn.Module):
    """Replaces an HF sparse-MoE block, keeping its router module exactly as HF wrote it.

    The router (`gate`) is HF's own module, so routing is bit-identical to the original model: DeepSeek-V3's
    fp32 logits, sigmoid scores, `e_score_correction_bias`, group-limited top-k, `norm_topk_prob` and
    `routed_scaling_factor`; DeepSeek-V2's softmax group routing; Qwen3-MoE / Mixtral softmax top-k.
    Subclasses change what happens between routing and the experts by overriding `route` / `remap`
    (identity expert map here). Shared experts are always computed and added, never skipped.
    Submodule names (`gate`, `experts`, `shared_experts`) match HF's, so state-dict keys stay the same.
    """

    def __init__(self, gate: nn.Module, experts: nn.Module, shared: nn.Module | None = None, *,
                 shared_name: str = "shared_experts", shared_expert_gate: nn.Module | None = None):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_name = shared_name if shared is not None else None
        if shared is not None:
            self.add_module(shared_name, shared)
        self.shared_expert_gate = shared_expert_gate

    @classmethod
    def from_hf(cls, block: nn.Module, experts: nn.Module | None = None) -> "ForgeMoE":
        """Wraps an HF sparse-MoE block. A block that is already a ForgeMoE (e.g. a PrunedMoE) keeps its class
        and routing and only gets the new `experts`: quantizing a pruned model must not undo the pruning."""
        if isinstance(block, ForgeMoE):
            if experts is not None:
                block.experts = experts
            return block
        err = unsupported_block_error(block)
        if err:
            raise ValueError(err)
        shared_name = next((n for n in _SHARED_NAMES if getattr(block, n, None) is not None), None)
        return cls(block.gate, experts if experts is not None else block.experts,
                   getattr(block, shared_name) if shared_name else None, shared_name=shared_name or "shared_experts",
                   shared_expert_gate=getattr(block, "shared_expert_gate", None))

    @property
    def shared(self) -> nn.Module | None:
        return getattr(self, self.shared_name) if self.shared_name else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (top_k_index [T, k], top_k_weights [T, k]) with HF's router."""
        _, weights, ids = self.gate(x)
        return ids, weights

    def remap(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Original expert ids -> stored expert ids. Identity here; PrunedMoE overrides it."""
        return ids, weights

    fused_decode = False  # class default: modules pickled before the fused decode path existed
    # the fused copy of the shared gate_up has all its zero points 8 (torchforge.ops.zero_points); its down projection
    # is read in place, so its own module's flag is asked on each call
    fused_shared_gate_up_zeros_are_8 = False
    fused_router = False

    @torch.no_grad()
    def use_fused_decode(self) -> bool:
        """Run phase, after the weights are loaded and `torchforge.use_mma_layout`: the shared expert rides in the
        routed experts' grouped kernels as expert id E (weight 1), and a DeepSeek-V3 router runs as one kernel
        (`torchforge::sigmoid_group_topk`). See torchforge/nn/moe_fused_decode.py. False, and nothing changed, where
        the block does not qualify (`fold_reason` says why). Same experts and weights as HF's router up to float
        rounding of the scores, and except among exactly tied scores (sigmoid saturating to 1.0 with no bias to part
        them), where the kernel takes the lowest expert id and torch.topk any; the expert outputs are summed in fp32
        with the shared one and rounded once. Taken only without autograd (inference) and up to
        FUSED_DECODE_MAX_TOKENS tokens (decode batches, short prefills); otherwise the block runs as before. A hooked
        router (router statistics, a user's hook, transformers recording router logits) is called as usual. The fused
        copy of the shared gate_up follows `load_state_dict`; other in-place weight changes need this call again."""
        from torchforge.nn.routing import router_family

        if fold_reason(self.experts, self.shared, self.shared_expert_gate) is not None:
            return False
        _fold_shared_gate_up(self)
        if not self.fused_decode:
            self.register_load_state_dict_post_hook(_refresh_fused_shared)
        self.fused_decode = True
        # PrunedMoE routes over its kept experts with its own route / remap: only the shared expert is folded there
        self.fused_router = type(self) is ForgeMoE and router_family(self.gate) == "deepseek_v3"
        return True

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        E = self.experts.num_experts
        if self.fused_router and not router_is_hooked(self.gate):
            from torchforge.ops.sigmoid_group_topk import sigmoid_group_topk

            g = self.gate
            logits = F.linear(x.float(), g.weight.float())  # HF's fp32 router logits
            weights, ids = sigmoid_group_topk(logits, g.e_score_correction_bias.float(), g.num_group, g.topk_group,
                                              g.top_k, g.norm_topk_prob, g.routed_scaling_factor, num_shared=1)
        else:
            ids, weights = self.remap(*self.route(x))
            ids = torch.cat([ids, ids.new_full((ids.shape[0], 1), E)], dim=1)
            weights = torch.cat([weights, weights.new_ones((weights.shape[0], 1))], dim=1)
        down = self.shared.down_proj
        shared = ((self.fused_shared_gate_up_qweight, self.fused_shared_gate_up_scales,
                   self.fused_shared_gate_up_qzeros), (down.qweight, down.scales, down.qzeros))
        zeros_8 = self.fused_shared_gate_up_zeros_are_8 and getattr(down, "zeros_are_8", False)
        return self.experts(x, ids, weights, shared=shared, shared_zeros_are_8=zeros_8)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self.fused_decode and not torch.is_grad_enabled() and x.shape[0] <= FUSED_DECODE_MAX_TOKENS:
            return self._forward_fused(x).reshape(shape)
        ids, weights = self.remap(*self.route(x))
        out = self.experts(x, ids, weights)
        shared = self.shared
        if shared is not None:
            s = shared(x)
            if self.shared_expert_gate is not None:  # Qwen2-MoE style gated shared expert
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        return out.reshape(shape)


def _fold_shared_gate_up(module: ForgeMoE) -> None:
    """The fused copy of the shared expert's gate_up (non-persistent buffers) and whether its zero points are all 8."""
    q, s, z = shared_gate_up(module.shared)
    module.register_buffer("fused_shared_gate_up_qweight", q, persistent=False)
    module.register_buffer("fused_shared_gate_up_scales", s, persistent=False)
    module.register_buffer("fused_shared_gate_up_qzeros", z, persistent=False)
    module.fused_shared_gate_up_zeros_are_8 = zeros_are_8(z)


def _refresh_fused_shared(module: ForgeMoE, incompatible_keys) -> None:
    """load_state_dict post-hook: the fused copy of the shared expert's gate_up follows newly loaded weights."""
    _fold_shared_gate_up(module)
