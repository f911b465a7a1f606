"""ForgeAWQExperts: all routed experts of one MoE layer in AWQ W4 form, a drop-in for HF's fused experts."""
from __future__ import annotations

import torch
from torch import nn

from torchforge import ops
from torchforge.nn._group_size import check_group_size
from torchforge.ops.awq_moe import awq_moe_gemm
from torchforge.ops.awq_mma_layout import awq_to_mma_layout, mma_layout_fits, mma_layout_to_awq
from torchforge.ops.awq_mma_moe_experts import awq_mma_moe_experts
from torchforge.ops.awq_moe_fused import awq_moe_down_combine, awq_moe_gate_up_silu
from torchforge.ops.zero_points import zeros_are_8


def _act(name_or_fn):
    if callable(name_or_fn):
        return name_or_fn
    from transformers.activations import ACT2FN

    return ACT2FN[name_or_fn]


def check_routing_args(owner: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> None:
    """HF's experts call: `top_k_index` and `top_k_weights` both [T, k] for hidden_states [T, H]. A weights tensor of
    another shape ([T, 1], [T]) broadcast in the weighted sum over the picks and gave a wrong output, no error."""
    if hidden_states.dim() != 2:
        raise ValueError(f"{owner}: hidden_states must be [T, H] (tokens flattened, as the MoE block passes them), got "
                         f"shape {tuple(hidden_states.shape)}")
    if top_k_index.dim() != 2:
        raise ValueError(f"{owner}: top_k_index must be [T, k] (the router's expert ids per token), got shape "
                         f"{tuple(top_k_index.shape)}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"{owner}: top_k_weights has shape {tuple(top_k_weights.shape)} but top_k_index has "
                         f"{tuple(top_k_index.shape)}; pass one routing weight per pick, [T, k]")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"{owner}: top_k_weights must be floating point (the router's weights), got "
                        f"{top_k_weights.dtype}")
    if top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"{owner}: top_k_index has {top_k_index.shape[0]} rows but hidden_states has "
                         f"{hidden_states.shape[0]} tokens; flatten the tokens to [T, H] and route each once")


def _is_silu(act_fn) -> bool:
    """nn.SiLU or transformers' SiLUActivation (ACT2FN["silu"]), both F.silu."""
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


class ForgeAWQExperts(nn.Module):
    """Routed experts stacked along dim 0, each projection in vLLM's AWQ layout.

    HF transformers 5 keeps experts fused as `gate_up_proj [E, 2I, H]` (gate rows first) and
    `down_proj [E, H, I]`. Here OC = 2I for gate_up: the gate is output columns [0, I) and up is [I, 2I).
    AWQ groups run along the input dim and words pack 8 output columns, so with I % 8 == 0 the fused
    tensors split exactly into vLLM's per-expert `gate_proj` / `up_proj` at export time.

      gate_up_qweight int32 [E, H, 2I // 8]   gate_up_scales fp16 [E, H // G, 2I]   gate_up_qzeros [E, H // G, 2I // 8]
      down_qweight    int32 [E, I, H // 8]    down_scales    fp16 [E, I // G, H]    down_qzeros    [E, I // G, H // 8]

    forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) matches HF's experts signature. Every
    routed (token, expert) pair is one row of a grouped W4A16 GEMM (`awq_moe_gemm`: expert-sorted blocks on
    CUDA): no Python loop over experts.

    `use_mma_layout()` (run phase, CUDA) re-packs both `*_qweight` buffers into MMA fragment order
    (`[E, OC // 64, IC * 8]`, torchforge.ops.awq_mma_layout) for the grouped tensor-core kernel of csrc/awq_mma_moe.cu;
    `state_dict()`, :meth:`awq_qweights` and the exporters still give vLLM's AWQ layout.
    """

    weight_layout = "awq"  # class default: modules pickled before the mma layout existed
    # On the mma layout: every zero point of both projections is 8, looked at when the layout is taken or a checkpoint
    # loaded; the decode kernels then skip qzeros (torchforge.ops.zero_points)
    zeros_are_8 = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, group_size: int = 128,
                 symmetric: bool = True, act_fn="silu", device=None):
        super().__init__()
        E, H, I, G = num_experts, hidden_size, intermediate_size, check_group_size("ForgeAWQExperts", group_size)
        for name, dim in (("hidden_size", H), ("intermediate_size", I)):
            if dim % G:
                raise ValueError(f"ForgeAWQExperts: {name}={dim} is not divisible by group_size={G}; choose a group "
                                 "size that divides it or ignore the experts (re:.*mlp\\.experts$)")
            if dim % 8:
                raise ValueError(f"ForgeAWQExperts: {name}={dim} must be divisible by 8 (AWQ packs 8 columns per int32)")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.group_size, self.symmetric = G, symmetric
        self.act_fn = _act(act_fn)
        i32 = dict(dtype=torch.int32, device=device)
        self.register_buffer("gate_up_qweight", torch.empty(E, H, 2 * I // 8, **i32))
        self.register_buffer("gate_up_scales", torch.empty(E, H // G, 2 * I, dtype=torch.float16, device=device))
        self.register_buffer("gate_up_qzeros", torch.empty(E, H // G, 2 * I // 8, **i32))
        self.register_buffer("down_qweight", torch.empty(E, I, H // 8, **i32))
        self.register_buffer("down_scales", torch.empty(E, I // G, H, dtype=torch.float16, device=device))
        self.register_buffer("down_qzeros", torch.empty(E, I // G, H // 8, **i32))
        self.weight_layout = "awq"
        self._register_state_dict_hook(_export_awq_layout)
        self._register_load_state_dict_pre_hook(_import_awq_layout, with_module=True)

    @torch.no_grad()
    def pack_weights(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> "ForgeAWQExperts":
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        if tuple(gate_up_proj.shape) != (E, 2 * I, H):
            raise ValueError(f"ForgeAWQExperts: gate_up_proj has shape {tuple(gate_up_proj.shape)}, expected [E, 2I, H] = [{E}, {2 * I}, {H}]")
        if tuple(down_proj.shape) != (E, H, I):
            raise ValueError(f"ForgeAWQExperts: down_proj has shape {tuple(down_proj.shape)}, expected [E, H, I] = [{E}, {H}, {I}]")
        q = lambda w: ops.awq_quantize(w, group_size=self.group_size, symmetric=self.symmetric)  # noqa: E731
        self.gate_up_qweight, self.gate_up_scales, self.gate_up_qzeros = q(gate_up_proj)
        self.down_qweight, self.down_scales, self.down_qzeros = q(down_proj)
        self.weight_layout = "awq"
        return self

    @classmethod
    def from_hf(cls, experts: nn.Module, group_size: int = 128, symmetric: bool = True) -> "ForgeAWQExperts":
        gu, down = experts.gate_up_proj, experts.down_proj
        return cls.empty_for(experts, group_size, symmetric, device=gu.device).pack_weights(gu, down)

    @classmethod
    def empty_for(cls, experts: nn.Module, group_size: int = 128, symmetric: bool = True,
                  device=None) -> "ForgeAWQExperts":
        """The unpacked module for HF fused `experts` (on `device`, e.g. meta to check that they fit)."""
        if getattr(experts, "is_transposed", False):
            raise ValueError(f"{type(experts).__name__} stores transposed expert weights; not supported yet")
        if getattr(experts, "has_bias", False):
            raise ValueError(f"{type(experts).__name__} has expert biases; not supported yet")
        E, two_i, H = experts.gate_up_proj.shape
        return cls(E, H, two_i // 2, group_size=group_size, symmetric=symmetric, act_fn=experts.act_fn, device=device)

    def dequantized_weights(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in HF's layout, in `dtype` (exact in fp32, rounded once)."""
        G = self.group_size
        gate_up_q, down_q = self.awq_qweights()
        return (ops.awq_dequantize(gate_up_q, self.gate_up_scales, self.gate_up_qzeros, G, dtype),
                ops.awq_dequantize(down_q, self.down_scales, self.down_qzeros, G, dtype))

    def awq_qweights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_qweight, down_qweight) in vLLM's AWQ layout, whatever layout the module runs with."""
        if self.weight_layout == "mma":
            return mma_layout_to_awq(self.gate_up_qweight), mma_layout_to_awq(self.down_qweight)
        return self.gate_up_qweight, self.down_qweight

    @torch.no_grad()
    def use_mma_layout(self) -> bool:
        """Switch both projections to the mma layout (exact); False, and nothing changed, where a shape or the group
        size does not fit it (hidden and intermediate sizes multiples of 64, the group size 32 or a multiple of 64)."""
        if self.weight_layout != "mma":
            H, I, G = self.hidden_size, self.intermediate_size, self.group_size
            if not (mma_layout_fits(H, 2 * I, G) and mma_layout_fits(I, H, G)):
                return False
            self.gate_up_qweight = awq_to_mma_layout(self.gate_up_qweight)
            self.down_qweight = awq_to_mma_layout(self.down_qweight)
            self.weight_layout = "mma"
        self.zeros_are_8 = zeros_are_8(self.gate_up_qzeros, self.down_qzeros)
        return True

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                shared: tuple | None = None, shared_zeros_are_8: bool = False) -> torch.Tensor:
        """HF's experts call. `shared` (mma path only, see ForgeMoE.use_fused_decode): ((qweight, scales, qzeros) of
        a shared expert's gate_up, the same of its down), routed as expert id E by `top_k_index`;
        `shared_zeros_are_8`: every zero point of those is 8."""
        check_routing_args("ForgeAWQExperts", hidden_states, top_k_index, top_k_weights)
        T, k = top_k_index.shape
        G = self.group_size
        flat_ids = top_k_index.reshape(-1)  # row t*k + j is token t's j-th pick
        # SiLU experts take the fused ops, in training too: they have gradients for x and the router weights
        # (ops/moe_autograd.py), and on the mma layout the path below would convert every expert to the AWQ layout
        # on each call
        fused = _is_silu(self.act_fn)
        if shared is not None and not (fused and self.weight_layout == "mma"):
            raise ValueError("ForgeAWQExperts: a shared expert is only taken on the mma layout with SiLU experts; "
                             "add it separately")
        if fused and self.weight_layout == "mma":
            # one op for both halves: where the rows are sorted by expert, gate_up and down share one sort
            symmetric = self.zeros_are_8 and (shared is None or shared_zeros_are_8)
            return awq_mma_moe_experts(hidden_states, flat_ids, top_k_weights,
                                       (self.gate_up_qweight, self.gate_up_scales, self.gate_up_qzeros),
                                       (self.down_qweight, self.down_scales, self.down_qzeros), G, k, shared,
                                       symmetric)
        if fused:
            # the same computation as below as two ops, whose decode path fuses SiLU * up and the weighted sum
            # into the GEMVs' split-K reduce kernels (awq_moe_fused.py)
            h = awq_moe_gate_up_silu(hidden_states, flat_ids, self.gate_up_qweight, self.gate_up_scales,
                                     self.gate_up_qzeros, G, k)
            return awq_moe_down_combine(h, flat_ids, top_k_weights, self.down_qweight, self.down_scales,
                                        self.down_qzeros, G)
        gate_up_q, down_q = self.awq_qweights()  # other activations: AWQ layout (a copy on mma)
        gate_up = awq_moe_gemm(hidden_states, flat_ids, gate_up_q, self.gate_up_scales, self.gate_up_qzeros, G, k)
        gate, up = gate_up.chunk(2, dim=-1)
        down = awq_moe_gemm(self.act_fn(gate) * up, flat_ids, down_q, self.down_scales, self.down_qzeros, G, 1)
        # Weighted sum over the k picks in fp32 (router weights are fp32), then back to the activation dtype.
        out = (down.view(T, k, self.hidden_size).float() * top_k_weights.unsqueeze(-1).float()).sum(dim=1)
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, intermediate_size="
                f"{self.intermediate_size}, group_size={self.group_size}, symmetric={self.symmetric}"
                + (", weight_layout=mma" if self.weight_layout == "mma" else ""))


_QWEIGHTS = ("gate_up_qweight", "down_qweight")


def _export_awq_layout(module: ForgeAWQExperts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict hook: checkpoints always hold vLLM's AWQ layout."""
    if module.weight_layout == "mma":
        for name in _QWEIGHTS:
            if prefix + name in state_dict:
                state_dict[prefix + name] = mma_layout_to_awq(state_dict[prefix + name])


def _import_awq_layout(module: ForgeAWQExperts, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: AWQ-layout qweights ([E, IC, OC // 8]) for a module on the mma layout."""
    if module.weight_layout != "mma":
        return
    E, H, I = module.num_experts, module.hidden_size, module.intermediate_size
    for name, awq_shape in zip(_QWEIGHTS, ((E, H, 2 * I // 8), (E, I, H // 8))):
        key = prefix + name
        if key in state_dict and tuple(state_dict[key].shape) == awq_shape:
            state_dict[key] = awq_to_mma_layout(state_dict[key])
    gu, dn = state_dict.get(prefix + "gate_up_qzeros"), state_dict.get(prefix + "down_qzeros")
    if gu is not None or dn is not None:
        module.zeros_are_8 = zeros_are_8(module.gate_up_qzeros if gu is None else gu,
                                         module.down_qzeros if dn is None else dn)
