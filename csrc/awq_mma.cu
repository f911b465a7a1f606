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
//   each row of x in the same fragment positions; and once per group, in fp32:
//   acc += s * (sum x (c + q) - (c + z) sum x). No per-weight subtract or multiply.
// * Block = 8 warps on 64 output columns and 16 rows of x; the warps (and with splits > 1 the
//   blocks along grid.z) take work items of 1 or 2 chunks (64 or 128 k, inside one quantization
//   group) in turn: 4 or 8 x 16 B in flight per thread. Warps are summed through shared memory;
//   K slices as in awq_gemv.cu: the last block of a tile to finish (atomic ticket, reset for the
//   next launch) adds them in slice order. Tried and dropped on the H100: requesting the next
//   item's words before computing on this one (register double buffer): 3-15% slower; blocks of
//   2 or 4 groups of 16 rows sharing each weight word through L1 (for M = 32..128): 5-45% slower
//   than one 16-row group per block re-reading the words from L2.
//
// This file needs only the CUDA headers: the torch op is in ops.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ptx_loads.cuh"
#include <type_traits>

namespace torchforge {
namespace awq_mma_detail {

using ptx::ld_stream;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 64;      // output columns per block: 4 MMA tiles of 16
constexpr int kRows = 16;      // rows of x per block: 2 MMA tiles of 8
constexpr int kPad = kCols + 4;

template <typename T>
struct Traits;
template <>
struct Traits<__nv_bfloat16> {
  static constexpr uint32_t kMagic2 = 0x43004300u;  // (128, 128)
  static constexpr uint32_t kOnes2 = 0x3F803F80u;   // (1, 1)
  static constexpr float kMagic = 128.0f;
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <>
struct Traits<__half> {
  static constexpr uint32_t kMagic2 = 0x64006400u;  // (1024, 1024)
  static constexpr uint32_t kOnes2 = 0x3C003C00u;
  static constexpr float kMagic = 1024.0f;
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// AWQ packs column 8w + j of a zero word at nibble (j / 2) + 4 (j % 2).
__device__ __forceinline__ int awq_shift(int col) { return 4 * (((col & 7) >> 1) + 4 * (col & 1)); }

// sum_k x[row] * W[col] for this lane's C fragments (4 column tiles x NT tiles of 8 rows): the warp takes work
// items first, first + workers, ... of `items` (CPG chunks of 64 k each, inside one quantization group).
// wbase: this column block's words + lane; xrow / xok: this lane's B-fragment rows of x (+ 16 t).
template <typename T, int NT, int CPG>
__device__ __forceinline__ void accumulate(float (&acc)[4][NT][4], const uint4* __restrict__ wbase,
                                           const __half* __restrict__ sc, const uint32_t* __restrict__ qz,
                                           const uint4* const (&xrow)[NT], const bool (&xok)[NT], int N, int cb,
                                           int items, int first, int workers, int chunks_per_group, int g) {
  using Tr = Traits<T>;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  for (int grp = first; grp < items; grp += workers) {
    uint4 w[CPG * 4];
#pragma unroll
    for (int i = 0; i < CPG * 4; ++i) w[i] = ld_stream(wbase + (static_cast<size_t>(grp) * CPG * 4 + i) * 32);
    float part[4][NT][4];
    float xs[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        xs[j][e] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) part[i][j][e] = 0.0f;
      }
    }
#pragma unroll
    for (int c = 0; c < CPG; ++c) {
      const int chunk = grp * CPG + c;
      uint4 xv[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (xok[j]) {
          xv[j][0] = __ldg(xrow[j] + chunk * 8);
          xv[j][1] = __ldg(xrow[j] + chunk * 8 + 1);
        } else {
          xv[j][0] = xv[j][1] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t b0[NT], b1[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          b0[j] = word(xv[j][s / 2], 2 * (s % 2));
          b1[j] = word(xv[j][s / 2], 2 * (s % 2) + 1);
          Tr::mma(xs[j], Tr::kOnes2, Tr::kOnes2, Tr::kOnes2, Tr::kOnes2, b0[j], b1[j]);
        }
        const uint4 ws = w[c * 4 + s];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t wv = word(ws, i);
          const uint32_t a0 = (wv & 0x000F000Fu) | Tr::kMagic2;
          const uint32_t a1 = ((wv >> 4) & 0x000F000Fu) | Tr::kMagic2;
          const uint32_t a2 = ((wv >> 8) & 0x000F000Fu) | Tr::kMagic2;
          const uint32_t a3 = ((wv >> 12) & 0x000F000Fu) | Tr::kMagic2;
#pragma unroll
          for (int j = 0; j < NT; ++j) Tr::mma(part[i][j], a0, a1, a2, a3, b0[j], b1[j]);
        }
      }
    }
    // once per item: acc += s * (part - (magic + z) * sum x) with its group's s and z; C rows g (e < 2) and
    // g + 8 (e >= 2)
    const int group = grp * CPG / chunks_per_group;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col0 = cb * kCols + 16 * i + g;
      const float s0 = __half2float(sc[static_cast<size_t>(group) * N + col0]);
      const float s1 = __half2float(sc[static_cast<size_t>(group) * N + col0 + 8]);
      const uint32_t* zrow = qz + static_cast<size_t>(group) * (N / 8) + col0 / 8;
      const float zc0 = Tr::kMagic + static_cast<float>((zrow[0] >> awq_shift(col0)) & 0xFu);
      const float zc1 = Tr::kMagic + static_cast<float>((zrow[1] >> awq_shift(col0)) & 0xFu);  // col0 + 8
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[i][j][0] = fmaf(s0, part[i][j][0] - zc0 * xs[j][0], acc[i][j][0]);
        acc[i][j][1] = fmaf(s0, part[i][j][1] - zc0 * xs[j][1], acc[i][j][1]);
        acc[i][j][2] = fmaf(s1, part[i][j][2] - zc1 * xs[j][2], acc[i][j][2]);
        acc[i][j][3] = fmaf(s1, part[i][j][3] - zc1 * xs[j][3], acc[i][j][3]);
      }
    }
  }
}

// C fragments of the 8 warps -> shared memory red[warp][row of x][column]: element e is column 16 i + g + 8 (e / 2),
// row 8 j + 2 t + (e % 2).
template <int NT>
__device__ __forceinline__ void stash(float* red, const float (&acc)[4][NT][4], int warp, int g, int t) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        red[(warp * kRows + 8 * j + 2 * t + (e & 1)) * kPad + 16 * i + g + 8 * (e >> 1)] = acc[i][j][e];
}

template <typename T, int NT, int CPG>
__global__ void __launch_bounds__(kThreads, 2)
    awq_mma_kernel(const T* __restrict__ x, const uint4* __restrict__ qw, const __half* __restrict__ sc,
                   const uint32_t* __restrict__ qz, const T* __restrict__ bias, T* __restrict__ out,
                   float* __restrict__ partial, unsigned int* __restrict__ tickets, int M, int N, int K,
                   int chunks_per_group, int splits) {
  using Tr = Traits<T>;
  __shared__ float red[kWarps * kRows * kPad];
  __shared__ bool is_last;
  const int mc = blockIdx.x;  // fastest: blocks on the same columns run together and share the weight in L2
  const int cb = blockIdx.y;
  const int slice = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int chunks = K / 64;
  const int items = chunks / CPG;
  const int workers = splits * kWarps;

  const uint4* wbase = qw + static_cast<size_t>(cb) * chunks * 128 + lane;  // 4 k-steps x 32 lanes per chunk
  const uint4* xrow[NT];
  bool xok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int m = mc * kRows + 8 * j + g;  // the B fragment's column (row of x) of this lane
    xok[j] = m < M;
    xrow[j] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(xok[j] ? m : 0) * K + 16 * t);
  }

  float acc[4][NT][4];
  accumulate<T, NT, CPG>(acc, wbase, sc, qz, xrow, xok, N, cb, items, slice * kWarps + warp, workers,
                         chunks_per_group, g);
  stash<NT>(red, acc, warp, g, t);
  __syncthreads();

  constexpr int kOut = NT * 8 * kCols;  // outputs of this block (rows x columns)
  constexpr int kPer = kOut / kThreads;
  float sum[kPer];
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int idx = threadIdx.x + r * kThreads;
    const int row = idx / kCols, col = idx % kCols;
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) v += red[(wi * kRows + row) * kPad + col];
    sum[r] = v;
  }
  const int tile = cb * gridDim.x + mc;
  if (splits == 1) {
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int idx = threadIdx.x + r * kThreads;
      const int m = mc * kRows + idx / kCols, n = cb * kCols + idx % kCols;
      if (m < M) out[static_cast<size_t>(m) * N + n] = Tr::from_f(bias != nullptr ? sum[r] + Tr::to_f(bias[n]) : sum[r]);
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int idx = threadIdx.x + r * kThreads;
    const int m = mc * kRows + idx / kCols, n = cb * kCols + idx % kCols;
    if (m < M) partial[(static_cast<size_t>(slice) * M + m) * N + n] = sum[r];
  }
  __threadfence();  // this block's partials are visible before its ticket is taken
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&tickets[tile], 1u) == static_cast<unsigned>(splits - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int idx = threadIdx.x + r * kThreads;
    const int m = mc * kRows + idx / kCols, n = cb * kCols + idx % kCols;
    if (m < M) {
      float total = 0.0f;
      for (int sl = 0; sl < splits; ++sl)  // slice order: deterministic; L2 reads, not a stale L1
        total += __ldcg(partial + (static_cast<size_t>(sl) * M + m) * N + n);
      out[static_cast<size_t>(m) * N + n] = Tr::from_f(bias != nullptr ? total + Tr::to_f(bias[n]) : total);
    }
  }
  if (threadIdx.x == 0) tickets[tile] = 0u;
}

// Grouped form for MoE experts: routed rows sorted by expert into blocks of NT * 8 (torchforge.ops.moe_align).
// Block b holds routed rows sorted_rows[b * NT * 8 + i] (R where padding) of expert block_expert[b] (E past the
// end: the block returns); routed row r reads x[r / x_row_div]. Each K slice writes its fp32 sums to
// partial[slice, r, :]; the caller's reduce kernel adds the slices and applies the epilogue (SiLU * up, or the
// router-weighted combine). Direct mode (sorted_rows null, decode: no more routed rows than experts): block b
// is routed row b alone, with expert block_expert[b] = expert_ids[b]; no sort, one 8-row MMA tile.
template <typename T, int NT, int CPG>
__global__ void __launch_bounds__(kThreads, 2)
    awq_mma_moe_kernel(const T* __restrict__ x, const uint4* __restrict__ qw, const __half* __restrict__ sc,
                       const uint32_t* __restrict__ qz, const int32_t* __restrict__ sorted_rows,
                       const int32_t* __restrict__ block_expert, float* __restrict__ partial, int R, int N, int K,
                       int E, int x_row_div, int chunks_per_group, int splits) {
  __shared__ float red[kWarps * kRows * kPad];
  const int b = blockIdx.x;
  const int cb = blockIdx.y;
  const int slice = blockIdx.z;
  const int e = block_expert[b];
  const bool direct = sorted_rows == nullptr;  // decode: block b is routed row b alone, block_expert its expert ids
  if (e < 0 || e >= E) {
    if (direct) {  // an expert id out of range: its row comes out NaN (no host sync to check the ids)
      for (int i = threadIdx.x; i < kCols; i += kThreads)
        partial[(static_cast<size_t>(slice) * R + b) * N + cb * kCols + i] = __int_as_float(0x7fc00000);
    }
    return;  // else: past the last block of the last expert
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int chunks = K / 64;
  const int items = chunks / CPG;
  const size_t groups = static_cast<size_t>(K / (64 * chunks_per_group));
  const uint4* wbase = qw + (static_cast<size_t>(e) * (N / kCols) + cb) * chunks * 128 + lane;
  const __half* sce = sc + static_cast<size_t>(e) * groups * N;
  const uint32_t* qze = qz + static_cast<size_t>(e) * groups * (N / 8);
  const uint4* xrow[NT];
  bool xok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int r = direct ? (8 * j + g == 0 ? b : R) : sorted_rows[b * NT * 8 + 8 * j + g];
    xok[j] = r >= 0 && r < R;
    xrow[j] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(xok[j] ? r / x_row_div : 0) * K + 16 * t);
  }
  float acc[4][NT][4];
  accumulate<T, NT, CPG>(acc, wbase, sce, qze, xrow, xok, N, cb, items, slice * kWarps + warp, splits * kWarps,
                         chunks_per_group, g);
  stash<NT>(red, acc, warp, g, t);
  __syncthreads();
  constexpr int kPer = NT * 8 * kCols / kThreads;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int idx = threadIdx.x + q * kThreads;
    const int row = idx / kCols, col = idx % kCols;
    const int r = direct ? (row == 0 ? b : R) : sorted_rows[b * NT * 8 + row];
    if (r < 0 || r >= R) continue;
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) v += red[(wi * kRows + row) * kPad + col];
    partial[(static_cast<size_t>(slice) * R + r) * N + cb * kCols + col] = v;
  }
}

template <typename T, int NT, int CPG>
cudaError_t launch(const void* x, const int32_t* qw, const void* sc, const int32_t* qz, const void* bias, void* out,
                   float* partial, unsigned int* tickets, int M, int N, int K, int group_size, int splits,
                   cudaStream_t stream) {
  const dim3 grid((M + kRows - 1) / kRows, N / kCols, splits);
  awq_mma_kernel<T, NT, CPG><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(x), reinterpret_cast<const uint4*>(qw), static_cast<const __half*>(sc),
      reinterpret_cast<const uint32_t*>(qz), static_cast<const T*>(bias), static_cast<T*>(out), partial, tickets,
      M, N, K, group_size / 64, splits);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_t(const void* x, const int32_t* qw, const void* sc, const int32_t* qz, const void* bias, void* out,
                     float* partial, unsigned int* tickets, int M, int N, int K, int group_size, int splits,
                     int item_chunks, cudaStream_t stream) {
  const bool one_tile = M <= 8;  // one 8-row MMA tile of x is enough
#define TF_MMA_LAUNCH(NT, CPG) \
  launch<T, NT, CPG>(x, qw, sc, qz, bias, out, partial, tickets, M, N, K, group_size, splits, stream)
  if (item_chunks == 1) return one_tile ? TF_MMA_LAUNCH(1, 1) : TF_MMA_LAUNCH(2, 1);
  if (item_chunks == 2) return one_tile ? TF_MMA_LAUNCH(1, 2) : TF_MMA_LAUNCH(2, 2);
#undef TF_MMA_LAUNCH
  return cudaErrorInvalidValue;
}

template <typename T, int NT>
cudaError_t launch_moe_nt(const void* x, const int32_t* qw, const void* sc, const int32_t* qz, const int32_t* rows,
                          const int32_t* block_expert, float* partial, int R, int N, int K, int E, int B,
                          int x_row_div, int group_size, int splits, int item_chunks, cudaStream_t stream) {
  const dim3 grid(B, N / kCols, splits);
#define TF_MMA_MOE(CPG)                                                                                          \
  awq_mma_moe_kernel<T, NT, CPG><<<grid, kThreads, 0, stream>>>(                                                 \
      static_cast<const T*>(x), reinterpret_cast<const uint4*>(qw), static_cast<const __half*>(sc),              \
      reinterpret_cast<const uint32_t*>(qz), rows, block_expert, partial, R, N, K, E, x_row_div, group_size / 64, \
      splits)
  if (item_chunks == 1) TF_MMA_MOE(1);
  else if (item_chunks == 2) TF_MMA_MOE(2);
  else return cudaErrorInvalidValue;
#undef TF_MMA_MOE
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_moe_t(int block_rows, const void* x, const int32_t* qw, const void* sc, const int32_t* qz,
                         const int32_t* rows, const int32_t* block_expert, float* partial, int R, int N, int K, int E,
                         int B, int x_row_div, int group_size, int splits, int item_chunks, cudaStream_t stream) {
  if (block_rows == 8)
    return launch_moe_nt<T, 1>(x, qw, sc, qz, rows, block_expert, partial, R, N, K, E, B, x_row_div, group_size,
                               splits, item_chunks, stream);
  if (block_rows == 16)
    return launch_moe_nt<T, 2>(x, qw, sc, qz, rows, block_expert, partial, R, N, K, E, B, x_row_div, group_size,
                               splits, item_chunks, stream);
  return cudaErrorInvalidValue;
}

}  // namespace awq_mma_detail

// dtype 0 = bf16, 1 = fp16 (x, bias, out). The caller (ops.cpp) has checked shapes, alignment,
// N % 64 == 0, group_size a multiple of 64 * item_chunks (1 or 2), K % group_size == 0,
// 1 <= splits <= K / (64 * item_chunks);
// `tickets` holds ceil(M / 16) * N / 64 zeros and `partial` splits * M * N floats (splits > 1).
cudaError_t awq_mma_launch(int dtype, const void* x, const int32_t* qweight, const void* scales,
                           const int32_t* qzeros, const void* bias, void* out, float* partial,
                           unsigned int* tickets, int64_t M, int64_t N, int64_t K, int64_t group_size,
                           int64_t splits, int64_t item_chunks, cudaStream_t stream) {
  using namespace awq_mma_detail;
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  const int g = static_cast<int>(group_size), s = static_cast<int>(splits), ic = static_cast<int>(item_chunks);
  if (dtype == 0) return launch_t<__nv_bfloat16>(x, qweight, scales, qzeros, bias, out, partial, tickets, m, n, k, g, s, ic, stream);
  if (dtype == 1) return launch_t<__half>(x, qweight, scales, qzeros, bias, out, partial, tickets, m, n, k, g, s, ic, stream);
  return cudaErrorInvalidValue;
}

// Grouped (MoE) launcher; dtype as above. The caller has checked shapes and alignment; block_rows (8 or 16) =
// sorted_rows.numel() / B; partial holds splits * R * N floats.
cudaError_t awq_mma_moe_launch(int dtype, int64_t block_rows, const void* x, const int32_t* qweight,
                               const void* scales, const int32_t* qzeros, const int32_t* sorted_rows,
                               const int32_t* block_expert, float* partial, int64_t R, int64_t N, int64_t K,
                               int64_t E, int64_t B, int64_t x_row_div, int64_t group_size, int64_t splits,
                               int64_t item_chunks, cudaStream_t stream) {
  using namespace awq_mma_detail;
  const int br = static_cast<int>(block_rows), r = static_cast<int>(R), n = static_cast<int>(N);
  const int k = static_cast<int>(K), e = static_cast<int>(E), b = static_cast<int>(B);
  const int xd = static_cast<int>(x_row_div), g = static_cast<int>(group_size), s = static_cast<int>(splits);
  const int ic = static_cast<int>(item_chunks);
  if (dtype == 0)
    return launch_moe_t<__nv_bfloat16>(br, x, qweight, scales, qzeros, sorted_rows, block_expert, partial, r, n, k, e,
                                       b, xd, g, s, ic, stream);
  if (dtype == 1)
    return launch_moe_t<__half>(br, x, qweight, scales, qzeros, sorted_rows, block_expert, partial, r, n, k, e, b,
                                xd, g, s, ic, stream);
  return cudaErrorInvalidValue;
}

}  // namespace torchforge
