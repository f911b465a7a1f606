"""Triton kernels for NVFP4 (E2M1 weights, E4M3 block-16 scales) on GPUs without FP4 tensor cores (Hopper).

Kernels exist only when triton imports (`HAS_TRITON`). The `launch_*` functions allocate outputs and launch
through `torch.library.wrap_triton`, so they work inside a `triton_op` body (torch.compile) and directly on
CPU tensors under TRITON_INTERPRET=1 (tests). Arguments are assumed validated by `torchforge.ops.nvfp4`.

Grouped (MoE) matmul, no host sync and no loop over experts:

1. `_nvfp4_align_kernel` (one program): histogram of the expert ids, each expert's segment padded to a
   multiple of BLOCK_M, exclusive prefix sum, then every row is placed in its expert's segment with an atomic
   cursor. Output: `sorted_rows [MAX_ROWS]` (original row indices, -1 for padding), MAX_ROWS a static bound.
   The order of rows inside a segment depends on the atomics, but every output row is computed from its own
   input row only, so results do not depend on it. Out-of-range ids go to an extra segment whose rows are
   written as NaN (no host-side range check).
2. `_nvfp4_grouped_gemm_kernel`: one program per (BLOCK_M sorted rows of one expert, BLOCK_N outputs).
   Packed bytes `[BLOCK_N, BLOCK_K / 2]` and fp8 scale bytes `[BLOCK_N, BLOCK_K / 16]` are loaded once per
   tile and dequantized in registers: the nibble becomes fp16 bits `sign << 15 | mag << 9` (= E2M1 * 2**-14,
   exact, subnormal for 0.5), the e4m3 byte becomes fp16 bits `sign << 15 | (b & 0x7f) << 7`
   (= scale * 2**-8, exact). The scale is multiplied by 2**22 in fp32 (exact), so the fp32 product is
   E2M1 * scale itself: in [2**-10, 2688] with at most 6 significant bits, exactly representable in bf16 and
   in fp16 (E2M1 * scale * 2**-22 was not: below fp16's 2**-14 it went subnormal, and blocks with a scale
   under 4 lost bits or flushed to 0 in the fp16 operand). The tensor-core operand is the exact weight; the
   fp32 accumulator is multiplied by `weight_scale_2` (times `input_scale` in W4A4 emulation) at the end.
   W4A4 emulation (`QUANT_A`) quantizes each activation tile as vLLM's `ref_nvfp4_quant` does (see
   `nvfp4_reference`), with exact fp8/E2M1 rounding in integer arithmetic.

At decode (few routed rows per expert) `torchforge.ops.nvfp4` runs the grouped GEMV of `nvfp4_gemv_triton`
instead (same contract, same exact dequantization, no sort, no padding to BLOCK_M, no tl.dot).
"""
import math
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._triton import CUDA_MAX_GRID_Z, HAS_TRITON, interpret_mode, stack_launches, tl, triton

__all__ = ["launch_nvfp4_grouped_linear", "launch_nvfp4_align", "grouped_config", "max_sorted_rows"]


def max_sorted_rows(rows: int, num_buckets: int, block_m: int) -> int:
    """Static bound on the padded, sorted row count: every non-empty bucket adds at most BLOCK_M - 1 rows."""
    bound = rows + (block_m - 1) * min(rows, num_buckets)
    return (bound + block_m - 1) // block_m * block_m


def grouped_config(rows: int, num_experts: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by average rows per active expert. From the H100 sweep
    (`bench/nvfp4_moe.py --sweep`, CUDA graphs, DeepSeek-V3 experts, 2026-11-22): below 16 rows per expert the
    first config was within 1% of the best at M = 1, 8, 64; at 16 rows (M = 512 x top-8 over 256 experts)
    BLOCK_M 32 / BLOCK_N 128 took gate_up from 4.96 to 4.47 ms and down from 2.57 to 2.38 ms. The last one is
    untested; `launch_nvfp4_grouped_linear` takes overrides."""
    per_expert = rows / max(1, min(rows, num_experts))
    if per_expert < 16:
        return 16, 64, 128, 4, 4
    if per_expert <= 32:
        return 32, 128, 128, 4, 3
    return 64, 128, 64, 8, 3


if HAS_TRITON:

    @triton.jit
    def _nvfp4_align_kernel(ids_ptr, sorted_ptr, cursor_ptr, R, E, MAX_ROWS,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, NB: tl.constexpr):
        for start in range(0, MAX_ROWS, BLOCK_R):
            offs = start + tl.arange(0, BLOCK_R)
            tl.store(sorted_ptr + offs, tl.full((BLOCK_R,), -1, tl.int32), mask=offs < MAX_ROWS)
        counts = tl.zeros((NB,), dtype=tl.int32)
        for start in range(0, R, BLOCK_R):
            offs = start + tl.arange(0, BLOCK_R)
            m = offs < R
            # range-check before the int32 cast: an int64 id past 2**31 must not wrap into [0, E)
            e = tl.load(ids_ptr + offs, mask=m, other=0)
            e = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)  # out-of-range ids: bucket E, written as NaN rows
            counts += tl.histogram(e, NB, mask=m).to(tl.int32)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(cursor_ptr + tl.arange(0, NB), tl.cumsum(padded, 0) - padded)
        tl.debug_barrier()
        for start in range(0, R, BLOCK_R):
            offs = start + tl.arange(0, BLOCK_R)
            m = offs < R
            e = tl.load(ids_ptr + offs, mask=m, other=0)
            e = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)
            pos = tl.atomic_add(cursor_ptr + e, tl.full((BLOCK_R,), 1, tl.int32), mask=m)
            tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=m)

    @triton.jit
    def _fp8_e4m3_rne(v):
        """fp32 v in [0, 448] -> the fp32 value of fp8_e4m3fn(v) (round to nearest even), exactly."""
        bits = v.to(tl.int32, bitcast=True)
        # normal e4m3 (v >= 2**-6): keep 3 mantissa bits, round half to even on the integer bits
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = 0xFFF00000
        # subnormal e4m3 (v < 2**-6): multiples of 2**-9, round half to even
        y = v * 512.0
        fl = y.to(tl.int32)
        frac = y - fl.to(tl.float32)
        up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
        sub = (fl + up.to(tl.int32)).to(tl.float32) * (1.0 / 512.0)
        return tl.where(v >= 0.015625, normal, sub)

    @triton.jit
    def _e2m1_round(a):
        """|x| in [0, 6] -> nearest E2M1 magnitude, ties to even (vLLM cast_to_fp4 / ModelOpt _cast_fp4)."""
        r = tl.where(a > 5.0, 6.0, 0.0)
        r = tl.where((a >= 3.5) & (a <= 5.0), 4.0, r)
        r = tl.where((a > 2.5) & (a < 3.5), 3.0, r)
        r = tl.where((a >= 1.75) & (a <= 2.5), 2.0, r)
        r = tl.where((a > 1.25) & (a < 1.75), 1.5, r)
        r = tl.where((a >= 0.75) & (a <= 1.25), 1.0, r)
        r = tl.where((a > 0.25) & (a < 0.75), 0.5, r)
        return r

    @triton.jit
    def _quant_a_tile(x, gs, BM: tl.constexpr, BK: tl.constexpr):
        """fp32 activation tile [BM, BK] -> fp32 E2M1 * fp8 block scale (vLLM ref_nvfp4_quant), exact."""
        xb = tl.reshape(x, (BM, BK // 16, 16))
        vmax = tl.max(tl.abs(xb), axis=2)
        scale = gs * (vmax * (1.0 / 6.0))
        scale = tl.minimum(scale, 448.0)
        sf = _fp8_e4m3_rne(scale)
        prod = sf * tl.div_rn(1.0, gs)
        out_scale = tl.div_rn(1.0, prod + (prod == 0.0).to(tl.float32) * 1e8)
        xs = xb * out_scale[:, :, None]
        xs = tl.minimum(tl.maximum(xs, -6.0), 6.0)
        q = _e2m1_round(tl.abs(xs))
        q = tl.where(xs < 0, -q, q) * sf[:, :, None]
        return tl.reshape(q, (BM, BK))

    @triton.jit
    def _nvfp4_weight_tile(w_ptr, s_ptr, offs_n, mask_n, k0, KP, KS, BK: tl.constexpr, BN: tl.constexpr):
        """fp32 [BN, BK] tile of E2M1 * scale for input channels k0 .. k0 + BK (exact, and exact in fp16 / bf16)."""
        kb = k0 // 2 + tl.arange(0, BK // 2)
        b = tl.load(w_ptr + offs_n[:, None] * KP + kb[None, :], mask=mask_n[:, None], other=0)
        b = b.to(tl.int16)
        c = tl.interleave(b & 0xF, (b >> 4) & 0xF)  # element 2j = low nibble of byte j
        wf = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.float16, bitcast=True)  # E2M1 * 2**-14
        ks = k0 // 16 + tl.arange(0, BK // 16)
        sb = tl.load(s_ptr + offs_n[:, None] * KS + ks[None, :], mask=mask_n[:, None], other=0).to(tl.int16)
        sf = (((sb & 0x80) << 8) | ((sb & 0x7F) << 7)).to(tl.float16, bitcast=True)  # scale * 2**-8
        # times 2**22 (exact): the tile is E2M1 * scale, which fp16 holds exactly (E2M1 * scale * 2**-22 can be
        # an fp16 subnormal, rounded or flushed to 0 when the dot operand is cast to fp16)
        sf = sf.to(tl.float32) * 4194304.0
        sf = tl.reshape(tl.broadcast_to(sf[:, :, None], (BN, BK // 16, 16)), (BN, BK))
        return wf.to(tl.float32) * sf

    @triton.jit
    def _nvfp4_dequant_kernel(w_ptr, s_ptr, ws2_ptr, out_ptr, N, K, KP, KS,
                              BN: tl.constexpr, BK: tl.constexpr):
        """out[b, n, k] = (E2M1 * scale) * weight_scale_2[b] in fp32 (the reference's order), then rounded."""
        pid_n = tl.program_id(0)
        k0 = tl.program_id(1) * BK
        b = tl.program_id(2).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        w = _nvfp4_weight_tile(w_ptr + b * N * KP, s_ptr + b * N * KS, offs_n, mask_n, k0, KP, KS, BK, BN)
        w = w * tl.load(ws2_ptr + b)
        offs_k = k0 + tl.arange(0, BK)
        out = out_ptr + b * N * K + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask_n[:, None])

    @triton.jit
    def _nvfp4_grouped_gemm_kernel(
        x_ptr, sorted_ptr, ids_ptr, w_ptr, s_ptr, ws2_ptr, ins_ptr, out_ptr,
        N, K, E, stride_xr, stride_or, X_ROW_DIV,
        QUANT_A: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        row0 = tl.load(sorted_ptr + pid_m * BLOCK_M)
        if row0 < 0:  # past the last expert's segment
            return
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = rows >= 0
        rows = tl.where(mask_m, rows, 0).to(tl.int64)
        e = tl.load(ids_ptr + row0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        out_ptrs = out_ptr + rows[:, None] * stride_or + offs_n[None, :]
        out_mask = mask_m[:, None] & mask_n[None, :]
        if (e < 0) | (e >= E):  # out-of-range expert id: NaN rows (no host sync to check it)
            nan = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
            tl.store(out_ptrs, nan.to(out_ptr.dtype.element_ty), mask=out_mask)
            return
        KP = K // 2
        KS = K // 16
        w_e = w_ptr + e * N * KP
        s_e = s_ptr + e * N * KS
        x_rows = x_ptr + (rows // X_ROW_DIV)[:, None] * stride_xr  # pair r reads token r // top_k
        ws2 = tl.load(ws2_ptr + e).to(tl.float32)
        if QUANT_A:
            ins = tl.load(ins_ptr + e).to(tl.float32)
            gs = tl.div_rn(1.0, ins)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None], other=0.0)
            if QUANT_A:
                x = _quant_a_tile(x.to(tl.float32), gs, BLOCK_M, BLOCK_K).to(x.dtype)
            w = _nvfp4_weight_tile(w_e, s_e, offs_n, mask_n, k0, KP, KS, BLOCK_K, BLOCK_N)
            if DOT_F32:  # fp32 activations, or bf16 under the interpreter (its bf16 dot is broken)
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        alpha = ws2
        if QUANT_A:
            alpha = ins * ws2
        tl.store(out_ptrs, (acc * alpha).to(out_ptr.dtype.element_ty), mask=out_mask)


def _require_triton():
    if not HAS_TRITON:
        raise RuntimeError("torchforge NVFP4 Triton kernels need triton; install it or use CPU tensors")


_MAX_GRID_Z = CUDA_MAX_GRID_Z  # the matrices of a stack go on grid dimension 2


def launch_nvfp4_dequantize(packed: Tensor, scales: Tensor, weight_scale_2: Tensor, dtype: torch.dtype) -> Tensor:
    """NVFP4 [..., N, K/2] -> W [..., N, K] in `dtype`, the bits of nvfp4_dequantize_ref: one launch for a stack of
    experts (the reference holds several fp32 temporaries a weight)."""
    _require_triton()
    *lead, n, kp = packed.shape
    k = kp * 2
    batch = math.prod(lead)
    out = torch.empty((*lead, n, k), dtype=dtype, device=packed.device)
    if out.numel() == 0:
        return out
    bk = next(b for b in (64, 32, 16) if k % b == 0)
    bn = 64
    ws2 = weight_scale_2.reshape(-1).to(torch.float32).expand(batch).contiguous()  # one per matrix (a scalar: all)
    p, s, o = (t.contiguous().view(batch, *t.shape[len(lead):]) for t in (packed, scales, out))
    s = s.view(torch.uint8)  # the fp8 scales as bytes: the tile decodes them
    # The matrices go on grid dimension 2, which CUDA caps at 65535: larger stacks take several launches.
    for i, nb in stack_launches(batch, _MAX_GRID_Z):
        torch.library.wrap_triton(_nvfp4_dequant_kernel)[(triton.cdiv(n, bn), k // bk, nb)](
            p[i:i + nb], s[i:i + nb], ws2[i:i + nb], o[i:i + nb], n, k, kp, k // 16, BN=bn, BK=bk, num_warps=4)
    return out


def launch_nvfp4_align(expert_ids: Tensor, num_experts: int, block_m: int) -> Tensor:
    """int32 ``sorted_rows [MAX_ROWS]``: row indices grouped by expert, each group padded to BLOCK_M with -1."""
    _require_triton()
    r = expert_ids.shape[0]
    nb = triton.next_power_of_2(num_experts + 1)
    max_rows = max_sorted_rows(r, num_experts + 1, block_m)
    sorted_rows = torch.empty(max_rows, dtype=torch.int32, device=expert_ids.device)
    cursor = torch.empty(nb, dtype=torch.int32, device=expert_ids.device)
    torch.library.wrap_triton(_nvfp4_align_kernel)[(1,)](
        expert_ids, sorted_rows, cursor, r, num_experts, max_rows, BLOCK_M=block_m, BLOCK_R=1024, NB=nb,
        num_warps=4)
    return sorted_rows


def launch_nvfp4_grouped_linear(
    x: Tensor,
    expert_ids: Tensor,
    packed: Tensor,
    scales: Tensor,
    weight_scale_2: Tensor,
    input_scale: Optional[Tensor] = None,
    x_row_div: int = 1,
    *,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> Tensor:
    """Row ``r`` of the ``[R, N]`` output (x.dtype) is ``x[r] @ W[expert_ids[r]].T`` with NVFP4 weights
    ``packed [E, N, K/2]``, ``scales [E, N, K/16]`` (fp8), ``weight_scale_2 [E]``; with ``input_scale [E]``
    the activations are NVFP4-quantized first (W4A4 emulation). Row ``r`` reads ``x[r // x_row_div]`` (the
    gate_up GEMM of top-k routing reads the ``[T, H]`` hidden states directly). Rows with an id outside
    ``[0, E)`` are NaN."""
    _require_triton()
    num_experts, n, kp = packed.shape
    k = kp * 2
    r = expert_ids.shape[0]
    out = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    cfg = grouped_config(r, num_experts)
    bm = block_m or cfg[0]
    bn = block_n or cfg[1]
    bk = block_k or cfg[2]
    while k % bk:
        bk //= 2
    assert bm >= 16 and bn >= 16 and bk >= 16, "tile sizes must be >= 16 (tl.dot) and K a multiple of 16"
    expert_ids = expert_ids.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    sorted_rows = launch_nvfp4_align(expert_ids, num_experts, bm)
    grid = (sorted_rows.shape[0] // bm, triton.cdiv(n, bn))
    quant_a = input_scale is not None
    dot_f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpret_mode())
    torch.library.wrap_triton(_nvfp4_grouped_gemm_kernel)[grid](
        x, sorted_rows, expert_ids, packed.contiguous(), scales.contiguous().view(torch.uint8),
        weight_scale_2.contiguous(), input_scale.contiguous() if quant_a else weight_scale_2, out,
        n, k, num_experts, x.stride(0), out.stride(0), x_row_div,
        QUANT_A=quant_a, DOT_F32=dot_f32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=num_warps or cfg[3], num_stages=num_stages or cfg[4],
    )
    return out
