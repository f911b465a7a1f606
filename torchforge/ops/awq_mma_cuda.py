"""Tensor-core W4A16 for decode batches in CUDA (csrc/awq_mma.cu, op `torchforge::awq_mma_cuda`).

Reads the weight in the mma layout (`torchforge.ops.awq_mma_layout`). Configuration, the dispatch check and the
op's fake (registered when the extension loads) live here; `torchforge.ops.awq_mma.awq_mma_linear` is the op
models call.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor

from torchforge.ops._check import check
from torchforge.ops.awq_wgmma_cost import (CLUSTER_SPLITS, H100_SMS, best_wgmma_config, decode_mma_time_us,
                                           dequant_cublas_time_us)

__all__ = ["MMA_CUDA_MAX_M", "mma_cuda_config", "mma_cuda_warps", "mma_cuda_prefetch", "mma_cuda_g32_splits",
           "mma_cuda_launch_config", "wgmma_g32_ready",
           "mma_tickets", "mma_cuda_ok", "launch_awq_mma_cuda",
           "mma_moe_cuda_ok", "mma_moe_sorts", "launch_awq_mma_moe_cuda", "WGMMA_MIN_ROWS", "WGMMA_MAX_M",
           "wgmma_cuda_config", "wgmma_cuda_ok", "wgmma_rows_ok", "launch_awq_wgmma_cuda", "register_fake",
           "moe_sorted_block_rows", "MOE_SORTED_BLOCK_ROWS", "MOE_WARPS", "WGMMA_MOE_MIN_ROWS_PER_EXPERT",
           "WGMMA_MOE_BLOCK128_MIN_ROWS_PER_EXPERT", "WGMMA_MOE_BLOCK_M", "MOE_WGMMA", "wgmma_moe_ok",
           "wgmma_moe_block_m", "moe_align_block_rows"]

# Rows of x the kernel takes: 16 per block along grid.x, each block re-reading its weight tile from L2. Up to 128
# rows, because on the DeepSeek-V3 shapes (BENCHMARKS.md, sixth session) the kernel beat the AWQ layout's Triton
# kernel by 15-20% at 96 rows and was within 5% of it at 128. That was before this session's ALU trims, which made
# it 7-15% faster. The mma layout's own fallback, dequantize + cuBLAS, ran 2-19% slower than that Triton kernel
# wherever both were measured (M >= 256).
MMA_CUDA_MAX_M = 128


def mma_cuda_config(m: int, k: int, n: int, group_size: int) -> tuple[int, int]:
    """(splits, item_chunks), from the H100 sweeps (`bench/w4a16_linear.py --mma-cuda-sweep`, 2026-11-22, DeepSeek-V3
    and hidden-4096 shapes, M = 1..64, BENCHMARKS.md): items of 128 k wherever the groups allow (64-k items lost
    up to 25% at 16 rows); no K slices once there are 96 or more tiles of 64 columns x 16 rows (a second slice
    gained at most 3% at M = 1 and lost 15-20% at M = 64), else 4 (small matrices: 24-64 tiles ran 20-30% faster
    with 4 slices than with 1, even where some warps get no item). 65-128 rows (MMA_CUDA_MAX_M) take the same rule
    without a sweep of their own: 1 slice, as at 64."""
    item_chunks = 2 if group_size % 128 == 0 else 1
    items = k // (64 * item_chunks)
    tiles = -(-m // 16) * (n // 64)
    return (1 if tiles >= 96 else max(1, min(4, items))), item_chunks


@functools.lru_cache(maxsize=None)
def _sm_count(index: Optional[int]) -> int:
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).multi_processor_count


def mma_cuda_warps(blocks: int, sms: int) -> int:
    """Warps per block of the dense CUDA kernel for a grid of `blocks` (row blocks x column blocks x K slices) on a
    device with `sms` SMs. Blocks of 8 warps fit 2 per SM, of 4 warps 4 per SM (<= 128 registers). Where a few 8-warp
    blocks would be left for a second wave, each latency bound on its own (a warp has one item of words in flight),
    4-warp blocks all start at once instead. H100, bf16 x, CUDA-graph ms, 8 against 4 warps (BENCHMARKS.md, ninth
    session):
    - 18432x7168, 288 blocks (up to 16 rows): 0.031 / 0.028 at M = 1, 0.037 / 0.036 at M = 16;
    - 7168x7168, 336 blocks (M = 48): 0.032 / 0.032;
    - 16896x7168, 264 blocks (one full wave of 8-warp blocks): 0.023 / 0.025 at M = 1;
    - 7168x7168, 448 blocks (M = 64): 0.038 / 0.039; 18432x7168, 576 blocks (M = 32): 0.051 / 0.060;
    - 7168x7168, 112 blocks (M <= 16): 0.014 / 0.019 at M = 1."""
    return 4 if 2 * sms < blocks <= 3 * sms else 8


def mma_cuda_prefetch(blocks: int, sms: int, warps: int, item_chunks: int, splits: int) -> bool:
    """Whether the dense CUDA kernel runs its prefetching loop (the next item's loads in flight while a warp computes
    this one; 255 registers, so 8 warps per SM): where the grid is one block of 8 warps per SM at most anyway and
    each block walks the whole K, which leaves every warp latency bound on its own loads. H100, kept tickets,
    CUDA-graph us, prefetch against the best other configuration (BENCHMARKS.md, thirteenth session):
    - 7168x7168 (112 blocks): 12.5-12.6 against 13.3 at M = 1 and 8 (at M = 16, 15.0-15.2 against 14.9 in 2 plain K
      slices: within noise; 16.9 with one);
    - 6144x1536 (96 blocks): 3.6-3.7 against 4.0-4.4 at M = 1 and 8, 4.7-4.8 against 5.3-5.7 at M = 16.
    Where it lost: with more blocks than SMs (18432x7168 30.7 against 27.8 at M = 1; 7168x7168 at 32 rows 23.3
    against 20.6), and within noise or up to 0.4 us slower with 4 K slices (1536x4096, 2048x7168).
    Also tried (nineteenth session) and dropped: each warp's words, scales and zeros through its own ring of 2-8
    shared-memory stages filled by bulk copies. It was 0.5-5 us slower than this dispatch on every shape and M = 1-16
    with the weights rotated out of L2 (7168x7168 at M = 1: 13.6 against 12.5 us).
    And (twenty-fourth session) each warp asking L2 for its own words 1, 2 or 3 items ahead (prefetch.global.L2, one
    line per lane, in both loops): slower at every ahead and M tried, 1-20% (18432x7168 at M = 16: 33.1 us without,
    36.9 / 39.6 / 38.5 with), and the instructions alone, turned off at run time, cost 1 us at M = 1 there."""
    return item_chunks == 2 and warps == 8 and splits == 1 and blocks <= sms


def mma_cuda_g32_splits(tiles: int, items: int, sms: int) -> int:
    """K slices of the dense CUDA kernel with groups of 32 (8-warp blocks, items of one chunk): the fewest, up to 4,
    whose grid fills at least 0.8 of its last wave of 8-warp blocks (2 per SM), else the fullest. Each register is
    dequantized there (item_dq), a longer chain per item than the magic form's; ncu at one row on 18432x7168 (288
    4-warp blocks, the group-128 rule): 8.7 warps per SM, no warp eligible in 54% of the cycles, issue slots 36% busy,
    DRAM 44%: latency bound. H100, CUDA-graph us, fp16 scales, bf16 x (BENCHMARKS.md, thirty-second session):
    18432x7168 3 slices 37.2 against 41.0 (1 slice of 4 warps) at one row, 41.6 against 41.8 at 16; 7168x7168 2
    slices 16.0 against 17.8 at one row, 18.0 against 19.9 at 16 (3 slices, 1.27 waves: 19.6)."""
    if tiles <= 0:  # no rows: the op returns the empty output
        return 1
    best, best_fill = 1, 0.0
    for splits in range(1, max(1, min(4, items)) + 1):
        waves = tiles * splits / (2 * sms)
        fill = waves / math.ceil(waves)
        if fill >= 0.8:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
    return best


def mma_cuda_launch_config(m: int, k: int, n: int, group_size: int, sms: int) -> tuple[int, int, int, bool]:
    """(splits, item_chunks, warps, prefetch) of the dense CUDA kernel for x [m, k] and n output columns on `sms` SMs:
    groups of 32 take mma_cuda_g32_splits and 8-warp blocks; others mma_cuda_config, mma_cuda_warps and
    mma_cuda_prefetch, except where there are at least 48 items and
    - mma_cuda_warps takes 4-warp blocks (more than 2 and at most 3 tiles per SM): 3 K slices, still 4-warp blocks
      (at one row only where the 3-slice grid fits in two rounds of blocks, 3 x tiles <= 8 x SMs; else 1 slice);
    - at 9-16 rows mma_cuda_prefetch would take the prefetching loop (one block per SM): 2 plain K slices.
    The items of 16 rows (two 8-row MMA tiles) cost twice the tensor work of 8 rows, and 2-3 4-warp blocks leave
    about 9 warps per SM to hide it; with 3 K slices each SM holds 16 (the rest run in a second wave). H100, kept
    tickets (thirteenth session): 18432x7168 at 12 and 16 rows 32.8-33.0 us against 35.6-35.7; at 1 row 28.1 against
    27.8, within noise. The H200 (thirty-fifth session, same kernels: its HBM3e reads 1.4x faster at the same latency,
    so a grid needs more loads in flight) took 3 slices at 1 row too: 23.1 against 25.3 us; and 2 plain slices on
    7168x7168 at 16 rows: 13.8 against the prefetching loop's 14.7 (H100: 14.9 against 15.0-15.2). With 8-warp grids
    slices lost on the H100: 16384x7168 27.0 against 24.9, 12288x7168 22.8 against 22.2, 14336x4096 16.7 against 14.3
    (2 slices, the best with slices); with few items the prefetching loop won at 16 rows (6144x1536: 4.7-4.8 against
    5.3-5.7).
    One row past 8/3 tiles per SM (forty-second session, H200, symmetric codes, two runs each within 0.1 us): the
    3-slice grid of 4-warp blocks needs a third round of blocks, and one slice is faster. 24576x7168 (384 tiles) 24.3
    against 28.8 us (zeros read 25.2 against 29.1), where 18432x7168 (288 tiles, two rounds) keeps 3 slices: 22.5
    against 22.3 in one, 22.6 against 23.9 zeros read. 2-16 rows were not swept, so they keep 3 slices."""
    tiles = -(-m // 16) * (n // 64)
    if group_size == 32:
        return mma_cuda_g32_splits(tiles, k // 64, sms), 1, 8, False
    splits, item_chunks = mma_cuda_config(m, k, n, group_size)
    warps = mma_cuda_warps(tiles * splits, sms)
    prefetch = mma_cuda_prefetch(tiles * splits, sms, warps, item_chunks, splits)
    if splits == 1 and m <= 16 and k // (64 * item_chunks) >= 48:
        if warps == 4:
            return (1 if m == 1 and 3 * tiles > 8 * sms else 3), item_chunks, 4, False
        if prefetch and m > 8:
            return 2, item_chunks, 8, False
    return splits, item_chunks, warps, prefetch


_MAX_X_NUMEL = 1 << 34  # ops.cpp: the kernels address x in 32-bit uint4 offsets


def _dense_shape_ok(numel: int, k: int, n: int) -> bool:
    """ops.cpp check_mma_dense's size limits (x smaller than 2^34 elements, K < 2^30, N < 2^22: grid dimension y is
    N / 64); a call past them raises there instead of taking the fallback."""
    return numel < _MAX_X_NUMEL and k < (1 << 30) and n < (1 << 22)


def _aligned16(*tensors: Tensor) -> bool:
    """Whether each tensor starts 16 bytes into an allocation's multiple (the kernels' vector loads and bulk copies).
    Storage offsets, not data_ptr(): the body of a triton_op is traced with functional / fake tensors under
    torch.compile, which have no data pointer (a storage's base is allocator-aligned)."""
    return all(t.storage_offset() * t.element_size() % 16 == 0 for t in tensors)


def _packed_rows(x2: Tensor) -> Tensor:
    """x2 [M, K] as the kernels read it: packed rows starting 16 bytes into an allocation's multiple. A copy where it
    is not; clone, not contiguous(), which returns a contiguous but misaligned view (a slice of a flat buffer) as is."""
    if x2.stride(-1) == 1 and x2.stride(0) == x2.shape[-1] and _aligned16(x2):
        return x2
    return x2.clone(memory_format=torch.contiguous_format)


def _scales_ok(x: Tensor, scales: Tensor) -> bool:
    # csrc/awq_mma.cuh dispatch_dtypes: fp16 scales (AWQ checkpoints), or bf16 ones with bf16 x (model.to(bf16))
    return scales.dtype == torch.float16 or scales.dtype == x.dtype == torch.bfloat16


def mma_cuda_ok(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                bias: Optional[Tensor]) -> bool:
    """Whether the CUDA kernel takes this call (else the caller converts to AWQ and uses `w4a16_linear`)."""
    if x.dim() == 0 or x.shape[-1] == 0 or qweight_mma.shape[0] == 0:
        return False
    m = x.numel() // x.shape[-1]
    # groups of 32: the kernel dequantizes every register instead (csrc/awq_mma.cuh, item_dq), zero words read as
    # 16-byte vectors
    return (1 <= m <= MMA_CUDA_MAX_M and (group_size % 64 == 0 or (group_size == 32 and _aligned16(qzeros)))
            and _dense_ok(x, qweight_mma, scales, qzeros, group_size, bias))


def _dense_ok(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
              bias: Optional[Tensor]) -> bool:
    from torchforge.ops._ext import has_cuda_ext

    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)  # (the group size: the callers)
            and _dense_shape_ok(x.numel(), x.shape[-1], qweight_mma.shape[0] * 64)
            and has_cuda_ext() and hasattr(torch.ops.torchforge, "awq_mma_cuda")
            and _scales_ok(x, scales)
            and all(t.is_contiguous() and t.device == x.device for t in (qweight_mma, scales, qzeros))
            and _aligned16(qweight_mma)
            and (bias is None or (bias.dtype == x.dtype and bias.device == x.device)))


def mma_tickets(n: int, device=None) -> Tensor:
    """A zeroed ticket buffer for `launch_awq_mma_cuda` on N = `n` output columns (any M it takes). The K slices of a
    tile meet on its ticket and the last one resets it, so the buffer stays zero and can be kept (a module's buffer):
    a fresh one per call costs a memset kernel, which the decode step of a hidden-4096 model paid 56 times."""
    return torch.zeros(-(-MMA_CUDA_MAX_M // 16) * (n // 64), dtype=torch.int32, device=device)


def launch_awq_mma_cuda(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                        bias: Optional[Tensor] = None, *, splits: Optional[int] = None,
                        item_chunks: Optional[int] = None, tickets: Optional[Tensor] = None,
                        warps: Optional[int] = None, prefetch: Optional[bool] = None,
                        perm: Optional[Tensor] = None, symmetric: bool = False) -> Tensor:
    """`x [..., K] @ dequant(W).T (+ bias)` in x.dtype, W in the mma layout `[N / 64, K * 8]`. `tickets`: see
    `mma_tickets` (None: the op allocates zeroed ones). `warps` per block: 4 or 8; `prefetch`: the kernel's
    software-pipelined loop (items of 128 k only; same bits). None: from mma_cuda_launch_config where the caller gives
    none of splits, item_chunks and warps, else from mma_cuda_config, mma_cuda_warps and mma_cuda_prefetch.
    `perm` (int32 [K]): the op computes with x[..., perm] (an act-order layer's rows sorted by group), gathered by a
    kernel of its own right before the decode kernel. `symmetric`: every zero point is 8, so the kernel does not read
    qzeros (torchforge.ops.zero_points)."""
    k = x.shape[-1]
    n = qweight_mma.shape[0] * 64
    x2 = x.reshape(-1, k)
    x2 = _packed_rows(x2)
    sms = _sm_count(x2.device.index)
    if splits is None and item_chunks is None and warps is None:
        splits, item_chunks, warps, pf = mma_cuda_launch_config(x2.shape[0], k, n, group_size, sms)
    else:  # a caller's own grid: the plain rules fill in the rest (not the 3-slice case, which is tied to 4 warps)
        s, c = mma_cuda_config(x2.shape[0], k, n, group_size)
        splits, item_chunks = splits or s, item_chunks or c
        blocks = -(-x2.shape[0] // 16) * (n // 64) * splits
        warps = warps or mma_cuda_warps(blocks, sms)
        pf = mma_cuda_prefetch(blocks, sms, warps, item_chunks, splits)
    prefetch = pf if prefetch is None else prefetch
    out = torch.ops.torchforge.awq_mma_cuda(x2, qweight_mma, scales, qzeros, group_size, bias, splits,
                                            item_chunks, tickets, warps, prefetch, perm, symmetric)
    return out.reshape(*x.shape[:-1], n)


# ------------------------------------------------------------------ prefill on Hopper: csrc/awq_wgmma.cu
# Rows of x the warpgroup-MMA kernel may take (sm_90 devices), all in its warp-specialized (WS) form: which block
# shape, and whether to run it at all rather than the decode kernel (up to 128 rows) or dequantize + cuBLAS (from 129),
# comes from the time model in awq_wgmma_cost, fitted on H100 sweeps of five matrix shapes (eleventh session).
# Below WGMMA_MIN_ROWS the decode kernel is bound by the weight reads and a 64-row wgmma block would waste half its
# tensor work or more (18432x7168 at 32 rows: 0.051 ms against 0.077). Past WGMMA_MAX_M dequantize + cuBLAS: cuBLAS
# reaches about 70% of the tensor peak at large M, this kernel 55%. What the model changed (ms, eleventh session):
# - 18432x7168 at 56-64 rows: (64, 2) blocks, 0.078 against 0.086 for the decode kernel (whose time steps up every
#   16 rows, where the wgmma kernel dequantizes each weight once per block of 64 or 128 rows).
# - 14336x4096: (128, 2) blocks from 129 rows (0.059 against 0.078 for the one-warpgroup (256, 1) of the row rule
#   before; since the twenty-sixth session the two-warpgroup (192, 1) and (256, 1), see below).
# - 4096-column matrices up to 256 rows: dequantize + cuBLAS (4096x4096 at 256 rows: 0.034 against 0.041).
# - A last round of few blocks in K slices (dp_tiles): 18432x7168 at 256 rows 0.148 against 0.196.
# - Every tile in K slices at 56-128 rows (twelfth session): 18432x7168 at 64 rows 0.068 against 0.077; 7168x7168 and
#   14336x4096 at 64 rows 0.032 / 0.033 against the decode kernel's 0.038 / 0.041.
# - (256, 1) blocks with two warpgroups sharing the x tile (twenty-sixth session) take most of 256-512 rows: 7168x7168
#   at 256 rows in 2 K slices 0.056 against 0.074, 18432x7168 at 512 rows 0.232 against 0.258. (192, 1), the same
#   block on 192 rows, takes 129-192 rows and some 384s: 18432x7168 at 192 rows 0.108 against 0.124, 7168x7168 at 384
#   0.081 against 0.090, 4096x4096 at 129-192 0.027-0.028 against dequantize + cuBLAS's 0.031-0.033.
# - Every tile in 2 K slices at 257-512 rows where they fit in one round (twenty-seventh session): 4096x14336 and
#   4096x12288 at 320-512 rows 0.077-0.109 against stream-K's 0.085-0.122; 4096x4096 at 384 rows 0.034 against
#   dequantize + cuBLAS's 0.037, but at 512 0.041 against its 0.039 (the model has cuBLAS at 0.046 there).
# - Every tile's K slices as one thread block cluster, the slices adding their sums in distributed shared memory
#   (thirty-third session): 7168x7168 at 48-256 rows 1.1-1.46x faster (0.026 ms at 64 rows against 0.032, 0.033 at 128
#   against 0.045, 0.033 at 72 against the decode kernel's 0.048); 14336x4096 at 48-128 rows 1.14-1.23x, 4096x14336
#   at 64-128 1.16-1.50x, 4096x4096 at 128-512 1.07-1.35x. The slots come from the device (op awq_wgmma_cluster_slots).
WGMMA_MIN_ROWS = 32
WGMMA_MAX_M = 512
_WGMMA_SHAPES = ((64, 4), (64, 2), (128, 2), (192, 1), (256, 1))  # (rows of x per block, column tiles per warp)


@functools.lru_cache(maxsize=None)
def _device_cluster_slots(device_index: int) -> tuple:
    """((splits, clusters the device runs at once), ...) for the time model's slice counts, from the extension (op
    awq_wgmma_cluster_slots: the GPC layout decides, e.g. 30 clusters of 4 on the H100 SXM); () where it has no such
    op (built before clusters existed)."""
    op = getattr(torch.ops.torchforge, "awq_wgmma_cluster_slots", None)
    if op is None:
        return ()
    with torch.cuda.device(device_index):  # (the same for every block shape: one block per SM)
        return tuple((s, int(op(64, 2, s))) for s in CLUSTER_SPLITS)


def _clusters_ok(device_index: Optional[int] = None):
    """What the time model may assume of clusters (awq_wgmma_cost.best_wgmma_config's `clusters`): the device's own
    cluster slots where the extension is loaded; without it no kernel runs, and the choices are the H100's (the tests
    on CPU pin those)."""
    from torchforge.ops._ext import has_cuda_ext

    if not has_cuda_ext():
        return True
    index = torch.cuda.current_device() if device_index is None else device_index
    return _device_cluster_slots(index)


def wgmma_cuda_config(m: int, k: int, n: int, sms: int = H100_SMS,
                      device_index: Optional[int] = None) -> tuple[int, int, int, int, bool, int, bool]:
    """(block_m, tile_set, splits, group_m, producer_warp, dp_tiles, cluster) for x [m, k] and n output columns on
    `sms` SMs: what the time model (awq_wgmma_cost) finds fastest, warp-specialized: whole tiles, the tiles of a last,
    nearly empty round of blocks in K slices (dp_tiles > 0), every tile in K slices (dp_tiles = 0; up to 256 rows, up to
    512 in one round of blocks), each tile's K slices as one cluster (cluster True), or stream-K (splits 0)."""
    (block_m, tile_set, splits, dp_tiles, cluster), _ = best_wgmma_config(int(m), int(k), int(n), sms,
                                                                          _clusters_ok(device_index))
    return block_m, tile_set, splits, 8, True, dp_tiles, cluster


def wgmma_rows_ok(m: int, k: int, n: int, sms: int = H100_SMS, device_index: Optional[int] = None) -> bool:
    """Whether x [m, k] with n output columns goes to the wgmma kernel: WGMMA_MIN_ROWS..WGMMA_MAX_M rows, where the
    time model has it faster than the decode kernel (up to MMA_CUDA_MAX_M rows) or dequantize + cuBLAS."""
    # Dynamic shapes (SymInts under torch.compile: the rows of x, or the weight's size where one compiled function
    # meets several) specialize here: the kernel's block shape and K slices depend on their exact values, and the time
    # model's arithmetic (divmod, min over floats) wants plain ints.
    if not WGMMA_MIN_ROWS <= m <= WGMMA_MAX_M:  # two guards on a SymInt: rows outside the range stay dynamic
        return False
    m, k, n = int(m), int(k), int(n)
    other = decode_mma_time_us(m, k, n) if m <= MMA_CUDA_MAX_M else dequant_cublas_time_us(m, k, n)
    return best_wgmma_config(m, k, n, sms, _clusters_ok(device_index))[1] < other


@functools.lru_cache(maxsize=None)
def wgmma_g32_ready(dtype: torch.dtype, scale_dtype: torch.dtype, grouped: bool, device_index: int) -> bool:
    """Whether the Hopper kernels run groups of 32 on this device for these dtypes (dense or grouped). Their only
    instances are warp-specialized, whose producer hands registers on to the consumers with setmaxnreg: that needs the
    kernel to start with enough of them (168 registers a thread today, ptxas' choice). A build that falls short would
    make the op raise, so the dispatch asks the extension (op awq_wgmma_g32_ready) once and takes another kernel there
    instead: the decode kernel or dequantize + cuBLAS (MoE: the grouped mma.sync kernel). The extension answers false
    on a device other than sm_90 (the kernels are built for sm_90a only)."""
    op = getattr(torch.ops.torchforge, "awq_wgmma_g32_ready", None)
    if op is None:  # an extension built before the op existed: the other kernels, slower but sure to run
        return False
    with torch.cuda.device(device_index):
        return bool(op(dtype, scale_dtype, grouped))


def _g32_ready(x: Tensor, scales: Tensor, group_size: int, grouped: bool) -> bool:
    if group_size != 32:
        return True
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return wgmma_g32_ready(x.dtype, scales.dtype, grouped, index)


def wgmma_cuda_ok(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                  bias: Optional[Tensor]) -> bool:
    """Whether the Hopper kernel takes this call: the decode kernel's conditions, an sm_90 device, and the rows and
    shape wgmma_rows_ok takes."""
    from torchforge.ops._ext import has_cuda_ext

    # has_cuda_ext() first: it loads the extension, which registers the op
    if not (x.is_cuda and x.dim() > 0 and x.shape[-1] > 0 and has_cuda_ext()
            and hasattr(torch.ops.torchforge, "awq_wgmma_cuda")):
        return False
    return (torch.cuda.get_device_capability(x.device) == (9, 0)
            and (group_size % 64 == 0 or group_size == 32)  # (before wgmma_rows_ok, which pins a traced row count)
            and wgmma_rows_ok(x.numel() // x.shape[-1], x.shape[-1], qweight_mma.shape[0] * 64,
                              _sm_count(x.device.index), x.device.index)
            and (x.shape[-1] // 64) * (group_size // 64) < 2 ** 32  # ops.cpp: the kernel's group by high multiply
            and _dense_ok(x, qweight_mma, scales, qzeros, group_size, bias)
            and _aligned16(scales, qzeros)  # bulk copies
            and _g32_ready(x, scales, group_size, grouped=False))


def launch_awq_wgmma_cuda(x: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor, group_size: int,
                          bias: Optional[Tensor] = None, *,
                          config: Optional[tuple] = None, tickets: Optional[Tensor] = None,
                          perm: Optional[Tensor] = None) -> Tensor:
    """`x [..., K] @ dequant(W).T (+ bias)` in x.dtype on Hopper, W in the mma layout `[N / 64, K * 8]`; config =
    (block_m, tile_set, splits, group_m, producer_warp[, dp_tiles[, cluster]]), else wgmma_cuda_config. dp_tiles > 0:
    tiles [0, dp_tiles) run whole, only the rest in `splits` K slices (a last round of few tiles; their blocks first).
    cluster (dp_tiles 0, splits 2..8): each tile's K slices run as one thread block cluster and meet in distributed
    shared memory instead of fp32 partials in global memory (the same bits).
    splits 0 (producer_warp): stream-K, dp_tiles blocks (0: one per SM) sharing the tiles' pairs of chunks evenly
    (whole tiles where K / 64 is odd).
    `tickets`: a kept zeroed buffer (`mma_tickets`; None: the op allocates one per call with K slices). `perm` (int32
    [K]): the x image holds x[..., perm] (an act-order layer's rows sorted by group)."""
    k = x.shape[-1]
    n = qweight_mma.shape[0] * 64
    x2 = x.reshape(-1, k)
    x2 = _packed_rows(x2)
    if config is None:
        config = wgmma_cuda_config(x2.shape[0], k, n, _sm_count(x2.device.index), x2.device.index)
    block_m, tile_set, splits, group_m, ws, *rest = config
    dp, cluster = (rest + [0, False])[:2]
    args = (x2, qweight_mma, scales, qzeros, group_size, bias, splits, block_m, tile_set, group_m, ws, dp,
            tickets if splits != 1 else None, perm)
    op = torch.ops.torchforge.awq_wgmma_cuda
    out = op(*args, cluster=True) if cluster else op(*args)  # (an extension from before clusters has no such argument)
    return out.reshape(*x.shape[:-1], n)


def mma_moe_cuda_ok(x: Tensor, qweight_mma: Tensor, scales: Tensor, group_size: int,
                    shared: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> bool:
    """Whether the grouped CUDA kernel takes this MoE call (with `shared`: one more expert's tensors)."""
    from torchforge.ops._ext import has_cuda_ext

    # x.shape[-1] > 0: with K = 0 the launcher's K-slice rule has no items, which ops.cpp rejects (the reference
    # returns the empty sums)
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and (group_size % 64 == 0 or group_size == 32)
            and has_cuda_ext() and x.dim() > 0 and x.shape[-1] > 0 and x.shape[-1] % 64 == 0
            and x.numel() < _MAX_X_NUMEL and hasattr(torch.ops.torchforge, "awq_mma_moe_cuda") and _scales_ok(x, scales)
            and qweight_mma.device == x.device and _aligned16(qweight_mma)
            and (shared is None or (all(t.is_contiguous() for t in shared) and _aligned16(shared[0]))))


# Rows per block when the routed rows are sorted by expert (more rows than experts). H100, one DeepSeek-V3 layer (256
# experts, top-8), `bench/moe_w4a16.py --mma-block-rows 8,16`, CUDA-graph ms (BENCHMARKS.md, ninth session):
#   tokens        64     128    256    512
#   8 rows       2.063  2.428  2.766  4.224
#   16 rows      2.451  2.750  3.026  3.895
# Blocks of 8 (one MMA tile) halve the MMA work of blocks holding a few rows; past about 8 routed rows per expert the
# second tile is mostly full and blocks of 16 dequantize each expert's weight half as often.
# MOE_SORTED_BLOCK_ROWS, when set, overrides the rule (benchmarks, tests).
MOE_SORTED_BLOCK_ROWS: Optional[int] = None
# Warps per block of the grouped kernel: 4. Its grids run many waves of blocks of unequal work (experts hit by
# more or fewer rows, empty padding blocks), which finer blocks balance better. H100, one DeepSeek-V3 layer, CUDA-graph
# ms, 4 against 8 warps (BENCHMARKS.md, ninth session): 0.075 / 0.075 at 1 token, 0.472 / 0.479 at 8, 0.905 / 0.928 at
# 16, 2.019 / 2.064 at 64, 3.708 / 3.885 at 512. The op's own default is 4 too. Set MOE_WARPS to override (benchmarks,
# tests).
MOE_WARPS: Optional[int] = None
# K slices of the grouped kernel: set MOE_SPLITS to override the rule below (benchmarks); clamped to the K items.
MOE_SPLITS: Optional[int] = None


def moe_sorted_block_rows(rows: int, num_experts: int) -> int:
    """Rows per sorted block for `rows` routed rows over `num_experts` experts."""
    if MOE_SORTED_BLOCK_ROWS is not None:
        return MOE_SORTED_BLOCK_ROWS
    return 8 if rows <= 8 * num_experts else 16


# Prefill with many routed rows per expert: the grouped wgmma kernel (csrc/awq_wgmma.cu, GROUPED), which decodes each
# weight once per block of 64 or 128 sorted rows instead of once per 8 or 16. The grouped mma.sync kernel's time grows
# with the rows, and it fell behind HF's bf16 grouped_mm from about 64 routed rows per expert.
# Where each takes over: H100, one DeepSeek-V3 MoE layer (7168x2048 experts, top-8), CUDA-graph ms of the experts
# forward, `bench/moe_w4a16.py --wgmma-sweep` (BENCHMARKS.md, twentieth session):
#   experts  rows per expert   HF bf16   mma.sync   wgmma 64   wgmma 128
#   256      16                 8.73      3.57       4.15       5.54
#   256      24                 9.18      4.89       4.26       5.69
#   256      48                10.28      8.97       4.84       6.15
#   256      64                10.99     12.01       6.80       6.63
#   256      128               16.56     23.17      11.30      10.03
#   256      256               23.07     46.86      20.45      17.43
#   32       16                 1.20      0.465      0.530      0.707
#   32       32                 1.26      0.717      0.559      0.743
#   32       64                 1.41      1.248      0.834      0.825
#   32       512                4.99      9.94       4.67       3.87
#   32       1024               9.47     21.27       9.43       7.54
# WGMMA_MOE_MIN_ROWS_PER_EXPERT: the average routed rows per expert from which the wgmma kernel runs (sm_90 only):
# between the last point mma.sync won (16) and the first it lost (24). From WGMMA_MOE_BLOCK128_MIN_ROWS_PER_EXPERT it
# runs on blocks of 128 rows (each weight decoded half as often again); at 48 rows blocks of 64 were 21% faster, at 64
# the two were within 3%, and from 128 blocks of 128 won by 11-20%.
# MOE_WGMMA, when set, forces the kernel on (True) or off (False) wherever it can run; WGMMA_MOE_BLOCK_M, when set (64
# or 128), forces its block (benchmarks, tests).
WGMMA_MOE_MIN_ROWS_PER_EXPERT = 20
WGMMA_MOE_BLOCK128_MIN_ROWS_PER_EXPERT = 64
WGMMA_MOE_BLOCK_M: Optional[int] = None
MOE_WGMMA: Optional[bool] = None


def wgmma_moe_ok(x: Tensor, rows: int, num_experts: int, scales: Tensor, qzeros: Tensor, group_size: int,
                 shared: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> bool:
    """Whether the grouped wgmma kernel takes a sorted grouped call of `rows` routed rows over `num_experts` experts
    (the shared one included), on top of mma_moe_cuda_ok's conditions."""
    from torchforge.ops._ext import has_cuda_ext

    if MOE_WGMMA is False or not (x.is_cuda and has_cuda_ext() and hasattr(torch.ops.torchforge, "awq_wgmma_moe_cuda")
                                  and torch.cuda.get_device_capability(x.device) == (9, 0)):
        return False
    # comparisons only: under torch.compile `rows` may be a SymInt, which int() would pin to one token count (a
    # recompile per prefill length); a comparison is a guard with two outcomes
    busy = MOE_WGMMA is True or rows >= WGMMA_MOE_MIN_ROWS_PER_EXPERT * num_experts
    return (busy and mma_moe_sorts(rows, num_experts) and (group_size % 64 == 0 or group_size == 32)
            and (x.shape[-1] // 64) * (group_size // 64) < 2 ** 32 and _aligned16(scales, qzeros)
            and (shared is None or _aligned16(*shared)) and _g32_ready(x, scales, group_size, grouped=True))


def wgmma_moe_block_m(rows: int, num_experts: int) -> int:
    """Rows per sorted block of the grouped wgmma kernel for `rows` routed rows over `num_experts` experts: 64 or 128
    (a comparison only: `rows` may be a SymInt)."""
    if WGMMA_MOE_BLOCK_M is not None:
        return WGMMA_MOE_BLOCK_M
    return 128 if rows >= WGMMA_MOE_BLOCK128_MIN_ROWS_PER_EXPERT * num_experts else 64


def moe_align_block_rows(x: Tensor, rows: int, num_experts: int, scales: Tensor, qzeros: Tensor, group_size: int,
                         shared: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> int:
    """Rows per moe_align block of a sorted grouped call: wgmma_moe_block_m where the wgmma kernel takes it, else
    moe_sorted_block_rows."""
    if wgmma_moe_ok(x, rows, num_experts, scales, qzeros, group_size, shared):
        return wgmma_moe_block_m(rows, num_experts)
    return moe_sorted_block_rows(rows, num_experts)


def mma_moe_sorts(rows: int, num_experts: int) -> bool:
    """Whether the grouped kernel sorts `rows` routed rows over `num_experts` experts (the shared one included) into
    blocks of moe_sorted_block_rows (moe_align); at most one row per expert (decode), each row is a block."""
    return rows > num_experts


def launch_awq_mma_moe_cuda(x: Tensor, expert_ids: Tensor, qweight_mma: Tensor, scales: Tensor, qzeros: Tensor,
                            group_size: int, x_row_div: int, shared: Optional[tuple[Tensor, Tensor, Tensor]] = None,
                            alignment: Optional[tuple[Tensor, Tensor]] = None, symmetric: bool = False) -> Tensor:
    """fp32 sums `[splits, R, N]` of routed row r = `x[r // x_row_div] @ W[expert_ids[r]].T`, W in the mma layout
    `[E, N / 64, K * 8]`. While there are no more routed rows than experts (decode) each row is a block of its own;
    beyond, rows are sorted by expert on the device into blocks of moe_align_block_rows (moe_align): 8 or 16 for the
    grouped mma.sync kernel, or 64 or 128 (wgmma_moe_block_m) where the grouped wgmma kernel takes the call (many rows
    per expert, sm_90; its result has one K slice). No host sync either way.
    `shared`: (qweight, scales, qzeros) of one more expert, id E, kept apart from the stacked ones.
    `alignment`: moe_align's (sorted_rows, block_expert) for these ids, `num_experts` (the shared one included) and
    moe_align_block_rows, computed once by the caller for both of a layer's grouped calls (awq_mma_moe_experts).
    Used only where the rows are sorted. Not checked here: an alignment of other ids reads wrong rows.
    `symmetric`: every zero point (the shared expert's too) is 8: the mma.sync kernel does not read qzeros."""
    from torchforge.ops.moe_align import moe_align

    num_experts, nb, k8 = qweight_mma.shape
    num_experts += int(shared is not None)  # an int: SymInt + bool trips sympy on torch 2.11 (opcheck, dynamic)
    k, n, rows = k8 // 8, nb * 64, expert_ids.numel()
    sorts = mma_moe_sorts(rows, num_experts)
    wgmma = sorts and wgmma_moe_ok(x, rows, num_experts, scales, qzeros, group_size, shared)
    block = wgmma_moe_block_m(rows, num_experts) if wgmma else moe_sorted_block_rows(rows, num_experts)
    if not sorts:  # decode: one routed row per block, no sort kernels in the step
        sorted_rows = torch.empty(0, dtype=torch.int32, device=x.device)
        block_expert = expert_ids.reshape(-1).to(torch.int32)
    elif alignment is not None:
        sorted_rows, block_expert = alignment
    else:
        sorted_rows, block_expert = moe_align(expert_ids, num_experts, block)
    x2 = _packed_rows(x)
    if wgmma:  # ops.cpp checks that sorted_rows holds `block` rows per block_expert entry
        return torch.ops.torchforge.awq_wgmma_moe_cuda(
            x2, qweight_mma.contiguous(), scales.contiguous(), qzeros.contiguous(), sorted_rows, block_expert, rows,
            x_row_div, group_size, block, 2, *(shared or (None, None, None)), True)
    # K slices by the dense kernel's rule, on the (upper bound of the) number of row blocks
    item_chunks = 2 if group_size % 128 == 0 else 1
    if group_size == 32:  # the kernel reads their zero words as 16-byte vectors (a copy only where not aligned)
        qzeros = qzeros if _aligned16(qzeros) else qzeros.clone()
        if shared is not None and not _aligned16(shared[2]):
            shared = (shared[0], shared[1], shared[2].clone())
    tiles = block_expert.numel() * (n // 64)
    splits = 1 if tiles >= 96 else max(1, min(4, k // (64 * item_chunks)))
    if MOE_SPLITS is not None:
        splits = max(1, min(MOE_SPLITS, k // (64 * item_chunks)))
    warps = MOE_WARPS or 4
    return torch.ops.torchforge.awq_mma_moe_cuda(x2, qweight_mma.contiguous(), scales.contiguous(), qzeros.contiguous(),
                                                 sorted_rows, block_expert, rows, x_row_div, group_size, splits,
                                                 item_chunks, *(shared or (None, None, None)), warps, symmetric)


_registered = False


def register_fake() -> None:
    """Shape function of torchforge::awq_mma_cuda (defined in C++ without one), once the extension is loaded."""
    global _registered
    if _registered or not hasattr(torch.ops.torchforge, "awq_mma_cuda"):
        return

    @torch.library.register_fake("torchforge::awq_mma_cuda")
    def _(x, qweight, scales, qzeros, group_size, bias, splits, item_chunks, tickets=None, warps=8, prefetch=False,
          perm=None, symmetric=False):
        check(warps in (4, 8), lambda: f"awq_mma_cuda: warps must be 4 or 8, got {warps}")
        check(not prefetch or item_chunks == 2,
              lambda: f"awq_mma_cuda: prefetch needs item_chunks = 2 (items of 128 k), got {item_chunks}")
        check(x.dim() == 2 and qweight.dim() == 2,
              lambda: f"awq_mma_cuda: x and qweight must be 2-D, got {tuple(x.shape)} and {tuple(qweight.shape)}")
        check(qweight.shape[1] == x.shape[1] * 8,
              lambda: f"awq_mma_cuda: qweight must be [N / 64, K * 8] with K = {x.shape[1]}, got "
                      f"{tuple(qweight.shape)}")
        check(x.dtype in (torch.float16, torch.bfloat16),
              lambda: f"awq_mma_cuda: x must be float16 or bfloat16, got {x.dtype}")
        return x.new_empty((x.shape[0], qweight.shape[0] * 64))

    if hasattr(torch.ops.torchforge, "awq_wgmma_cuda"):
        @torch.library.register_fake("torchforge::awq_wgmma_cuda")
        def _(x, qweight, scales, qzeros, group_size, bias, splits, block_m, tile_set, group_m, producer_warp=False,
              dp_tiles=0, tickets=None, perm=None, cluster=False):
            check(not cluster or (2 <= splits <= 8 and dp_tiles == 0 and producer_warp),
                  lambda: f"awq_wgmma_cuda: cluster=True runs every tile in 2..8 K slices (got splits = {splits}, "
                          f"dp_tiles = {dp_tiles}) on the warp-specialized kernel (producer_warp=True)")
            check(x.dim() == 2 and qweight.dim() == 2 and qweight.shape[1] == x.shape[1] * 8,
                  lambda: f"awq_wgmma_cuda: x must be [M, K] and qweight [N / 64, K * 8], got "
                          f"{tuple(x.shape)} and {tuple(qweight.shape)}")
            check((block_m, tile_set) in _WGMMA_SHAPES,
                  lambda: f"awq_wgmma_cuda: (block_m, tile_set) must be one of {_WGMMA_SHAPES}, got "
                          f"({block_m}, {tile_set})")
            return x.new_empty((x.shape[0], qweight.shape[0] * 64))

    if hasattr(torch.ops.torchforge, "awq_wgmma_moe_cuda"):
        @torch.library.register_fake("torchforge::awq_wgmma_moe_cuda")
        def _(x, qweight, scales, qzeros, sorted_rows, block_expert, num_rows, x_row_div, group_size, block_m,
              tile_set, shared_qweight=None, shared_scales=None, shared_qzeros=None, producer_warp=True):
            check((block_m, tile_set) in ((64, 2), (128, 2)),
                  lambda: f"awq_wgmma_moe_cuda: (block_m, tile_set) must be (64, 2) or (128, 2), got "
                          f"({block_m}, {tile_set})")
            check(qweight.dim() == 3 and qweight.shape[2] == x.shape[1] * 8,
                  lambda: f"awq_wgmma_moe_cuda: qweight must be [E, N / 64, K * 8] with K = {x.shape[1]}, got "
                          f"{tuple(qweight.shape)}")
            check(sorted_rows.numel() == block_expert.numel() * block_m,
                  lambda: f"awq_wgmma_moe_cuda: sorted_rows must hold B * block_m = {block_expert.numel()} * "
                          f"{block_m} rows, got {sorted_rows.numel()}")
            return x.new_empty((1, num_rows, qweight.shape[1] * 64), dtype=torch.float32)

    if hasattr(torch.ops.torchforge, "awq_mma_moe_cuda"):
        @torch.library.register_fake("torchforge::awq_mma_moe_cuda")
        def _(x, qweight, scales, qzeros, sorted_rows, block_expert, num_rows, x_row_div, group_size, splits,
              item_chunks, shared_qweight=None, shared_scales=None, shared_qzeros=None, warps=4, symmetric=False):
            check(warps in (4, 8), lambda: f"awq_mma_moe_cuda: warps must be 4 or 8, got {warps}")
            check(qweight.dim() == 3 and qweight.shape[2] == x.shape[1] * 8,
                  lambda: f"awq_mma_moe_cuda: qweight must be [E, N / 64, K * 8] with K = {x.shape[1]}, got "
                          f"{tuple(qweight.shape)}")
            return x.new_empty((splits, num_rows, qweight.shape[1] * 64), dtype=torch.float32)

    _registered = True
