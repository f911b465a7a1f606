"""ForgeMoE: the common MoE block that quantized (and later pruned / NVFP4) experts plug into."""
from __future__ import annotations

import torch
from torch import nn

# Attribute names HF transformers 5 uses for an always-on shared expert MLP.
_SHARED_NAMES = ("shared_experts", "shared_expert")


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
        for attr in ("gate", "experts"):
            if not hasattr(block, attr):
                raise TypeError(f"{type(block).__name__} has no `{attr}`: not an HF transformers 5 sparse-MoE block")
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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        ids, weights = self.remap(*self.route(x))
        out = self.experts(x, ids, weights)
        shared = self.shared
        if shared is not None:
            s = shared(x)
            if self.shared_expert_gate is not None:  # Qwen2-MoE style gated shared expert
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        return out.reshape(shape)
