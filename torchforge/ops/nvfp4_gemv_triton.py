"""Grouped NVFP4 GEMV (MoE decode) on GPUs without FP4 tensor cores (Hopper): one routed row per program.

At decode every expert gets about one routed row; the grouped GEMM of `torchforge.ops.nvfp4_triton` pads each
expert block to BLOCK_M = 16 rows, goes through tl.dot and needs the on-device align (sort) kernel first. Here
program (r, n-block, k-split) reads expert ``ids[r]``'s packed codes ``[BLOCK_N, BLOCK_K / 2]`` straight from
HBM (as int32 words, contiguous along K) with its fp8 block scales, dequantizes them in registers and multiplies
by ``x[r // x_row_div]`` with fp32 FMAs; no sort, no padding, no tl.dot. Grid axis 0 is the row, so the rows
that share an expert and an n-block run side by side and the second read of the slab comes from L2.

Dequantization is exact and decodes the same bit patterns as the grouped kernel (see `nvfp4_triton`); it
stays in fp32 here (no fp16 / bf16 tensor-core operand), so the 2**-22 shift of the decoded values is harmless:

* an int32 word w holds 8 codes (byte j: code 2j in the low nibble). For q = 0..3,
  ``((w << (12 - 4q)) & 0x80008000) | ((w << (9 - 4q)) & 0x0E000E00)`` holds two fp16 bit patterns
  ``sign << 15 | mag << 9`` at once, codes q (low half) and q + 4 (high half), each = E2M1 * 2**-14 (exact, 0.5
  is an fp16 subnormal); each half becomes fp32 in one HADD2.F32 (ptxas reads the high half in place). About 2
  integer ops per code instead of 4 for one nibble at a time.
* the 16 products of one scale block are summed in fp32 (FMAs, in registers), then multiplied by the e4m3
  scale as fp16 bits ``sign << 15 | (b & 0x7f) << 7`` (= scale * 2**-8, exact). One multiply per 16 codes
  instead of one per code.
* ``weight_scale_2 * 2**22`` (times ``input_scale`` in W4A4 emulation) multiplies the row's fp32 sum at the end.

Compared with the grouped kernel only the fp32 summation order differs (per block of 16, then over blocks).
Layout: every tensor in the K loop is 2-D [BLOCK_N, words] in the layout of the coalesced word load (16 bytes
per thread), the 8 codes of a word and the 2 words of a scale block stay in one thread, so the K loop has no
shuffles; x is loaded once per tile and split into 8 vectors (code p of every word). sm_90 SASS at BLOCK_N 64,
BLOCK_K 256, 4 warps: 128 registers, no spills, about 4.8 instructions per code in the K loop.

Split-K: with SPLIT_K > 1 each program writes its fp32 partial sum (already scaled) to ``[SPLIT_K, R, N]``;
`awq_splitk_triton._splitk_reduce_kernel` adds the partials in a fixed order (deterministic, no atomics) and casts.

Out-of-range expert ids (outside ``[0, E)``): the row is written as NaN, as the grouped kernel does (no host
sync). W4A4 emulation (``input_scale``) quantizes each x block of 16 exactly as the grouped kernel does.
"""
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_nvfp4_grouped_gemv", "gemv_config", "use_grouped_gemv", "GEMV_MAX_ROWS_PER_EXPERT"]

# Dispatch rule (shape only): the GEMV reads an expert's weights once per routed row (duplicates mostly from
# L2, see above) and dequantizes them once per row; the grouped GEMM reads and dequantizes once per expert
# block but pads to 16 rows and sorts first. H100 (`bench/nvfp4_moe.py --gemv-sweep --gemv-m 1,8,16,32`,
# DeepSeek-V3 experts, 2026-11-22): the GEMV is 1.9-2.1x faster than the grouped GEMM at 8 and 64 routed rows,
# 1.6-1.7x at 128 and still 1.3x at 256 rows (= E); larger counts were not measured, so the GEMV stops at R = E.
GEMV_MAX_ROWS_PER_EXPERT = 1.0


def use_grouped_gemv(rows: int, num_experts: int) -> bool:
    """True when the grouped NVFP4 matmul of ``rows`` routed rows over ``num_experts`` experts should run as the
    GEMV: ``rows <= max(1, num_experts * GEMV_MAX_ROWS_PER_EXPERT)`` (DeepSeek-V3, 256 experts, top-8: up to
    32 tokens; a dense layer (one expert): one row). Depends on shapes only (no host sync)."""
    return 0 < rows <= max(1, int(num_experts * GEMV_MAX_ROWS_PER_EXPERT))


def gemv_config(rows: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps). Chosen from the compiled SASS (about 5 instructions per code, no
    spills, no cross-lane traffic in the K loop at BLOCK_N 64 / BLOCK_K 256 / 4 warps), then confirmed by the H100
    sweep (`bench/nvfp4_moe.py --gemv-sweep`, 24 configurations, 2026-11-22): within 2% of the best at every
    measured size (M = 1 gate_up 0.069 ms = 1.9 TB/s, best 0.068). SPLIT_K doubles (up to 8, while it divides
    the number of K tiles) until there are at least 512 programs; the sweep found no split faster at M >= 1."""
    bn, bk, warps = 64, 256, 4
    while k % bk:
        bk //= 2
    tiles = max(1, k // bk)
    programs = rows * -(-n // bn)
    split = 1
    while programs * split < 512 and split < 8 and tiles % (2 * split) == 0:
        split *= 2
    return bn, bk, split, warps


if HAS_TRITON:
    from torchforge.ops.awq_splitk_triton import _splitk_reduce_kernel
    from torchforge.ops.nvfp4_triton import _quant_a_tile

    @triton.jit
    def _e2m1_pair(w, Q: tl.constexpr):
        """int32 words of 8 E2M1 codes -> fp32 E2M1 * 2**-14 of codes Q (low half) and Q + 4 (high half)."""
        # sign bits 4Q + 3 and 4Q + 19 -> 15 and 31; magnitude bits 4Q .. 4Q + 2 (+ 16) -> 9 .. 11 (+ 16)
        if Q == 3:
            h = (w & -2147450880) | ((w >> 3) & 0x0E000E00)  # -2147450880 = 0x80008000
        else:
            h = ((w << (12 - 4 * Q)) & -2147450880) | ((w << (9 - 4 * Q)) & 0x0E000E00)
        lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _x_by_code(x_row, k0, gs, QUANT_A: tl.constexpr, BKB: tl.constexpr):
        """fp32 x[k0 + 8 w + p] for the BKB * 2 words w of the tile, as 8 vectors (p = 0..7)."""
        xb = tl.load(x_row + k0 + tl.arange(0, BKB)[:, None] * 16 + tl.arange(0, 16)[None, :]).to(tl.float32)
        if QUANT_A:
            xb = _quant_a_tile(xb, gs, BKB, 16)  # one scale block per row of xb, as the grouped kernel does
        xt = tl.reshape(xb, (BKB * 2, 2, 2, 2))  # [word, p // 4, (p // 2) % 2, p % 2]
        c0, c1 = tl.split(xt)
        c00, c01 = tl.split(c0)
        c10, c11 = tl.split(c1)
        x0, x4 = tl.split(c00)
        x2, x6 = tl.split(c01)
        x1, x5 = tl.split(c10)
        x3, x7 = tl.split(c11)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _nvfp4_grouped_gemv_kernel(
        x_ptr, ids_ptr, w_ptr, s_ptr, ws2_ptr, ins_ptr, dst_ptr,
        N, KW, KS, E, stride_xr, stride_dr, stride_ds, X_ROW_DIV, WORDS_PER_SPLIT,
        QUANT_A: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        BKW: tl.constexpr = BLOCK_K // 8  # int32 words (8 codes each) per row of the tile
        BKB: tl.constexpr = BLOCK_K // 16  # scale blocks per row of the tile
        r = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        dst = dst_ptr + pid_k.to(tl.int64) * stride_ds + r.to(tl.int64) * stride_dr + offs_n
        e = tl.load(ids_ptr + r).to(tl.int64)
        if (e < 0) | (e >= E):  # out-of-range expert id: NaN row (no host sync to check it)
            nan = tl.full((BLOCK_N,), float("nan"), tl.float32)
            tl.store(dst, nan.to(dst_ptr.dtype.element_ty), mask=mask_n)
            return
        w_rows = w_ptr + e * N * KW + offs_n[:, None] * KW
        s_rows = s_ptr + e * N * KS + offs_n[:, None] * KS
        x_row = x_ptr + (r // X_ROW_DIV).to(tl.int64) * stride_xr  # pair r reads token r // top_k
        ws2 = tl.load(ws2_ptr + e).to(tl.float32)
        gs = 1.0
        if QUANT_A:
            ins = tl.load(ins_ptr + e).to(tl.float32)
            gs = tl.div_rn(1.0, ins)
        kw_begin = pid_k * WORDS_PER_SPLIT
        kw_end = tl.minimum(kw_begin + WORDS_PER_SPLIT, KW)
        acc = tl.zeros((BLOCK_N, BKB), dtype=tl.float32)
        for kw0 in range(kw_begin, kw_end, BKW):
            w = tl.load(w_rows + kw0 + tl.arange(0, BKW)[None, :], mask=mask_n[:, None], other=0)
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_by_code(x_row, kw0 * 8, gs, QUANT_A, BKB)
            l0, h0 = _e2m1_pair(w, 0)
            l1, h1 = _e2m1_pair(w, 1)
            l2, h2 = _e2m1_pair(w, 2)
            l3, h3 = _e2m1_pair(w, 3)
            p = l0 * x0[None, :]  # per word: one multiply and 7 FMAs, in registers
            p += h0 * x4[None, :]
            p += l1 * x1[None, :]
            p += h1 * x5[None, :]
            p += l2 * x2[None, :]
            p += h2 * x6[None, :]
            p += l3 * x3[None, :]
            p += h3 * x7[None, :]
            block_sum = tl.sum(tl.reshape(p, (BLOCK_N, BKB, 2)), 2)  # two words = one scale block
            sb = tl.load(s_rows + kw0 // 2 + tl.arange(0, BKB)[None, :], mask=mask_n[:, None], other=0)
            sb = sb.to(tl.int32)
            sf = (((sb & 0x80) << 8) | ((sb & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)  # scale*2**-8
            acc += block_sum * sf.to(tl.float32)
        alpha = ws2 * 4194304.0  # 2**22 undoes the in-register shift
        if QUANT_A:
            alpha = ins * ws2 * 4194304.0
        tl.store(dst, (tl.sum(acc, 1) * alpha).to(dst_ptr.dtype.element_ty), mask=mask_n)



def launch_nvfp4_grouped_gemv(
    x: Tensor,
    expert_ids: Tensor,
    packed: Tensor,
    scales: Tensor,
    weight_scale_2: Tensor,
    input_scale: Optional[Tensor] = None,
    x_row_div: int = 1,
    *,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
    split_k: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> Tensor:
    """Same contract as `launch_nvfp4_grouped_linear`: row ``r`` of the ``[R, N]`` output (x.dtype) is
    ``x[r // x_row_div] @ W[expert_ids[r]].T`` with ``packed [E, N, K/2]`` uint8, ``scales [E, N, K/16]`` fp8,
    ``weight_scale_2 [E]``, optional ``input_scale [E]`` (W4A4 emulation); rows with an id outside ``[0, E)`` are
    NaN. Meant for few rows per expert (decode). ``block_k`` must be a power of two >= 16 (it is halved until it
    divides K); ``split_k`` is capped at the number of K tiles."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge NVFP4 GEMV kernel needs triton; install it or use CPU tensors")
    num_experts, n, kp = packed.shape
    k = kp * 2
    r = expert_ids.shape[0]
    out = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    cfg = gemv_config(r, n, k)
    bn = block_n or cfg[0]
    bk = block_k or cfg[1]
    while k % bk:
        bk //= 2
    assert bn >= 1 and bk >= 16 and bk & (bk - 1) == 0 and bn & (bn - 1) == 0, \
        "block_n, block_k must be powers of two, block_k >= 16 (and K a multiple of 16)"
    tiles = max(1, k // bk)  # K = 0: one empty slice (the kernel's K loop is empty), not a division by 0
    split = max(1, min(split_k or cfg[2], tiles))
    tiles_per_split = triton.cdiv(tiles, split)
    split = triton.cdiv(tiles, tiles_per_split)  # no empty K slices
    expert_ids = expert_ids.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    packed = packed.contiguous()
    if packed.storage_offset() % 4:  # the kernel reads int32 words
        packed = packed.clone()
    # [E, N, K/8]; little-endian: byte j of a word is bits 8j .. 8j+7 (K = 0: no bytes to view as words)
    words = packed.view(torch.int32) if k else packed.new_empty((num_experts, n, 0), dtype=torch.int32)
    quant_a = input_scale is not None
    if split == 1:
        dst, stride_ds = out, 0
    else:
        dst = torch.empty((split, r, n), dtype=torch.float32, device=x.device)
        stride_ds = r * n
    grid = (r, triton.cdiv(n, bn), split)
    torch.library.wrap_triton(_nvfp4_grouped_gemv_kernel)[grid](
        x, expert_ids, words, scales.contiguous().view(torch.uint8), weight_scale_2.contiguous(),
        input_scale.contiguous() if quant_a else weight_scale_2, dst,
        n, k // 8, k // 16, num_experts, x.stride(0), n, stride_ds, x_row_div, tiles_per_split * bk // 8,
        QUANT_A=quant_a, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps or cfg[3],
    )
    if split > 1:
        block = 1024
        # the W4A16 split-K reduce: fixed-order fp32 sum of the slices (deterministic), cast to out's dtype
        torch.library.wrap_triton(_splitk_reduce_kernel)[(triton.cdiv(r * n, block),)](
            dst, dst, out, r * n, n, SPLIT_K=split, HAS_BIAS=False, BLOCK=block, num_warps=4)
    return out
