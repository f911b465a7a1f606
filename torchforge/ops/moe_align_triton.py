"""`moe_align` in one Triton launch: what the ~20 small torch ops of moe_align_ref compute, bit for bit.

One program (grid (1,)) loops over the rows twice, keeping the per-expert counts in registers: pass 1 counts
the rows of each bucket, pass 2 writes every row to its padded slot (bucket start + rows of its bucket in
earlier chunks + rank within the chunk). No atomics, so the order within an expert is the row order, as the
reference's stable argsort gives. Buckets are one-hot compares against `arange(EB)`, EB >= E + 2: buckets
0..E-1 the experts, E the out-of-range ids, one spare for the masked lanes of the last chunk.
"""
import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton
from torchforge.ops.moe_align import max_blocks

__all__ = ["launch_moe_align_triton"]

if HAS_TRITON:

    @triton.jit
    def _bucket(ids_ptr, r, m, E, EB: tl.constexpr):
        """Bucket of rows r: the expert id, E for out-of-range ids, the spare EB - 1 for masked lanes."""
        e = tl.load(ids_ptr + r, mask=m, other=0)
        e = tl.where((e >= 0) & (e < E), e, E)
        return tl.where(m, e, EB - 1).to(tl.int32)

    @triton.jit
    def _moe_align_kernel(ids_ptr, rows_ptr, bexp_ptr, R, E, B, BLOCK_M: tl.constexpr, EB: tl.constexpr,
                          C: tl.constexpr, FILL: tl.constexpr):
        buckets = tl.arange(0, EB)
        lanes = tl.arange(0, C)
        counts = tl.zeros((EB,), dtype=tl.int32)
        for start in range(0, R, C):
            r = start + lanes
            m = r < R
            e = _bucket(ids_ptr, r, m, E, EB)
            counts += tl.sum((e[:, None] == buckets[None, :]).to(tl.int32), axis=0)
        counts = tl.where(buckets <= E, counts, 0)  # the spare bucket gets no blocks
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, 0)
        next_slot = pad_end - padded  # per bucket: where its next row goes

        for start in range(0, B * BLOCK_M, FILL):
            offs = start + tl.arange(0, FILL)
            tl.store(rows_ptr + offs, tl.zeros((FILL,), dtype=tl.int32) + R, mask=offs < B * BLOCK_M)
        tl.debug_barrier()  # the padding must land before the rows overwrite it (other threads store them)

        for start in range(0, R, C):
            r = start + lanes
            m = r < R
            e = _bucket(ids_ptr, r, m, E, EB)
            onehot = (e[:, None] == buckets[None, :]).to(tl.int32)
            rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # earlier rows of its bucket in the chunk
            dest = tl.sum(onehot * next_slot[None, :], axis=1) + rank
            tl.store(rows_ptr + dest, r, mask=m)
            next_slot += tl.sum(onehot, axis=0)

        # block b's expert = number of real buckets ending at or before its first slot (searchsorted right=True)
        for start in range(0, B, C):
            b = start + lanes
            ended = (pad_end[None, :] <= (b * BLOCK_M)[:, None]) & (buckets[None, :] <= E)
            be = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), E)
            tl.store(bexp_ptr + b, be, mask=b < B)


def launch_moe_align_triton(expert_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Same contract and result as `moe_align_ref`; one program, so meant for moderate row counts."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge moe_align kernel needs triton")
    ids = expert_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    ids = ids.contiguous()
    R = ids.numel()
    B = max_blocks(R, num_experts + 1, block_m)
    if B * block_m >= 2**31:
        raise ValueError(f"moe_align_triton: {R} rows give {B * block_m} slots, past int32 indexing")
    sorted_rows = torch.empty(B * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(B, dtype=torch.int32, device=ids.device)
    eb = triton.next_power_of_2(num_experts + 2)
    chunk = max(16, min(256, 8192 // eb))
    torch.library.wrap_triton(_moe_align_kernel)[(1,)](
        ids, sorted_rows, block_expert, R, num_experts, B, BLOCK_M=block_m, EB=eb, C=chunk, FILL=1024)
    return sorted_rows, block_expert
