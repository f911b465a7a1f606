"""ForgeAWQLinear: a Linear whose weight is stored in vLLM's AWQ W4 layout."""
from __future__ import annotations

import torch
from torch import nn

from torchforge import ops
from torchforge.nn._bias import check_pack_bias
from torchforge.nn._group_size import check_group_size
from torchforge.nn.mma_tickets import add_mma_tickets, rezero_mma_tickets
from torchforge.ops.awq_mma import awq_mma_linear
from torchforge.ops.awq_mma_layout import (
    awq_to_mma_layout,
    mma_layout_fits,
    mma_layout_to_awq,
)
from torchforge.ops.zero_points import zeros_are_8


class W4LinearMixin:
    """What ForgeAWQLinear and ForgeGPTQLinear share (a plain class, listed before nn.Module in their bases): `mma_tickets`
    rezeroed after every move or cast, `zeros_are_8`, and the repr."""

    # On the mma layout: every zero point is 8, looked at once when the layout is taken or a checkpoint loaded
    # (not after in-place edits of qzeros); the decode kernel then skips qzeros (torchforge.ops.zero_points).
    zeros_are_8 = False

    def _look_at_zeros(self, qzeros=None) -> None:
        self.zeros_are_8 = self.weight_layout == "mma" and zeros_are_8(self.qzeros if qzeros is None else qzeros)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        rezero_mma_tickets(self)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}"
                + (f", weight_layout={self.weight_layout}" if self.weight_layout != type(self).weight_layout else ""))


class ForgeAWQLinear(W4LinearMixin, nn.Module):
    weight_layout = "awq"  # class default: modules pickled before the mma layout existed

    """y = x @ dequant(W).T + b with W stored as AWQ W4 buffers (plain tensors, no subclass).

    Buffers carry the exact names and layouts vLLM's AWQ loader reads, so the state dict exports as is:
      qweight int32 [IC, OC // 8]  (8 output channels per word, nibble order 0,2,4,6,1,3,5,7)
      scales  fp16  [IC // G, OC]
      qzeros  int32 [IC // G, OC // 8]
    Built in two phases: construct (any device, including meta) then `pack_weight`, or `from_linear`.

    `use_mma_layout()` (run phase, for CUDA decode) stores qweight's codes in MMA fragment order instead
    (`torchforge.ops.awq_mma_layout`, int32 [OC // 64, IC * 8], same bytes), read by the tensor-core kernel of
    csrc/awq_mma.cu. `state_dict()` still gives vLLM's AWQ layout, and `load_state_dict` takes it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, group_size: int = 128,
                 symmetric: bool = True, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        group_size = check_group_size("ForgeAWQLinear", group_size)
        if out_features % 8:
            raise ValueError(f"ForgeAWQLinear: out_features={out_features} must be divisible by 8 (AWQ packs 8 output "
                             "channels per int32); keep this layer unquantized with the recipe's `ignore`")
        if in_features % group_size:
            raise ValueError(f"ForgeAWQLinear: in_features={in_features} is not divisible by group_size={group_size}; "
                             "choose a group size that divides it or ignore this layer")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.symmetric = group_size, symmetric
        ng = in_features // group_size
        self.register_buffer("qweight", torch.empty(in_features, out_features // 8, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(ng, out_features, dtype=torch.float16, device=device))
        self.register_buffer("qzeros", torch.empty(ng, out_features // 8, dtype=torch.int32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        self.weight_layout = "awq"
        self._register_state_dict_hook(_export_awq_layout)
        self._register_load_state_dict_pre_hook(_import_awq_layout, with_module=True)

    @torch.no_grad()
    def pack_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "ForgeAWQLinear":
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"ForgeAWQLinear.pack_weight: weight has shape {tuple(weight.shape)}, expected "
                             f"[out_features, in_features] = [{self.out_features}, {self.in_features}]")
        check_pack_bias("ForgeAWQLinear.pack_weight", self, bias)
        qweight, scales, qzeros = ops.awq_quantize(weight, group_size=self.group_size, symmetric=self.symmetric)
        self.qweight, self.scales, self.qzeros = qweight, scales, qzeros
        self.weight_layout = "awq"
        if bias is not None:
            self.bias = bias.detach().to(device=qweight.device, dtype=self.bias.dtype)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = True) -> "ForgeAWQLinear":
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group_size=group_size,
                  symmetric=symmetric, device=w.device, dtype=w.dtype)
        return mod.pack_weight(w, linear.bias)

    def awq_qweight(self) -> torch.Tensor:
        """qweight in vLLM's AWQ layout [IC, OC // 8], whatever layout the module runs with."""
        return mma_layout_to_awq(self.qweight) if self.weight_layout == "mma" else self.qweight

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [OC, IC] this layer computes with, in `dtype`: (q - z) * s exact in fp32, rounded once (scales
        rounded to `dtype` first would round twice)."""
        return ops.awq_dequantize(self.awq_qweight(), self.scales, self.qzeros, self.group_size, dtype)

    @torch.no_grad()
    def use_mma_layout(self) -> bool:
        """Switch qweight to the mma layout (exact, in place of the AWQ words); False, and nothing changed, where
        the shape or group size does not fit it (OC and IC multiples of 64, the group size 32 or a multiple of 64). The CUDA kernel needs
        the compiled extension and reads fp16 scales (AWQ's own dtype), or bf16 ones with bf16 activations (after
        `model.to(torch.bfloat16)`); otherwise, and past 128 rows, a call dequantizes the weight and runs cuBLAS,
        except on Hopper, where 32-512 rows run the warpgroup-MMA kernel wherever its time model has it faster
        (torchforge.ops.awq_mma)."""
        if self.weight_layout != "mma":
            if not mma_layout_fits(self.in_features, self.out_features, self.group_size):
                return False
            self.qweight = awq_to_mma_layout(self.qweight)
            self.weight_layout = "mma"
            add_mma_tickets(self)
        self._look_at_zeros()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_layout == "mma":
            return awq_mma_linear(x, self.qweight, self.scales, self.qzeros, self.group_size, self.bias,
                                  getattr(self, "mma_tickets", None), symmetric=self.zeros_are_8)
        return ops.w4a16_linear(x, self.qweight, self.scales, self.qzeros, self.group_size, self.bias)


def _export_awq_layout(module: ForgeAWQLinear, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict hook: checkpoints always hold vLLM's AWQ layout."""
    key = prefix + "qweight"
    if module.weight_layout == "mma" and key in state_dict:
        state_dict[key] = mma_layout_to_awq(state_dict[key])


def _import_awq_layout(module: ForgeAWQLinear, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: an AWQ-layout qweight [IC, OC // 8] is converted for a module on the mma layout."""
    key = prefix + "qweight"
    if module.weight_layout == "mma" and key in state_dict:
        q = state_dict[key]
        if tuple(q.shape) == (module.in_features, module.out_features // 8):
            state_dict[key] = awq_to_mma_layout(q)
    if module.weight_layout == "mma" and prefix + "qzeros" in state_dict:
        module._look_at_zeros(state_dict[prefix + "qzeros"])


def use_mma_layout(model: nn.Module, experts: bool = True, fused_moe: bool = True) -> int:
    """Switch every `ForgeAWQLinear` and `ForgeGPTQLinear` (and, with `experts`, `ForgeAWQExperts`) of `model` that
    fits to the mma layout: faster decode on CUDA (the tensor-core kernels of csrc/awq_mma.cu; linear layers run
    Triton dequantize + cuBLAS beyond 128 rows, or on Hopper up to 512 rows csrc/awq_wgmma.cu where faster). With
    `fused_moe`, every `ForgeMoE` block that then qualifies also takes the fused decode path
    (`ForgeMoE.use_fused_decode`: shared expert inside the grouped expert kernels, DeepSeek-V3 routing in one
    kernel). Returns how many modules switched, fused blocks included. Exports are
    unchanged (each module's own checkpoint layout). A `ForgeGPTQLinear` the mma layout does not fit (dims not multiples
    of 64, a group size of 16) goes to vLLM's AWQ layout instead (`ForgeGPTQLinear.use_awq_layout`), and counts too."""
    from torchforge.nn.awq_experts import ForgeAWQExperts
    from torchforge.nn.gptq_linear import ForgeGPTQLinear
    from torchforge.nn.moe import ForgeMoE

    kinds = (ForgeAWQLinear, ForgeGPTQLinear) + ((ForgeAWQExperts,) if experts else ())
    n = sum(m.use_mma_layout() or (isinstance(m, ForgeGPTQLinear) and m.use_awq_layout())
            for m in model.modules() if isinstance(m, kinds))
    if fused_moe:
        n += sum(m.use_fused_decode() for m in model.modules() if isinstance(m, ForgeMoE))
    return n
