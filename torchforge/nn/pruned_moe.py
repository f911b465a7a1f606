"""PrunedMoE: a ForgeMoE whose experts module holds only the kept experts (seed 000 sections 4.2 and 5).

The router (HF's module) keeps all its original rows; `expert_map_row` (int32 `[E_orig]`: compact id, or -1
for a pruned expert) says which experts exist. Two modes:

* `drop` (seed 000 section 5): HF's router runs over all original experts; `moe_remap` sends each pick to
  its compact id, and pruned picks to compact expert 0 with weight 0. So a token whose picks were pruned
  gets less routed output. `renormalize=True` rescales the kept weights so they sum to what all top-k
  weights summed to (which keeps `routed_scaling_factor` / `norm_topk_prob` semantics: a token always
  receives the same total routed weight); a token whose picks were all pruned gets no routed output.
* `reroute`: pruned experts are removed before the top-k (`torchforge.nn.routing`), so every token gets
  `top_k` kept experts. This is exactly the routing of the smaller standard model that
  `torchforge.prune.export` writes, group-limited routing included (see routing.py for the group rule).

Storage order of the kept experts (`slot_map`, int32 `[E_orig]`: original id -> row of the experts module):
* drop: the expert map's compact order (row c = the expert with compact id c), as seed 000's runtime
  expects: the checkpoint's expert ids are the map's compact ids and `expert_map.pt` maps onto them.
* reroute: ascending original id. This is the expert order of the standard smaller checkpoint (it keeps
  each routing group's experts contiguous, so DeepSeek's group-limited routing survives the export), and
  storing the same order makes PrunedMoE(reroute) compute exactly what the exported model computes
  (HF's fused experts kernels sum in an order that depends on the expert numbering). The map's compact
  ids (hit order) matter for reroute only through which experts are kept.
Routing yields original ids; `remap` (the `moe_remap` op with `slot_map`) turns them into rows.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from torchforge import ops
from torchforge.nn.moe import ForgeMoE
from torchforge.nn.moe_fused_decode import router_is_hooked
from torchforge.nn.routing import KeptExperts, route_kept, router_family, router_groups

MODES = ("drop", "reroute")

__all__ = ["PrunedMoE", "select_experts", "num_experts_of", "storage_order", "slot_map", "MODES"]


def num_experts_of(experts: nn.Module) -> int:
    """Expert count of an HF fused-experts module or ForgeAWQExperts."""
    n = getattr(experts, "num_experts", None)
    if isinstance(n, int):
        return n
    gu = getattr(experts, "gate_up_proj", None)
    if isinstance(gu, torch.Tensor):
        return gu.shape[0]
    raise TypeError(f"{type(experts).__name__} is not a fused experts module (no num_experts / gate_up_proj)")


def select_experts(module: nn.Module, original_ids) -> nn.Module:
    """A copy of `module` holding only experts `original_ids`, in that order (new expert i = old `original_ids[i]`).

    Works for HF transformers 5 fused experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, biases)
    and `ForgeAWQExperts` (AWQ buffers `[E, ...]`): every parameter / buffer of the module itself whose
    leading dim is E is sliced along dim 0 (a new tensor; the original module is not changed) and
    `num_experts` is updated. Other attributes are deep-copied, except `config`, which stays shared with
    the model (HF reads `config._experts_implementation` from it).
    """
    E = num_experts_of(module)
    ids = torch.as_tensor(original_ids, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0:
        raise ValueError("select_experts: original_ids is empty; keep at least one expert")
    if int(ids.min()) < 0 or int(ids.max()) >= E:
        raise ValueError(f"select_experts: original_ids {ids.tolist()} must lie in [0, {E}) ({type(module).__name__} "
                         f"has {E} experts)")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"select_experts: original_ids {ids.tolist()} holds duplicates")
    memo: dict[int, object] = {}
    for t in list(module._parameters.values()) + list(module._buffers.values()):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == E:
            sliced = t.detach().index_select(0, ids.to(t.device))
            memo[id(t)] = nn.Parameter(sliced, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else sliced
    if getattr(module, "config", None) is not None:
        memo[id(module.config)] = module.config
    new = copy.deepcopy(module, memo)
    new.num_experts = ids.numel()
    return new


def storage_order(expert_map_row: torch.Tensor, mode: str) -> torch.Tensor:
    """Original ids of the kept experts in the order PrunedMoE(mode) stores them (see the module docstring)."""
    row = torch.as_tensor(expert_map_row).cpu().long()
    kept = torch.nonzero(row >= 0).squeeze(1)  # ascending original id
    if mode == "reroute":
        return kept
    return kept[torch.argsort(row[kept])]  # by compact id


def slot_map(expert_map_row: torch.Tensor, mode: str) -> torch.Tensor:
    """int32 [E_orig]: original expert id -> row of the experts module, -1 when pruned."""
    row = torch.as_tensor(expert_map_row).cpu()
    order = storage_order(row, mode)
    out = torch.full((row.numel(),), -1, dtype=torch.int32)
    out[order] = torch.arange(order.numel(), dtype=torch.int32)
    return out


def _checked_row(gate: nn.Module, expert_map_row, mode: str, renormalize: bool) -> torch.Tensor:
    """The validated expert-map row for a block routed by `gate`; raises what cannot be pruned that way (a bad mode,
    a row that does not fit the router, reroute without a router re-implementation or with fewer than top_k kept)."""
    if mode not in MODES:
        raise ValueError(f"PrunedMoE: mode={mode!r}; choose 'reroute' (pruned experts removed before top-k) or "
                         "'drop' (router over all experts, pruned picks get weight 0)")
    if renormalize and mode != "drop":
        raise ValueError("PrunedMoE: renormalize=True applies to mode='drop'; reroute already gives every token "
                         "top_k kept experts with the router's own weights")
    from torchforge.prune.expert_map import validate_expert_map

    row = torch.as_tensor(expert_map_row)
    if row.dim() != 1:
        raise ValueError(f"PrunedMoE: expert_map_row must be 1-D [E] (one expert-map row), got shape "
                         f"{tuple(row.shape)}")
    row = validate_expert_map(row[None])[0]
    E, k = row.numel(), int((row >= 0).sum())
    router_e = getattr(gate, "num_experts", None) or getattr(getattr(gate, "weight", None), "shape", [None])[0]
    if router_e is not None and router_e != E:
        raise ValueError(f"PrunedMoE: the expert-map row has {E} entries but the router scores {router_e} experts")
    if mode == "reroute":
        if router_family(gate) is None:
            from torchforge.nn.routing import ROUTER_FAMILIES

            raise TypeError(f"PrunedMoE: mode='reroute' has no router re-implementation for {type(gate).__name__} "
                            f"(known: {sorted(ROUTER_FAMILIES)}); use mode='drop' or add one in "
                            "torchforge/nn/routing.py")
        top_k = gate.top_k
        if k < top_k:
            raise ValueError(f"PrunedMoE: mode='reroute' needs at least top_k={top_k} kept experts per layer, the "
                             f"map keeps {k}; keep more experts or use mode='drop'")
    return row


class PrunedMoE(ForgeMoE):
    """A MoE block with pruned routed experts. Build it with `PrunedMoE.from_block` or `torchforge.prune_experts`.

    `experts` must already hold the kept experts in `storage_order(expert_map_row, mode)` (see `select_experts`).
    """

    def __init__(self, gate: nn.Module, experts: nn.Module, shared: nn.Module | None = None, *,
                 expert_map_row: torch.Tensor, mode: str = "reroute", renormalize: bool = False,
                 shared_name: str = "shared_experts", shared_expert_gate: nn.Module | None = None):
        super().__init__(gate, experts, shared, shared_name=shared_name, shared_expert_gate=shared_expert_gate)
        row = _checked_row(gate, expert_map_row, mode, renormalize)
        E, k = row.numel(), int((row >= 0).sum())
        if num_experts_of(experts) != k:
            raise ValueError(f"PrunedMoE: the expert map keeps {k} experts but the experts module holds "
                             f"{num_experts_of(experts)}; slice it with select_experts(experts, kept_original_ids)")
        self.mode, self.renormalize = mode, bool(renormalize)
        self.num_original_experts, self.num_kept = E, k
        # Derived from the expert map, which is saved on its own (expert_map.pt): not in the state dict. The host
        # copy rebuilds them after every device move (see _apply), so to_empty() / meta construction is safe.
        self._row_host = row.clone()
        self._n_group = router_groups(gate)[0] if mode == "reroute" else None
        device = _device_of(gate)
        self.register_buffer("expert_map_row", row.to(device), persistent=False)
        self.register_buffer("slot_map", slot_map(row, mode).to(device), persistent=False)
        self.kept = None
        if mode == "reroute":
            self.kept = KeptExperts(row >= 0, self._n_group).to(_device_of(gate))
        # load_state_dict(..., assign=True) moves no buffer: a block built on meta would keep meta map buffers
        self.register_load_state_dict_post_hook(_map_buffers_follow_gate)

    def _restore_map_buffers(self, device: torch.device) -> None:
        self.expert_map_row = self._row_host.to(device)
        self.slot_map = slot_map(self._row_host, self.mode).to(device)
        if self.kept is not None:
            self.kept = KeptExperts(self._row_host >= 0, self._n_group).to(device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        device = self.expert_map_row.device
        if device.type != "meta":  # to_empty() leaves uninitialized memory: restore the map-derived buffers
            self._restore_map_buffers(device)
        return self

    @classmethod
    def from_block(cls, block: nn.Module, expert_map_row: torch.Tensor, mode: str = "reroute",
                   renormalize: bool = False) -> "PrunedMoE":
        """An HF sparse-MoE block or a ForgeMoE (e.g. after `torchforge.quantize`) -> PrunedMoE. The block is
        not modified; the kept experts are copied out of it."""
        base, row = cls.check_block(block, expert_map_row, mode, renormalize)
        experts = select_experts(base.experts, storage_order(row, mode))
        return cls(base.gate, experts, base.shared, expert_map_row=row, mode=mode, renormalize=renormalize,
                   shared_name=base.shared_name or "shared_experts", shared_expert_gate=base.shared_expert_gate)

    @classmethod
    def check_block(cls, block: nn.Module, expert_map_row, mode: str = "reroute", renormalize: bool = False
                    ) -> tuple[ForgeMoE, torch.Tensor]:
        """What `from_block` checks, without copying any expert: raises if the block cannot be pruned this way;
        returns (the block as a ForgeMoE, the validated row). `prune_experts` checks every block before it
        replaces the first."""
        if isinstance(block, PrunedMoE):
            raise TypeError("PrunedMoE.from_block: the block is already pruned; prune the original model once with "
                            "the final expert map")
        base = block if isinstance(block, ForgeMoE) else ForgeMoE.from_hf(block)
        E, n = num_experts_of(base.experts), torch.as_tensor(expert_map_row).numel()
        if n != E:
            raise ValueError(f"PrunedMoE.from_block: the expert-map row has {n} entries but the block has {E} routed "
                             "experts")
        return base, _checked_row(base.gate, expert_map_row, mode, renormalize)

    def kept_original_ids(self) -> torch.Tensor:
        """Original ids of the stored experts: row j of the experts module is original expert ids[j]."""
        return storage_order(self._row_host, self.mode)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "drop":
            return super().route(x)  # HF's router over all original experts
        if router_is_hooked(self.gate):
            # route_kept reads the router's weights without calling it: call it for its hooks (a user's hook,
            # transformers' router-logit capture for output_router_logits), which see HF's router over all original
            # experts; the routing itself runs over the kept ones below (so torchforge's router statistics refuse
            # PrunedMoE blocks: these picks are not the block's)
            self.gate(x)
        weights, ids = route_kept(self.gate, x, self.kept)
        return ids, weights

    def remap(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_ids, new_w = ops.moe_remap(ids, weights, self.slot_map)
        if self.renormalize:
            # Kept weights scaled to the total of all picks; tokens with no kept pick keep all-zero weights.
            total = weights.sum(dim=-1, keepdim=True)
            kept_total = new_w.sum(dim=-1, keepdim=True)
            scale = torch.where(kept_total > 0, total / torch.where(kept_total > 0, kept_total, 1), 0)
            new_w = new_w * scale
        return new_ids, new_w

    def extra_repr(self) -> str:
        extra = f", renormalize={self.renormalize}" if self.mode == "drop" else ""
        return f"mode={self.mode!r}, kept={self.num_kept}/{self.num_original_experts}{extra}"


def _map_buffers_follow_gate(module: PrunedMoE, incompatible_keys) -> None:
    """load_state_dict post-hook: the map-derived buffers (not in the state dict) follow the router's device, which
    `load_state_dict(..., assign=True)` sets on a block built on meta."""
    device = _device_of(module.gate)
    if device.type != "meta" and module.expert_map_row.device != device:
        module._restore_map_buffers(device)


def _device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")
