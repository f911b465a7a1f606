"""ForgeGPTQLinear: a Linear whose weight is stored in the GPTQ W4 checkpoint layout."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from torchforge.ops import gptq as gptq_ops
from torchforge.ops.awq import awq_pack


class ForgeGPTQLinear(nn.Module):
    """y = x @ dequant(W).T + b with W stored in AutoGPTQ / vLLM ``gptq`` layout (plain buffers):

      qweight int32 [IC // 8, OC]       8 consecutive input rows per word, row 8r + j in bits 4j
      qzeros  int32 [IC // G, OC // 8]  zero points minus 1 (v1 convention, see torchforge.ops.gptq_reference)
      scales  fp16  [IC // G, OC]
      g_idx   int32 [IC]                group of each input row (k // G: torchforge does not reorder columns)

    Build: construct (any device, meta included) then :meth:`pack_result` with a
    :class:`torchforge.gptq.GPTQResult`, or :meth:`from_linear` (GPTQ with a Hessian, or round-to-nearest on
    the GPTQ grid without one). Forward runs ``torchforge.ops.gptq.w4a16_gptq_linear``.
    """

    bits = 4

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, group_size: int = 128,
                 symmetric: bool = True, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if out_features % 8:
            raise ValueError(f"ForgeGPTQLinear: out_features={out_features} must be divisible by 8 (qzeros packs 8 "
                             "output channels per int32); keep this layer unquantized with the recipe's `ignore`")
        if in_features % group_size or in_features % 8:
            raise ValueError(f"ForgeGPTQLinear: in_features={in_features} must be divisible by group_size={group_size} "
                             "and by 8 (qweight packs 8 input rows per int32)")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.symmetric = group_size, symmetric
        ng = in_features // group_size
        self.register_buffer("qweight", torch.empty(in_features // 8, out_features, dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.empty(ng, out_features // 8, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(ng, out_features, dtype=torch.float16, device=device))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @torch.no_grad()
    def pack_result(self, result, bias: Optional[torch.Tensor] = None) -> "ForgeGPTQLinear":
        """Fill the buffers from a ``GPTQResult`` of this layer's weight ``[OC, IC]``."""
        oc, ic = result.codes.shape[-2:]
        if (oc, ic) != (self.out_features, self.in_features) or result.codes.dim() != 2:
            raise ValueError(f"ForgeGPTQLinear.pack_result: result has codes {tuple(result.codes.shape)}, expected "
                             f"[out_features, in_features] = [{self.out_features}, {self.in_features}]")
        if result.group_size != self.group_size or result.bits != 4:
            raise ValueError(f"ForgeGPTQLinear.pack_result: result has group_size={result.group_size}, "
                             f"bits={result.bits}; this layer holds 4-bit codes with group_size={self.group_size}")
        self.qweight = gptq_ops.gptq_pack(result.codes.T.contiguous())
        self.qzeros = gptq_ops.gptq_pack_zeros(result.zeros.T.contiguous())
        self.scales = result.scales.T.to(torch.float16).contiguous()
        self.g_idx = gptq_ops.trivial_g_idx(self.in_features, self.group_size, device=self.qweight.device)
        if bias is not None:
            if self.bias is None:
                raise ValueError("ForgeGPTQLinear.pack_result: got a bias but the module was built with bias=False")
            self.bias = bias.detach().to(device=self.qweight.device, dtype=self.bias.dtype)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, hessian: Optional[torch.Tensor] = None, *, group_size: int = 128,
                    symmetric: bool = True, **solve_kw) -> "ForgeGPTQLinear":
        """GPTQ of ``linear.weight`` with ``hessian`` (``[IC, IC]`` or block-diagonal); without one,
        ``H = I``, which is round-to-nearest on the same grid. ``solve_kw`` go to ``torchforge.gptq.solve``
        (``block_size``, ``damp``, ``mse``, ``static_groups``, ...)."""
        from torchforge.gptq import solve, solve_batched

        w = linear.weight
        if hessian is None:
            hessian = torch.eye(linear.in_features, device=w.device)
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group_size=group_size,
                  symmetric=symmetric, device=w.device, dtype=w.dtype)
        if w.is_cuda:
            res = solve_batched(w[None], hessian.to(w.device)[None], group_size=group_size, symmetric=symmetric, **solve_kw)
            res = res._replace(codes=res.codes[0], scales=res.scales[0], zeros=res.zeros[0], qmeta=res.qmeta[0])
        else:
            res = solve(w, hessian.to(w.device), group_size=group_size, symmetric=symmetric, **solve_kw)
        return mod.pack_result(res, linear.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [OC, IC] this layer computes with, in `dtype`."""
        return gptq_ops.gptq_dequantize(self.qweight, self.scales.to(dtype), self.qzeros, self.g_idx)

    def has_act_order(self) -> bool:
        """True when g_idx is not ``k // group_size`` (checkpoints of other tools)."""
        return not torch.equal(self.g_idx.cpu(), gptq_ops.trivial_g_idx(self.in_features, self.group_size))

    @torch.no_grad()
    def awq_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight, scales, qzeros) in vLLM's AWQ layout, exactly the same weight (no act-order only)."""
        if self.has_act_order():
            raise ValueError("ForgeGPTQLinear: act-order (a permuted g_idx) has no AWQ-layout equivalent")
        codes = gptq_ops.gptq_unpack(self.qweight)  # [IC, OC]
        zeros = gptq_ops.gptq_unpack_zeros(self.qzeros)  # [NG, OC]
        if int(zeros.max()) > 15:
            raise ValueError("ForgeGPTQLinear: a stored zero point of 16 has no 4-bit AWQ equivalent")
        return awq_pack(codes), self.scales, awq_pack(zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gptq_ops.w4a16_gptq_linear(x, self.qweight, self.scales, self.qzeros, self.g_idx, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}")
