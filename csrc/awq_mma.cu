// W4A16 for decode batches (1..16 rows per block, more rows through more blocks) on tensor cores,
// from AWQ codes stored in MMA fragment order ("mma layout", built once at load time by
// torchforge.ops.awq_mma_layout; scales and qzeros stay in vLLM's AWQ layout):
//
//   out[m, n] = sum_k x[m, k] * (q[k, n] - z[k / G, n]) * s[k / G, n]  (+ bias[n])
//
// Swap AB: out.T = W @ x.T with mma.sync.m16n8k16: the weight is the 16-row A operand (16 output
// columns x 16 k), the activations the 8-column B operand (16 k x 8 rows of x), so one row of x
// wastes no weight traffic and 16 rows cost two MMAs per weight fragment.
// * Layout: int32 [N / 64, K * 8]. For a block of 64 output columns, a 64-k chunk c and a k-step
//   s (16 k), lane L of a warp reads one uint4: its A fragment for each of the 4 column tiles T,
//   so a warp reads 512 contiguous bytes per k-step. In a word, nibble p holds the code of column
//   64 cb + 16 T + L / 4 + 8 (p & 1) at k = 64 c + 16 (L % 4) + 4 s + 2 ((p >> 1) & 1) + (p >> 2).
//   MMA k-index 2t + e (e < 2) is mapped to k = 16t + 4s + e and 2t + 8 + e to 16t + 4s + 2 + e
//   (the same for A and B, and a dot product does not care about the order of k): lane t then
//   reads x[m, 16t .. 16t + 15] of each chunk as two 16-byte loads, and register r of its A
//   fragment is nibbles (r, r + 4) of the word: one shift and one LOP3 per 2 weights,
//   `(w >> 4r) & 0x000F000F | magic`, with no reordering at run time.
// * magic: 128 in bf16 (0x4300), 1024 in fp16 (0x6400), where the ulp is 1, so OR-ing a code in
//   gives c + q exactly. The MMA sums x (c + q) per group; an MMA with all-ones A gives sum x for
//   each row of x in the same fragment positions (two row tiles: one MMA of x as A against all-ones B, then shuffles;
//   awq_mma.cuh, XS16); and once per group, in fp32:
//   acc += s * (sum x (c + q) - (c + z) sum x). No per-weight subtract or multiply. Two row tiles of symmetric codes
//   subtract c + 8 from each A register instead (exact) and need no sum of x (awq_mma.cuh, ZA). Except with groups
//   of 32 (G32), where an MMA's k spans two groups: each register is then dequantized to the reference's (q - z) s
//   (awq_mma.cuh, item_dq). H100, 16 rows, bf16 x, fp16 scales: 18432x7168 0.042 ms (2.3x bf16), 7168x7168 0.021
//   (1.8x); the AWQ layout's Triton kernel, which groups of 32 ran before, 0.096 / 0.047 (BENCHMARKS.md, thirty-first
//   session).
// * Block = 8 warps (or 4: mma_cuda_warps, mma_cuda_launch_config) on 64 output columns and 16 rows
//   of x; the warps (and with splits > 1 the blocks along grid.z) take work items of 1 or 2 chunks (64 or 128 k,
//   inside one quantization group) in turn: 4 or 8 x 16 B in flight per thread. Warps are summed through shared
//   memory;
//   K slices as in awq_gemv.cu: the last block of a tile to finish (atomic ticket, reset for the
//   next launch) adds them in slice order, the slices outermost. Tried and dropped on the H100: requesting the next
//   item's words before computing on this one (register double buffer) within 128 registers: 3-15% slower (it is
//   kept as the prefetching loop, accumulate<..., PF = true>, at 255 registers where the grid gives 8 warps per SM
//   anyway, thirteenth session); "stream mode", one block per SM on an equal share of all tiles' items, tiles cut
//   across blocks and their fp32 partials added in order: 3-4 us slower on every swept shape (thirteenth); blocks of
//   2 or 4 groups of 16 rows sharing each weight word through L1 (for M = 32..128): 5-45% slower
//   than one 16-row group per block re-reading the words from L2.
//   Also tried (2026-11-22, BENCHMARKS.md "sixth session") for 16..128 rows: blocks of 8 warps on 8 column blocks
//   (512 columns) walking K together, x staged in shared memory once for all 8 (8x less x traffic), 16 or 32 rows
//   per block; first with the words loaded into registers, then with words and x through a 4-stage cp.async
//   pipeline. Both ran 1.2-7x slower than this kernel at every M and K-slice count (1 or 2 8-warp blocks per SM
//   at 118-255 registers; ncu at M = 64: 2 warps per scheduler, 7.3 cycles per issue, 20% of memory and SM
//   throughput). This kernel at M = 64 is not L2 bound (ncu: L2 39%, SM throughput 64%, 16 warps per SM):
//   the ALU pipe is its busiest (67%, the dequantization's LOP3 / SHF). 4 row tiles (32 rows) per warp, which
//   halves the dequantization per row (709 instead of 2 x 554 SASS instructions per item) at 254 registers (one
//   block per SM): 3-8% faster at M = 64, 4-20% slower at M = 32..48 on the DeepSeek-V3 shapes; not kept.
//   Blocks on two column blocks, half the warps on each walking the same items, so that the second half's x loads
//   hit L1 (twenty-eighth session, after TORCHFORGE_MMA_ABLATE=1 put 10% of the 16-row time on x): right, but the
//   grid of half as many blocks lost more than the L2 reads saved: 7168x7168 at 16 rows 16.6 against 14.4 us, at
//   one row 13.9 against 11.3; 18432x7168 at 16 rows 34.7 against 33.1 (best configuration of each build).
//   A weight ring per warp in shared memory (thirty-sixth session, H200): each item's words (2 or 4 KB contiguous) by
//   one bulk copy (cp.async.bulk + mbarrier) 6 / CPG items ahead, so 3x the bytes in flight per SM without
//   registers; same bits. Slower at every swept M and K-slice count (best of each, us): 18432x7168 at one row 27.5
//   against 23.3, at 16 rows 40.8 against 29.9; 7168x7168 at one row 13.0 against 10.8 (prefetching loop), 17.8
//   against 13.7 at 16.
//   Thirty-seventh session (H200, BENCHMARKS.md), both dropped: a rolling L2 prefetch, lane 0 of each warp asking
//   for its item 1-4 rounds ahead (cp.async.bulk.prefetch.L2, the distance a kernel parameter so that no register
//   spilled): slower at every distance in every configuration near the best (18432x7168 at one row, as dispatched,
//   23.7 us without, 27.2-31.5 with; 16 rows 30.5 against 32.1-38.3; faster by up to 1.5 us only in single-slice
//   configurations that stayed 14-87% slower than the dispatched one); and one 8-row tile's plain loop built for 24
//   or 32 warps per SM (78 registers without spills, 64 with 104 bytes spilled): the best configuration at 24 (2
//   slices, 23.4 us) no faster than at 16 (3 slices, 23.3), 32 never the fastest. bench/decode_read_ceiling.py: a
//   streaming read of that layer's 68.6 MB takes 16.7 us, its words read in this kernel's order (3 slices of 4-warp
//   blocks, no arithmetic) 17.6, cuBLAS bf16 on a weight of the same bytes 21.2; the kernel's 23.2 is 72% of the
//   read. Under ncu (SM clock held at 1.32 GHz, about 2/3 of its boost) it took 31.8 us (1.36x) while bf16 took
//   73.3 (71.7 in graphs): the time mostly follows the SM clock, so what is left is the arithmetic between a warp's
//   loads, not the DRAM. Kept from that: with one 8-row tile of x the plain loop rolls its registers (awq_mma.cuh,
//   accumulate), each word and chunk of x of the warp's next item requested as soon as this item's MMAs are done with
//   the register, without a second buffer (127 registers, no spills): 18432x7168 at one row 23.2-23.7 -> 22.3-22.4
//   us (3.03-3.11x bf16), at 8 rows 23.8 -> 22.8.
//   Thirty-eighth session (H200), both dropped: the next item's scale row and zero words asked for ahead of load_group
//   (one prefetch.global.L1 or .L2 from two lanes as the next item's words go out; a plain loop at 9-16 rows: as its
//   own words go out): slower everywhere (18432x7168 at one row 23.4 us without, 24.2-24.3 with; 16 rows 30.6 against
//   31.6; the MoE layer at one token 0.061 against 0.064 ms); and the 9-16-row plain loop rolled like the one-tile
//   loop, built for 12 warps per SM (168 registers, no spills): 18432x7168 at 16 rows 34.8 against 29.9 us in the
//   dispatched configuration (3 slices, 4 warps), 31.6 at best (1 slice) against 29.9; on 7168x7168 it helped the
//   4-warp configurations (16.6 against 18.4 us in 2 slices) but none reached the dispatched 8-warp one (13.8).
//   Forty-first session (H200), both dropped: "stream mode", a grid of as many blocks as the SMs hold at once, each
//   on an equal contiguous range of all column blocks' items (column block major), its warps taking the range's
//   items in turn and flushing each column block they meet (shared-memory sum, then a partial with a ticket per
//   column block and the last block adding them in block order), so that no block runs in a second round: (a) 4-warp
//   blocks, 4 per SM, the rolling loop per column block: 18432x7168 24.3 us at one row against 22.5 (3 slices), 30.8
//   against 29.3 at 16 rows, 7168x7168 14.1 against 10.0; (b) 8-warp blocks, one per SM, the prefetching loop running
//   on across column blocks: 27.3 / 35.0 on 18432x7168 (1-slice prefetching loop 26.8 / 34.8), 7168x7168 15.0 against
//   10.0. Bits within tolerance, sanitizer-clean. K slices 5, 7, 9 and 14 (fewer items a warp, more rounds) were
//   slower than 3 in the same order; so neither the second round of blocks nor the short last one is what costs.
//   Forty-second session (H200), all three dropped. ncu's stall samples by instruction (bench/ncu_decode_stalls.sh) put
//   42% of 18432x7168's one-row samples on the fold's first use of a scale: load_group asks for the item's scales only
//   after its MMAs, and each 128-byte scale row is read by one warp, from DRAM. (a) The group's scale (and zero) words
//   asked for with the next item's layout words, one 32-bit word a lane, spread by shuffles at the fold, the next
//   item's first chunk's loads held before its second chunk's MMAs by a __syncwarp: the wait moved to the words and
//   the time stayed (22.3 us symmetric; zeros read 23.1-23.4 against 22.2, 8 rows 23.4 against 22.6-22.8); with two
//   row tiles every placement spilled (96-116 bytes in registers, 108-164 staged by cp.async). (b) The rolling loop for
//   two row tiles on items of 64 k (128 registers, no spills): 18432x7168 at 16 rows 30.5 against 29.3 (the plain loop
//   on 128 k), 7168x7168 14.7 against 13.4. (c) One row with x's row in shared memory (cp.async, read per chunk), which
//   took the rolling loop to 95-96 registers for 5 blocks of 4 warps per SM: 31.3 against 22.5 us as dispatched.
//   ncu (bench/ncu_read_vs_decode.sh): bench/decode_read_ceiling.py's read of the same words in the same order runs
//   24.5 warps per SM (56 registers) against this kernel's 13.7 (114), for the same 68 MB from DRAM.
//   Forty-third session (H200), where the time goes (bench/mma_decode_ablation.sh: timing-only builds, us, 18432x7168,
//   symmetric): at one row as dispatched (3 slices of 4 warps) 22.1-22.4; with nothing read from memory (words, x,
//   scales made in registers) 15.6; with the loads and no arithmetic 20.1; without the words only 17.2. In one slice:
//   22.0, 17.1, 16.5. So the 3-slice grid's loads alone (its second round of blocks, the partials) take 90% of its
//   time and its arithmetic alone 70%, and one slice swaps them. Half the MMAs changed nothing at one row (21.8).
//   Forty-fourth session (H200, BENCHMARKS.md), both dropped: (a) the zero in A for zeros read at 9-16 rows (the
//   group's zero words and scales loaded with the item's words, each column tile's two zeros in one register, folded
//   into HADD2's .H0_H0 / .H1_H1 operands): 18432x7168 at 16 rows 29.7 against 29.7 us, 12 rows 29.2 against 29.4,
//   7168x7168 13.5 against 13.5 (the 4-warp loop spilled 76 bytes; scales loaded after the MMAs: 88 bytes, 31.2; zero
//   words as two 16-byte loads: 100 bytes); the prefetching loop, which holds the values already, 14.3 against 14.4.
//   (b) One row in 8-warp blocks on 64-k items at 80 registers (3 blocks per SM, one round of blocks): 18432x7168
//   23.6 us in 1 slice, 23.2 in 2, against 22.4 as dispatched; 24576x7168 24.0 against 23.9.
//
// This file needs only the CUDA headers: the torch op is in ops.cpp.
#include <type_traits>

#include "awq_mma.cuh"
#include "pdl.cuh"

namespace torchforge {
namespace awq_mma_detail {

// W warps per block (8, or 4: mma_cuda_warps, mma_cuda_launch_config); 16 warps per SM either way
// (<= 128 registers). PF: the prefetching loop (accumulate, awq_mma.cuh), whose two item buffers need up to 255 registers
// (16 rows): 8 warps per SM, one block of 8 or two of 4 (three of 4 at 168 registers spilled 848 bytes).
// Timing-only builds (bench/wgmma_ablation.sh, results wrong): 1 = every lane reads row 0's x, so x costs what it
// costs at one row (how much of the 16-row time is the x traffic from L2; a block reads 16 x K of x, as many bytes as
// its int4 words). Twenty-eighth session, H100, 16 rows as dispatched: 7168x7168 14.6 -> 13.2 us, 18432x7168 33.1 ->
// 30.9 (30.0 in one slice of 4-warp blocks). So even with x free the 7168x7168 decode misses 3x bf16 (12.6 us).
// (TORCHFORGE_MMA_ABLATE and its other bits: awq_mma.cuh.)

template <int W, bool PF>
constexpr int kMinBlocks = PF ? 8 / W : 16 / W;

template <typename T, typename S, int NT, int CPG, int W, bool PF, bool G32, bool R1, bool SYM>
__global__ void __launch_bounds__(32 * W, (kMinBlocks<W, PF>))
    awq_mma_kernel(const T* __restrict__ x, const uint4* __restrict__ qw, const S* __restrict__ sc,
                   const uint32_t* __restrict__ qz, const T* __restrict__ bias, T* __restrict__ out,
                   float* __restrict__ partial, unsigned int* __restrict__ tickets, int M, int N, int K,
                   int chunks_per_group, int splits, int prefetch_rounds) {
  using Tr = Traits<T>;
  constexpr int kBlockThreads = 32 * W;
  __shared__ float red[W * kRows * kPad];
  __shared__ bool is_last;
  const int mc = blockIdx.x;  // fastest: blocks on the same columns run together and share the weight in L2
  const int cb = blockIdx.y;
  const int slice = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int chunks = K / 64;
  const int items = chunks / CPG;
  const int workers = splits * W;

  const uint4* wbase = qw + static_cast<size_t>(cb) * chunks * 128 + lane;  // 4 k-steps x 32 lanes per chunk
  const uint4* xb = reinterpret_cast<const uint4*>(x + 16 * t);
  int xoff[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int m = mc * kRows + 8 * j + g;  // the B fragment's column (row of x) of this lane
    xoff[j] = (m < M && !(TORCHFORGE_MMA_ABLATE & 1) ? m : 0) * (K / 8);
  }

  // The words of the block's first items (two rounds of its warps: what they load first) go to L2 in two bulk
  // requests at once, ahead of the warps' own loads, and, with PDL (pdl.cuh), while the kernel before this one
  // finishes; x, out, partials and tickets are touched only after the wait. The launcher asks for it with one row
  // block and whole K per block only, where it measured faster (H100, twenty-second session, us with and without:
  // 7168x7168 11.6 / 12.7 at M = 1 and 14.6 / 15.2 at 16; 18432x7168 27.3 / 28.1 at M = 1), and for at most a third
  // of the block's items (24576x1536 at M = 1: 12 items per block, 4 warps: 8.8 us with one round, 10.2 with two,
  // 9.3 with none). With K slices, whose two rounds cover 43-100% of the weight, or several row blocks on the same
  // words it was 4-10% slower (18432x7168 at M = 16 in 3 slices: 36.2 / 33.2; 4096x4096 at 16: 9.1 / 8.2).
  if (threadIdx.x < prefetch_rounds) {  // 0, 1 or 2
    const int item = threadIdx.x * workers + slice * W;  // the round's W items are contiguous
    if (item < items)
      pdl::prefetch_l2(qw + (static_cast<size_t>(cb) * chunks + item * CPG) * 128, min(W, items - item) * CPG * 2048u);
  }
  pdl::wait();

  float acc[4][NT][4];
  accumulate<T, S, NT, CPG, PF, G32, R1, SYM>(acc, wbase, sc, qz, xb, xoff, N, cb, items, slice * W + warp, workers,
                                             chunks_per_group, g);
  // The next kernel may launch once every block is past its weights. Not earlier: blocks of a next decode GEMM
  // resident from the start prefetched weights that this one's stream evicted from L2 before they were used
  // (18432x7168 at M = 1: 0.031 against 0.027 ms, twenty-second session).
  pdl::launch_dependents();
  stash<NT>(red, acc, warp, g, t);
  __syncthreads();

  constexpr int kOut = NT * 8 * kCols;  // outputs of this block (rows x columns)
  constexpr int kPer = kOut / kBlockThreads;
  float sum[kPer];
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int idx = threadIdx.x + r * kBlockThreads;
    const int row = idx / kCols, col = idx % kCols;
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < W; ++wi) v += red[(wi * kRows + row) * kPad + col];
    sum[r] = v;
  }
  const int tile = cb * gridDim.x + mc;
  if (splits == 1) {
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int idx = threadIdx.x + r * kBlockThreads;
      const int m = mc * kRows + idx / kCols, n = cb * kCols + idx % kCols;
      if (m < M)
        out[static_cast<size_t>(m) * N + n] = Tr::from_f(bias != nullptr ? sum[r] + Tr::to_f(bias[n]) : sum[r]);
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int idx = threadIdx.x + r * kBlockThreads;
    const int m = mc * kRows + idx / kCols, n = cb * kCols + idx % kCols;
    if (m < M) partial[(static_cast<size_t>(slice) * M + m) * N + n] = sum[r];
  }
  __threadfence();  // this block's partials are visible before its ticket is taken
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&tickets[tile], 1u) == static_cast<unsigned>(splits - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Slice order (deterministic), the slices outermost so that a thread's kPer loads of a slice are in flight together
  // (with the slices innermost each load waited for the one before, as in awq_wgmma.cu's reduction before its fix).
  // L2 reads (__ldcg), not a stale L1.
#pragma unroll
  for (int r = 0; r < kPer; ++r) sum[r] = 0.0f;
  for (int sl = 0; sl < splits; ++sl) {
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int idx = threadIdx.x + r * kBlockThreads;
      const int m = mc * kRows + idx / kCols, n = cb * kCols + idx % kCols;
      if (m < M) sum[r] += __ldcg(partial + (static_cast<size_t>(sl) * M + m) * N + n);
    }
  }
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int idx = threadIdx.x + r * kBlockThreads;
    const int m = mc * kRows + idx / kCols, n = cb * kCols + idx % kCols;
    if (m < M)
      out[static_cast<size_t>(m) * N + n] = Tr::from_f(bias != nullptr ? sum[r] + Tr::to_f(bias[n]) : sum[r]);
  }
  if (threadIdx.x == 0) tickets[tile] = 0u;
}

// x [M, K] -> xp [M, K], xp[m, i] = x[m, perm[i]]: an act-order layer's features in the order its weight rows are
// stored (sorted by group, torchforge.nn.gptq_linear), 8 outputs a thread. A kernel of its own: reading x through
// perm inside the decode kernel (16 2-byte loads per 16 k of a lane) measured 1.3x (one row) to 6.5x (16 rows) slower
// than the kernel on a gathered copy (18432x7168, H100): at 16 rows each 2-byte load cost a 32-byte sector from L2.
// It lets the decode kernel launch at once (PDL), which prefetches its first weights into L2 while this one runs.
template <typename T>
__global__ void gather_cols_kernel(const T* __restrict__ x, const int* __restrict__ perm, T* __restrict__ xp, int M,
                                   int K) {
  pdl::wait();  // x comes from the kernels before this one
  pdl::launch_dependents();
  const int64_t piece = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (piece >= static_cast<int64_t>(M) * (K / 8)) return;
  const int m = static_cast<int>(piece / (K / 8)), k = static_cast<int>(piece % (K / 8)) * 8;
  const unsigned short* row = reinterpret_cast<const unsigned short*>(x) + static_cast<size_t>(m) * K;
  const int4 p0 = __ldg(reinterpret_cast<const int4*>(perm + k)), p1 = __ldg(reinterpret_cast<const int4*>(perm + k) + 1);
  const auto pair = [&](int a, int b) {
    return perm_elem<T, true>(row, a, K) | (perm_elem<T, true>(row, b, K) << 16);
  };
  reinterpret_cast<uint4*>(xp)[piece] = make_uint4(pair(p0.x, p0.y), pair(p0.z, p0.w), pair(p1.x, p1.y),
                                                   pair(p1.z, p1.w));
}

template <typename T, typename S, int NT, int CPG, int W, bool PF, bool G32 = false, bool R1 = false,
          bool SYM = false>
cudaError_t launch(const void* x, const int32_t* qw, const void* sc, const int32_t* qz, const void* bias, void* out,
                   float* partial, unsigned int* tickets, int M, int N, int K, int group_size, int splits,
                   cudaStream_t stream, const int32_t* perm, void* x_perm) {
  if (perm != nullptr) {  // gather x[:, perm] first; the kernel below then reads that copy
    const int64_t pieces = static_cast<int64_t>(M) * (K / 8);
    const cudaError_t err = pdl::launch(gather_cols_kernel<T>, true, dim3(static_cast<unsigned>((pieces + 255) / 256)),
                                        dim3(256), 0, stream, static_cast<const T*>(x), perm, static_cast<T*>(x_perm),
                                        M, K);
    if (err != cudaSuccess) return err;
    x = x_perm;
  }
  const dim3 grid((M + kRows - 1) / kRows, N / kCols, splits);
  // The L2 prefetch at the kernel's start (see the kernel): with one row block and whole K per block only, and as many
  // rounds of items (2 or 1) as stay within a third of the block's items.
  const int items = K / 64 / CPG;
  const int rounds = splits == 1 && M <= 16 ? (6 * W <= items ? 2 : 3 * W <= items ? 1 : 0) : 0;
  return pdl::launch(awq_mma_kernel<T, S, NT, CPG, W, PF, G32, R1, SYM>, perm == nullptr, grid, dim3(32 * W), 0, stream,
                     static_cast<const T*>(x), reinterpret_cast<const uint4*>(qw), static_cast<const S*>(sc),
                     reinterpret_cast<const uint32_t*>(qz), static_cast<const T*>(bias), static_cast<T*>(out), partial,
                     tickets, M, N, K, group_size / 64, splits,
                     pdl::start_prefetch() >= 0 ? pdl::start_prefetch() : rounds);
}

}  // namespace awq_mma_detail

// dtype: x, bias and out (0 = bf16, 1 = fp16); scale_dtype: scales (0 = bf16 with bf16 x, 1 = fp16). The caller
// (ops.cpp) has checked shapes, alignment, N % 64 == 0, group_size 32 (item_chunks 1) or a multiple of 64 *
// item_chunks (1 or 2),
// K % 64 == 0 and K % group_size == 0, 1 <= splits <= K / (64 * item_chunks), warps 4 or 8 per block, prefetch only with
// item_chunks 2 (else cudaErrorInvalidValue);
// `tickets` holds ceil(M / 16) * N / 64 zeros and `partial` splits * M * N floats (splits > 1); perm: nullptr, or
// int32 [K] (16-byte aligned, values in [0, K)) that x is read through (x[:, perm], gathered into x_perm [M, K]);
// symmetric: every zero point is 8, so qzeros is not read (except with groups of 32).
cudaError_t awq_mma_launch(int dtype, int scale_dtype, const void* x, const int32_t* qweight, const void* scales,
                           const int32_t* qzeros, const void* bias, void* out, float* partial,
                           unsigned int* tickets, int64_t M, int64_t N, int64_t K, int64_t group_size,
                           int64_t splits, int64_t item_chunks, int64_t warps, bool prefetch, cudaStream_t stream,
                           const int32_t* perm, void* x_perm, bool symmetric) {
  using namespace awq_mma_detail;
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  const int g = static_cast<int>(group_size), s = static_cast<int>(splits);
  if ((item_chunks != 1 && item_chunks != 2) || (warps != 4 && warps != 8)) return cudaErrorInvalidValue;
  return dispatch_dtypes(dtype, scale_dtype, [&](auto t, auto sv) {
    using T = decltype(t);
    using S = decltype(sv);
    const bool one_tile = m <= 8;  // one 8-row MMA tile of x is enough
    // one row (decode at batch 1): the fold leaves out the C elements of odd rows (awq_mma.cuh, fold R1)
    auto run = [&](auto nt, auto cpg, auto r1, auto sym) {
      constexpr int NT = decltype(nt)::value, CPG = decltype(cpg)::value;
      constexpr bool R1 = decltype(r1)::value, SYM = decltype(sym)::value;
      auto go = [&](auto kernel_launch) {
        return kernel_launch(x, qweight, scales, qzeros, bias, out, partial, tickets, m, n, k, g, s, stream, perm,
                             x_perm);
      };
      if (g == 32) {  // groups of 32: the per-register dequantization (awq_mma.cuh, item_dq), items of 64 k only
        if constexpr (CPG == 1 && !R1 && !SYM) {
          if (!prefetch)
            return warps == 4 ? go(launch<T, S, NT, CPG, 4, false, true>) : go(launch<T, S, NT, CPG, 8, false, true>);
        }
        return cudaErrorInvalidValue;
      }
      if constexpr (CPG == 2) {  // the prefetching loop is built for items of 128 k only (groups of 128, 256, ...)
        if (prefetch)
          return warps == 4 ? go(launch<T, S, NT, CPG, 4, true, false, R1, SYM>)
                            : go(launch<T, S, NT, CPG, 8, true, false, R1, SYM>);
      }
      if (prefetch) return cudaErrorInvalidValue;
      // not R1 for the plain loop of 8 warps on items of 128 k: there ptxas (CUDA 13.0) reloads addresses and kernel
      // parameters inside the loop at 128 registers, 486 SASS instructions per item against 449 without (410 with
      // 4 warps)
      return warps == 4 ? go(launch<T, S, NT, CPG, 4, false, false, R1, SYM>)
                        : go(launch<T, S, NT, CPG, 8, false, false, R1 && CPG == 1, SYM>);
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using Yes = std::true_type;
    using No = std::false_type;
    const bool one_row = m == 1 && g != 32;
    // symmetric: the caller's word that every zero point is 8 (not read then; groups of 32 read them anyway)
    auto pick = [&](auto nt, auto cpg, auto r1) {
      return symmetric && g != 32 ? run(nt, cpg, r1, Yes{}) : run(nt, cpg, r1, No{});
    };
    if (item_chunks == 1) {
      return one_row ? pick(I1{}, I1{}, Yes{}) : one_tile ? pick(I1{}, I1{}, No{}) : pick(I2{}, I1{}, No{});
    }
    return one_row ? pick(I1{}, I2{}, Yes{}) : one_tile ? pick(I1{}, I2{}, No{}) : pick(I2{}, I2{}, No{});
  });
}

}  // namespace torchforge
