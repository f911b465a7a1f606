"""Grouped W4A16 GEMV over routed rows (AWQ layout): the MoE decode path, without tensor cores.

At decode each routed (token, expert) row usually has its expert to itself (M = 1 x top-8 over 256 experts),
so the expert-sorted grouped GEMM (awq_moe_triton.py) pads every block to 16 rows for tl.dot and pays the
moe_align step. Here every routed row r is its own GEMV against W[expert_ids[r]], with the arithmetic of the
batch-1 GEMV (awq_gemv_triton.py):

- program (r, word block, K slice): expert e = expert_ids[r] (int64 offsets into qweight [E, K, N/8],
  scales [E, K/G, N], qzeros [E, K/G, N/8]) and activation row x[r // X_ROW_DIV] (gate_up reads the [T, H]
  hidden states with X_ROW_DIV = top_k, as awq_moe_gemm does);
- each thread holds whole packed words (8 output columns) and walks K with FMAs into fp32; a code is masked in
  place into the mantissa of 2^23 so that float - 2^23 = code * 2^pos exactly (no int-to-float conversion);
  scale and zero are applied once per group: s * (sum_k x q - z sum_k x);
- fp32 partials [SPLIT_K, R, N] are added in a fixed order by the split-K reduce kernel of awq_splitk_triton.py
  (deterministic, no atomics) and cast to x.dtype; with SPLIT_K = 1 the kernel writes the output directly.

Unlike awq_gemv_triton.py, the 8 nibbles of a word are 8 separate [BLOCK_K, BLOCK_W] accumulators instead of a
broadcast [BLOCK_K, BLOCK_W, 8] tile: there Triton spreads the 8 nibbles of a word over 8 threads (each word is
replicated through shared memory every tile) and needs a shift per nibble. Here a word gets its 2^23 bits OR-ed
in once (nibbles 5-7 once more after one shift), then one AND with an immediate, one FADD and one FFMA per
code. sm_90 SASS of the inner loop (compiled on CPU, not timed): ~3.8-4.2 instructions per weight against
~5.9 for the broadcast form; at M = 1 such a GEMV is issue-bound near the HBM rate, so this is the lever. The
K-sum of a group is reduced across threads once per group; with BLOCK_W = 128 x num_warps each thread holds
whole columns of the tile and that reduction stays in registers. The inner loop is software-pipelined
(NUM_STAGES, cp.async into shared memory) because the accumulators leave room for few warps per SM.

The routed row is the fastest grid axis (axis 0): programs of rows that share an expert (duplicate ids at
M > 1) read the same weight tile back to back, so the repeat read is likely an L2 hit; axis 0 also has no
65535 limit on R. Out-of-range ids are not checked on the host (a sync): the row reads expert 0 (in
bounds) and comes out NaN, like `_awq_grouped_linear_kernel`. The dequantized weight is never rounded to the
activation dtype (exact-scale fp32 sums), so results differ from the reference, which rounds it, by about that
rounding, inside the output dtype's own rounding.
"""
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_awq_moe_gemv", "moe_gemv_config"]

if HAS_TRITON:

    @triton.jit
    def _nib_fma(acc, src, xv, POS: tl.constexpr):
        """acc + (code of the nibble at bits POS..POS+3) * 2^POS * xv. `src` is the word with the bits of 2^23
        (0x4B000000) already OR-ed in (once per word): one AND with an immediate leaves code * 2^POS in the
        mantissa of 2^23, so the float minus 2^23 is exact; the 2^POS is undone once per group."""
        bits = src & ((0xF << POS) | 0x4B000000)
        return acc + (bits.to(tl.float32, bitcast=True) - 8388608.0) * xv

    @triton.jit
    def _group_out(o, a, xsum, s_g, z_g, offs_w, mask_w, P: tl.constexpr, POS: tl.constexpr, COL: tl.constexpr):
        """o + s * (sum_k x q - z sum_k x) for the column COL of every word (nibble P, held at bit POS)."""
        part = tl.sum(a, axis=0) * (1.0 / (1 << POS))
        s = tl.load(s_g + offs_w * 8 + COL, mask=mask_w, other=0.0).to(tl.float32)
        z = ((z_g >> (4 * P)) & 0xF).to(tl.float32)
        return o + s * (part - z * xsum)

    @triton.jit
    def _awq_moe_gemv_kernel(x_ptr, ids_ptr, qw_ptr, s_ptr, z_ptr, part_ptr, R, N, NP, E, stride_x, X_ROW_DIV,
                             GROUPS, GROUPS_PER_SPLIT, MAGIC,
                             GROUP_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                             NUM_STAGES: tl.constexpr):
        r = tl.program_id(0)
        pid_w = tl.program_id(1)
        pid_k = tl.program_id(2)
        e = tl.load(ids_ptr + r).to(tl.int64)
        valid = (e >= 0) & (e < E)
        e = tl.where(valid, e, 0)  # bad id: read expert 0 (in bounds), write NaN below
        K = GROUPS * GROUP_SIZE
        qw_e = qw_ptr + e * K * NP
        s_e = s_ptr + e * GROUPS * N
        z_e = z_ptr + e * GROUPS * NP
        x_row = x_ptr + (r // X_ROW_DIV).to(tl.int64) * stride_x
        offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # packed words = 8 output columns each
        mask_w = offs_w < NP
        offs_k = tl.arange(0, BLOCK_K)
        # o<P>: output column of nibble P of every word (AWQ order: nibble P holds column 0, 2, 4, 6, 1, 3, 5, 7)
        o0 = tl.zeros((BLOCK_W,), dtype=tl.float32)
        o1 = tl.zeros_like(o0)
        o2 = tl.zeros_like(o0)
        o3 = tl.zeros_like(o0)
        o4 = tl.zeros_like(o0)
        o5 = tl.zeros_like(o0)
        o6 = tl.zeros_like(o0)
        o7 = tl.zeros_like(o0)
        g_begin = pid_k * GROUPS_PER_SPLIT
        for g in range(g_begin, g_begin + GROUPS_PER_SPLIT):
            # a<P>: [BLOCK_K, BLOCK_W] per-element sums, reduced over K once per group (not per tile)
            a0 = tl.zeros((BLOCK_K, BLOCK_W), dtype=tl.float32)
            a1 = tl.zeros_like(a0)
            a2 = tl.zeros_like(a0)
            a3 = tl.zeros_like(a0)
            a4 = tl.zeros_like(a0)
            a5 = tl.zeros_like(a0)
            a6 = tl.zeros_like(a0)
            a7 = tl.zeros_like(a0)
            xs = tl.zeros((BLOCK_K, 1), dtype=tl.float32)
            for k0 in tl.range(0, GROUP_SIZE, BLOCK_K, num_stages=NUM_STAGES):
                k = g * GROUP_SIZE + k0 + offs_k
                w = tl.load(qw_e + k[:, None] * NP + offs_w[None, :], mask=mask_w[None, :], other=0)
                xv = tl.load(x_row + k).to(tl.float32)[:, None]
                # OR the bits of 2^23 in once per word. MAGIC (= 0x4B000000) is a run-time argument so that LLVM
                # cannot fold the OR back into every per-nibble AND (two constants per LOP3: ptxas then
                # rematerializes one of them in a register at every use).
                wh = (w >> 12) | MAGIC  # nibbles 5, 6, 7 down to bits 8, 12, 16 (sign bits: masked off)
                w = w | MAGIC  # nibbles 0-4 sit at bits 0-19, below the exponent bits of 2^23
                a0 = _nib_fma(a0, w, xv, 0)
                a1 = _nib_fma(a1, w, xv, 4)
                a2 = _nib_fma(a2, w, xv, 8)
                a3 = _nib_fma(a3, w, xv, 12)
                a4 = _nib_fma(a4, w, xv, 16)
                a5 = _nib_fma(a5, wh, xv, 8)
                a6 = _nib_fma(a6, wh, xv, 12)
                a7 = _nib_fma(a7, wh, xv, 16)
                xs += xv
            xsum = tl.sum(xs)
            s_g = s_e + g * N
            z_g = tl.load(z_e + g * NP + offs_w, mask=mask_w, other=0)
            o0 = _group_out(o0, a0, xsum, s_g, z_g, offs_w, mask_w, 0, 0, 0)
            o1 = _group_out(o1, a1, xsum, s_g, z_g, offs_w, mask_w, 1, 4, 2)
            o2 = _group_out(o2, a2, xsum, s_g, z_g, offs_w, mask_w, 2, 8, 4)
            o3 = _group_out(o3, a3, xsum, s_g, z_g, offs_w, mask_w, 3, 12, 6)
            o4 = _group_out(o4, a4, xsum, s_g, z_g, offs_w, mask_w, 4, 16, 1)
            o5 = _group_out(o5, a5, xsum, s_g, z_g, offs_w, mask_w, 5, 8, 3)
            o6 = _group_out(o6, a6, xsum, s_g, z_g, offs_w, mask_w, 6, 12, 5)
            o7 = _group_out(o7, a7, xsum, s_g, z_g, offs_w, mask_w, 7, 16, 7)
        # [BLOCK_W, 8] tile in column order c = 4 b2 + 2 b1 + b0 (joins add the last dim: innermost join is b2)
        tile = tl.join(tl.join(tl.join(o0, o2), tl.join(o1, o3)), tl.join(tl.join(o4, o6), tl.join(o5, o7)))
        tile = tl.reshape(tile, (BLOCK_W, 8))
        tile = tl.where(valid, tile, float("nan"))
        out = part_ptr + (pid_k * R + r).to(tl.int64) * N + offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(out, tile.to(part_ptr.dtype.element_ty), mask=mask_w[:, None])


def moe_gemv_config(num_rows: int, k: int, n: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_W, BLOCK_K, SPLIT_K, num_warps, num_stages) of the grouped GEMV. Chosen a priori from the sm_90 SASS
    (registers, instructions per weight), then checked by the H100 sweep (`python bench/moe_w4a16.py --gemv-sweep
    --gemv-m 1,8,16,32`, BENCHMARKS.md): best or within 2% everywhere except 32 tokens' gate_up (1.35 against
    1.16 ms). One warp over 128 words (the K-sum of a group stays in registers), BLOCK_K 2 (156
    registers: ~12 one-warp programs per SM), 5 pipeline stages (4 KB in flight per warp, as few warps fit);
    two groups per K slice (like the batch-1 GEMV), or one when that leaves fewer than 768 programs (~6 per SM
    of an H100: M = 1 down has 448)."""
    groups = k // group_size
    bw, warps = 128, 1
    bk = min(2, group_size)
    programs = num_rows * -(-(n // 8) // bw)
    split = groups // 2 if groups % 2 == 0 and programs * (groups // 2) >= 768 else max(groups, 1)  # IC = 0: one
    return bw, bk, split, warps, 5


def launch_awq_moe_gemv(x: Tensor, expert_ids: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor,
                        group_size: int, *, x_row_div: int = 1, block_w: Optional[int] = None,
                        block_k: Optional[int] = None, split_k: Optional[int] = None,
                        num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                        partials: bool = False) -> Tensor:
    """out[r] = x[r // x_row_div] @ dequant(W[expert_ids[r]]).T for r < R = expert_ids.numel(); [R, OC] in
    x.dtype. Rows whose id is outside [0, E) come out NaN. Arguments are assumed validated by awq_moe_gemm;
    keyword overrides (block_w, block_k, split_k, num_warps, num_stages) default to `moe_gemv_config`.
    partials=True returns the unreduced fp32 `[SPLIT_K, R, OC]` instead (for a fused epilogue reduce)."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge MoE GEMV kernel needs triton")
    from torchforge.ops.awq_splitk_triton import _splitk_reduce_kernel

    E, K, NP = qweight.shape
    N = NP * 8
    R = expert_ids.numel()
    bw, bk, split, warps, stages = moe_gemv_config(R, K, N, group_size)
    bw, bk, split = block_w or bw, block_k or bk, split_k or split
    warps, stages = num_warps or warps, num_stages or stages
    groups = K // group_size
    if groups % split or group_size % bk:
        raise ValueError(f"launch_awq_moe_gemv: split_k={split} must divide the {groups} groups and block_k={bk} "
                         f"must divide group_size={group_size}")
    if bw & (bw - 1) or bk & (bk - 1):
        raise ValueError(f"launch_awq_moe_gemv: block_w={bw} and block_k={bk} must be powers of two")
    out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    if partials or split > 1:
        part = torch.empty((split, R, N), dtype=torch.float32, device=x.device)
    else:
        part = out
    if R == 0:
        return part if partials else out
    if E == 0:  # every id is out of range; the kernel would read "expert 0" from an empty tensor
        out.fill_(float("nan"))
        return part.fill_(float("nan")) if partials else out
    x = x.contiguous()
    ids = expert_ids.reshape(R).contiguous()
    grid = (R, triton.cdiv(NP, bw), split)
    # MAGIC = the bits of 2^23, passed at run time (see the kernel)
    torch.library.wrap_triton(_awq_moe_gemv_kernel)[grid](
        x, ids, qweight.contiguous(), scales.contiguous(), qzeros.contiguous(), part, R, N, NP, E, x.stride(0),
        x_row_div, groups, groups // split, 0x4B000000, GROUP_SIZE=group_size, BLOCK_W=bw, BLOCK_K=bk,
        NUM_STAGES=stages, num_warps=warps)
    if partials:
        return part
    if split > 1:
        block = 1024
        torch.library.wrap_triton(_splitk_reduce_kernel)[(triton.cdiv(R * N, block),)](
            part, part, out, R * N, N, SPLIT_K=split, HAS_BIAS=False, BLOCK=block)
    return out
