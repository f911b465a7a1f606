// Batch-1 W4A16 GEMV in vLLM's AWQ layout (decode with one token):
//
//   out[n] = sum_k x[k] * (q[k, n] - z[k / G, n]) * s[k / G, n]  (+ bias[n])
//   x [K] fp16 / bf16; qweight int32 [K, N/8]; scales fp16 [K/G, N]; qzeros int32 [K/G, N/8]
//   (column 8c + order[p] in nibble p of word c, order = [0, 2, 4, 6, 1, 3, 5, 7]).
//
// Streaming the int4 weight at HBM speed is the whole job; no tensor cores (one row of x).
// * Block = 256 threads over a tile of 256 output columns (32 packed words): 8 "column threads"
//   load 16 B (4 words, 32 columns) of a k-row each, so a warp reads 4 rows x 128 contiguous
//   bytes per instruction; the 32 "k-lanes" of the block take items of ROWS consecutive k-rows
//   (inside one quantization group) in turn. blockIdx.y splits K into `splits` slices of items.
// * Per weight: one LOP3 (plus a shift for nibbles 5-7), one FADD, one FFMA. The nibble is
//   masked in place at bit pos <= 16 and OR-ed into the mantissa of 2^23, so that
//   float(bits) - 2^23 = q * 2^pos exactly (no int-to-float conversion); each nibble position
//   has its own accumulator, and 2^-pos, the scale and the zero point are applied once per item:
//   acc += s * (2^-pos * sum_k x q 2^pos - z * sum_k x).
// * The 32 k-lanes are summed through shared memory. With splits > 1 each block writes its slice
//   of fp32 partial sums; the last block of a column tile to finish (an atomic ticket per tile,
//   reset by that block for the next launch) adds the slices in slice order (deterministic),
//   adds the bias and writes the output: one kernel, no second launch.
//
// This file needs only the CUDA headers: the torch op is in ops.cpp (awq_gemv_launch below).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ptx_loads.cuh"

namespace torchforge {
namespace awq_gemv_detail {

using ptx::ld_stream;

constexpr int kThreads = 256;
constexpr int kColThreads = 8;                      // threads over one k-row of the tile
constexpr int kLanes = kThreads / kColThreads;      // 32 k-lanes
constexpr int kTileWords = kColThreads * 4;         // 32 words = 256 columns
constexpr int kTileCols = kTileWords * 8;
constexpr int kPad = 33;                            // shared-memory stride per 32 columns: no bank conflicts

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// q * 2^pos of nibble P of w, exactly (see the file comment).
template <int P>
__device__ __forceinline__ float nibble_scaled(uint32_t w) {
  constexpr int kDown = P >= 5 ? 4 * P - 16 : 0;
  constexpr int kPos = 4 * P - kDown;
  return __uint_as_float(((w >> kDown) & (0xFu << kPos)) | 0x4B000000u) - 8388608.0f;
}

__host__ __device__ constexpr float nibble_undo(int p) {  // 2^-pos
  return p == 0 ? 1.0f : p == 1 ? 0.0625f : p == 2 ? 0.00390625f : p == 3 ? 0.000244140625f : 1.52587890625e-05f;
}

__host__ __device__ constexpr int nibble_col(int p) { return p < 4 ? 2 * p : 2 * p - 7; }  // AWQ order

template <int P>
__device__ __forceinline__ void fma_word(float* part, uint32_t w, float xv) {
  part[P] = fmaf(nibble_scaled<P>(w), xv, part[P]);
  if constexpr (P < 7) fma_word<P + 1>(part, w, xv);
}

template <typename T, int ROWS, int UNROLL>
__global__ void __launch_bounds__(kThreads, 2)
    awq_gemv_kernel(const T* __restrict__ x, const uint4* __restrict__ qw, const __half* __restrict__ sc,
                    const uint32_t* __restrict__ qz, const T* __restrict__ bias, T* __restrict__ out,
                    float* __restrict__ partial, unsigned int* __restrict__ tickets, int N, int NP, int K,
                    int group_size, int items_per_block, int splits) {
  static_assert(ROWS % UNROLL == 0, "UNROLL must divide ROWS");
  __shared__ float red[kLanes * kColThreads * kPad];
  __shared__ bool is_last;
  const int tx = threadIdx.x % kColThreads;
  const int ty = threadIdx.x / kColThreads;
  const int tile = blockIdx.x;
  const int slice = blockIdx.y;
  const int word0 = tile * kTileWords + tx * 4;  // this thread's 4 words (NP % 4 == 0: all in or all out)
  const int np4 = NP / 4;
  const int n_items = K / ROWS;
  const int item_end = min((slice + 1) * items_per_block, n_items);

  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;

  if (word0 < NP) {
    for (int item = slice * items_per_block + ty; item < item_end; item += kLanes) {
      const int k0 = item * ROWS;
      const uint4* wp = qw + static_cast<size_t>(k0) * np4 + word0 / 4;
      float part[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) part[i] = 0.0f;
      float xsum = 0.0f;
#pragma unroll
      for (int r = 0; r < ROWS; r += UNROLL) {
        uint4 w[UNROLL];
        float xv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          w[u] = ld_stream(wp + static_cast<size_t>(r + u) * np4);
          xv[u] = to_f<T>(x[k0 + r + u]);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          xsum += xv[u];
          fma_word<0>(part + 0, w[u].x, xv[u]);
          fma_word<0>(part + 8, w[u].y, xv[u]);
          fma_word<0>(part + 16, w[u].z, xv[u]);
          fma_word<0>(part + 24, w[u].w, xv[u]);
        }
      }
      // scale and zero point of this item's group: 8 consecutive fp16 scales and one zero word per word
      const int g = k0 / group_size;
      const uint4 zw = *reinterpret_cast<const uint4*>(qz + static_cast<size_t>(g) * NP + word0);
      const uint32_t zs[4] = {zw.x, zw.y, zw.z, zw.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 sv = *reinterpret_cast<const uint4*>(sc + static_cast<size_t>(g) * N + 8 * (word0 + j));
        const __half* s8 = reinterpret_cast<const __half*>(&sv);
#pragma unroll
        for (int p = 0; p < 8; ++p) {
          const float s = __half2float(s8[nibble_col(p)]);
          const float z = static_cast<float>((zs[j] >> (4 * p)) & 0xFu);
          acc[j * 8 + p] = fmaf(s, fmaf(part[j * 8 + p], nibble_undo(p), -z * xsum), acc[j * 8 + p]);
        }
      }
    }
  }

  // sum the 32 k-lanes: red[ty][tx][33], column (tx * 4 + j) * 8 + nibble_col(p) of the tile
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int p = 0; p < 8; ++p) red[(ty * kColThreads + tx) * kPad + j * 8 + nibble_col(p)] = acc[j * 8 + p];
  }
  __syncthreads();
  const int c = threadIdx.x;  // one column of the tile per thread
  float sum = 0.0f;
#pragma unroll 8
  for (int l = 0; l < kLanes; ++l) sum += red[(l * kColThreads + c / 32) * kPad + c % 32];
  const int n = tile * kTileCols + c;
  if (splits == 1) {
    if (n < N) out[n] = from_f<T>(bias != nullptr ? sum + to_f<T>(bias[n]) : sum);
    return;
  }
  if (n < N) partial[static_cast<size_t>(slice) * N + n] = sum;
  __threadfence();  // this block's partials are visible before its ticket is taken
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&tickets[tile], 1u) == static_cast<unsigned>(splits - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (n < N) {
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) total += __ldcg(partial + static_cast<size_t>(s) * N + n);  // L2, not a stale L1
    out[n] = from_f<T>(bias != nullptr ? total + to_f<T>(bias[n]) : total);
  }
  if (threadIdx.x == 0) tickets[tile] = 0u;
}

template <typename T, int ROWS>
cudaError_t launch_rows(const void* x, const int32_t* qw, const void* sc, const int32_t* qz, const void* bias,
                        void* out, float* partial, unsigned int* tickets, int N, int K, int group_size,
                        int splits, cudaStream_t stream) {
  const int NP = N / 8;
  const int tiles = (NP + kTileWords - 1) / kTileWords;
  const int n_items = K / ROWS;
  const int items_per_block = (n_items + splits - 1) / splits;
  const dim3 grid(tiles, splits);
  awq_gemv_kernel<T, ROWS, (ROWS < 8 ? ROWS : 8)><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(x), reinterpret_cast<const uint4*>(qw), static_cast<const __half*>(sc),
      reinterpret_cast<const uint32_t*>(qz), static_cast<const T*>(bias), static_cast<T*>(out), partial,
      tickets, N, NP, K, group_size, items_per_block, splits);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_t(int rows, const void* x, const int32_t* qw, const void* sc, const int32_t* qz,
                     const void* bias, void* out, float* partial, unsigned int* tickets, int N, int K,
                     int group_size, int splits, cudaStream_t stream) {
  switch (rows) {
    case 16: return launch_rows<T, 16>(x, qw, sc, qz, bias, out, partial, tickets, N, K, group_size, splits, stream);
    case 32: return launch_rows<T, 32>(x, qw, sc, qz, bias, out, partial, tickets, N, K, group_size, splits, stream);
    case 64: return launch_rows<T, 64>(x, qw, sc, qz, bias, out, partial, tickets, N, K, group_size, splits, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace awq_gemv_detail

// dtype 0 = bf16, 1 = fp16 (x, bias, out). The caller (ops.cpp) has checked shapes, alignment,
// N % 32 == 0, rows | group_size, rows | K, splits <= K / rows; `tickets` holds ceil(N / 256)
// zeros and `partial` splits * N floats (unused when splits == 1).
cudaError_t awq_gemv_launch(int dtype, int rows, const void* x, const int32_t* qweight, const void* scales,
                            const int32_t* qzeros, const void* bias, void* out, float* partial,
                            unsigned int* tickets, int64_t N, int64_t K, int64_t group_size, int64_t splits,
                            cudaStream_t stream) {
  using namespace awq_gemv_detail;
  const int n = static_cast<int>(N), k = static_cast<int>(K), g = static_cast<int>(group_size);
  const int s = static_cast<int>(splits);
  if (dtype == 0)
    return launch_t<__nv_bfloat16>(rows, x, qweight, scales, qzeros, bias, out, partial, tickets, n, k, g, s, stream);
  if (dtype == 1)
    return launch_t<__half>(rows, x, qweight, scales, qzeros, bias, out, partial, tickets, n, k, g, s, stream);
  return cudaErrorInvalidValue;
}

}  // namespace torchforge
