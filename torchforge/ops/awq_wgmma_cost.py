"""A time model of the Hopper W4A16 kernel (csrc/awq_wgmma.cu) and of its fallback, dequantize + cuBLAS, fitted to
H100 sweeps (BENCHMARKS.md, eleventh session: 18432x7168, 7168x7168, 14336x4096, 4096x14336 and 4096x4096 at
32-512 rows). The dispatch (`awq_mma_cuda.wgmma_cuda_config`, `wgmma_rows_ok`) picks the kernel's block shape and
whether to run it at all from these estimates (against the decode kernel up to 128 rows, dequantize + cuBLAS
from 129), instead of row thresholds fitted to two matrix shapes.

Why a model: a block of the kernel runs one output tile over the whole K, so its time is K / 64 chunks at a
per-chunk cost of its block shape, and the GPU runs ceil(blocks / SMs) rounds of them. K slices cut a tile's chunks
at the price of fp32 partials: for the tiles of a last, nearly empty round (wgmma_tail_time_us), and up to 256 rows
(512 where the slices fit in one round) for every tile, where few tiles would leave SMs idle (wgmma_split_time_us;
twelfth session, once the split reduction was fixed: slicing every tile had lost in every sweep before). The block
counts differ between the shapes:
(256, 1) makes 2x as many blocks along the columns as (128, 2), (64, 2) 2x as many along the rows. A shape that
leaves a last round nearly empty loses to one with fewer, bigger blocks (18432 columns at 256 rows: 288 blocks of
(64, 2) take 3 rounds of 132, 144 of (128, 2) or (256, 1) take 2), and on narrow matrices every shape leaves SMs idle
(4096 columns up to 256 rows: 64 blocks of (64, 2) at most, 32 of (256, 1)), where cuBLAS on a dequantized copy may
win.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

__all__ = ["H100_SMS", "WGMMA_US_PER_CHUNK", "WGMMA_MIN_M", "TAIL_SPLITS", "wgmma_blocks", "wgmma_time_us",
           "wgmma_tail_time_us", "wgmma_split_time_us", "wgmma_stream_k_time_us", "wgmma_cluster_time_us",
           "cluster_slots", "best_wgmma_shape",
           "best_wgmma_config", "dequant_cublas_time_us", "decode_mma_time_us"]

H100_SMS = 132
# Microseconds per 64-k chunk of one block while every block of its round runs (one block per SM), fitted on the H100
# runs: (128, 2) 0.82-0.98 over five shapes, (64, 2) 0.67-0.78. Blocks compute 128 x 256, 256 x 128 and 64 x 256
# outputs. (256, 1) has two warpgroups since the twenty-sixth session (one before, 256 x 64 outputs at 0.54-0.59):
# 0.84-0.91 of (128, 2)'s time for the same outputs in the same run (18432x7168 and 7168x7168 at 256, 512 and 4096
# rows), as it decodes each weight once per 256 rows instead of once per 128. (192, 1) (twenty-sixth session, the
# same two warpgroups on 192 rows: 128 x 192 outputs): 0.66-0.74 at full rounds on four shapes at 160-384 rows.
WGMMA_US_PER_CHUNK = {(128, 2): 0.87, (256, 1): 0.77, (192, 1): 0.70, (64, 2): 0.72}
# Rows from which a shape is considered: where it was swept. The two-warpgroup (192, 1) and (256, 1) were measured from
# 160 rows; below 129 the model would give them rows it never timed them on (2048x16384 at 100 rows: (192, 1), 92 of
# its rows empty, 0.6 us ahead of (64, 2) by the estimate).
WGMMA_MIN_M = {(192, 1): 129, (256, 1): 129}
WGMMA_FIXED_US = 3.0  # the x image kernel and the launches
# dequantize + cuBLAS: a pass that reads the int4 weight and writes it in bf16 (2.5 bytes an element), then a bf16
# GEMM bound by its weight reads or by the tensor cores plus one block's walk over K, the least time of any tile
# whatever the rows (GEMM_US_PER_K). Without that term the estimate was 19% low on narrow matrices at 256-384 rows
# (3072x7168: cuBLAS at 417-454 TFLOP/s) and 15-26% high past 512 rows. Fitted on 8 matrices at 128-1024 rows
# (twenty-eighth session, `bench/w4a16_linear.py --cublas-fit`): the pass took 13 / 47 / 120 us on 14.7 M / 51.4 M /
# 132 M elements; the whole within 0.88-1.18x of the measured (rms 7%; 0.81-1.26x, rms 12%, before).
DEQUANT_BYTES_PER_S = 2.8e12
DEQUANT_FIXED_US = 2.0
GEMM_BYTES_PER_S = 2.46e12
GEMM_FLOP_PER_S = 775e12
GEMM_FIXED_US = 0.65
GEMM_US_PER_K = 1.3e-3
# A last round of few tiles can run in K slices (dp_tiles: the full rounds' tiles whole, the rest in `splits` slices
# each, their blocks first in the launch). The SMs that run a slice still run a whole tile after it, so the slice's
# fp32 partials and the reduction (one block reads every slice of its tile) add to the time: about 10 us + 3.5 us per
# slice for a block of 128 x 256 outputs. Fitted on 18432x7168 at 160-512 rows and 14336x4096 at 384 (twelfth
# session: 0.144-0.146 ms at 256 rows, 2-6 slices within 0.004 of the measured; 160 rows measures ~10 us under the
# estimate (its second row block has 32 rows), 512 rows 10-20 us over).
TAIL_SPLITS = (2, 3, 4, 6, 8)
TAIL_FIXUP_US = 10.0
TAIL_FIXUP_US_PER_SLICE = 3.5
# Every tile in K slices (dp_tiles = 0): where few tiles leave SMs idle, at up to 256 rows. Twelfth session (since
# the eleventh session's fix of the split reduction; before it, slicing every tile lost in every sweep): 18432x7168 at
# 64 rows, (64, 2) in 3 slices, 0.068 ms against 0.077 whole; 7168x7168, 4 slices, 0.032 against the decode kernel's
# 0.038; 14336x4096, 2 slices, 0.033 against 0.041. Cost: ceil(tiles x splits / SMs) rounds of ceil(chunks / splits)
# chunks and 3 us (each round's blocks fill their pipeline and write partials), + 2 us, + 3 us per slice for a block
# of 128 x 256 outputs (the reduction). Fitted on those three matrices at 48-128 rows: within 4 us at 48-64 rows,
# 4-8 us under at 96-128 (the (128, 2) blocks).
SPLIT_SPLITS = (2, 3, 4, 6)
SPLIT_FIXED_US = 2.0
SPLIT_ROUND_US = 3.0
SPLIT_US_PER_SLICE = 3.0
# (Up to 128 rows until the twenty-sixth session. Two-warpgroup (256, 1) blocks on 7168x7168 at 256 rows: 56 tiles in 2
# slices, 0.056 ms against 0.080 whole; the estimate 0.057.) Up to SPLIT_ONE_ROUND_MAX_M rows where all the slices run
# in one round (twenty-seventh session: 4096x14336 and 4096x12288 at 320-512 rows, 64 tiles of (192, 1) or (256, 1) in
# 2 slices, 0.077-0.109 ms against stream-K's 0.085-0.122, estimated within 8% low; where they took several rounds,
# 18432x7168 and 7168x18432 at 320-384 rows, (128, 2) in 3 slices measured slower than whole tiles, though the
# estimate had them 2-9% faster). 512: the dispatch's last row for the kernel (awq_mma_cuda.WGMMA_MAX_M) and the
# sweeps' (past it the model would send 2048x7168 at 748-1024 rows to one round of slices, never measured).
SPLIT_MAX_M = 256
SPLIT_ONE_ROUND_MAX_M = 512
# Every tile in K slices, each tile's slices one thread block cluster (cluster=True, thirty-third session): the slices
# add their sums through distributed shared memory, every block of the cluster a share, instead of one last block
# reading fp32 partials from L2. Clusters of s blocks need s free SMs of one GPC: the H100 runs 66 / 39 / 30 / 17 / 15
# at once for s = 2 / 3 / 4 / 6 / 8 (cudaOccupancyMaxActiveClusters, one block per SM), so 4 slices use 120 SMs and 6
# only 102. Fitted on 7168x7168, 4096x14336 and 14336x4096 at 64-256 rows (41 configurations in one round, bench
# `--cluster-check`): FIXED + CLUSTER_FIXED_US + 0.91 x the chunks' time + 1.3 us per slice for a block of 128 x 256
# outputs, within 0.88-1.09 of the measured (256 rows 9-12% under). 7168x7168 at 64 rows, (64, 2) in 4 slices: 0.026
# ms against 0.032 through the partials, at 128 rows (128, 2) in 4: 0.034 against 0.045. One round of clusters only:
# two rounds (18432x7168 at 72-128 rows, 72 tiles of (128, 2) in clusters of 3, within 10% of the estimate) ran as
# fast as stream-K at group 128 (0.076-0.081 ms both) and 3-4% slower at group 32 (0.080-0.086 against 0.077-0.084).
CLUSTER_SPLITS = (2, 3, 4, 6, 8)
H100_CLUSTER_SLOTS = {2: 66, 3: 39, 4: 30, 6: 17, 8: 15}
CLUSTER_FIXED_US = 2.0
CLUSTER_CHUNK_FACTOR = 0.91
CLUSTER_US_PER_SLICE = 1.3
CLUSTER_MAX_ROUNDS = 1
CLUSTER_SHAPES = ((64, 2), (128, 2), (192, 1), (256, 1))  # csrc/awq_wgmma.cu kClusterPath: not (64, 4)
# Stream-K (splits 0, twenty-first session): one block per SM, each running an equal share of the (tile, pair of
# chunks) units, so no SM idles through a partial last round; a tile cut between blocks costs fp32 partials and a
# reduction by its last block, in part order. Per shape (fixed us, us per chunk per SM, us per part of a tile), fitted
# on 18432x7168 and 7168x7168 at 64-512 rows with the weights rotated through copies (bench/common.py's L2Rotation):
# within 6%. (128, 2) was refitted in the twenty-third session, once its wgmmas were no longer serialized (see
# csrc/awq_wgmma.cu, "Units are pairs"). That build also brought the whole-tile and K-slice estimates above within
# 0.91-1.12 of the rotated measurements, so stream-K's estimate is no longer divided by a margin (1.15 before, when
# they came out 7% over to 25% under; it picked stream-K at 512 rows on 18432x7168, 0.265 ms against the tail
# slices' 0.255). Up to STREAM_K_MAX_PARTS parts per tile: 7168x7168 at 64 rows cuts each tile of (64, 2) in 4.7
# parts, whose serial reduction made it 9% slower than 4 K slices (0.035 against 0.032 ms). At least
# STREAM_K_MIN_CHUNKS chunks per SM: 14336x4096 at 48-64 rows (27 per SM) ran 8% slower than 2 K slices (0.035
# against 0.032-0.033).
# (256, 1) fitted in the twenty-sixth session on the same two matrices at 256 and 512 rows: 136 us on 18432x7168 at
# 256 rows against 0.127-0.130 ms measured (5-7% high, so its 4 tail slices, 0.129, are taken there), 65 against 0.067
# on 7168x7168; (192, 1) on 18432x7168, 7168x7168, 14336x4096 and 4096x14336 at 160-384 rows, within 5%.
STREAM_K_US = {(64, 2): (9.9, 0.70, 1.78), (128, 2): (8.7, 1.03, 5.2), (256, 1): (3.0, 1.05, 5.0),
               (192, 1): (4.0, 0.82, 5.0)}
STREAM_K_MAX_PARTS = 3.0
STREAM_K_MIN_CHUNKS = 32
# The decode kernel (csrc/awq_mma.cu, up to 128 rows) dequantizes every weight once per 16 rows of x: its time steps
# up every 16 rows by 0.16-0.18 us per million weights on all five swept shapes (18432x7168: 0.069 ms at 48 rows,
# 0.086 at 56, 0.105 at 72, 0.135 at 96, 0.175 at 128), and is at least the time to read the int4 weight.
DECODE_US_PER_MWEIGHT_PER_16_ROWS = 0.168
DECODE_BYTES_PER_S = 2.4e12
DECODE_FIXED_US = 1.0


def _groups(shape: tuple[int, int]) -> int:
    """Consumer warpgroups per block (csrc/awq_wgmma.cu, kGroups): two, but one for (64, 4)."""
    block_m, tile_set = shape
    return 2 if tile_set == 2 or block_m >= 192 else 1


def wgmma_blocks(m: int, n: int, shape: tuple[int, int]) -> int:
    """Blocks of the kernel for m rows and n output columns: each warpgroup takes tile_set of the 4 column tiles of
    each 256 columns, on block_m rows ((128, 2) and (64, 2): one block per 256 columns; (256, 1): two; (64, 4), one
    warpgroup: one)."""
    block_m, tile_set = shape
    per_256 = 4 // (tile_set * _groups(shape))
    return -(-n // 256) * per_256 * -(-m // block_m)


def _block_outputs(shape: tuple[int, int]) -> int:
    """Outputs of one block (rows x columns): the fp32 partials each of its K slices writes (ops.cpp's
    awq_wgmma_block_outputs)."""
    block_m, tile_set = shape
    return block_m * 64 * tile_set * _groups(shape)


def _shapes_for(m: int) -> list[tuple[int, int]]:
    """The block shapes of WGMMA_US_PER_CHUNK considered at m rows (WGMMA_MIN_M), in its order."""
    return [s for s in WGMMA_US_PER_CHUNK if m >= WGMMA_MIN_M.get(s, 0)]


def wgmma_time_us(m: int, k: int, n: int, shape: tuple[int, int], sms: int = H100_SMS) -> float:
    """Estimated microseconds of the WS kernel with blocks of `shape` on x [m, k] and n output columns."""
    rounds = -(-wgmma_blocks(m, n, shape) // sms)
    return WGMMA_FIXED_US + rounds * (k // 64) * WGMMA_US_PER_CHUNK[shape]


def wgmma_tail_time_us(m: int, k: int, n: int, shape: tuple[int, int], splits: int, sms: int = H100_SMS) -> float:
    """Estimated microseconds with the last round's tiles in `splits` K slices (inf where there is no such round, its
    slices would not fit in one round, or K has fewer than `splits` chunks of 64)."""
    blocks = wgmma_blocks(m, n, shape)
    full, rest = divmod(blocks, sms)
    chunks = k // 64
    if full == 0 or rest == 0 or rest * splits > sms or splits > chunks:  # the op takes 1..K/64 slices
        return float("inf")
    fixup = TAIL_FIXUP_US + TAIL_FIXUP_US_PER_SLICE * splits * _block_outputs(shape) / (128 * 256)
    return (WGMMA_FIXED_US + full * chunks * WGMMA_US_PER_CHUNK[shape]
            + -(-chunks // splits) * WGMMA_US_PER_CHUNK[shape] + fixup)


def wgmma_split_time_us(m: int, k: int, n: int, shape: tuple[int, int], splits: int, sms: int = H100_SMS) -> float:
    """Estimated microseconds with every tile in `splits` K slices (inf past SPLIT_MAX_M rows, or SPLIT_ONE_ROUND_MAX_M
    where the slices run in one round, or where K has fewer than `splits` chunks of 64)."""
    chunks = k // 64
    rounds = -(-wgmma_blocks(m, n, shape) * splits // sms)
    if m > (SPLIT_ONE_ROUND_MAX_M if rounds == 1 else SPLIT_MAX_M) or splits > chunks:
        return float("inf")
    return (WGMMA_FIXED_US + rounds * (-(-chunks // splits) * WGMMA_US_PER_CHUNK[shape] + SPLIT_ROUND_US)
            + SPLIT_FIXED_US + SPLIT_US_PER_SLICE * splits * _block_outputs(shape) / (128 * 256))


def wgmma_stream_k_time_us(m: int, k: int, n: int, shape: tuple[int, int], sms: int = H100_SMS) -> float:
    """Estimated microseconds of stream-K on `sms` blocks (inf for shapes without a fit, past STREAM_K_MAX_PARTS
    parts per tile, under STREAM_K_MIN_CHUNKS chunks per SM, or with an odd number of chunks, where the kernel runs
    whole tiles: its units are pairs of chunks)."""
    chunks = k // 64
    if shape not in STREAM_K_US or chunks % 2:
        return float("inf")
    per_sm = wgmma_blocks(m, n, shape) * chunks / sms
    if per_sm == 0:  # no rows or no chunk of 64 k: no units to share (the other estimates take these)
        return float("inf")
    parts = chunks / per_sm  # blocks per tile, on average
    if parts > STREAM_K_MAX_PARTS or per_sm < STREAM_K_MIN_CHUNKS:
        return float("inf")
    fixed, per_chunk, per_part = STREAM_K_US[shape]
    return fixed + per_chunk * per_sm + per_part * max(1.0, parts)


def cluster_slots(splits: int, sms: int = H100_SMS) -> int:
    """Clusters of `splits` blocks (one per SM) that run at once: the H100's count, scaled to other SM counts."""
    slots = H100_CLUSTER_SLOTS.get(splits, 0)
    return slots if sms == H100_SMS else slots * sms // H100_SMS


def wgmma_cluster_time_us(m: int, k: int, n: int, shape: tuple[int, int], splits: int, sms: int = H100_SMS,
                          slots: Optional[int] = None) -> float:
    """Estimated microseconds with every tile's `splits` K slices run as one cluster, `slots` of them at once (None:
    cluster_slots). inf for shapes without the cluster path, without slots, past CLUSTER_MAX_ROUNDS rounds of
    clusters, past SPLIT_MAX_M rows, or SPLIT_ONE_ROUND_MAX_M in one round, or where K has fewer than `splits` chunks
    of 64."""
    chunks = k // 64
    slots = cluster_slots(splits, sms) if slots is None else slots
    tiles = wgmma_blocks(m, n, shape)
    if shape not in CLUSTER_SHAPES or slots == 0 or splits > chunks or tiles == 0:
        return float("inf")
    rounds = -(-tiles // slots)
    if rounds > CLUSTER_MAX_ROUNDS or m > (SPLIT_ONE_ROUND_MAX_M if rounds == 1 else SPLIT_MAX_M):
        return float("inf")
    per_round = (CLUSTER_CHUNK_FACTOR * -(-chunks // splits) * WGMMA_US_PER_CHUNK[shape]
                 + CLUSTER_US_PER_SLICE * splits * _block_outputs(shape) / (128 * 256))
    return WGMMA_FIXED_US + CLUSTER_FIXED_US + rounds * per_round


@functools.lru_cache(maxsize=4096)  # asked twice per call (wgmma_rows_ok, then wgmma_cuda_config), same few shapes
def best_wgmma_config(m: int, k: int, n: int, sms: int = H100_SMS,
                      clusters: Union[bool, tuple] = True) -> tuple[tuple[int, int, int, int, bool], float]:
    """((block_m, tile_set, splits, dp_tiles, cluster), estimated us) with the least estimated time: every block shape
    whole (splits 1, dp_tiles 0), with its last round's tiles in TAIL_SPLITS slices (dp_tiles > 0), with every tile in
    SPLIT_SPLITS slices (dp_tiles 0, up to SPLIT_MAX_M rows, SPLIT_ONE_ROUND_MAX_M in one round), every tile's
    CLUSTER_SPLITS slices as one cluster (cluster True; `clusters`: True for cluster_slots, a device's own
    ((splits, slots), ...) from op awq_wgmma_cluster_slots, False for none), or stream-K (splits 0, dp_tiles 0: one
    block per SM). Ties go to the earlier shape in WGMMA_US_PER_CHUNK ((128, 2) first: it reads x from L2 the fewest
    times), then to fewer slices, then to the partials."""
    options = []
    for shape in _shapes_for(m):
        options.append(((*shape, 0, 0, False), wgmma_stream_k_time_us(m, k, n, shape, sms)))
        options.append(((*shape, 1, 0, False), wgmma_time_us(m, k, n, shape, sms)))
        blocks = wgmma_blocks(m, n, shape)
        for splits in TAIL_SPLITS:
            options.append(((*shape, splits, blocks - blocks % sms, False),
                            wgmma_tail_time_us(m, k, n, shape, splits, sms)))
        for splits in SPLIT_SPLITS:
            options.append(((*shape, splits, 0, False), wgmma_split_time_us(m, k, n, shape, splits, sms)))
        own = dict(clusters) if isinstance(clusters, tuple) else {}
        for splits in CLUSTER_SPLITS if clusters else ():
            options.append(((*shape, splits, 0, True),
                            wgmma_cluster_time_us(m, k, n, shape, splits, sms, own.get(splits) if own else None)))
    return min(options, key=lambda o: o[1])


def best_wgmma_shape(m: int, k: int, n: int, sms: int = H100_SMS) -> tuple[tuple[int, int], float]:
    """The block shape with the least estimated time without K slices, and that time; ties go to the earlier shape
    in WGMMA_US_PER_CHUNK."""
    return min(((s, wgmma_time_us(m, k, n, s, sms)) for s in _shapes_for(m)), key=lambda st: st[1])


def dequant_cublas_time_us(m: int, k: int, n: int) -> float:
    """Estimated microseconds of the fallback: dequantize the weight to bf16, then x @ W.T in cuBLAS."""
    elems = n * k
    gemm = max(2 * elems / GEMM_BYTES_PER_S * 1e6, GEMM_FIXED_US + 2 * m * elems / GEMM_FLOP_PER_S * 1e6 + GEMM_US_PER_K * k)
    return DEQUANT_FIXED_US + 2.5 * elems / DEQUANT_BYTES_PER_S * 1e6 + gemm


def decode_mma_time_us(m: int, k: int, n: int) -> float:
    """Estimated microseconds of the decode kernel (csrc/awq_mma.cu) on x [m, k] and n output columns."""
    elems = n * k
    return DECODE_FIXED_US + max(-(-m // 16) * elems * 1e-6 * DECODE_US_PER_MWEIGHT_PER_16_ROWS,
                                 elems / 2 / DECODE_BYTES_PER_S * 1e6)
