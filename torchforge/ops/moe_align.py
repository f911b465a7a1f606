"""Sorting routed (token, expert) rows into per-expert blocks on the device, without a host sync.

A grouped MoE GEMM wants each program to see rows of ONE expert, so it can load that expert's weight
tile once for BLOCK_M rows (vLLM's `moe_align_block_size` does the same). Every expert's rows are padded
to a multiple of BLOCK_M; padding slots hold the sentinel R. All shapes are static (an upper bound on the
number of blocks), so this is capturable in a CUDA graph and traceable by torch.compile.

Expert ids outside [0, E) are not checked on the host (a sync): they are sorted into one more bucket, after
expert E - 1, whose blocks get block expert E like the empty blocks past the end. The grouped kernels write NaN
rows for the real rows of such blocks (past the end there are none), as the per-row decode kernels do.

On CUDA the sort is one Triton launch (moe_align_triton.py) instead of ~20 small torch ops (about
500 us of host time per call on the H200's host) up to MOE_ALIGN_TRITON_MAX_ROWS rows; its single program walks the
rows. Beyond, the chunked kernels (three launches, a program per chunk of rows) run, and past
MOE_ALIGN_CHUNKED_MAX_ROWS the torch ops, whose sort then wins. The torch ops (moe_align_ref) are also the CPU path
and the kernels' test oracle.
"""
from __future__ import annotations

import torch

from torchforge.ops._triton import use_triton

# Which kernel sorts on CUDA, by routed rows. H100, `bench/moe_align.py` (BENCHMARKS.md, seventeenth session), GPU us
# from a CUDA graph, 65 / 257 experts:
#   rows                 9            144          1152         4608         16380         65538
#   one program        8.4 / 4.3   17.3 / 23.8   87 / 152    337 / 561    1738 / 2320   7755 / 10611
#   chunks of 64       9.8 / 13.6  11.1 / 17.0   13.3 / 30.3 20.9 / 43.7   53.6 / 122    257 / 416
#   chunks of 128     15.4 / 22.2  14.5 / 24.1   16.7 / 36.7 22.9 / 46.1   51.5 / 110    196 / 323
#   torch ops         53.6 / 54.8  75.4 / 77.3   86.2 / 88.1  115 / 120     138 / 142    140 / 138
# The one program walks all rows serially; the chunked kernels walk a chunk per program, then one program walks the
# chunks (their offsets), which is what grows past ~16k rows; the torch ops' sort stays near flat.
MOE_ALIGN_TRITON_MAX_ROWS = 64  # the one-program kernel
MOE_ALIGN_CHUNKED_MAX_ROWS = 32768  # the chunked kernels; beyond, the torch ops


def moe_align_chunk_rows(num_rows: int) -> int:
    """Rows per program of the chunked kernels for `num_rows` routed rows (table above)."""
    return 64 if num_rows <= 8192 else 128


def max_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on non-empty blocks: each expert adds < 1 block of padding, and no block is empty."""
    return max(1, min(-(-num_rows // block_m) + num_experts, num_rows))


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [R] -> (sorted_rows int32 [B * block_m], block_expert int32 [B]).

    sorted_rows[b * block_m + i] is the i-th row of block b (R where it is padding); block_expert[b] is the
    expert of block b, or `num_experts` for the rows of out-of-range ids and for the (empty) blocks past the end.
    """
    if use_triton(expert_ids):
        from torchforge.ops import moe_align_triton as kernels  # imports max_blocks from here

        rows = expert_ids.numel()
        if rows <= MOE_ALIGN_TRITON_MAX_ROWS:
            return kernels.launch_moe_align_triton(expert_ids, num_experts, block_m)
        if rows <= MOE_ALIGN_CHUNKED_MAX_ROWS:
            return kernels.launch_moe_align_chunked(expert_ids, num_experts, block_m, moe_align_chunk_rows(rows))
    return moe_align_ref(expert_ids, num_experts, block_m)


def moe_align_ref(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch-ops version of moe_align (any device, any R); the Triton kernels must match it bit for bit."""
    ids = expert_ids.reshape(-1).to(torch.int64)
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # bucket E: out-of-range ids
    R = ids.numel()
    B = max_blocks(R, num_experts + 1, block_m)
    dev = ids.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    first = torch.cumsum(counts, 0) - counts                  # first sorted position of each expert
    order = torch.argsort(ids, stable=True)                   # rows grouped by expert
    sorted_e = ids[order]
    dest = pad_start[sorted_e] + (torch.arange(R, device=dev) - first[sorted_e])
    sorted_rows = torch.full((B * block_m,), R, dtype=torch.int32, device=dev)
    sorted_rows.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(B, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=num_experts).to(torch.int32)
    return sorted_rows, block_expert
