// W4A16 for prefill-sized batches on Hopper's warpgroup MMA (sm_90a; any M, dispatched for 32-512 rows where a time
// model has it fastest, see torchforge/ops/awq_mma_cuda.py and awq_wgmma_cost.py), from the same mma layout as the
// decode kernel (awq_mma.cu; built once at load time by torchforge.ops.awq_mma_layout):
//
//   out[m, n] = sum_k x[m, k] * (q[k, n] - z[k / G, n]) * s[k / G, n]  (+ bias[n])
//
// Swap AB, as in awq_mma.cu: out.T = W @ x.T. The weight is wgmma's A operand in registers, dequantized once per
// block of BM rows of x (the decode kernel decodes it again for every 16 rows, which made it ALU bound past 16
// rows); the activations are the B operand, BM rows (wgmma's N) read from shared memory.
// * Warpgroup = 4 warps on 4 layout column blocks (256 output columns), BM rows of x, and TW of each column block's
//   4 column tiles of 16: warp w holds column block 4 cbg + w. A block has one warpgroup ((64, 4)), or two sharing
//   the stage: on the two halves of the tiles (TW = 2), or on two of them (BM = 192 or 256, TW = 1); the blocks along
//   grid.x walk the remaining tile sets.
//   The wgmma for tile T then covers the 64 columns {64 (4 cbg + w) + 16 T + r : w < 4, r < 16}, one 16-column tile
//   per warp: exactly the rows of A each warp owns in the instruction, so every lane's layout word is its A
//   fragment as it is (register r = nibbles r, r + 4). Accumulators: TW x BM / 2 floats per thread (128 at most).
// * Dequantization per register (2 weights): one shift and one LOP3 (magic + q, exact), one subtract of the
//   column's magic + z (exact: small integers), one multiply by the scale: (q - z) s rounded once to x's dtype, the
//   value the reference feeds its matmul (awq_reference: fp32, then cast). fp16 scales with bf16 x are split as
//   s = hi + lo in bf16 (lo is exact: fp16 has 3 more significand bits) and applied as fma(d, hi, d lo), still one
//   rounding of the exact product.
// * k order: the layout maps the MMA k-index 2t + e (e < 2) of k-step s to k = 16t + 4s + e and 2t + 8 + e to
//   16t + 4s + 2 + e (see awq_mma.cu). A first kernel writes x once in that order ("x image"), as tiles of BM rows x
//   one 64-k chunk, each contiguous and already in the swizzled byte order wgmma's K-major B expects in shared
//   memory: in row r of a tile, 16-byte piece j holds positions 8 j' .. 8 j' + 7 with j' = j ^ (r % 8), and
//   position p = 16 s + 8 e + 2 t + h is k = 16 t + 4 s + 2 e + h. Each k-step is then 32 consecutive bytes of a
//   128-byte row, and a stage is a handful of contiguous copies.
// * Pipeline: per 64-k chunk, one stage of shared memory holds the x tile [BM rows x 128 B], the 4 column blocks'
//   layout words (8 KB) and the chunk's group of scales and zero words, copied with bulk copies (the TMA engine, no
//   tensor map needed) that complete on the stage's mbarrier. The dispatched kernel is warp specialized (WS, below):
//   a producer issues each stage's copies once the consumers have released it. Without WS, thread 0 issues them
//   the whole ring first and refills each stage after a block barrier. A chunk's A fragments are all dequantized
//   first, then its 4 x TW wgmmas go out as one commit group. The A registers are double-buffered across chunks, so
//   the next chunk's dequantization runs while this chunk's group is in flight.
// * How it got here (H100, TFLOP/s at M = 4096 on 18432x7168; BENCHMARKS.md "seventh session"):
//   - 327: every thread copied x with cp.async, 4 bytes at a time (the copies were 37% of the loop's 407 SASS
//     instructions per chunk), and each k-step was its own commit group.
//   - 377 with the x image; 384 with bulk copies; 400 with two warpgroups per block.
//   - 457 (46% of the dense peak) with whole-chunk groups.
//   - Tried and dropped: no block barrier, where the last warp to release a stage refilled it (354); 5 stages (no
//     change then, seventh session; 8 stages for blocks of 64 and 128 rows since the fourteenth, see Stage).
//   - Also dropped (thirtieth session, commit 368045b): no x image kernel, the producer warpgroup copying each x tile
//     into the image's order itself, a 4-byte cp.async per pair of k (the order permutes pairs, so no wider copy
//     fits) completing on the stage's mbarrier (cp.async.mbarrier.arrive.noinc). Same bits, but 1.5-3.7x slower at
//     128-4096 rows: 128 threads at 24 registers moved a 32 KB tile in about 3x a chunk's time.
//   - (64, 4) spills a little: 128 accumulators plus two 64-register A buffers. ptxas serializes its wgmmas (C7511).
// * Groups of 32 (G32, warp-specialized kernels only): a chunk's stage holds both its groups' rows of scales and zero
//   words, and lane t dequantizes with row t / 2 (its 16 k of the chunk lie in group 2 c + t / 2); the arithmetic is
//   the same. The other kernels' SASS is unchanged by it (thirty-first session).
// * K slices as in awq_mma.cu (fp32 partials; the last block of a tile adds them in slice order), for every tile or
//   only for those of a last, nearly empty round of blocks (dp_tiles, see launch), whose blocks come first in the grid.
// * K slices in clusters (cluster, thirty-third session): every tile's slices run as one thread block cluster, whose
//   blocks add the slices' sums through distributed shared memory, each a share of the tile, instead of each slice
//   writing fp32 partials to global memory for one last block to read (a serial read of the whole tile on one SM, on
//   the critical path). Same additions in the same order, so the same bits. 7168x7168 on the H100: 0.026 against 0.032
//   ms at 64 rows ((64, 2) in 4 slices), 0.034 against 0.045 at 128 ((128, 2) in 4), 0.051 against 0.056 at 256
//   ((256, 1) in 2). Clusters of s blocks need s free SMs of one GPC (op awq_wgmma_cluster_slots: 30 of 4 blocks on
//   the H100, 15 of 8), so the time model weighs the rounds (awq_wgmma_cost.wgmma_cluster_time_us).
// * Stream-K (splits 0): one block per SM, each on an equal share of the (tile, pair of chunks) units, its producer running on
//   from one tile to the next. At 64 rows on 18432x7168 (72 tiles of (64, 2) for 132 SMs) the K-sliced grid left a
//   quarter of the SMs' time idle (ncu, twenty-first session: 85k of 113k cycles active) and refilled the ring once
//   per block; stream-K took 0.056 ms against 0.065 (BENCHMARKS.md, twenty-first session).
// * Where the time goes at 16-256 rows (twenty-fifth session, BENCHMARKS.md; bench/wgmma_rate.cu,
//   bench/wgmma_ablation.sh, bench/wgmma_sk_grid.py):
//   - wgmma with A in registers runs at the dense rate from N = 64.
//   - With this dequantization, N = 64 is bound by its issue (0.68 of the dense rate; an exact fp32 variant was
//     slower); from N = 128 it is hidden.
//   - Of 58 us at 64 rows on 18432x7168, the bf16x2 dequantization arithmetic costs about 8, waiting for memory 10,
//     stream-K's partials 5 (TORCHFORGE_WGMMA_ABLATE builds). 31 us remain without all three, against 18 us of
//     tensor work at the dense rate; the ring of copies alone takes 34 us. So what is left is overlap: fully
//     overlapped, these parts would take about 44 us. At 256 rows the dequantization arithmetic costs 22 of 143 us.
//   - Twice the consumer warps ((64, 1), four warpgroups) gained nothing.
//   - (256, 1) with one warpgroup was bound by its copies from L2 (a 32 KB x tile per 64 columns and chunk); two
//     warpgroups sharing it took 7168x7168 at 256 rows from 0.074 to 0.056 ms (twenty-sixth session). Clusters of two
//     such blocks sharing their stages by multicast bulk copies were 1.3-1.7x slower with a fenced remote release
//     (mbarrier.arrive.release.cluster: a MEMBAR.ALL.GPU per warp and stage; commit 1767af8), and still 1-17% slower
//     with CUTLASS's plain mbarrier.arrive.shared::cluster (commit 0a508fe, (192, 1) too), though alone such copies
//     fill a ring 1.7x faster than plain ones (bench/multicast_rate.cu; twenty-seventh session).
// * Grouped form for MoE prefill (GROUPED, op awq_wgmma_moe_cuda): the routed rows sorted by expert into blocks of BM
//   (moe_align), the x image gathered from them, each tile on its block's expert's weights, fp32 sums scattered back to
//   the routed rows. With many rows per expert this decodes each weight once per 64 rows instead of once per 8 or 16
//   (awq_mma_moe.cu): one DeepSeek-V3 layer at 4096 tokens took 10.9 ms against 22.7 (bf16 grouped_mm: 16.4;
//   BENCHMARKS.md, nineteenth session).
//
// This file needs only the CUDA headers: the torch op is in ops.cpp.
#include <algorithm>
#include <cstdio>
#include <type_traits>

#include "awq_mma.cuh"
#include "cluster.cuh"
#include "pdl.cuh"
#include "wgmma.cuh"

namespace torchforge {
namespace awq_wgmma_detail {

using awq_mma_detail::and_or;
using awq_mma_detail::awq_shift;
using awq_mma_detail::Pair;
using awq_mma_detail::perm_elem;
using awq_mma_detail::Traits;

// Warpgroups per block: with 2 column tiles per warp, two warpgroups take the two halves of the same 4 column blocks
// and share the stage (x tile, all words).
// (256, 1): two warpgroups on two of the 4 column tiles, sharing the stage's 32 KB x tile. With one warpgroup (until
// the twenty-sixth session) each block read that x tile and 8 KB of words from L2 for every 4 wgmmas: the ring of
// copies alone took 0.056 ms at 256 rows on 7168x7168, and the kernel 0.074; two took 0.057 in 2 K slices (and 0.717
// against 1.116 at 4096 rows; BENCHMARKS.md, twenty-sixth session). (192, 1) is the same block on 192 rows: 160-192
// and 384 rows without a half-empty row block (7168x7168 at 384 rows: 0.079 against (256, 1)'s 0.090).
template <int BM, int TW>
constexpr int kGroups = TW == 2 || BM >= 192 ? 2 : 1;
template <int BM, int TW>
constexpr int kThreads = 128 * kGroups<BM, TW>;  // the consumer warpgroups (+ the producer with WS)
// WS producer: one warp beside one consumer warpgroup; a whole warpgroup beside two, which gives its registers to
// them (setmaxnreg): ptxas caps a block of 288 or 384 threads at 168 registers, and two consumer warpgroups need
// more (254 for (128, 2), 168 with spills and serialized wgmmas for (64, 2); (256, 1) holds as many accumulators as
// (128, 2), (192, 1) three quarters). 384 x 168 = 128 x 24 + 256 x 240.
template <int BM, int TW>
constexpr int kProducerThreads = kGroups<BM, TW> == 2 ? 128 : 32;
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
constexpr int kBlockCols = 256;     // 4 warps x one 64-column layout block
// Elements per row of a tile's outputs staged in shared memory (the last segment's store, see the kernel): 256 + 8, so
// that the fragment writes' rows (2 t apart, t = lane % 4) fall in different banks.
constexpr int kOutPitch = kBlockCols + 8;
constexpr int kMaxSmem = 232448;    // shared memory a block may opt into on sm_90 (227 KB), static included
constexpr int kStaticSmem = 256;    // the kernel's own __shared__ (mbarriers, is_last): 144 bytes, rounded up

// A ring of kStages stages: the consumers hold two (the chunk whose wgmmas may still be in flight, the next one whose
// words they have loaded), the producer fills the rest ahead. As many as fit up to 8 (at 64 rows, 8 ran 3-5% faster
// than 4, fourteenth session); 4 for blocks of 256 rows, where 5 ran 6% slower with one warpgroup (7168x7168, 256
// rows) and no faster with two (twenty-sixth session); 6 fit for 192 rows.
#ifndef TORCHFORGE_WGMMA_MAX_STAGES  // (a build flag for sweeps of the ring size)
#define TORCHFORGE_WGMMA_MAX_STAGES 8
#endif
constexpr int kMaxStages = TORCHFORGE_WGMMA_MAX_STAGES;
// Ablations for profiling only (a build flag, bench/wgmma_ablation.sh; the results are wrong, only the times count):
// * bit 0 keeps only the dequantization's shift and LOP3 (magic + q), without its bf16x2 / f16x2 subtract, multiply
//   and fma (one add per register instead made ptxas serialize every wgmma, twenty-fifth session);
// * bit 1 drops the bulk copies and the consumers' waits for them (the stages hold whatever shared memory held, and
//   the producer does nothing);
// * bit 4 drops the partials of tiles cut between blocks (each part stores its own sums);
// * bit 5 drops only the x tiles' copies, bit 6 only the layout words' copies;
// * bit 7 drops the dequantization and the wgmmas: the copies' pace alone.
#ifndef TORCHFORGE_WGMMA_ABLATE
#define TORCHFORGE_WGMMA_ABLATE 0
#endif
constexpr int kAblate = TORCHFORGE_WGMMA_ABLATE;
// Timeline for profiling only (a build flag, bench/wgmma_timeline.py; thirty-fourth session): thread 0 of every block
// records its start, the end of its PDL wait, its main loops' and epilogues' cycles and its end in `timeline`, which a
// second kernel prints ("TL ..." lines; device printf, kept out of the main kernel, whose wgmmas ptxas serializes
// around any call).
#ifndef TORCHFORGE_WGMMA_TIMELINE
#define TORCHFORGE_WGMMA_TIMELINE 0
#endif
constexpr int kTimelineBlocks = TORCHFORGE_WGMMA_TIMELINE ? 8192 : 1;
__device__ long long timeline[kTimelineBlocks][8];
__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#if TORCHFORGE_WGMMA_TIMELINE
__global__ void timeline_print_kernel(int blocks) {
  for (int b = 0; b < blocks && b < kTimelineBlocks; ++b)
    printf("TL %d %lld %lld %lld %lld %lld %lld %lld %lld\n", b, timeline[b][0], timeline[b][1], timeline[b][2],
           timeline[b][3], timeline[b][4], timeline[b][5], timeline[b][6], timeline[b][7]);
}
#endif
// K slices in clusters: at most the portable cluster size. Built into the dense warp-specialized K-slice kernels
// but (64, 4), which spills (the launchers run the others without clusters): ptxas gave the kernels without a
// producer more registers and (64, 4) more spills with it.
constexpr int kMaxClusterSlices = 8;
template <int BM, int TW, bool WS, bool GROUPED, bool SK>
constexpr bool kClusterPath = WS && !GROUPED && !SK && !(BM == 64 && TW == 4);
// G32: groups of 32 rows, two per chunk (lane t's 16 k of a chunk lie in group 2 c + t / 2): the stage holds both
// rows of scales and of zero words, each lane reads its own (awq_mma.cuh, item_dq has the dense decode form).
template <int BM, bool G32 = false>
struct Stage {
  static constexpr int kRowsSZ = G32 ? 2 : 1;
  static constexpr int kX = BM * 128;   // BM rows x 64 k of x
  static constexpr int kW = 4 * 128 * 16;  // 4 column blocks x 4 k-steps x 32 lanes x uint4
  static constexpr int kS = kRowsSZ * kBlockCols * 2;  // scales: one row per group of the chunk
  static constexpr int kZ = kRowsSZ * kBlockCols / 8 * 4;  // zero words
  static constexpr int kBytes = (kX + kW + kS + kZ + 1023) / 1024 * 1024;  // x stays 1024-byte aligned
  static constexpr int kFit = (kMaxSmem - 1024 - kStaticSmem) / kBytes;
  static constexpr int kStages = BM == 256 ? 4 : kFit < kMaxStages ? kFit : kMaxStages;
  static constexpr int kSmem = kStages * kBytes + 1024;  // + room to align the dynamic base
  static_assert(kStages >= 3 && kStages <= kFit, "the ring needs the consumers' two stages and one ahead, and fits");
  static_assert(BM * kOutPitch * 2 <= kStages * kBytes, "a tile's outputs (2-byte x) can be staged in the ring");
};

// The TW words of this lane's layout uint4 that this warpgroup's tile set tq uses (tq < 4 / TW).
template <int TW>
__device__ __forceinline__ void lds_words(uint32_t (&w)[TW], const uint8_t* p, int tq) {
  if constexpr (TW == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (TW == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p + 8 * tq);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p + 4 * tq);
  }
}

// Blocks per SM the registers are capped for: one for every shape (each needs more than 128 registers a thread,
// or with WS a 384-thread block at 168).
template <int BM, int TW>
constexpr int kMinBlocks = 1;

// WS (warp specialized): a producer (kProducerThreads) issues the bulk copies of every stage as soon as the consumers
// release it, on a second mbarrier per stage ("empty"; every consumer thread arrives once its warpgroup's wgmmas on
// the stage have retired). The block barrier per chunk, 19.5% of the stall samples in ncu, goes away, and the two
// warpgroups no longer wait for each other. Every dispatched configuration is WS (tenth session, H100: 8-19% faster
// on the same blocks; 0.199 against 0.236 ms at M = 256 on 18432x7168). With two consumer warpgroups the producer
// is a warpgroup that drops to 24 registers (setmaxnreg) so that they get 240; with a producer warp, ptxas held
// (64, 2) at 168 registers, with spills and serialized wgmmas, and (128, 2) could not have it at all.
// The grouped (MoE) form's extra arguments (GROUPED): routed rows sorted by expert into blocks of BM
// (torchforge.ops.moe_align with block_m = BM): block b holds sorted rows b * BM .. b * BM + BM - 1, whose entries
// sorted_rows[i] are routed rows (num_rows or more where padding), of expert block_expert[b]. The x image is gathered
// from those rows (routed row r reads x[r / x_row_div]). Expert E is the shared one where shared_qw is set; other ids
// out of [0, E) (moe_align's bucket for out-of-range ids) give NaN rows, as the grouped mma.sync kernel does. Each
// tile writes its fp32 sums to partial[r, n] of its real rows: one K slice, the layout of awq_mma_moe_cuda's output.
template <typename S>
struct Grouped {
  const int32_t* sorted_rows;
  const int32_t* block_expert;
  const uint4* shared_qw;
  const S* shared_sc;
  const uint32_t* shared_qz;
  int num_rows;
  int E;
};

template <typename T, typename S, int BM, int TW, bool WS, bool GROUPED = false, bool SK = false, bool G32 = false>
__global__ void __launch_bounds__(kThreads<BM, TW> + (WS ? kProducerThreads<BM, TW> : 0), (kMinBlocks<BM, TW>))
    awq_wgmma_kernel(const T* __restrict__ x, const uint4* __restrict__ qw, const S* __restrict__ sc,
                     const uint32_t* __restrict__ qz, const T* __restrict__ bias, T* __restrict__ out,
                     float* __restrict__ partial, unsigned int* __restrict__ tickets, int M, int N, int K,
                     int chunks_per_group, int splits, int group_m, int sliced_tiles, int whole_tiles,
                     Grouped<S> gp, bool cluster_arg) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using St = Stage<BM, G32>;
  constexpr int kStages = St::kStages;
  using P = Pair<T>;
  using Tr = Traits<T>;
  constexpr bool kSplitScale = !std::is_same<T, S>::value;  // fp16 scales with bf16 x: s = hi + lo
  constexpr int kSets = 4 / (TW * kGroups<BM, TW>);  // blocks along the column tiles of one column block group
  extern __shared__ uint8_t smem_raw[];
  // The stages' base, 1024-byte aligned (the swizzle of wgmma's B operand), as an offset from smem_raw: a pointer
  // rebuilt from an integer lost the shared address space, and every load from it became a 64-bit generic one with its
  // address arithmetic (LD.E in ncu, fourteenth session).
  const uint32_t raw_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024u - (raw_base & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  const uint32_t smem_base = raw_base + pad;
  __shared__ bool is_last;
  // per stage: the bulk copies of its chunk have landed ("full"); with WS also the consumers released it ("empty")
  __shared__ alignas(8) uint64_t bars[WS ? 2 * kStages : kStages];
  const uint32_t bar_base = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
  const uint32_t empty_base = bar_base + kStages * 8;

  // (TORCHFORGE_WGMMA_TIMELINE: thread 0's records in shared memory, so that no register lives across the loops)
  __shared__ long long tl_sh[TORCHFORGE_WGMMA_TIMELINE ? 8 : 1];
  if (TORCHFORGE_WGMMA_TIMELINE && threadIdx.x == 0) {
    tl_sh[0] = global_ns();
    tl_sh[1] = clock64();
    tl_sh[3] = tl_sh[4] = tl_sh[6] = 0;  // loops, epilogues, segments
  }
  const int tid = threadIdx.x, warp = tid / 32 % 4, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int nblocks = N / 64;
  const int ncols = (nblocks + 3) / 4 * kSets;  // blocks along the columns
  const int mblocks = (M + BM - 1) / BM;
  const int chunks = K / 64;
  const int bid = static_cast<int>(blockIdx.x), grid = static_cast<int>(gridDim.x);
  // A block's work is a list of segments: a tile (pid) and its chunks [c_begin, c_end).
  // * K slices (splits >= 1): one segment. The grid's first sliced_tiles x splits blocks run tiles [whole_tiles,
  //   whole_tiles + sliced_tiles) in K slices (slice-major), the rest tiles [0, whole_tiles) whole (see launch).
  // * Stream-K (SK: splits == 0, WS, an even number of chunks): the grid (one block per SM) shares the units (tile,
  //   pair of chunks) evenly, in tile-major order: block b runs units [U b / G, U (b + 1) / G). Its segments are the
  //   tail of a tile, whole tiles, and the head of another. The producer runs on across them, so the ring is filled
  //   once per block, not once per tile, and no SM idles through a last, partial round of tiles.
  //   Units are pairs so that every segment is a whole number of the consumers' two-chunk steps: a lone last chunk
  //   after that loop, inside the loop over segments, made ptxas serialize every wgmma of (128, 2) for want of
  //   registers (C7512; the A buffer it reused could not be proven free), which cost its whole-tile and stream-K
  //   calls 10-20% from the twenty-first session until the twenty-third.
  // (awq_wgmma_launch runs whole tiles without WS or with an odd number of chunks; grouped: one segment)
  static_assert(!SK || (WS && !GROUPED), "stream-K is built into the dense warp-specialized kernel only");
  // (the launchers build groups of 32 for it only: where producer_pool_ok fails they return cudaErrorInvalidValue
  // instead of falling back to the kernel without a producer, which would need its own instances)
  static_assert(!G32 || WS, "groups of 32 are built into the warp-specialized kernel only");
  constexpr bool stream_k = SK;
  const int pairs = chunks / 2;  // stream-K's units per tile
  // Unit math (ops.cpp checks units < 2^31): u0(b) = U b / G = q b + r b / G. r b < G^2 passes 2^31 from G = 46342
  // blocks (a caller's dp_tiles may ask for up to one block per unit), so that product is taken in 64 bits.
  const int units = stream_k ? mblocks * ncols * pairs : 1;
  const int uq = units / grid, ur = units % grid;
  auto block_start = [&](int b) { return uq * b + static_cast<int>(static_cast<long long>(ur) * b / grid); };
  const int u_begin = stream_k ? block_start(bid) : 0;
  const int u_end = stream_k ? block_start(bid + 1) : 1;
  const int sliced_blocks = sliced_tiles * splits;
  const bool sliced = !stream_k && bid < sliced_blocks;
  // a sliced tile's ticket and partials, and its K slice: slice-major, or in clusters (cluster: every tile sliced,
  // its slices the blocks of one cluster, rank = slice)
  const bool cluster = kClusterPath<BM, TW, WS, GROUPED, SK> && cluster_arg;  // (other instances: no such code)
  const int slot = sliced ? (cluster ? bid / splits : bid % sliced_tiles) : 0;
  const int slice = sliced ? (cluster ? bid % splits : bid / sliced_tiles) : 0;
  struct Segment {
    int pid, c_begin, c_end;
  };
  // The segment at unit u, and u moved past it; false once the block's units are done.
  auto next_segment = [&](int& u, Segment& s) {
    if (u >= u_end) return false;
    if (stream_k) {
      s.pid = u / pairs;
      s.c_begin = 2 * (u - s.pid * pairs);
      s.c_end = min(chunks, s.c_begin + 2 * (u_end - u));
      u += (s.c_end - s.c_begin) / 2;
    } else {  // K slices: possibly empty (then its partials are zeros)
      const int slices = sliced ? splits : 1;
      const int per_split = (chunks + slices - 1) / slices;
      s.pid = sliced ? whole_tiles + slot : bid - sliced_blocks;
      s.c_begin = min(chunks, slice * per_split);
      s.c_end = min(chunks, s.c_begin + per_split);
      u = u_end;
    }
    return true;
  };
  // Stream-K: the block that runs unit u, the last b with u0(b) = floor(U b / G) <= u, i.e. U b <= (u + 1) G - 1:
  // b = ((u + 1) G - 1) / U (at most G - 1 for u < U; a search down from u / q took up to G / q steps), and the
  // first tile of block b.
  auto block_of = [&](int u) {
    return static_cast<int>((static_cast<long long>(u + 1) * grid - 1) / units);
  };
  auto first_tile = [&](int b) { return block_start(b) / pairs; };

  // What a tile's stages and threads need: row block mb and column block group cbg (row blocks walk in groups of
  // group_m, so that the blocks running together share x and the weight in L2), this warpgroup's tile set tq, the x
  // image tiles and the (expert's) weights.
  struct Tile {
    int m0, cbg, tq, n0, valid_cbs;
    uint32_t s_bytes, z_bytes, stage_bytes;
    const T* x_tiles;
    const uint4* qw;
    const S* sc;
    const uint32_t* qz;
    int expert;
  };
  auto tile_at = [&](int pid) {
    Tile tl;
    const int per_group = group_m * ncols;
    const int first_m = pid / per_group * group_m;
    const int rows_in_group = min(mblocks - first_m, group_m);
    const int mb = first_m + pid % per_group % rows_in_group;
    const int col = pid % per_group / rows_in_group;
    tl.m0 = mb * BM;
    tl.cbg = col / kSets;
    tl.tq = col % kSets * kGroups<BM, TW> + tid / 128;
    tl.n0 = kBlockCols * tl.cbg;
    tl.valid_cbs = min(4, nblocks - 4 * tl.cbg);
    tl.s_bytes = min(kBlockCols, N - tl.n0) * static_cast<uint32_t>(sizeof(S));
    tl.z_bytes = min(kBlockCols, N - tl.n0) / 8 * 4u;
    tl.stage_bytes = St::kX + tl.valid_cbs * 2048u + St::kRowsSZ * (tl.s_bytes + tl.z_bytes);
    tl.x_tiles = x + static_cast<size_t>(mb) * chunks * (BM * 64);
    tl.qw = qw, tl.sc = sc, tl.qz = qz, tl.expert = 0;
    if constexpr (GROUPED) {  // this tile's expert: its weights, or the shared expert's
      const int e = gp.block_expert[mb];
      tl.expert = e;
      if (e == gp.E && gp.shared_qw != nullptr) {
        tl.qw = gp.shared_qw, tl.sc = gp.shared_sc, tl.qz = gp.shared_qz;
      } else if (e >= 0 && e < gp.E) {
        tl.qw = qw + static_cast<size_t>(e) * (N / 64) * (K / 64) * 128;
        const int groups = G32 ? K / 32 : K / 64 / chunks_per_group;
        tl.sc = sc + static_cast<size_t>(e) * groups * N;
        tl.qz = qz + static_cast<size_t>(e) * groups * (N / 8);
      }
    }
    return tl;
  };
  int first_u = u_begin;
  Segment first;
  if (!next_segment(first_u, first)) return;  // stream-K: more blocks than units
  // PDL (pdl.cuh): the first tile's words, scales and zero words for the ring's first fills (twice the stages) go to L2
  // while the x image kernel (and whatever ran before it) finishes; the x image, the grouped form's expert ids, out,
  // partials and tickets are read or written only after the wait.
  if constexpr (!GROUPED) {
    if (tid == 0 && first.c_end > first.c_begin) {  // an empty K slice (e.g. 9 chunks in 6 slices) has no words
      const Tile tl = tile_at(first.pid);
      const int n = min(first.c_end - first.c_begin, 2 * kStages);
      for (int i = 0; i < tl.valid_cbs; ++i)
        pdl::prefetch_l2(tl.qw + (static_cast<size_t>(4 * tl.cbg + i) * chunks + first.c_begin) * 128, n * 2048u);
      const int g_first = G32 ? 2 * first.c_begin : first.c_begin / chunks_per_group;
      const int g_last = G32 ? 2 * (first.c_begin + n) - 1 : (first.c_begin + n - 1) / chunks_per_group;
      for (int gi = g_first; gi <= g_last; ++gi) {
        pdl::prefetch_l2(tl.sc + static_cast<size_t>(gi) * N + tl.n0, tl.s_bytes);
        pdl::prefetch_l2(tl.qz + static_cast<size_t>(gi) * (N / 8) + tl.n0 / 8, tl.z_bytes);
      }
    }
  }
  pdl::wait();
  if (TORCHFORGE_WGMMA_TIMELINE && tid == 0) tl_sh[2] = clock64() - tl_sh[1];
  if constexpr (GROUPED) {  // (one segment) out-of-range ids (moe_align's last bucket) or empty blocks past the end
    const Tile tl = tile_at(first.pid);
    if (!(tl.expert == gp.E && gp.shared_qw != nullptr) && (tl.expert < 0 || tl.expert >= gp.E)) {
      for (int i = tid; i < BM * kBlockCols; i += blockDim.x) {
        const int r = gp.sorted_rows[tl.m0 + i / kBlockCols], n = tl.n0 + i % kBlockCols;
        if (r >= 0 && r < gp.num_rows && n < N) partial[static_cast<size_t>(r) * N + n] = __int_as_float(0x7fc00000);
      }
      return;
    }
  }

  // Quantization group of chunk c as a high multiply by ceil(2^32 / d), d = chunks_per_group > 1: exact while c d <
  // 2^32, which ops.cpp checks ((K / 64) (group_size / 64) < 2^32). ncu (ninth session) had the loop's two runtime
  // divisions per chunk, MUFU.RCP sequences, among its busiest instructions.
  const uint32_t group_mul =
      !G32 && chunks_per_group > 1 ? static_cast<uint32_t>((0x100000000ull + chunks_per_group - 1) / chunks_per_group) : 0u;
  auto group_of = [&](int c) {
    return chunks_per_group > 1 ? static_cast<int>(__umulhi(static_cast<uint32_t>(c), group_mul)) : c;
  };
  // One thread copies a chunk's stage with the bulk-copy (TMA) engine: the x image tile, the 4 column blocks' words,
  // the group's scales and zero words, all contiguous in global memory; the stage's mbarrier counts the bytes.
  auto load_stage = [&](const Tile& tl, int c, int st) {
    if constexpr ((kAblate & 2) != 0) return;
    const uint32_t base = smem_base + st * St::kBytes;
    const uint32_t bar = bar_base + st * 8;
    constexpr bool kCopyX = (kAblate & 32) == 0, kCopyW = (kAblate & 64) == 0;
    ptx::mbar_expect_tx(bar, tl.stage_bytes - (kCopyX ? 0u : St::kX) - (kCopyW ? 0u : tl.valid_cbs * 2048u));
    if (kCopyX) ptx::bulk_copy(base, tl.x_tiles + static_cast<size_t>(c) * (BM * 64), St::kX, bar);
    for (int i = 0; kCopyW && i < tl.valid_cbs; ++i)
      ptx::bulk_copy(base + St::kX + i * 2048, tl.qw + (static_cast<size_t>(4 * tl.cbg + i) * chunks + c) * 128, 2048,
                     bar);
    const int group = G32 ? 2 * c : group_of(c);
#pragma unroll
    for (int r = 0; r < St::kRowsSZ; ++r) {  // (G32: groups 2 c and 2 c + 1)
      ptx::bulk_copy(base + St::kX + St::kW + r * kBlockCols * 2, tl.sc + static_cast<size_t>(group + r) * N + tl.n0,
                     tl.s_bytes, bar);
      ptx::bulk_copy(base + St::kX + St::kW + St::kS + r * kBlockCols / 2,
                     tl.qz + static_cast<size_t>(group + r) * (N / 8) + tl.n0 / 8, tl.z_bytes, bar);
    }
  };
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) ptx::mbar_init(bar_base + i * 8, 1);
    if constexpr (WS)
      for (int i = 0; i < kStages; ++i) ptx::mbar_init(empty_base + i * 8, kThreads<BM, TW>);
    ptx::mbar_fence_init();
  }
  __syncthreads();
  if constexpr (WS) {
    if (tid >= kThreads<BM, TW>) {  // the producer: fill stage it % kStages once its previous fill is released
      if constexpr (kGroups<BM, TW> == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
      if (tid == kThreads<BM, TW> && (kAblate & 2) == 0) {
        unsigned it = 0;
        int u = u_begin;
        Segment s;
        while (next_segment(u, s)) {
          const Tile tl = tile_at(s.pid);
          for (int c = s.c_begin; c < s.c_end; ++c, ++it) {
            if (it >= kStages) ptx::mbar_wait(empty_base + it % kStages * 8, (it / kStages - 1) & 1);
            load_stage(tl, c, it % kStages);
          }
        }
      }
      return;  // the consumers sync among themselves from here on (consumer_sync)
    }
    if constexpr (kGroups<BM, TW> == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
  }
  // A barrier of the consumer threads only (with WS the producer has left).
  auto consumer_sync = [] {
    if constexpr (WS)
      asm volatile("bar.sync 1, %0;" ::"n"(kThreads<BM, TW>) : "memory");
    else
      __syncthreads();
  };

  const int zshift = awq_shift(g);
  float acc[TW][BM / 2];
  uint32_t zc[TW][2], shi[TW][2], slo[TW][2];
  uint32_t wr[4][TW];  // the layout words of the next chunk to dequantize
  uint32_t a0[4][TW][4], a1[4][TW][4];
  unsigned base = 0;  // stages the block's earlier segments used
  int u = u_begin;
  Segment s;
  while (next_segment(u, s)) {
    if (TORCHFORGE_WGMMA_TIMELINE && tid == 0) {  // [5]: this segment's start; [7]: the last loop's end
      tl_sh[5] = clock64();
      if (tl_sh[6] > 0) tl_sh[4] += tl_sh[5] - tl_sh[7];
    }
    const Tile tl = tile_at(s.pid);
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
      for (int e = 0; e < BM / 2; ++e) acc[i][e] = 0.0f;

    // Without WS (one segment), thread 0 fills the whole ring first, then refills each stage once every consumer
    // thread has retired the wgmmas that read it (the block barrier in `chunk`).
    if (!WS && tid == 0)
      for (int i = 0; i < kStages && s.c_begin + i < s.c_end; ++i) load_stage(tl, s.c_begin + i, i);

    // Wait for chunk c's stage and load what the threads themselves read of it: this lane's layout words and, at the
    // start of a quantization group, the scales and zero points of its columns. `chunk` calls it for the next chunk
    // once its own wgmmas are issued and the previous chunk's stage released, so these loads and the scale
    // conversions run while the tensor cores work, not at the head of the next chunk's dequantization (ncu,
    // fourteenth session: at 4096 rows the scale loads and conversions had 16% of the loop's stall samples). Stages
    // and fill parities come from the chunk index: warp-uniform, so wgmma's descriptors stay in uniform registers.
    auto fetch = [&](int c) {
      const unsigned it = base + static_cast<unsigned>(c - s.c_begin);
      if constexpr ((kAblate & 2) == 0) ptx::mbar_wait(bar_base + it % kStages * 8, (it / kStages) & 1);  // landed
      const uint8_t* stage = smem + it % kStages * St::kBytes;
      const uint8_t* wsm = stage + St::kX + (warp * 128 + lane) * 16;
#pragma unroll
      for (int k = 0; k < 4; ++k) lds_words<TW>(wr[k], wsm + k * 32 * 16, tl.tq);
      if (G32 || c == s.c_begin || group_of(c) * chunks_per_group == c) {
        const int row = G32 ? t >> 1 : 0;  // G32: this lane's group of the chunk's two
        const S* ss = reinterpret_cast<const S*>(stage + St::kX + St::kW) + row * kBlockCols;
        const uint32_t* zs = reinterpret_cast<const uint32_t*>(stage + St::kX + St::kW + St::kS) + row * (kBlockCols / 8);
#pragma unroll
        for (int i = 0; i < TW; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int n = 64 * warp + 16 * (tl.tq * TW + i) + g + 8 * h;  // column within the block's 256
            const uint32_t z = and_or(zs[n / 8] >> zshift, 0xFu, static_cast<uint32_t>(Tr::kMagic2 & 0xFFFFu));
            zc[i][h] = z | (z << 16);  // (magic + z) twice, exact
            const float sv = awq_mma_detail::scale_f(ss[n]);
            shi[i][h] = P::splat(sv);
            slo[i][h] = kSplitScale ? P::splat(sv - P::low(shi[i][h])) : 0u;
          }
        }
      }
    };
    // One chunk: dequantize all its A fragments into `a` from the fetched words, issue its wgmmas as one commit group,
    // retire the previous chunk's group and release its stage, then fetch the next chunk. The A registers of a group
    // are read while it runs, so chunks alternate between two buffers (the loop below is unrolled by two for that):
    // the next chunk's dequantization overlaps this chunk's wgmmas. (One commit group per k-step, waiting for the
    // previous k-step, left the tensor pipe 60% idle: ncu, 2026-11-22.)
    auto chunk = [&](int c, uint32_t(&a)[4][TW][4]) {
      const unsigned it = base + static_cast<unsigned>(c - s.c_begin);
      if constexpr ((kAblate & 128) == 0) {  // (bit 7: no dequantization and no wgmmas at all)
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int i = 0; i < TW; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const uint32_t d = P::sub(and_or(wr[k][i] >> (4 * r), 0x000F000Fu, Tr::kMagic2), zc[i][r & 1]);
              a[k][i][r] = (kAblate & 1) != 0 ? and_or(wr[k][i] >> (4 * r), 0x000F000Fu, Tr::kMagic2)
                           : kSplitScale ? P::fma(d, shi[i][r & 1], P::mul(d, slo[i][r & 1]))
                                         : P::mul(d, shi[i][r & 1]);
            }
        const uint64_t desc = wgmma::desc_k_sw128(smem_base + it % kStages * St::kBytes);
        wgmma::fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int i = 0; i < TW; ++i)  // + 32 bytes per k-step, in 16s
            wgmma::mma_rs<BM, T>(acc[i], a[k][i][0], a[k][i][1], a[k][i][2], a[k][i][3], desc + 2 * k);
        wgmma::commit();
        wgmma::wait<1>();
      }
      // Chunk c - 1's wgmmas have retired (this thread's warpgroup) and its words and scales were read: release its
      // stage. WS: every consumer thread arrives on its empty barrier for its own loads (one lane per warp after
      // __syncwarp left compute-sanitizer's racecheck reporting the producer's refill against the other lanes' loads,
      // tenth session). No proxy fence before the arrive: the loads' values have been used, and the bulk copy that
      // refills the stage is issued only after the producer's wait on this barrier, as in CUTLASS's TMA pipelines (the
      // fence was a MEMBAR.ALL.CTA per chunk on the consumers' critical path). Without WS: a block barrier, then
      // thread 0 refills the stage.
      if (c > s.c_begin) {
        if constexpr (WS) {
          ptx::mbar_arrive(empty_base + (it - 1) % kStages * 8);
        } else {
          __syncthreads();  // both warpgroups have retired chunk c - 1's wgmmas
          if (tid == 0 && c - 1 + kStages < s.c_end) load_stage(tl, c - 1 + kStages, (it - 1) % kStages);
        }
      }
      if (c + 1 < s.c_end) fetch(c + 1);  // its loads overlap this chunk's wgmmas
    };
    int c = s.c_begin;
    if (c < s.c_end) fetch(c);
    for (; c + 1 < s.c_end; c += 2) {
      chunk(c, a0);
      chunk(c + 1, a1);
    }
    if constexpr (!SK)  // (stream-K segments are whole pairs, see above)
      if (c < s.c_end) chunk(c, a0);
    wgmma::wait<0>();
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
      for (int e = 0; e < BM / 2; ++e) wgmma::fence_operand(acc[i][e]);
    if (TORCHFORGE_WGMMA_TIMELINE && tid == 0) {
      tl_sh[7] = clock64();
      tl_sh[3] += tl_sh[7] - tl_sh[5];
      ++tl_sh[6];
    }
    // The segment's last stage: released here, for the producer's next segments (stream-K).
    if constexpr (WS)
      if (s.c_end > s.c_begin) ptx::mbar_arrive(empty_base + (base + s.c_end - s.c_begin - 1) % kStages * 8);
    base += static_cast<unsigned>(s.c_end - s.c_begin);
    // PDL: the next kernel may launch once every block is past its main loop (as in awq_mma.cu: earlier, a next
    // GEMM's prefetched weights would be evicted by this one's stream before their use). Not from the producer, whose
    // last loads go out kStages chunks before that: the first call by any thread of a block counts for the block.
    if (u >= u_end) pdl::launch_dependents();

    // acc[i][4 j + e]: column 64 cb + 16 (tq TW + i) + g + 8 (e / 2), row m0 + 8 j + 2 t + (e % 2)
    const int cb = 4 * tl.cbg + warp;
    const bool cols_ok = cb < nblocks;
    auto for_each = [&](auto&& f) {
#pragma unroll
      for (int i = 0; i < TW; ++i)
#pragma unroll
        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int m = tl.m0 + 8 * j + 2 * t + (e & 1);
            const int n = 64 * cb + 16 * (tl.tq * TW + i) + g + 8 * (e >> 1);
            if (cols_ok && m < M) f(acc[i][4 * j + e], m, n);
          }
    };
    // A tile in parts (K slices, or stream-K segments of several blocks): every part writes fp32 partials, and the
    // last to finish adds them into acc, in part order (deterministic). Stream-K: a block writes at most two parts,
    // the tail of its first tile (slot 2 b) and the head of its last (slot 2 b + 1); part j of tile pid is block
    // b_first + j's.
    int parts = sliced ? splits : 1, my_part = slice, ticket = slot, b_first = 0;
    if (stream_k) {
      b_first = block_of(s.pid * pairs);
      parts = block_of(s.pid * pairs + pairs - 1) - b_first + 1;
      my_part = bid - b_first;
      ticket = s.pid;
    }
    if constexpr ((kAblate & 16) != 0) parts = 1;  // (profiling: no partials, each part stores its own sums)
    // K slices in a cluster (cluster, see launch): the parts meet in distributed shared memory instead of through fp32
    // partials in global memory that one last block reads. Every part stores its accumulators in its ring's memory
    // (free once both warpgroups' wgmmas are done), in 16-byte quads (acc[i][e .. e + 3], e % 4 == 0: rows m, m + 1
    // of columns n, n + 8), quad q of thread tid at q x threads + tid. Part r then owns this thread's quads
    // [r Q / P, (r + 1) Q / P): it adds them over the parts in part order, the partials' own additions (so the same
    // bits), and stores them. (A first form kept the own quads in registers and indexed the accumulators with
    // compile-time loops over quads and parts: 4x the kernel's code.)
    if constexpr (kClusterPath<BM, TW, WS, GROUPED, SK>) {
      if (cluster && parts > 1) {
        constexpr int kQ = TW * (BM / 2) / 4;
        consumer_sync();
        float4* mine = reinterpret_cast<float4*>(smem) + tid;
#pragma unroll
        for (int q = 0; q < kQ; ++q) {
          const int i = 4 * q / (BM / 2), e = 4 * q % (BM / 2);
          mine[q * kThreads<BM, TW>] = make_float4(acc[i][e], acc[i][e + 1], acc[i][e + 2], acc[i][e + 3]);
        }
        const uint32_t here = smem_base + tid * 16 + cluster::sync();
        const int P = parts, r = my_part;
#pragma unroll 1
        for (int q = r * kQ / P; q < (r + 1) * kQ / P; ++q) {
          const int i = 4 * q / (BM / 2), e = 4 * q % (BM / 2);
          if (!cols_ok || tl.m0 + 2 * e + 2 * t >= M) continue;  // none of its outputs exists (tails)
          const uint32_t a = here + q * kThreads<BM, TW> * 16;
          float4 v[kMaxClusterSlices];
#pragma unroll
          for (int j = 0; j < kMaxClusterSlices; ++j)
            if (j < P) v[j] = cluster::ld_v4(cluster::map(a, j));
          float4 sum = v[0];
#pragma unroll
          for (int j = 1; j < kMaxClusterSlices; ++j)
            if (j < P) sum.x += v[j].x, sum.y += v[j].y, sum.z += v[j].z, sum.w += v[j].w;
          const float part_sum[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
          for (int w = 0; w < 4; ++w) {  // acc[i][e + w], as for_each below (with j = e / 4)
            const int m = tl.m0 + 2 * e + 2 * t + (w & 1);
            const int n = 64 * cb + 16 * (tl.tq * TW + i) + g + 8 * (w >> 1);
            if (m < M)
              out[static_cast<size_t>(m) * N + n] =
                  Tr::from_f(bias != nullptr ? part_sum[w] + Tr::to_f(bias[n]) : part_sum[w]);
          }
        }
        cluster::arrive();  // this block has read what it needed of the others'
        cluster::wait();    // and keeps its memory until they have too
        continue;
      }
    }
    if (parts > 1) {
      // fp32 partials in the block's own order: part slot, then accumulator, then thread (each store and load
      // coalesced across the block, and no index math on rows and columns).
      constexpr int kAcc = TW * (BM / 2);
      const size_t tile_floats = static_cast<size_t>(kAcc) * kThreads<BM, TW>;
      auto part = [&](int j) {
        size_t index = static_cast<size_t>(j) * sliced_tiles + slot;
        if (stream_k) index = 2 * static_cast<size_t>(b_first + j) + (first_tile(b_first + j) == s.pid ? 0 : 1);
        return partial + index * tile_floats + tid;
      };
      float* mine = part(my_part);
#pragma unroll
      for (int i = 0; i < TW; ++i)
#pragma unroll
        for (int e = 0; e < BM / 2; ++e) __stcg(mine + (i * (BM / 2) + e) * kThreads<BM, TW>, acc[i][e]);
      __threadfence();  // this block's partials are visible before its ticket is taken
      consumer_sync();
      if (tid == 0) is_last = atomicAdd(&tickets[ticket], 1u) == static_cast<unsigned>(parts - 1);
      consumer_sync();
      if (!is_last) continue;
      __threadfence();
      // Part order (deterministic), 32 accumulators' loads at once per part: with the parts innermost, every load
      // waited for the one before (an L2 round trip each, kAcc x parts of them; 11 slices took 0.27 ms on the H100);
      // all kAcc at once spilled. L2 reads (__ldcg), not a stale L1. This one block reading every part costs about
      // 2 us per part of 128 x 256 outputs (twelfth session, 12 tiles alone on the GPU): the SM's own L2 bandwidth,
      // not latency. Bulk copies of the partials into the stages' shared memory (96 KB in flight instead of 32) were
      // 5-10 us slower per call, not faster. A last block that is part 0 or 1 keeps its own part in acc and adds the
      // others to it in order (own + p0 = p0 + own exactly, so the sum has the same bits): one part fewer to read.
      constexpr int kBatch = 32;
      static_assert(kAcc % kBatch == 0, "accumulators come in batches of 32");
      const bool keep_own = my_part <= 1;
#pragma unroll
      for (int b = 0; b < kAcc; b += kBatch)
        for (int j = 0; j < parts; ++j) {
          if (keep_own && j == my_part) continue;
          const float* p = part(j);
#pragma unroll
          for (int q = 0; q < kBatch; ++q) {
            const int a = b + q, i = a / (BM / 2), e = a % (BM / 2);
            const float v = __ldcg(p + a * kThreads<BM, TW>);
            acc[i][e] = j == 0 && !keep_own ? v : acc[i][e] + v;
          }
        }
      if (tid == 0) tickets[ticket] = 0u;  // for the next call; every part of this tile has taken its ticket
    }
    if constexpr (GROUPED) {
      for_each([&](float v, int m, int n) {
        const int r = __ldg(gp.sorted_rows + m);
        if (r >= 0 && r < gp.num_rows) partial[static_cast<size_t>(r) * N + n] = v;
      });
    } else if (!stream_k || u >= u_end) {
      // The block's last segment: its ring is free (every stage it was sent has been consumed), so the tile's outputs
      // go through it: each thread's fragments into shared memory, then rows of 16-byte stores. Stored straight from
      // the fragments, a warp's store covered 4 rows x 16 bytes, and a (192, 1) tile took about 14k cycles to leave
      // (bench/wgmma_timeline.py, thirty-fourth session).
      consumer_sync();  // both warpgroups' wgmmas are done with the ring
      T* staged = reinterpret_cast<T*>(smem);
      for_each([&](float v, int m, int n) {
        staged[(m - tl.m0) * kOutPitch + n - tl.n0] = Tr::from_f(bias != nullptr ? v + Tr::to_f(bias[n]) : v);
      });
      consumer_sync();
      // the block's columns in each column block: kOwned tiles of 16 from tile t0, 2 x 16 bytes each
      constexpr int kOwned = TW * kGroups<BM, TW>;
      const int t0 = (tl.tq - tid / 128) * TW;
      const int rows = min(BM, M - tl.m0), per_row = tl.valid_cbs * kOwned * 2;
      for (int p = tid; p < rows * per_row; p += kThreads<BM, TW>) {
        const int r = p / per_row, q = p % per_row, cbl = q / (kOwned * 2);
        const int col = 64 * cbl + 16 * t0 + 8 * (q % (kOwned * 2));  // within the block's 256
        *reinterpret_cast<uint4*>(out + static_cast<size_t>(tl.m0 + r) * N + tl.n0 + col) =
            *reinterpret_cast<const uint4*>(staged + r * kOutPitch + col);
      }
    } else {
      for_each([&](float v, int m, int n) {
        out[static_cast<size_t>(m) * N + n] = Tr::from_f(bias != nullptr ? v + Tr::to_f(bias[n]) : v);
      });
    }
  }
  if (TORCHFORGE_WGMMA_TIMELINE && tid == 0 && bid < kTimelineBlocks) {
    const long long end = clock64();
    if (tl_sh[6] > 0) tl_sh[4] += end - tl_sh[7];
    const long long v[8] = {tl_sh[0], global_ns(), tl_sh[2], tl_sh[3], tl_sh[4], end - tl_sh[1], tl_sh[6],
                            static_cast<long long>(base)};
    for (int i = 0; i < 8; ++i) timeline[bid][i] = v[i];
  }
#else
  __trap();  // built without sm_90a (TORCHFORGE_CUDA_ARCH): fail loudly rather than return an unwritten output
#endif
}

// x [M, K] -> x image: tiles of BM rows x one 64-k chunk, each contiguous (BM x 128 bytes, rows past M zero), tile
// (row block mb, chunk c) at mb * (K / 64) + c. One thread per 16-byte piece j of a tile row, gathering the 4 pairs of
// k it holds (positions 8 j' .. 8 j' + 7 with j' = j ^ (row % 8) = 2 s + e: k = 16 t + 4 s + 2 e + h, t < 4, h < 2).
// Grouped (sorted_rows set): image row m is routed row sorted_rows[m], which reads x[sorted_rows[m] / x_row_div];
// padding (num_rows or more) stays zero. perm set (int32 [K], an act-order layer's input rows sorted by group): the
// image holds x[:, perm], each k gathered on its own.
template <typename T, int BM>
__global__ void x_image_kernel(const T* __restrict__ x, T* __restrict__ img, int M, int K,
                               const int32_t* __restrict__ sorted_rows, int num_rows, int x_row_div,
                               const int32_t* __restrict__ perm) {
  pdl::wait();  // x (and sorted_rows) come from the kernels before; img may still be read by the previous call's kernel
  pdl::launch_dependents();
  const int64_t piece = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int chunks = K / 64;
  if (piece >= static_cast<int64_t>((M + BM - 1) / BM) * BM * K / 8) return;
  const int64_t tile = piece / (BM * 8);
  const int row = static_cast<int>(piece % (BM * 8)) / 8, j = static_cast<int>(piece % 8);
  const int m = static_cast<int>(tile / chunks) * BM + row, c = static_cast<int>(tile % chunks);
  int src_row = m < M ? m : -1;
  if (sorted_rows != nullptr && src_row >= 0) {
    const int r = __ldg(sorted_rows + m);
    src_row = r >= 0 && r < num_rows ? r / x_row_div : -1;
  }
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (src_row >= 0) {
    const int jp = j ^ (row % 8);
    if (perm == nullptr) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(x + static_cast<size_t>(src_row) * K + c * 64);
      v.x = __ldg(src + jp);  // the pair of k at 16 t + 4 s + 2 e is word 8 t + 2 s + e = 8 t + j'
      v.y = __ldg(src + 8 + jp);
      v.z = __ldg(src + 16 + jp);
      v.w = __ldg(src + 24 + jp);
    } else {  // the same pairs of sorted positions, each element read through perm (outside [0, K): NaN)
      const unsigned short* row = reinterpret_cast<const unsigned short*>(x + static_cast<size_t>(src_row) * K);
      const int2* pk = reinterpret_cast<const int2*>(perm + c * 64) + jp;
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int2 p = __ldg(pk + 8 * q);
        w[q] = perm_elem<T, true>(row, p.x, K) | (perm_elem<T, true>(row, p.y, K) << 16);
      }
      v = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  reinterpret_cast<uint4*>(img)[piece] = v;
}

// The x image of x[:, perm] with one block per image row: the row of x read once into shared memory (16-byte loads),
// then gathered from there. x_image_kernel's own path through perm reads each element with a 2-byte load, a 32-byte
// sector from L2 each (7168x7168 at 256 rows on the H100: 0.067 ms against 0.057 without perm). Rows of x up to
// kPermRowBytes; past them x_image_kernel gathers.
constexpr int kPermRowBytes = 48 * 1024;
template <typename T, int BM>
__global__ void x_image_perm_kernel(const T* __restrict__ x, T* __restrict__ img, int M, int K,
                                    const int32_t* __restrict__ perm) {
  extern __shared__ uint4 xrow[];  // K / 8
  pdl::wait();
  pdl::launch_dependents();
  const int r = blockIdx.x, row = r % BM, chunks = K / 64;
  const int64_t tile0 = static_cast<int64_t>(r / BM) * chunks;
  uint4* out = reinterpret_cast<uint4*>(img);
  if (r >= M) {  // padding rows of the last row block
    for (int p = threadIdx.x; p < chunks * 8; p += blockDim.x)
      out[(tile0 + p / 8) * (BM * 8) + row * 8 + p % 8] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<size_t>(r) * K);
  for (int i = threadIdx.x; i < K / 8; i += blockDim.x) xrow[i] = __ldg(src + i);
  __syncthreads();
  const unsigned short* xs = reinterpret_cast<const unsigned short*>(xrow);
  const auto at = [&](int i) { return perm_elem<T, false>(xs, i, K); };
  for (int p = threadIdx.x; p < chunks * 8; p += blockDim.x) {
    const int c = p / 8, j = p % 8, jp = j ^ (row % 8);
    const int2* pk = reinterpret_cast<const int2*>(perm + c * 64) + jp;  // as x_image_kernel: word 8 q + j'
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int2 pq = __ldg(pk + 8 * q);
      w[q] = at(pq.x) | (at(pq.y) << 16);
    }
    out[(tile0 + c) * (BM * 8) + row * 8 + j] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// A kernel instance's opt-in to more than 48 KB of dynamic shared memory, once per device.
template <typename T, typename S, int BM, int TW, bool WS, bool GROUPED, bool SK, bool G32>
cudaError_t allow_smem() {
  static unsigned long long attr_set = 0;
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 64 || !(attr_set >> dev & 1)) {
    const cudaError_t err = cudaFuncSetAttribute(awq_wgmma_kernel<T, S, BM, TW, WS, GROUPED, SK, G32>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, Stage<BM, G32>::kSmem);
    if (err != cudaSuccess) return err;
    if (dev < 64) attr_set |= 1ull << dev;
  }
  return cudaSuccess;
}

// Whether a tile's `splits` K slices can run as one cluster (the kernel's cluster path): a portable cluster size, and
// the ring holds the block's accumulators (64-128 KB against at least 164 KB of stages).
template <int BM, int TW, bool G32>
constexpr bool cluster_fits(int splits) {
  return kClusterPath<BM, TW, true, false, false> && splits >= 2 && splits <= kMaxClusterSlices &&
         TW * (BM / 2) * 4 * kThreads<BM, TW> <= Stage<BM, G32>::kStages * Stage<BM, G32>::kBytes;
}

template <typename T, typename S, int BM, int TW, bool WS, bool GROUPED = false, bool SK = false, bool G32 = false>
cudaError_t launch(const void* x, void* x_image, const int32_t* qw, const void* sc, const int32_t* qz, const void* bias,
                   void* out, float* partial, unsigned int* tickets, int M, int N, int K, int group_size, int splits,
                   int group_m, int dp_tiles, cudaStream_t stream, Grouped<S> gp = {}, int x_row_div = 1,
                   const int32_t* perm = nullptr, bool cluster = false) {
  auto kernel = awq_wgmma_kernel<T, S, BM, TW, WS, GROUPED, SK, G32>;
  constexpr int smem = Stage<BM, G32>::kSmem;
  // cluster: every tile in `splits` K slices, each tile's slices one cluster (the kernel's cluster path)
  if (cluster && (!kClusterPath<BM, TW, WS, GROUPED, SK> || dp_tiles != 0 || !cluster_fits<BM, TW, G32>(splits)))
    return cudaErrorInvalidValue;
  if (const cudaError_t err = allow_smem<T, S, BM, TW, WS, GROUPED, SK, G32>(); err != cudaSuccess) return err;
  const int64_t pieces = static_cast<int64_t>((M + BM - 1) / BM) * BM * K / 8;
  cudaError_t err =
      perm != nullptr && gp.sorted_rows == nullptr && K * static_cast<int>(sizeof(T)) <= kPermRowBytes
          ? pdl::launch(x_image_perm_kernel<T, BM>, true, dim3(static_cast<unsigned>((M + BM - 1) / BM * BM)),
                        dim3(256), K * sizeof(T), stream, static_cast<const T*>(x), static_cast<T*>(x_image), M, K,
                        perm)
          : pdl::launch(x_image_kernel<T, BM>, true, dim3(static_cast<unsigned>((pieces + 255) / 256)), dim3(256), 0,
                        stream, static_cast<const T*>(x), static_cast<T*>(x_image), M, K, gp.sorted_rows,
                        gp.num_rows, x_row_div, perm);
  if (err != cudaSuccess) return err;
  const int ncols = (N / 64 + 3) / 4 * (4 / (TW * kGroups<BM, TW>));
  const int tiles = ncols * ((M + BM - 1) / BM);
  // With splits > 1, tiles [dp_tiles, tiles) run in `splits` K slices each and tiles [0, dp_tiles) whole, in one
  // launch with the sliced blocks first. A last round of few tiles, which would leave most SMs idle for a whole tile's
  // time, then takes 1 / splits of it at the start, while the other SMs start on whole tiles. The SMs that ran a
  // slice still run a whole tile after it, so the slices' partials and reduction stay on the critical path. Two
  // launches (whole tiles, then the slices) measured 2-4 us slower: 0.148 against 0.144-0.146 ms at 256 rows on
  // 18432x7168 (eleventh and twelfth sessions).
  // SK (splits == 0): dp_tiles blocks share the tiles' pairs of chunks (at most one block per pair).
  static_assert(!SK || WS, "stream-K runs on the warp-specialized kernel");
  const int sliced = !SK && splits > 1 ? tiles - dp_tiles : 0;
  const int whole = tiles - sliced;
  const int blocks = SK ? std::min(dp_tiles, tiles * (K / 128)) : sliced * splits + whole;
  const dim3 block(kThreads<BM, TW> + (WS ? kProducerThreads<BM, TW> : 0));
  err = pdl::launch_clusters(kernel, false, cluster ? static_cast<unsigned>(splits) : 1u, dim3(blocks), block, smem,
                              stream, static_cast<const T*>(x_image), reinterpret_cast<const uint4*>(qw),
                              static_cast<const S*>(sc), reinterpret_cast<const uint32_t*>(qz),
                              static_cast<const T*>(bias), static_cast<T*>(out), partial, tickets, M, N, K,
                              group_size / 64, splits, group_m, sliced, whole, gp, cluster);
#if TORCHFORGE_WGMMA_TIMELINE
  if (err == cudaSuccess) timeline_print_kernel<<<1, 1, 0, stream>>>(blocks);
#endif
  return err;
}

// Whether the WS kernel may run. setmaxnreg only moves registers within the block's allocation: the consumers' 240 exist only if the WS kernel
// with a producer warpgroup starts at 168 registers (384 x 168 = 128 x 24 + 256 x 240), as ptxas builds it today.
// A build that started lower would hang in setmaxnreg.inc; it runs the kernel without WS instead (the same bits).
template <typename T, typename S, int BM, int TW, bool GROUPED = false, bool SK = false, bool G32 = false>
bool producer_pool_ok() {
  if constexpr (kGroups<BM, TW> == 1) return true;  // a producer warp: no setmaxnreg
  static int regs = -1;  // one binary for every device; a racing first call stores the same value
  if (regs < 0) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, awq_wgmma_kernel<T, S, BM, TW, true, GROUPED, SK, G32>) != cudaSuccess) {
      // e.g. asked while a device other than sm_90 is current: not cached, and the (non-sticky) error is cleared so
      // that the next launch check does not report it
      (void)cudaGetLastError();
      return false;
    }
    regs = attr.numRegs;
  }
  return regs * (kThreads<BM, TW> + kProducerThreads<BM, TW>) >=
         kProducerThreads<BM, TW> * kProducerRegs + kThreads<BM, TW> * kConsumerRegs;
}

// f(integral_constant<int, BM>{}, integral_constant<int, TW>{}) for a dense block shape (block_m, tile_set), or `none`
// for another pair: the runtime arguments of the ops to the kernel instances' template arguments.
template <typename R, typename F>
R with_dense_shape(int64_t block_m, int64_t tile_set, R none, F&& f) {
  using std::integral_constant;
  if (block_m == 64 && tile_set == 4) return f(integral_constant<int, 64>{}, integral_constant<int, 4>{});
  if (block_m == 64 && tile_set == 2) return f(integral_constant<int, 64>{}, integral_constant<int, 2>{});
  if (block_m == 128 && tile_set == 2) return f(integral_constant<int, 128>{}, integral_constant<int, 2>{});
  if (block_m == 192 && tile_set == 1) return f(integral_constant<int, 192>{}, integral_constant<int, 1>{});
  if (block_m == 256 && tile_set == 1) return f(integral_constant<int, 256>{}, integral_constant<int, 1>{});
  return none;
}

}  // namespace awq_wgmma_detail

// Whether the group-32 kernels can run for these dtypes (0 = bf16, 1 = fp16, as in awq_wgmma_launch): every dense
// block shape (grouped: the grouped ones) has its warp-specialized instance starting with the registers that
// setmaxnreg hands on (producer_pool_ok). Only those instances exist for groups of 32; where a build falls short the
// launchers would return an error, so the Python dispatch asks here first and takes another kernel (op
// torchforge::awq_wgmma_g32_ready). Stream-K falls back to the same shape's K-slice instance, so the dense answer
// needs only those. False for an unknown dtype pair.
bool awq_wgmma_g32_ready(int dtype, int scale_dtype, bool grouped) {
  using namespace awq_wgmma_detail;
  return awq_mma_detail::dispatch_dtypes(dtype, scale_dtype, [&](auto tv, auto sv) {
           using T = decltype(tv);
           using S = decltype(sv);
           using std::integral_constant;
           const auto ok = [](auto bm, auto tw, auto gr) {
             return producer_pool_ok<T, S, decltype(bm)::value, decltype(tw)::value, decltype(gr)::value, false,
                                     true>();
           };
           using I1 = integral_constant<int, 1>;
           using I2 = integral_constant<int, 2>;
           using I4 = integral_constant<int, 4>;
           using I64 = integral_constant<int, 64>;
           using I128 = integral_constant<int, 128>;
           const bool ready =
               grouped ? ok(I64{}, I2{}, std::true_type{}) && ok(I128{}, I2{}, std::true_type{})
                       : ok(I64{}, I4{}, std::false_type{}) && ok(I64{}, I2{}, std::false_type{}) &&
                             ok(I128{}, I2{}, std::false_type{}) &&
                             ok(integral_constant<int, 192>{}, I1{}, std::false_type{}) &&
                             ok(integral_constant<int, 256>{}, I1{}, std::false_type{});
           return ready ? cudaSuccess : cudaErrorInvalidValue;
         }) == cudaSuccess;
}

// How many clusters of `splits` blocks of the dense K-slice kernel (block_m, tile_set) the current device runs at
// once (cudaOccupancyMaxActiveClusters; one block per SM), or 0 where the slices cannot run as clusters. Every
// instance takes one SM a block, so the bf16 one answers for all dtypes.
int awq_wgmma_cluster_slots(int64_t block_m, int64_t tile_set, int64_t splits) {
  using namespace awq_wgmma_detail;
  auto slots = [&](auto bm, auto tw) {
    constexpr int BM = decltype(bm)::value, TW = decltype(tw)::value;
    using T = __nv_bfloat16;
    if (!cluster_fits<BM, TW, false>(static_cast<int>(splits))) return 0;
    if (allow_smem<T, T, BM, TW, true, false, false, false>() != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(splits));
    cfg.blockDim = dim3(kThreads<BM, TW> + kProducerThreads<BM, TW>);
    cfg.dynamicSmemBytes = Stage<BM, false>::kSmem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(splits);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, awq_wgmma_kernel<T, T, BM, TW, true, false, false, false>, &cfg) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  };
  return with_dense_shape(block_m, tile_set, 0, slots);
}

// Rows of the x image (M rounded up to whole blocks of block_m).
int64_t awq_wgmma_image_rows(int64_t M, int64_t block_m) { return (M + block_m - 1) / block_m * block_m; }

// Outputs of one block (block_m rows x 64 tile_set columns per warpgroup): the fp32 partials a tile's K slice writes.
static int64_t wgmma_groups(int64_t block_m, int64_t tile_set) { return tile_set == 2 || block_m >= 192 ? 2 : 1; }
int64_t awq_wgmma_block_outputs(int64_t block_m, int64_t tile_set) {
  return block_m * 64 * tile_set * wgmma_groups(block_m, tile_set);
}

// Number of blocks along the columns x rows (the op allocates tiles - dp_tiles tickets with splits > 1).
int64_t awq_wgmma_tiles(int64_t M, int64_t N, int64_t block_m, int64_t tile_set) {
  const int64_t sets = 4 / (tile_set * wgmma_groups(block_m, tile_set));  // tile sets on blocks of their own
  return (N / 64 + 3) / 4 * sets * ((M + block_m - 1) / block_m);
}

// dtype: x, bias and out (0 = bf16, 1 = fp16); scale_dtype as in awq_mma.cu. (block_m, tile_set): (64, 4), (64, 2),
// (128, 2), (192, 1) or (256, 1) rows of x per block x column tiles per warp. The caller (ops.cpp) has checked shapes,
// alignment, N % 64 == 0, group_size % 64 == 0 (or 32 with producer_warp), K % group_size == 0, 0 <= splits <= K / 64,
// that the device is an
// sm_90 one; `x_image` holds awq_wgmma_image_rows(M, block_m) * K elements; with splits > 1, `tickets` holds
// awq_wgmma_tiles(...) - dp_tiles zeros and `partial` splits * (tiles - dp_tiles) * awq_wgmma_block_outputs floats;
// producer_warp (WS): see the kernel and producer_pool_ok; dp_tiles: see launch. splits == 0: stream-K on dp_tiles
// blocks (WS only; whole tiles where the WS kernel cannot run or K / 64 is odd), at most one per pair of chunks (ops.cpp
// caps dp_tiles at tiles * (K / 128)), `tickets` holds awq_wgmma_tiles(...) zeros and `partial` 2 * dp_tiles *
// awq_wgmma_block_outputs floats.
cudaError_t awq_wgmma_launch(int dtype, int scale_dtype, const void* x, void* x_image, const int32_t* qweight,
                             const void* scales, const int32_t* qzeros, const void* bias, void* out, float* partial,
                             unsigned int* tickets, int64_t M, int64_t N, int64_t K, int64_t group_size,
                             int64_t splits, int64_t block_m, int64_t tile_set, int64_t group_m, bool producer_warp,
                             int64_t dp_tiles, cudaStream_t stream, const int32_t* perm, bool cluster) {
  using namespace awq_wgmma_detail;
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  const int gs = static_cast<int>(group_size), s = static_cast<int>(splits), gm = static_cast<int>(group_m);
  const int dp = static_cast<int>(dp_tiles);
  return awq_mma_detail::dispatch_dtypes(dtype, scale_dtype, [&](auto tv, auto sv) {
    using T = decltype(tv);
    using S = decltype(sv);
    auto run = [&](auto bm, auto tw) {
      constexpr int BM = decltype(bm)::value, TW = decltype(tw)::value;
      if (gs == 32) {  // groups of 32: built for the warp-specialized kernel only (whole tiles, K slices, stream-K)
        if (!producer_warp) return cudaErrorInvalidValue;
        if (s == 0 && k / 64 % 2 == 0 && producer_pool_ok<T, S, BM, TW, false, true, true>())
          return launch<T, S, BM, TW, true, false, true, true>(x, x_image, qweight, scales, qzeros, bias, out,
                                                               partial, tickets, m, n, k, gs, 0, gm, dp, stream, {}, 1,
                                                               perm);
        if (!producer_pool_ok<T, S, BM, TW, false, false, true>()) return cudaErrorInvalidValue;
        return launch<T, S, BM, TW, true, false, false, true>(
            x, x_image, qweight, scales, qzeros, bias, out, partial, tickets, m, n, k, gs, s == 0 ? 1 : s, gm,
            s == 0 ? 0 : dp, stream, {}, 1, perm, cluster && cluster_fits<BM, TW, true>(s) && dp == 0);
      }
      // Stream-K needs the producer and whole pairs of chunks (see the kernel); otherwise splits 0 runs whole tiles
      // (the dispatch's config must not turn into an error; ops.cpp refuses splits 0 without producer_warp itself).
      if (s == 0 && k / 64 % 2 == 0 && producer_warp && producer_pool_ok<T, S, BM, TW, false, true>())
        return launch<T, S, BM, TW, true, false, true>(x, x_image, qweight, scales, qzeros, bias, out, partial,
                                                       tickets, m, n, k, gs, 0, gm, dp, stream, {}, 1, perm);
      const int whole_s = s == 0 ? 1 : s, whole_dp = s == 0 ? 0 : dp;
      // cluster where it fits, else the same slices through partials (ops.cpp has allocated them either way)
      if (producer_warp && producer_pool_ok<T, S, BM, TW>())
        return launch<T, S, BM, TW, true>(x, x_image, qweight, scales, qzeros, bias, out, partial, tickets, m, n, k,
                                          gs, whole_s, gm, whole_dp, stream, {}, 1, perm,
                                          cluster && cluster_fits<BM, TW, false>(s) && dp == 0);
      return launch<T, S, BM, TW, false>(x, x_image, qweight, scales, qzeros, bias, out, partial, tickets, m, n, k,
                                         gs, whole_s, gm, whole_dp, stream, {}, 1, perm);
    };
    return with_dense_shape(block_m, tile_set, cudaErrorInvalidValue, run);
  });
}

// Grouped (MoE) form: x [X, K]; expert weights qweight [E, N / 64, K * 8], scales [E, K/G, N], qzeros [E, K/G, N/8];
// sorted_rows [B * block_m] and block_expert [B] from moe_align with block_m (see Grouped); optional shared expert
// (id E) tensors of one routed expert's shapes. Writes the fp32 sums of every real routed row to partial [num_rows, N]
// (one K slice). x_image holds B * block_m * K elements. Whole tiles only (no K slices): the row blocks of many
// experts fill the GPU. The caller (ops.cpp) has checked shapes, dtypes, alignment and the device.
cudaError_t awq_wgmma_moe_launch(int dtype, int scale_dtype, const void* x, void* x_image, const int32_t* qweight,
                                 const void* scales, const int32_t* qzeros, const int32_t* shared_qweight,
                                 const void* shared_scales, const int32_t* shared_qzeros, const int32_t* sorted_rows,
                                 const int32_t* block_expert, float* partial, int64_t num_rows, int64_t x_row_div,
                                 int64_t blocks, int64_t N, int64_t K, int64_t E, int64_t group_size, int64_t block_m,
                                 int64_t tile_set, bool producer_warp, cudaStream_t stream) {
  using namespace awq_wgmma_detail;
  const int m = static_cast<int>(blocks * block_m), n = static_cast<int>(N), k = static_cast<int>(K);
  const int gs = static_cast<int>(group_size);
  return awq_mma_detail::dispatch_dtypes(dtype, scale_dtype, [&](auto tv, auto sv) {
    using T = decltype(tv);
    using S = decltype(sv);
    const Grouped<S> gp{sorted_rows, block_expert, reinterpret_cast<const uint4*>(shared_qweight),
                        static_cast<const S*>(shared_scales), reinterpret_cast<const uint32_t*>(shared_qzeros),
                        static_cast<int>(num_rows), static_cast<int>(E)};
    auto run = [&](auto bm, auto tw) {
      constexpr int BM = decltype(bm)::value, TW = decltype(tw)::value;
      // group_m 8: the row blocks of one expert, adjacent in the sort, run together on the same columns
      if (gs == 32) {  // groups of 32: the warp-specialized kernel only
        if (!(producer_warp && producer_pool_ok<T, S, BM, TW, true, false, true>())) return cudaErrorInvalidValue;
        return launch<T, S, BM, TW, true, true, false, true>(x, x_image, qweight, scales, qzeros, nullptr, nullptr,
                                                             partial, nullptr, m, n, k, gs, 1, 8, 0, stream, gp,
                                                             static_cast<int>(x_row_div));
      }
      if (producer_warp && producer_pool_ok<T, S, BM, TW, true>())
        return launch<T, S, BM, TW, true, true>(x, x_image, qweight, scales, qzeros, nullptr, nullptr, partial,
                                                nullptr, m, n, k, gs, 1, 8, 0, stream, gp,
                                                static_cast<int>(x_row_div));
      return launch<T, S, BM, TW, false, true>(x, x_image, qweight, scales, qzeros, nullptr, nullptr, partial, nullptr,
                                               m, n, k, gs, 1, 8, 0, stream, gp, static_cast<int>(x_row_div));
    };
    using std::integral_constant;
    if (block_m == 64 && tile_set == 2) return run(integral_constant<int, 64>{}, integral_constant<int, 2>{});
    if (block_m == 128 && tile_set == 2) return run(integral_constant<int, 128>{}, integral_constant<int, 2>{});
    return cudaErrorInvalidValue;
  });
}

}  // namespace torchforge
