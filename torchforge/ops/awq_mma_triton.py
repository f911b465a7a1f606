"""Tensor-core W4A16 kernel (AWQ layout) for M >= 2 rows, with two layout choices and optional split-K.

One kernel, three compile-time switches, so the sweep in `bench/w4a16_linear.py --mma-sweep` can pick per M:

- SWAP_AB computes out.T = W @ x.T: the weight tile is the MMA's M operand (64-row granules on Hopper) and
  the activation rows are its N (as few as 8/16), so a decode batch of 16 rows does not pad to 64.
- FACTORED feeds the raw codes to tl.dot and applies scale and zero once per tile and column:
  sum_k x (q - z) s = s (sum_k x (q + c) - (z + c) sum_k x). Each code is OR-ed into the mantissa of
  c = 128 (bf16) or 1024 (fp16), whose ulp is 1, so `c + q` is exact and costs one OR instead of an
  int-to-float conversion, a subtraction and a multiply per weight; the weight itself is exact here (the
  reference rounds (q - z) s to the activation dtype first, a difference far inside the test tolerance).
- PREFETCH loads the next weight tile (words, zeros, scales) into registers before decoding the current one.
- split_k > 1 (IS_SPLIT) splits K into slices (more programs when M and OC give too few) with fp32 partials
  `[SPLIT_K, M, OC]` added by the split-K reduce kernel (deterministic, no atomics).

Programs are ordered in groups of GROUP_M row blocks so that neighbouring programs share weight tiles in L2.
Arguments are assumed validated by `torchforge.ops.awq`.
"""
from typing import NamedTuple

import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["MmaConfig", "launch_w4a16_mma", "mma_config"]


class MmaConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    swap_ab: bool
    factored: bool
    num_warps: int
    num_stages: int
    prefetch: bool = True


def mma_config(m: int, k: int, n: int, group_size: int) -> MmaConfig:
    """Configuration by rows M, from two H100 sweeps (`bench/w4a16_linear.py --mma-sweep`, 2026-11-22, bf16,
    18432x7168 and 7168x7168, BENCHMARKS.md): SWAP_AB + FACTORED with BLOCK_N 64 and SPLIT_K 4 up to 16 rows
    (0.062 / 0.028 ms at M = 16 against 0.079 / 0.036 for the split-K kernel); the plain layout, BLOCK 64 x 64,
    SPLIT_K 4 on wide outputs (2 on 7168) up to 64 rows (0.098 / 0.042 against 0.163 / 0.117 for the tiled
    kernel) and SPLIT_K 2 up to 128 rows. Beyond that `w4a16_linear` dequantizes and calls cuBLAS."""
    bk = next(b for b in (128, 64, 32, 16) if group_size % b == 0)

    def split(want: int) -> int:  # the largest of want, want / 2, ... whose K slices are whole tiles
        while want > 1 and k % (want * bk):
            want //= 2
        return want

    if m <= 16:
        return MmaConfig(16, 64, bk, split(4), True, True, 4, 3, True)
    if m <= 64:
        return MmaConfig(64, 64, bk, split(4 if n >= 16384 else 2), False, False, 4, 4, True)
    if m <= 256:
        return MmaConfig(64, 64, bk, split(2), False, False, 4, 4, True)
    return MmaConfig(128, 128, min(bk, 64), 1, False, False, 4, 4, True)


if HAS_TRITON:
    from torchforge.ops.awq_splitk_triton import _splitk_reduce_kernel
    from torchforge.ops.awq_triton import _awq_nibbles

    @triton.jit
    def _awq_raw_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, pid_n, N, NP, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Packed words `[BLOCK_K, BLOCK_N // 8]` of rows k0 + offs_k, and the zero words `[BLOCK_N // 8]` and
        scales `[BLOCK_N]` of their group (BLOCK_K divides the group size), as loaded."""
        g = k0 // GROUP_SIZE
        offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        mask_w = offs_w < NP
        words = tl.load(qw_ptr + (k0 + offs_k)[:, None] * NP + offs_w[None, :], mask=mask_w[None, :], other=0)
        zwords = tl.load(z_ptr + g * NP + offs_w, mask=mask_w, other=0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        s = tl.load(s_ptr + g * N + offs_n, mask=offs_n < N, other=0.0)
        return words, zwords, s

    @triton.jit
    def _w4a16_mma_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
        M, N, NP, stride_xm, K_PER_SPLIT,
        GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, IS_SPLIT: tl.constexpr, SWAP_AB: tl.constexpr, FACTORED: tl.constexpr,
        MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr, PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        blocks_m = tl.cdiv(M, BLOCK_M)
        blocks_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = pid_k * K_PER_SPLIT
        k_last = k_begin + K_PER_SPLIT - BLOCK_K
        if PREFETCH:
            words, zwords, s = _awq_raw_tile(qw_ptr, s_ptr, z_ptr, k_begin, offs_k, pid_n, N, NP, GROUP_SIZE, BLOCK_N)
        for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
            if PREFETCH:
                # Issue the next tile's loads before this tile's math: Triton's pipeliner only stages loads
                # that feed tl.dot directly, and the weight words go through integer ops first.
                cur_words, cur_zwords, cur_s = words, zwords, s
                words, zwords, s = _awq_raw_tile(qw_ptr, s_ptr, z_ptr, tl.minimum(k0 + BLOCK_K, k_last), offs_k,
                                                 pid_n, N, NP, GROUP_SIZE, BLOCK_N)
            else:
                cur_words, cur_zwords, cur_s = _awq_raw_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, pid_n, N, NP,
                                                             GROUP_SIZE, BLOCK_N)
            q = _awq_nibbles(cur_words, pid_n, BLOCK_N)
            z = _awq_nibbles(cur_zwords, pid_n, BLOCK_N)
            sf = cur_s.to(tl.float32)
            if FACTORED:
                w = (q | MAGIC_BITS).to(tl.int16).to(x.dtype, bitcast=True)  # c + q, exact
                zc = z.to(tl.float32) + MAGIC
                xs = tl.sum(x.to(tl.float32), axis=1)
                if SWAP_AB:
                    part = tl.dot(tl.trans(w), tl.trans(x))
                    acc += sf[:, None] * (part - zc[:, None] * xs[None, :])
                else:
                    part = tl.dot(x, w)
                    acc += (part - xs[:, None] * zc[None, :]) * sf[None, :]
            else:
                w = ((q - z[None, :]).to(tl.float32) * sf[None, :]).to(x.dtype)
                if SWAP_AB:
                    acc = tl.dot(tl.trans(w), tl.trans(x), acc)
                else:
                    acc = tl.dot(x, w, acc)
        if SWAP_AB:
            acc = tl.trans(acc)
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        if IS_SPLIT:
            part_ptrs = out_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
            tl.store(part_ptrs, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# bf16 128.0 and fp16 1024.0: the mantissa's ulp is 1 there, so OR-ing a 4-bit code in gives c + q exactly.
_MAGIC_BITS = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


def launch_w4a16_mma(x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                     bias: Tensor | None = None, *, config: MmaConfig | None = None, group_m: int = 8) -> Tensor:
    """`x [..., IC] @ dequant(W).T (+ bias)` on tensor cores; x bf16 or fp16; output in x.dtype."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge W4A16 MMA kernel needs triton")
    if x.dtype not in _MAGIC_BITS:
        raise ValueError(f"launch_w4a16_mma: x is {x.dtype}; this kernel takes bfloat16 or float16")
    ic, np_ = qweight.shape
    oc = np_ * 8
    lead = x.shape[:-1]
    x2 = x.reshape(-1, ic)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    cfg = config or mma_config(m, ic, oc, group_size)
    if group_size % cfg.block_k or ic % (cfg.split_k * cfg.block_k):
        raise ValueError(f"launch_w4a16_mma: block_k={cfg.block_k} must divide group_size={group_size} and "
                         f"split_k*block_k={cfg.split_k * cfg.block_k} must divide IC={ic}")
    out = torch.empty((m, oc), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, oc)
    split = cfg.split_k
    target = torch.empty((split, m, oc), dtype=torch.float32, device=x.device) if split > 1 else out
    has_bias = bias is not None
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(oc, cfg.block_n), split)
    torch.library.wrap_triton(_w4a16_mma_kernel)[grid](
        x2, qweight, scales, qzeros, bias if has_bias else scales, target,
        m, oc, np_, x2.stride(0), ic // split,
        GROUP_SIZE=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=group_m,
        IS_SPLIT=split > 1, SWAP_AB=cfg.swap_ab, FACTORED=cfg.factored,
        MAGIC_BITS=_MAGIC_BITS[x.dtype][0], MAGIC=_MAGIC_BITS[x.dtype][1], PREFETCH=cfg.prefetch,
        HAS_BIAS=has_bias and split == 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        torch.library.wrap_triton(_splitk_reduce_kernel)[(triton.cdiv(m * oc, block),)](
            target, bias if has_bias else target, out, m * oc, oc, SPLIT_K=split, HAS_BIAS=has_bias, BLOCK=block)
    return out.reshape(*lead, oc)
