"""The GPTQ solver (seed 002 sections 3, 7.2, 12.5; GPTQ's Algorithm 1), reference and fast batched.

Layout: ``weight [OC, IC]`` (nn.Linear), ``hessian [IC, IC]`` (``X^T X / N`` of the layer inputs, see
:mod:`torchforge.gptq.hessian`) or its block-diagonal form ``[ceil(IC / bs), bs, bs]``. GPTQ walks the
input columns ``c = 0 .. IC-1`` (the seed's rows of the transposed weight): quantize column ``c``, then
push its error ``(w - w_hat) / U[c, c]`` into the later columns through row ``c`` of ``U``, the upper
Cholesky factor of ``H^-1`` (``H^-1 = U^T U``). Columns are processed in blocks: inside a block the
update is applied column by column, the later columns get it lazily as one matmul at the block's end
(this only reorders the arithmetic).

Preparation (both solvers, per matrix): dead input channels (``H[c, c] == 0``, never activated) get
``H[c, c] = 1`` and a zero weight column; then ``H += damp * mean(diag(H)) * I``.

Quantization grid: one qmeta4 word per (output row, group of ``group_size`` input columns)
(:mod:`torchforge.ops.qmeta4`: range-based, optional L^p refinement). Codes are always computed with
the *effective* scale, ``decode(qmeta)`` rounded to ``scale_dtype`` (fp16 by default), exactly what an
export writes, so a checkpoint decodes to the solver's ``w_hat`` bit for bit:
``q = clamp(round(w / s) + z, 0, 2**bits - 1)``, ``w_hat = (q - z) * s``.

Group parameters:

* ``static_groups=True`` (seed 002's qmeta4-first design): every group's qmeta is built once from the
  original weight before any error is propagated.
* ``static_groups=False`` (original GPTQ): a group's qmeta is built when the solver reaches its first
  column, from the weight as updated by every earlier column. The original GPTQ code reads the group
  from a copy that misses the in-block updates of earlier columns of the same block when the group
  starts inside a block (group_size < block_size); here the group is always read fully updated, so the
  result does not depend on ``block_size`` (up to float rounding).

Result layout (:class:`GPTQResult`): ``codes uint8 [..., OC, IC]``, ``scales [..., OC, IC // G]`` in
``scale_dtype``, ``zeros uint8 [..., OC, IC // G]``, ``qmeta int32 [..., OC, IC // G]``: rows are output
channels, like the weight. Exports transpose to the checkpoint layouts (``[IC // G, OC]``).

Memory plan for a DeepSeek-V3 MoE layer (hidden 7168, expert intermediate 2048, 256 routed experts) on
one 80 GB GPU, fp32 throughout:

* ``gate_proj`` and ``up_proj`` of an expert see the same inputs, so they share one Hessian and are solved
  as one ``[4096, 7168]`` matrix. Dense Hessians: 256 x 7168^2 x 4 B = 52.6 GB per layer; they are
  accumulated on the host (pinned memory, or per expert on the GPU and offloaded) and solved in chunks
  (``chunk_size``, e.g. 32 experts): per chunk the Hessians (6.6 GB; factored in place with
  ``inplace=True``), the fp32 weights (3.8 GB) and the codes (0.9 GB), about 12 GB with the factorisation
  workspace of one matrix.
* ``down_proj`` ``[7168, 2048]``: Hessians 256 x 2048^2 x 4 B = 4.3 GB, all 256 experts in one call
  (weights 15 GB fp32, codes 3.8 GB).
* Block-diagonal Hessians (``bs = 128``, seed 003's low-memory mode): 256 x 56 x 128^2 x 4 B = 0.94 GB
  for gate/up and 0.27 GB for down, so every expert of a layer fits in one call with no host traffic,
  and the solve needs no lazy inter-block update at all (``H^-1`` is block diagonal too).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from torchforge.gptq.precision import with_ieee_fp32_matmul
from torchforge.ops._triton import can_launch
from torchforge.ops.qmeta4 import qmeta4_build, qmeta4_mse_refine
from torchforge.ops.qmeta4_reference import (
    default_grid,
    qmeta4_build_ref,
    qmeta4_decode_ref,
    qmeta4_mse_refine_ref,
    quantize_with,
)

__all__ = ["GPTQResult", "inverse_hessian_factor", "solve", "solve_batched"]

_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class GPTQResult(NamedTuple):
    """GPTQ output for a weight ``[..., OC, IC]`` (rows = output channels, groups along IC).

    ``codes`` uint8 ``[..., OC, IC]`` (0 .. 2**bits - 1), ``scales`` ``[..., OC, IC // G]`` in the
    export dtype, ``zeros`` uint8 ``[..., OC, IC // G]``, ``qmeta`` int32 ``[..., OC, IC // G]``
    (``scales == decode(qmeta).to(scale_dtype)``). ``W_hat[o, c] = (codes[o, c] - zeros[o, c // G]) *
    scales[o, c // G]`` (:meth:`dequantize`).
    """

    codes: Tensor
    scales: Tensor
    zeros: Tensor
    qmeta: Tensor
    group_size: int
    bits: int
    symmetric: bool

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        g = self.group_size
        s = self.scales.to(torch.float32).repeat_interleave(g, dim=-1)
        z = self.zeros.to(torch.float32).repeat_interleave(g, dim=-1)
        return ((self.codes.to(torch.float32) - z) * s).to(dtype)


# ------------------------------------------------------------------------------------------ checks
def _check_common(op: str, weight: Tensor, hessian: Tensor, bits: int, group_size: int, block_size: int,
                  damp: float, scale_dtype: torch.dtype, batched: bool) -> bool:
    """Validates; returns True when ``hessian`` is block diagonal."""
    wdims = 3 if batched else 2
    wlayout = "[B, OC, IC]" if batched else "[OC, IC] (nn.Linear layout)"
    if not isinstance(weight, Tensor) or weight.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"{op}: weight must be a float32/float16/bfloat16/float8_e4m3fn tensor, got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.dim() != wdims:
        raise ValueError(f"{op}: weight must be {wlayout}, got shape {tuple(weight.shape)}")
    if not isinstance(hessian, Tensor) or not hessian.is_floating_point():
        raise TypeError(f"{op}: hessian must be a floating point tensor, got "
                        f"{getattr(hessian, 'dtype', type(hessian).__name__)}")
    if hessian.device != weight.device:
        raise ValueError(f"{op}: hessian is on {hessian.device} but weight is on {weight.device}")
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"{op}: bits={bits!r} must be an int in 2..8")
    ic = weight.shape[-1]
    if not isinstance(group_size, int) or group_size <= 0 or ic % group_size:
        raise ValueError(f"{op}: group_size={group_size!r} does not divide IC={ic} (weight {tuple(weight.shape)}); "
                         "groups run along the input dim: choose a group size that divides it")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{op}: block_size={block_size!r} must be a positive int")
    if not (isinstance(damp, (int, float)) and damp >= 0 and math.isfinite(damp)):
        raise ValueError(f"{op}: damp={damp!r} must be a finite number >= 0 (fraction of mean(diag(H)))")
    if scale_dtype not in _SCALE_DTYPES:
        raise TypeError(f"{op}: scale_dtype must be float16/bfloat16/float32, got {scale_dtype}")
    lead = tuple(weight.shape[:-2])
    hdims = hessian.dim() - len(lead)
    if hdims == 2:
        if hessian.shape[-1] != hessian.shape[-2]:
            raise ValueError(f"{op}: hessian has shape {tuple(hessian.shape)}: not square; expected "
                             f"{(*lead, ic, ic)} (or block-diagonal {(*lead, 'nb', 'bs', 'bs')})")
        if tuple(hessian.shape) != (*lead, ic, ic):
            raise ValueError(f"{op}: hessian has shape {tuple(hessian.shape)} but weight {tuple(weight.shape)} "
                             f"has IC={ic} input channels: expected {(*lead, ic, ic)}")
        block = False
    elif hdims == 3:
        nb, bs, bs2 = hessian.shape[-3:]
        if bs != bs2:
            raise ValueError(f"{op}: block-diagonal hessian has shape {tuple(hessian.shape)}: blocks are not "
                             "square")
        if tuple(hessian.shape[:-3]) != lead or nb != -(-ic // bs):
            raise ValueError(f"{op}: block-diagonal hessian has shape {tuple(hessian.shape)} but weight "
                             f"{tuple(weight.shape)} with IC={ic} needs {(*lead, -(-ic // bs), bs, bs)}")
        block = True
    else:
        raise ValueError(f"{op}: hessian has shape {tuple(hessian.shape)}; expected {(*lead, ic, ic)} or the "
                         f"block-diagonal {(*lead, 'ceil(IC / bs)', 'bs', 'bs')}")
    for name, t in (("weight", weight), ("hessian", hessian)):
        bad = int((~torch.isfinite(t.float() if t.dtype == torch.float8_e4m3fn else t)).sum())
        if bad:
            raise ValueError(f"{op}: {name} contains {bad} NaN/Inf values (of {t.numel()}); fix the "
                             f"{'checkpoint' if name == 'weight' else 'calibration activations'} first")
    return block


# ------------------------------------------------------------------------------ Hessian -> factor
def _prepare(h: Tensor, w: Tensor, damp: float, ic: int) -> None:
    """In place on fp32 copies: dead channels -> H[c, c] = 1 and W[..., c] = 0; H += damp * mean(diag) I.

    ``h``: ``[..., IC, IC]`` (dense) with ``w [..., OC, IC]``."""
    diag = h.diagonal(dim1=-2, dim2=-1)
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)
    w.masked_fill_(dead.unsqueeze(-2), 0.0)
    diag.add_(damp * diag[..., :ic].mean(-1, keepdim=True))


def _cholesky_error(op: str, info: Tensor, damp: float) -> ValueError:
    bad = torch.nonzero(info).flatten().tolist()
    return ValueError(f"{op}: the damped Hessian is not positive definite (Cholesky failed for matrices "
                      f"{bad[:8]}); increase damp (now {damp}) or calibrate with more tokens")


def _upper_factor_of_inverse(h: Tensor, op: str, damp: float) -> Tensor:
    """``U`` upper triangular with ``H^-1 = U^T U`` for ``h [..., n, n]`` (SPD, fp32), without forming
    ``H^-1``: with ``J`` the reversal permutation and ``J H J = L L^T``, ``U = J L^-1 J``.
    One Cholesky and one triangular inverse instead of GPTQ's Cholesky, inverse and second Cholesky."""
    hf = h.flip(-1, -2)
    lower, info = torch.linalg.cholesky_ex(hf)
    if bool((info != 0).any()):
        raise _cholesky_error(op, info.reshape(-1), damp)
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device).expand_as(lower)
    linv = torch.linalg.solve_triangular(lower, eye, upper=False)
    return linv.flip(-1, -2)


def inverse_hessian_factor(hessian: Tensor, damp: float = 0.01) -> Tensor:
    """The solver's ``U`` for a dense ``[..., n, n]`` Hessian (dead channels and damping applied as in the
    solver); ``U^T U = (H + damp * mean(diag(H)) I)^-1``."""
    h = hessian.to(torch.float32).clone()
    _prepare(h, torch.zeros(*h.shape[:-2], 1, h.shape[-1], device=h.device), damp, h.shape[-1])
    return _upper_factor_of_inverse(h, "inverse_hessian_factor", damp)


# ------------------------------------------------------------------------------- qmeta helpers
def _group_meta(x: Tensor, group_size: int, bits: int, symmetric: bool, mse: bool, mse_norm: float,
                mse_grid: Optional[Tensor], scale_dtype: torch.dtype, use_ops: bool) -> Tensor:
    """qmeta4 of ``x [..., OC, k * G]`` (range, then the optional L^p refinement)."""
    if use_ops:
        q = qmeta4_build(x, group_size, bits, symmetric)
        if mse:
            grid = mse_grid if mse_grid is not None else default_grid(device=x.device)
            q = qmeta4_mse_refine(x, q, group_size, bits, grid=grid, norm=mse_norm, scale_dtype=scale_dtype)
        return q
    q = qmeta4_build_ref(x, group_size, bits, symmetric)
    if mse:
        grid = mse_grid if mse_grid is not None else default_grid(device=x.device)
        q = qmeta4_mse_refine_ref(x, q, grid.to(x.device), group_size, bits, mse_norm, scale_dtype)
    return q


def _scale_zero(qmeta: Tensor, scale_dtype: torch.dtype):
    s, z, _ = qmeta4_decode_ref(qmeta)
    return s.to(scale_dtype).to(torch.float32), z.to(torch.float32)


def _result(codes, qmeta, group_size, bits, symmetric, scale_dtype) -> GPTQResult:
    s, z, _ = qmeta4_decode_ref(qmeta)
    return GPTQResult(codes, s.to(scale_dtype), z, qmeta, group_size, bits, symmetric)


# ------------------------------------------------------------------------------ reference solver
@torch.no_grad()
def check_scale_range(op: str, weight: Tensor, bits: int, group_size: int, symmetric: bool,
                      scale_dtype: torch.dtype = torch.float16) -> None:
    """Group scales start from the weight's group ranges and are stored in `scale_dtype`: past its maximum they
    become inf and the error feedback turns the rest of the row into NaN (which then read as NaN input)."""
    x = weight.reshape(*weight.shape[:-1], weight.shape[-1] // group_size, group_size)
    maxq = 2 ** bits - 1
    if symmetric:
        s = 2.0 * x.abs().amax(dim=-1).float() / maxq
    else:
        s = (x.amax(dim=-1).float().clamp(min=0) - x.amin(dim=-1).float().clamp(max=0)) / maxq
    limit = torch.finfo(scale_dtype).max
    over = s > limit
    if bool(over.any()):
        raise ValueError(f"{op}: {int(over.sum())} group scales would exceed the {scale_dtype} maximum {limit:.6g} "
                         f"(largest {float(s.max()):.6g}): the weight is too large for {scale_dtype} GPTQ scales; "
                         "rescale the layer or keep it unquantized with the recipe's ignore")


@with_ieee_fp32_matmul
def solve(weight: Tensor, hessian: Tensor, *, bits: int = 4, group_size: int = 128, symmetric: bool = True,
          block_size: int = 128, damp: float = 0.01, mse: bool = False, static_groups: bool = False,
          mse_norm: float = 2.4, mse_grid: Optional[Tensor] = None,
          scale_dtype: torch.dtype = torch.float16) -> GPTQResult:
    """Reference GPTQ of one ``weight [OC, IC]`` with ``hessian [IC, IC]`` (or block-diagonal
    ``[ceil(IC / bs), bs, bs]``, solved as the dense block-diagonal matrix).

    Follows GPTQ's code: Cholesky of the damped ``H``, ``H^-1`` from it, then the upper Cholesky factor
    of ``H^-1``; blocks of ``block_size`` columns with a per-column Python loop inside (slow on purpose:
    it is the oracle the fast solver is tested and benchmarked against). See the module docstring for
    the grid, dead channels, damping and the two group modes. ``mse``: refine every group's scale by the
    L^``mse_norm`` grid search (``mse_grid``: factors, default ``1 - 0.2 k / 100``).
    """
    op = "solve"
    block = _check_common(op, weight, hessian, bits, group_size, block_size, damp, scale_dtype, batched=False)
    check_scale_range(op, weight, bits, group_size, symmetric, scale_dtype)
    oc, ic = weight.shape
    w = weight.to(torch.float32).clone()
    if block:
        h = torch.block_diag(*hessian.to(torch.float32))[:ic, :ic].clone()
    else:
        h = hessian.to(torch.float32).clone()
    _prepare(h, w, damp, ic)
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info) != 0:
        raise _cholesky_error(op, info.reshape(1), damp)
    u = torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)

    g, maxq = group_size, 2**bits - 1
    ng = ic // g
    meta = lambda x: _group_meta(x, g, bits, symmetric, mse, mse_norm, mse_grid, scale_dtype, False)  # noqa: E731
    qmeta = meta(w) if static_groups else torch.empty(oc, ng, dtype=torch.int32, device=w.device)
    codes = torch.empty(oc, ic, dtype=torch.uint8, device=w.device)
    for i1 in range(0, ic, block_size):
        i2 = min(i1 + block_size, ic)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            c = i1 + i
            if c % g == 0 and not static_groups:
                # The group's columns as updated by every earlier column: in-block ones from w1, later
                # ones from w minus the block's pending lazy update.
                later = w[:, i2:] - err1[:, :i] @ u[i1:c, i2:]
                qmeta[:, c // g] = meta(torch.cat([w1[:, i:], later], dim=1)[:, :g])[:, 0]
            s, z = _scale_zero(qmeta[:, c // g], scale_dtype)
            col = w1[:, i]
            q, w_hat = quantize_with(col, s, z, maxq)
            codes[:, c] = q.to(torch.uint8)
            err = (col - w_hat) / u[c, c]
            w1[:, i:] -= err.unsqueeze(1) * u[c, c:i2].unsqueeze(0)
            err1[:, i] = err
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    return _result(codes, qmeta, g, bits, symmetric, scale_dtype)


# ------------------------------------------------------------------------------- batched solver
def _block_step_torch(w: Tensor, u: Tensor, s: Tensor, z: Tensor, codes: Tensor, err: Tensor, maxq: int) -> None:
    """Same contract as ``launch_gptq_block``, batched torch ops with a per-column loop (CPU path)."""
    w1 = w.clone()
    for i in range(w.shape[-1]):
        col = w1[:, :, i]
        q, w_hat = quantize_with(col, s, z, maxq)
        codes[:, :, i] = q.to(torch.uint8)
        e = (col - w_hat) / u[:, i, i].unsqueeze(-1)
        err[:, :, i] = e
        w1[:, :, i + 1:] -= e.unsqueeze(-1) * u[:, i, i + 1:].unsqueeze(1)


def _factor_batched(hessian: Tensor, w: Tensor, damp: float, block: bool, inplace: bool, op: str) -> Tensor:
    """fp32 ``U`` factors: dense ``[B, IC, IC]`` (one matrix at a time, bounded workspace) or block
    ``[B, nb, bs, bs]`` (all blocks in one batched call). Mutates ``w`` (dead columns -> 0)."""
    ic = w.shape[-1]
    if block:
        nmat, nb, bs = hessian.shape[0], hessian.shape[1], hessian.shape[-1]
        hb = hessian.to(torch.float32)
        if not (inplace and hb.data_ptr() == hessian.data_ptr()):
            hb = hb.clone()
        d = hb.diagonal(dim1=-2, dim2=-1)  # [B, nb, bs], a view: the fills below write into hb
        dead = d == 0  # also the zero padding of the last block: it becomes an identity block
        d.masked_fill_(dead, 1.0)
        w.masked_fill_(dead.reshape(nmat, nb * bs)[:, None, :ic], 0.0)
        mean = d.reshape(nmat, nb * bs)[:, :ic].mean(-1)  # over the real channels only, as the dense solver
        d.add_((damp * mean)[:, None, None])
        return _upper_factor_of_inverse(hb, op, damp)
    out = hessian if (inplace and hessian.dtype == torch.float32) else torch.empty(
        hessian.shape, dtype=torch.float32, device=hessian.device)
    for b in range(hessian.shape[0]):
        h = hessian[b].to(torch.float32).clone()
        _prepare(h, w[b], damp, ic)
        out[b] = _upper_factor_of_inverse(h, op, damp)
    return out


@torch.no_grad()
@with_ieee_fp32_matmul
def solve_batched(weight: Tensor, hessian: Tensor, *, bits: int = 4, group_size: int = 128,
                  symmetric: bool = True, block_size: int = 128, damp: float = 0.01, mse: bool = False,
                  static_groups: bool = False, mse_norm: float = 2.4, mse_grid: Optional[Tensor] = None,
                  scale_dtype: torch.dtype = torch.float16, backend: str = "auto",
                  chunk_size: Optional[int] = None, inplace: bool = False) -> GPTQResult:
    """GPTQ of ``B`` matrices in one call: ``weight [B, OC, IC]``, ``hessian [B, IC, IC]`` or block-diagonal
    ``[B, ceil(IC / bs), bs, bs]`` (seed 003's low-memory mode: each block solved on its own, no lazy
    update across blocks). Same math and result layout as :func:`solve` (with a leading ``B``).

    Per matrix, ``U`` comes from one Cholesky of the flipped Hessian and a triangular inverse (see
    ``_upper_factor_of_inverse``). The columns are walked in blocks of ``kb = gcd(block_size, group_size)``
    (``gcd(bs, group_size, block_size)`` for block Hessians), so every group starts at a block start and
    its qmeta (``qmeta4_build`` / ``qmeta4_mse_refine``, Triton on CUDA) is built from fully updated
    weights. Per block: one launch of the Triton block kernel for all matrices and row tiles (the column
    loop runs inside it, see :mod:`torchforge.gptq.solver_triton`), then the lazy update of the later
    columns as one ``baddbmm``. Python loops over blocks (``IC / kb``), never over columns.

    ``backend``: ``"triton"`` (the kernel; CUDA, or CPU under TRITON_INTERPRET=1), ``"torch"`` (batched
    torch ops with a per-column loop, the CPU path) or ``"auto"`` (triton on CUDA, torch otherwise).
    ``chunk_size``: solve at most this many matrices at a time (bounds the fp32 workspace; see the memory
    plan in the module docstring). ``inplace``: factor an fp32 ``hessian`` in its own storage (it is
    overwritten with ``U``) instead of allocating a copy.
    """
    op = "solve_batched"
    block = _check_common(op, weight, hessian, bits, group_size, block_size, damp, scale_dtype, batched=True)
    check_scale_range(op, weight, bits, group_size, symmetric, scale_dtype)
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"{op}: backend={backend!r}; expected 'auto', 'triton' or 'torch'")
    if backend == "auto":
        backend = "triton" if weight.is_cuda and can_launch(weight) else "torch"
    if backend == "triton" and not can_launch(weight):
        raise RuntimeError(f"{op}: backend='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    nmat = weight.shape[0]
    if chunk_size is not None and 0 < chunk_size < nmat:
        parts = [solve_batched(weight[i:i + chunk_size], hessian[i:i + chunk_size], bits=bits,
                               group_size=group_size, symmetric=symmetric, block_size=block_size, damp=damp,
                               mse=mse, static_groups=static_groups, mse_norm=mse_norm, mse_grid=mse_grid,
                               scale_dtype=scale_dtype, backend=backend, inplace=inplace)
                 for i in range(0, nmat, chunk_size)]
        return GPTQResult(*(torch.cat([p[k] for p in parts]) for k in range(4)), group_size, bits, symmetric)

    _, oc, ic = weight.shape
    g, maxq = group_size, 2**bits - 1
    w = weight.to(torch.float32).clone()
    u_all = _factor_batched(hessian, w, damp, block, inplace, op)
    if block:
        hb = hessian.shape[-1]
        kb = math.gcd(math.gcd(hb, g), block_size)
        segments = [(k * hb, min((k + 1) * hb, ic), u_all[:, k]) for k in range(u_all.shape[1])]
    else:
        kb = math.gcd(block_size, g)
        segments = [(0, ic, u_all)]
    use_ops = backend == "triton"
    meta = lambda x: _group_meta(x, g, bits, symmetric, mse, mse_norm, mse_grid, scale_dtype, use_ops)  # noqa: E731
    qmeta = meta(w) if static_groups else torch.empty(nmat, oc, ic // g, dtype=torch.int32, device=w.device)
    codes = torch.empty(nmat, oc, ic, dtype=torch.uint8, device=w.device)
    err = torch.empty(nmat, oc, kb, dtype=torch.float32, device=w.device)
    if backend == "triton":
        from torchforge.gptq.solver_triton import launch_gptq_block as step
    else:
        step = _block_step_torch
    for lo, hi, u in segments:
        for j1 in range(lo, hi, kb):
            j2 = min(j1 + kb, hi)
            if j1 % g == 0 and not static_groups:
                qmeta[:, :, j1 // g] = meta(w[:, :, j1:j1 + g])[:, :, 0]
            s, z = _scale_zero(qmeta[:, :, j1 // g], scale_dtype)
            e = err[:, :, : j2 - j1]
            step(w[:, :, j1:j2], u[:, j1 - lo:j2 - lo, j1 - lo:j2 - lo], s.contiguous(), z.contiguous(),
                 codes[:, :, j1:j2], e, maxq)
            if j2 < hi:
                w[:, :, j2:hi].baddbmm_(e, u[:, j1 - lo:j2 - lo, j2 - lo:hi - lo], alpha=-1.0)
    return _result(codes, qmeta, g, bits, symmetric, scale_dtype)
