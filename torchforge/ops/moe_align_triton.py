"""`moe_align` in one Triton launch: what the ~20 small torch ops of moe_align_ref compute, bit for bit.

One program (grid (1,)) loops over the rows twice, keeping the per-expert counts in registers: pass 1 counts
the rows of each bucket, pass 2 writes every row to its padded slot (bucket start + rows of its bucket in
earlier chunks + rank within the chunk). No atomics, so the order within an expert is the row order, as the
reference's stable argsort gives. Buckets are one-hot compares against `arange(EB)`, EB >= E + 2: buckets
0..E-1 the experts, E the out-of-range ids, one spare for the masked lanes of the last chunk.

Past a few hundred rows the one program's serial walk is the bound, so `launch_moe_align_chunked` splits the rows
into chunks (moe_align.moe_align_chunk_rows picks their size) over three launches, still without atomics and with
the same bits: (1) one program per chunk counts its rows per bucket; (2) one program turns the counts into each
chunk's first slot per bucket (bucket start + rows of that bucket in earlier chunks), writes the padding and the
block experts; (3) one program per chunk writes its rows from those slots, walking its chunk as the one-program
kernel walks all rows.
"""
import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton
from torchforge.ops.moe_align import max_blocks

__all__ = ["launch_moe_align_triton", "launch_moe_align_chunked"]

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

        _store_block_experts(bexp_ptr, pad_end, E, B, BLOCK_M, EB, C)

    @triton.jit
    def _store_block_experts(bexp_ptr, pad_end, E, B, BLOCK_M: tl.constexpr, EB: tl.constexpr, C: tl.constexpr):
        """block b's expert = number of real buckets ending at or before its first slot (searchsorted right=True)."""
        buckets = tl.arange(0, EB)
        for start in range(0, B, C):
            b = start + tl.arange(0, C)
            ended = (pad_end[None, :] <= (b * BLOCK_M)[:, None]) & (buckets[None, :] <= E)
            be = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), E)
            tl.store(bexp_ptr + b, be, mask=b < B)

    @triton.jit
    def _chunk_count_kernel(ids_ptr, counts_ptr, R, E, EB: tl.constexpr, C: tl.constexpr, CHUNK: tl.constexpr):
        """counts[chunk, bucket]: rows of each bucket in this program's chunk of CHUNK rows."""
        chunk = tl.program_id(0)
        buckets = tl.arange(0, EB)
        counts = tl.zeros((EB,), dtype=tl.int32)
        for start in range(0, CHUNK, C):
            r = chunk * CHUNK + start + tl.arange(0, C)
            e = _bucket(ids_ptr, r, r < R, E, EB)
            counts += tl.sum((e[:, None] == buckets[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + chunk * EB + buckets, counts)

    @triton.jit
    def _chunk_offsets_kernel(counts_ptr, rows_ptr, bexp_ptr, R, E, B, n_chunks, BLOCK_M: tl.constexpr,
                              EB: tl.constexpr, C: tl.constexpr, FILL: tl.constexpr):
        """In place: counts[chunk, bucket] -> the chunk's first slot of that bucket; then the padding and the block
        experts (the scatter kernel, launched after, overwrites the padding slots of real rows)."""
        buckets = tl.arange(0, EB)
        real = buckets <= E  # the spare bucket (masked lanes) gets no slots
        totals = tl.zeros((EB,), dtype=tl.int32)
        for chunk in range(0, n_chunks):
            totals += tl.load(counts_ptr + chunk * EB + buckets)
        totals = tl.where(real, totals, 0)
        padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, 0)
        next_slot = pad_end - padded
        for chunk in range(0, n_chunks):
            c = tl.load(counts_ptr + chunk * EB + buckets)
            tl.store(counts_ptr + chunk * EB + buckets, next_slot)
            next_slot += c
        for start in range(0, B * BLOCK_M, FILL):
            offs = start + tl.arange(0, FILL)
            tl.store(rows_ptr + offs, tl.zeros((FILL,), dtype=tl.int32) + R, mask=offs < B * BLOCK_M)
        _store_block_experts(bexp_ptr, pad_end, E, B, BLOCK_M, EB, C)

    @triton.jit
    def _chunk_scatter_kernel(ids_ptr, slots_ptr, rows_ptr, R, E, EB: tl.constexpr, C: tl.constexpr,
                              CHUNK: tl.constexpr):
        """Each row of this program's chunk to its slot: the chunk's first slot of its bucket + earlier rows of the
        bucket in the chunk (row order within an expert, as the stable argsort of the reference)."""
        chunk = tl.program_id(0)
        buckets = tl.arange(0, EB)
        next_slot = tl.load(slots_ptr + chunk * EB + buckets)
        for start in range(0, CHUNK, C):
            r = chunk * CHUNK + start + tl.arange(0, C)
            m = r < R
            e = _bucket(ids_ptr, r, m, E, EB)
            onehot = (e[:, None] == buckets[None, :]).to(tl.int32)
            rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
            dest = tl.sum(onehot * next_slot[None, :], axis=1) + rank
            tl.store(rows_ptr + dest, r, mask=m)
            next_slot += tl.sum(onehot, axis=0)


def _prepare(expert_ids: Tensor, num_experts: int, block_m: int, op: str):
    if not HAS_TRITON:
        raise RuntimeError("torchforge moe_align kernels need triton")
    ids = expert_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    ids = ids.contiguous()
    R = ids.numel()
    B = max_blocks(R, num_experts + 1, block_m)
    if B * block_m >= 2**31:
        raise ValueError(f"{op}: {R} rows give {B * block_m} slots, past int32 indexing")
    sorted_rows = torch.empty(B * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(B, dtype=torch.int32, device=ids.device)
    eb = triton.next_power_of_2(num_experts + 2)
    chunk = max(16, min(256, 8192 // eb))  # rows per step: a [rows, buckets] one-hot of at most 8192 elements
    return ids, R, B, sorted_rows, block_expert, eb, chunk


def launch_moe_align_triton(expert_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Same contract and result as `moe_align_ref`; one program, so meant for moderate row counts."""
    ids, R, B, sorted_rows, block_expert, eb, chunk = _prepare(expert_ids, num_experts, block_m, "moe_align_triton")
    torch.library.wrap_triton(_moe_align_kernel)[(1,)](
        ids, sorted_rows, block_expert, R, num_experts, B, BLOCK_M=block_m, EB=eb, C=chunk, FILL=1024)
    return sorted_rows, block_expert


def launch_moe_align_chunked(expert_ids: Tensor, num_experts: int, block_m: int,
                             chunk_rows: int) -> tuple[Tensor, Tensor]:
    """Same contract and result as `moe_align_ref`, in three launches over chunks of `chunk_rows` rows (a power of
    two); for row counts where one program walking all rows is too slow."""
    ids, R, B, sorted_rows, block_expert, eb, step = _prepare(expert_ids, num_experts, block_m, "moe_align_chunked")
    step = min(step, chunk_rows)
    n_chunks = max(1, -(-R // chunk_rows))
    slots = torch.empty(n_chunks, eb, dtype=torch.int32, device=ids.device)  # counts, then first slots
    torch.library.wrap_triton(_chunk_count_kernel)[(n_chunks,)](
        ids, slots, R, num_experts, EB=eb, C=step, CHUNK=chunk_rows)
    torch.library.wrap_triton(_chunk_offsets_kernel)[(1,)](
        slots, sorted_rows, block_expert, R, num_experts, B, n_chunks, BLOCK_M=block_m, EB=eb, C=step, FILL=1024)
    torch.library.wrap_triton(_chunk_scatter_kernel)[(n_chunks,)](
        ids, slots, sorted_rows, R, num_experts, EB=eb, C=step, CHUNK=chunk_rows)
    return sorted_rows, block_expert
