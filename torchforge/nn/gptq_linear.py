"""ForgeGPTQLinear: a Linear whose weight is stored in the GPTQ W4 checkpoint layout."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from torchforge.nn._bias import check_pack_bias
from torchforge.nn._group_size import check_group_size
from torchforge.nn.awq_linear import ForgeAWQLinear, W4LinearMixin
from torchforge.nn.mma_tickets import add_mma_tickets
from torchforge import ops
from torchforge.ops import gptq as gptq_ops
from torchforge.ops.awq import awq_pack, awq_unpack
from torchforge.ops.awq_mma import awq_mma_linear
from torchforge.ops.awq_mma_layout import (
    awq_to_mma_layout,
    mma_layout_fits,
    mma_layout_to_awq,
)


class ForgeGPTQLinear(W4LinearMixin, nn.Module):
    """y = x @ dequant(W).T + b with W stored in AutoGPTQ / vLLM ``gptq`` layout (plain buffers):

      qweight int32 [IC // 8, OC]       8 consecutive input rows per word, row 8r + j in bits 4j
      qzeros  int32 [IC // G, OC // 8]  zero points minus 1 (v1 convention, see torchforge.ops.gptq_reference)
      scales  fp16  [IC // G, OC]       (pack_result: the solver's scale_dtype; a loaded checkpoint's dtype)
      g_idx   int32 [IC]                group of each input row (k // G: torchforge does not reorder columns)

    Build: construct (any device, meta included) then :meth:`pack_result` with a
    :class:`torchforge.gptq.GPTQResult`, or :meth:`from_linear` (GPTQ with a Hessian, or round-to-nearest on
    the GPTQ grid without one). Forward runs ``torchforge.ops.gptq.w4a16_gptq_linear``.

    ``use_mma_layout()`` (run phase, CUDA decode) re-packs the same numbers for the tensor-core kernels of
    csrc/awq_mma.cu: qweight as AWQ codes in MMA fragment order [OC // 64, IC * 8] and qzeros as true zero points in
    AWQ order. With act-order the input rows are stored sorted by group (``act_perm``, a non-persistent int32 buffer,
    derived from ``g_idx`` when switching or loading: assign ``g_idx`` only through ``load_state_dict``) and each call
    computes with ``x[..., act_perm]``. Where the mma layout does not fit (OC or IC not multiples of 64, or a group
    size of 16), :meth:`use_awq_layout` re-packs the same way into vLLM's AWQ layout for ``w4a16_linear``'s kernels: the GPTQ
    layout's own kernel reads a scale and zero point per input row through ``g_idx`` and runs at 0.08-0.5x bf16
    (BENCHMARKS.md, twenty-ninth session). ``state_dict()``, :meth:`gptq_tensors` and the exporters still give the
    GPTQ layout, rows in their checkpoint order.
    """

    bits = 4
    weight_layout = "gptq"  # class default: modules pickled before the mma layout existed

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, group_size: int = 128,
                 symmetric: bool = True, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        group_size = check_group_size("ForgeGPTQLinear", group_size)
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
        # the mma layout of an act-order layer: its rows sorted by group (act_order_perm); derived from g_idx, so
        # not saved
        self.register_buffer("act_perm", None, persistent=False)
        self.weight_layout = "gptq"
        self._register_state_dict_hook(_export_gptq_layout)
        self._register_load_state_dict_pre_hook(_import_gptq_layout, with_module=True)

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
        check_pack_bias("ForgeGPTQLinear.pack_result", self, bias)
        zeros0 = int((result.zeros == 0).sum())
        if zeros0:
            raise ValueError(f"ForgeGPTQLinear.pack_result: {zeros0} zero points are 0, which GPTQ v1 qzeros (z - 1 in "
                             "4 bits) cannot hold; torchforge.quantize keeps such a layer as a ForgeAWQLinear (true "
                             "zero points); here, quantize symmetrically or pack the result into a ForgeAWQLinear")
        self.qweight = gptq_ops.gptq_pack(result.codes.T.contiguous())
        self.qzeros = gptq_ops.gptq_pack_zeros(result.zeros.T.contiguous())
        # the solver's scale_dtype (fp16 by default): an fp16 cast would turn bf16 scales past 65504 into inf; the
        # fp16 formats (vllm-gptq, vllm-awq) cast at export, exactly or not at all
        self.scales = result.scales.T.contiguous()
        self.g_idx = gptq_ops.trivial_g_idx(self.in_features, self.group_size, device=self.qweight.device)
        self.weight_layout = "gptq"
        if bias is not None:
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

    def gptq_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight, qzeros) in the GPTQ layout, whatever layout the module runs with."""
        if self.weight_layout in _AWQ_RUN_LAYOUTS:
            return _awq_to_gptq(self._awq_qweight(self.qweight), self.qzeros, getattr(self, "act_perm", None))
        return self.qweight, self.qzeros

    def _awq_qweight(self, qweight: torch.Tensor) -> torch.Tensor:
        """A run-layout qweight as AWQ words [IC, OC // 8] (rows sorted by group for act-order)."""
        return mma_layout_to_awq(qweight) if self.weight_layout == "mma" else qweight

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [OC, IC] this layer computes with, in `dtype` (exact in fp32, rounded once)."""
        qweight, qzeros = self.gptq_tensors()
        return gptq_ops.gptq_dequantize(qweight, self.scales.float(), qzeros, self.g_idx).to(dtype)

    def has_act_order(self) -> bool:
        """True when g_idx is not ``k // group_size`` (checkpoints of other tools)."""
        return not torch.equal(self.g_idx.cpu(), gptq_ops.trivial_g_idx(self.in_features, self.group_size))

    @torch.no_grad()
    def awq_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight, scales, qzeros) in vLLM's AWQ layout, exactly the same weight (no act-order only)."""
        if self.has_act_order():
            raise ValueError("ForgeGPTQLinear: act-order (a permuted g_idx) has no AWQ-layout equivalent")
        if self.weight_layout in _AWQ_RUN_LAYOUTS:
            return self._awq_qweight(self.qweight), self.scales, self.qzeros
        qweight, qzeros = _gptq_to_awq(self.qweight, self.qzeros, None)
        return qweight, self.scales, qzeros

    @torch.no_grad()
    def use_mma_layout(self) -> bool:
        """Switch to the mma layout (exact); False, and nothing changed, for a stored zero point of 16 (GPTQ v1 can
        hold it, 4 bits cannot), an act-order ``g_idx`` whose groups are not all ``group_size`` rows, or a shape
        that does not fit (OC and IC multiples of 64, the group size 32 or a multiple of 64). A layer on the AWQ
        layout (use_awq_layout) moves on to it where it fits. Act-order layers store their rows sorted by group
        and permute x on each call (``act_perm``)."""
        if self.weight_layout != "mma":
            if not mma_layout_fits(self.in_features, self.out_features, self.group_size):
                return False
            if self.weight_layout == "awq":  # already AWQ words, rows sorted by group: only the fragment order changes
                self.qweight, self.weight_layout = awq_to_mma_layout(self.qweight), "mma"
                add_mma_tickets(self)
            elif not self._switch_layout("mma"):
                return False
        self._look_at_zeros()
        return True

    @torch.no_grad()
    def use_awq_layout(self) -> bool:
        """Switch to vLLM's AWQ layout (exact), for layers the mma layout does not fit (OC or IC not multiples of 64, a
        group size of 16): ``w4a16_linear``'s kernels read contiguous groups, one scale per group, where the GPTQ
        kernel gathers a scale and zero point per input row. Act-order as on the mma layout (rows sorted by group,
        ``x[..., act_perm]`` on each call). False, and nothing changed, on the mma layout already, for a stored zero
        point of 16, act-order groups of unequal sizes, or on the meta device."""
        if self.weight_layout == "awq":
            return True
        return self.weight_layout == "gptq" and self._switch_layout("awq")

    def _switch_layout(self, layout: str) -> bool:
        if self.qweight.is_meta:  # the zero points cannot be checked: switch after loading
            return False
        try:
            perm = gptq_ops.act_order_perm(self.g_idx, self.group_size)
            qweight, qzeros = _gptq_to_awq(self.qweight, self.qzeros, perm)
        except ValueError:  # unequal groups, or a zero point of 16: the GPTQ kernel keeps the layer
            return False
        self.qweight, self.qzeros = awq_to_mma_layout(qweight) if layout == "mma" else qweight, qzeros
        self.register_buffer("act_perm", None if perm is None else perm.to(torch.int32),  # what the kernels read
                             persistent=False)  # registered again: modules pickled before it
        self.weight_layout = layout
        if layout == "mma":
            add_mma_tickets(self)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        perm = getattr(self, "act_perm", None)  # the stored rows are sorted by group (use_mma_layout / use_awq_layout)
        if self.weight_layout == "mma":
            return awq_mma_linear(x, self.qweight, self.scales, self.qzeros, self.group_size, self.bias,
                                  getattr(self, "mma_tickets", None), perm, symmetric=self.zeros_are_8)
        if self.weight_layout == "awq":
            return ops.w4a16_linear(x if perm is None else x.index_select(-1, perm), self.qweight, self.scales,
                                    self.qzeros, self.group_size, self.bias)
        return gptq_ops.w4a16_gptq_linear(x, self.qweight, self.scales, self.qzeros, self.g_idx, self.bias)


_AWQ_RUN_LAYOUTS = ("mma", "awq")  # run layouts holding AWQ codes and true zero points (rows sorted by group)


def is_act_order(g_idx: torch.Tensor, in_features: int, groups: int) -> bool:
    """True when ``g_idx`` is not ``k // (in_features // groups)`` for ``k < in_features`` (act-order: the groups
    of the input columns permuted, which only the GPTQ layout holds)."""
    return not torch.equal(g_idx.to(torch.int32), gptq_ops.trivial_g_idx(in_features, in_features // groups))


@torch.no_grad()
def w4_linear_from_gptq(linear: nn.Linear, qweight: torch.Tensor, scales: torch.Tensor, *,
                        zeros: Optional[torch.Tensor] = None, qzeros: Optional[torch.Tensor] = None,
                        g_idx: Optional[torch.Tensor] = None, group_size: int, symmetric: bool) -> nn.Module:
    """The W4 module that replaces ``linear`` (built on its weight's device, meta included, and dtype; its bias, if
    any, copied) from GPTQ-layout tensors:

      qweight int32 [IC // 8, OC]; scales [NG, OC]; g_idx int32 [IC] (None: ``k // group_size``, no act-order)
      zero points: either ``zeros`` [NG, OC] (true zero points, uint8) or ``qzeros`` (GPTQ v1 ``z - 1``, packed)

    A ForgeGPTQLinear holding them (scales in their dtype; qweight, qzeros and g_idx as given, not copied); or, where
    one of ``zeros`` is 0, which GPTQ v1 qzeros (``z - 1`` in 4 bits) cannot hold, a ForgeAWQLinear with the same
    codes, scales and true zero points (contiguous groups: act-order there raises ValueError). Used by GPTQ
    calibration (the solver's result: an asymmetric group with no weight below about s / 2 gets zero point 0) and by
    the vllm-gptq / compressed-tensors loader."""
    if (zeros is None) == (qzeros is None):
        raise TypeError("w4_linear_from_gptq: pass exactly one of zeros (true zero points) and qzeros (GPTQ v1)")
    kw = dict(bias=linear.bias is not None, group_size=group_size, symmetric=symmetric, device=linear.weight.device,
              dtype=linear.weight.dtype)
    if zeros is not None and bool((zeros == 0).any()):
        if g_idx is not None and is_act_order(g_idx, g_idx.shape[0], scales.shape[0]):
            raise ValueError("w4_linear_from_gptq: act-order (a permuted g_idx) with a zero point of 0 is not "
                             "supported (GPTQ v1 qzeros cannot hold 0, the AWQ layout no g_idx)")
        new = ForgeAWQLinear(linear.in_features, linear.out_features, **kw)
        new.qweight, new.qzeros, new.scales = awq_pack(gptq_ops.gptq_unpack(qweight)), awq_pack(zeros), scales
    else:
        qzeros = gptq_ops.gptq_pack_zeros(zeros) if qzeros is None else qzeros
        new = ForgeGPTQLinear(linear.in_features, linear.out_features, **kw)
        if g_idx is None:
            g_idx = gptq_ops.trivial_g_idx(linear.in_features, group_size, device=qweight.device)
        new.qweight, new.qzeros, new.scales, new.g_idx = qweight, qzeros, scales, g_idx
    if linear.bias is not None:
        new.bias = linear.bias.detach().to(device=new.bias.device, dtype=new.bias.dtype)
    return new


def _gptq_to_awq(qweight: torch.Tensor, qzeros: torch.Tensor,
                 perm: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (qweight, qzeros) -> AWQ-layout (qweight, qzeros) of the same numbers, the input rows in `perm`'s order
    (act_order_perm) where given; ValueError for a stored zero point of 16."""
    zeros = gptq_ops.gptq_unpack_zeros(qzeros)  # [NG, OC]
    if zeros.numel() and int(zeros.max()) > 15:
        raise ValueError("ForgeGPTQLinear: a stored zero point of 16 has no 4-bit AWQ equivalent")
    codes = gptq_ops.gptq_unpack(qweight)  # [IC, OC]
    if perm is not None:
        codes = codes.index_select(0, perm.to(codes.device))
    return awq_pack(codes), awq_pack(zeros)


def _awq_to_gptq(qweight_awq: torch.Tensor, qzeros_awq: torch.Tensor,
                 perm: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    codes = awq_unpack(qweight_awq)  # [IC, OC], rows in perm's order where given
    if perm is not None:
        codes = codes.index_select(0, torch.argsort(perm).to(codes.device))
    return gptq_ops.gptq_pack(codes), gptq_ops.gptq_pack_zeros(awq_unpack(qzeros_awq))


def _export_gptq_layout(module: ForgeGPTQLinear, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict hook: checkpoints always hold the GPTQ layout."""
    kq, kz = prefix + "qweight", prefix + "qzeros"
    if module.weight_layout in _AWQ_RUN_LAYOUTS and kq in state_dict and kz in state_dict:
        state_dict[kq], state_dict[kz] = _awq_to_gptq(
            module._awq_qweight(state_dict[kq]), state_dict[kz], getattr(module, "act_perm", None))


def _import_gptq_layout(module: ForgeGPTQLinear, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: GPTQ-layout qweight [IC // 8, OC] and qzeros, for a module on the mma or AWQ layout
    (its rows sorted by the checkpoint's g_idx where that is act-order, and `act_perm` set to match). `act_perm` is set
    here, before torch copies the tensors: a load that then fails leaves the module's rows and act_perm as loaded."""
    kq, kz, kg = prefix + "qweight", prefix + "qzeros", prefix + "g_idx"
    layout = module.weight_layout
    if layout in _AWQ_RUN_LAYOUTS and kg in state_dict and not (kq in state_dict and kz in state_dict):
        raise ValueError(f"ForgeGPTQLinear.load_state_dict ({prefix or 'module'}): g_idx without qweight and qzeros, "
                         f"into a module on the {layout} layout, would leave its rows sorted by the old groups; load "
                         "qweight, qzeros and g_idx together")
    if layout in _AWQ_RUN_LAYOUTS and kq in state_dict and kz in state_dict:
        if tuple(state_dict[kq].shape) == (module.in_features // 8, module.out_features):
            g_idx = state_dict.get(kg, module.g_idx)
            try:
                perm = gptq_ops.act_order_perm(g_idx, module.group_size)
                qweight, qzeros = _gptq_to_awq(state_dict[kq], state_dict[kz], perm)
            except ValueError as err:
                raise ValueError(f"ForgeGPTQLinear.load_state_dict ({prefix or 'module'}): this module runs on the "
                                 f"{layout} layout, which cannot hold this checkpoint ({err}); load into a module on the "
                                 "GPTQ layout (a fresh one) and call use_mma_layout() after loading: it keeps the GPTQ "
                                 "kernel for such layers") from err
            state_dict[kq], state_dict[kz] = awq_to_mma_layout(qweight) if layout == "mma" else qweight, qzeros
            module._look_at_zeros(qzeros)
            # where qweight will be: the checkpoint's tensor with assign=True (which moves no buffer), else the module's
            device = (state_dict[kq] if args and args[0].get("assign_to_params_buffers") else module.qweight).device
            module.register_buffer("act_perm", None if perm is None else perm.to(device, torch.int32),
                                   persistent=False)
