// How fast Hopper's warpgroup MMA runs at the small N (rows of x) of the W4A16 kernel (csrc/awq_wgmma.cu), apart
// from everything else that kernel does: one block per SM, WG warpgroups each issuing chunks of 4 k-steps x CHAINS
// independent m64nNk16 wgmmas (one accumulator each) as one commit group, then waiting for the previous chunk's
// group, as awq_wgmma_kernel does. A from registers (RS, the kernel's form) or from shared memory (SS), optionally
// with the kernel's per-register dequantization (shift, LOP3, subtract, multiply, fma) of each chunk's A before its
// issue, while the previous chunk's group runs. B (and SS's A) read zeros from shared memory: the values do not change the timing.
// Modes 4-7 (thirty-fourth session) ask why the dequantization holds N = 64 at 0.68 of the dense rate: the same
// arithmetic with no wgmma (4: dequantize and store each register pair to shared memory, the wgmmas' time taken out),
// beside SS wgmmas (5: A from shared memory, the dequantized registers stored to another part of it, as warps that
// dequantize into shared memory for the tensor cores would), and both without the fp16 scale's hi / lo split (6: RS,
// 7: SS; bf16 scales, subtract and multiply only), and the exact product through fp32 FMAs (8: RS, 9: alone).
// Modes 10-12 add, one at a time, what awq_wgmma_kernel's consumers do per chunk besides: 10 reads each chunk's words
// from a ring of shared-memory stages (lds_words, after the previous group's wait, as `fetch` does); 11 also converts
// the group's scales and zero words every second chunk (groups of 128: the hi / lo splats, magic + z); 12 also
// releases each stage with one mbarrier arrive per thread. So 1 -> 12 is the micro-benchmark's floor -> the kernel's
// consumer loop without its copies.
// Prints cycles per wgmma per SM next to the tensor cores' dense bf16 rate (N x 64 x 16 / 2048 FMAs per cycle), and the
// SM clock over the run (the slowest block's cycles / the elapsed time), with zeros and with random operands.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -o /tmp/wgmma_rate bench/wgmma_rate.cu
//   /tmp/wgmma_rate [dequant | overheads]
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "awq_mma.cuh"
#include "ptx_loads.cuh"
#include "wgmma.cuh"
#include "bench_timing.cuh"

using namespace torchforge;

template <int N>
__device__ __forceinline__ void mma_ss(float* d, uint64_t da, uint64_t db);
template <>
__device__ __forceinline__ void mma_ss<64>(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ uint32_t deq(uint32_t w, int r, uint32_t zc, uint32_t hi, uint32_t lo) {
  uint32_t q, d, m, out;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(q) : "r"(w >> (4 * r)));
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(q), "r"(zc));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(d), "r"(lo));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(d), "r"(hi), "r"(m));
  return out;
}

// bf16 scales (what a bf16 model holds): no hi / lo split, (q - z) s is one rounded multiply.
__device__ __forceinline__ uint32_t deq_bf16(uint32_t w, int r, uint32_t zc, uint32_t s) {
  uint32_t q, d, out;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(q) : "r"(w >> (4 * r)));
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(q), "r"(zc));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(d), "r"(s));
  return out;
}

// The exact product through fp32 FMAs (mode 8): 128 + q and 128 + z have 8 significant bits, an fp16 scale 11, so
// (128 + q) s and (128 + z) s are exact in fp32, and fma(128 + q, s, -(128 + z) s) = (q - z) s exactly; one
// cvt.rn.bf16x2.f32 then rounds both halves once. nzs = -(128 + z) s.
__device__ __forceinline__ uint32_t deq_ffma(uint32_t w, int r, float sf, float nzs) {
  uint32_t q, out;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(q) : "r"(w >> (4 * r)));
  const float lo = fmaf(__uint_as_float(q << 16), sf, nzs);
  const float hi = fmaf(__uint_as_float(q & 0xFFFF0000u), sf, nzs);
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

// The same result through fp32 (bf16 x, fp16 scale s, zero z): the LOP3's bf16 pair (128 + q) is, half by half, the
// fp32 value 128 + q once moved to the upper 16 bits; (128 + q) - (128 + z) and the product by s are exact in fp32,
// and one cvt.rn.bf16x2.f32 rounds both once, as the bf16x2 path's fma does. zf = 128 + z, sf = s as fp32.
__device__ __forceinline__ uint32_t deq_f32(uint32_t w, int r, float zf, float sf) {
  uint32_t q, out;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(q) : "r"(w >> (4 * r)));
  const float lo = (__uint_as_float(q << 16) - zf) * sf;
  const float hi = (__uint_as_float(q & 0xFFFF0000u) - zf) * sf;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

// MODE 0: RS, A fixed; 1: RS with the dequantization of the next chunk's A (bf16x2 arithmetic); 2: SS; 3: as 1, the
// arithmetic in fp32 (deq_f32); 4: the dequantization of 1 alone, stored to shared memory (no wgmma); 5: SS with the
// dequantization of 4; 6: as 1, bf16 scales (deq_bf16); 7: as 5, bf16 scales; 8: as 1 through fp32 FMAs (deq_ffma);
// 9: the dequantization of 8 alone, stored (as 4); 10-12: as 1 with the kernel's words from shared memory, + group
// values, + stage releases (see the top).
template <int N, int WG, int CHAINS, int MODE>
__global__ void __launch_bounds__(128 * WG, 1) rate_kernel(int iters, const uint32_t* words, long long* cycles,
                                                            float* sink, int random_fill) {
  extern __shared__ __align__(1024) uint8_t smem[];
  constexpr int kB = N * 128;  // B: N rows x 64 k (the 4 k-steps), then SS's A: 64 rows x 64 k, then (modes 4, 5, 7)
                               // where the dequantized registers go: 16 bytes a thread per k-step and chain
  // zeros, or random bf16 pairs of magnitude below 2 (more bits toggling: the power draw, and so the clock, differ)
  for (int i = threadIdx.x; i < (kB + 8192) / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = random_fill ? (static_cast<uint32_t>(i) * 2654435761u) & 0xBFFFBFFFu : 0u;
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint64_t db = wgmma::desc_k_sw128(base);
  const uint64_t da = wgmma::desc_k_sw128(base + kB);
  float acc[CHAINS][N / 2];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) acc[c][e] = 0.0f;
  // modes >= 10: kStages stages of the kernel's words (4 column blocks x 4 k-steps x 32 lanes x 16 bytes), then each
  // stage's group row of 256 fp16 scales and 32 zero words, then the empty barriers
  constexpr int kStages = 8, kWords = 8192, kGroupRow = 512 + 128;
  const uint32_t ring = base + kB + 8192;
  const uint32_t group_rows = ring + kStages * kWords;
  const uint32_t empty = group_rows + kStages * kGroupRow;
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, tq = threadIdx.x / 128, g = lane / 4;
  if constexpr (MODE >= 10) {
    for (int i = threadIdx.x; i < kStages * (kWords + kGroupRow) / 4; i += blockDim.x) {
      const uint32_t v = static_cast<uint32_t>(i) * 2246822519u + 374761393u;
      // scales: small positive fp16 values; words and zero words: any bits
      const int o = i % ((kWords + kGroupRow) / 4);
      const bool scale = o >= kWords / 4 && o < (kWords + 512) / 4;
      reinterpret_cast<uint32_t*>(smem + kB + 8192)[i] = scale ? 0x20002000u | (v & 0x03FF03FFu) : v;
    }
    if (threadIdx.x == 0)
      for (int i = 0; i < kStages; ++i) ptx::mbar_init(empty + i * 8, 128 * WG);
    ptx::mbar_fence_init();
  }
  uint32_t a[2][4][CHAINS][4];
  uint32_t w[4][CHAINS];
  uint32_t zc[CHAINS][2], shi[CHAINS][2], slo[CHAINS][2];  // modes >= 11: the group's values, as the kernel's
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) zc[c][h] = 0x43084308u, shi[c][h] = 0x3c003c00u, slo[c][h] = 0x00010001u;
  const int zshift = torchforge::awq_mma_detail::awq_shift(g);
  unsigned it = 0;  // chunks done (modes >= 10: the stage of the next chunk's words)
  // modes >= 10: the next chunk's words from its stage (and every second chunk its group's values), as `fetch`
  auto fetch = [&](unsigned next) {
    const uint32_t stage = ring + next % kStages * kWords + (warp * 128 + lane) * 16 + 8 * tq;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t lo_w, hi_w;
      asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(lo_w), "=r"(hi_w) : "r"(stage + k * 512));
      w[k][0] = lo_w;
      if constexpr (CHAINS > 1) w[k][1] = hi_w;
    }
    if (MODE >= 11 && next % 2 == 0) {
      using P = torchforge::awq_mma_detail::Pair<__nv_bfloat16>;
      const uint32_t row = group_rows + next % kStages * kGroupRow;
#pragma unroll
      for (int i = 0; i < CHAINS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = 64 * warp + 16 * (tq * CHAINS + i) + g + 8 * h;
          uint32_t zw;
          unsigned short sbits;
          asm volatile("ld.shared.b32 %0, [%1];" : "=r"(zw) : "r"(row + 512 + n / 8 * 4));
          asm volatile("ld.shared.u16 %0, [%1];" : "=h"(sbits) : "r"(row + n * 2));
          const uint32_t z = torchforge::awq_mma_detail::and_or(zw >> zshift, 0xFu, 0x4300u);
          zc[i][h] = z | (z << 16);
          const float sv = __half2float(__ushort_as_half(sbits));
          shi[i][h] = P::splat(sv);
          slo[i][h] = P::splat(sv - P::low(shi[i][h]));
        }
    }
  };
  if constexpr (MODE >= 10) fetch(0);
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      w[k][c] = words[(threadIdx.x + 32 * (4 * c + k)) % 1024];
#pragma unroll
      for (int r = 0; r < 4; ++r) a[0][k][c][r] = a[1][k][c][r] = random_fill ? (w[k][c] >> r) & 0xBFFFBFFFu : 0u;
    }
  const uint32_t zc0 = 0x43084308u, hi = 0x3c003c00u, lo = 0x00010001u;
  __syncthreads();
  const long long t0 = clock64();
  // As awq_wgmma_kernel's `chunk`: dequantize this chunk's A (MODE 1) into the buffer whose wgmmas retired at the
  // previous wait, issue the chunk's group, wait for the previous group.
  auto chunk = [&](uint32_t(&cur)[4][CHAINS][4]) {
    constexpr bool kDeq = MODE == 1 || MODE >= 3;
    // the dequantized registers go to shared memory
    constexpr bool kStore = MODE == 4 || MODE == 5 || MODE == 7 || MODE == 9;
    if constexpr (kDeq) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
          if constexpr (MODE < 10) w[k][c] = w[k][c] * 1664525u + 1013904223u;  // new words (one IMAD, as an LDS)
#pragma unroll
          for (int r = 0; r < 4; ++r)
            cur[k][c][r] = MODE == 3              ? deq_f32(w[k][c], r, 136.0f, 0.0123f)
                           : MODE == 8 || MODE == 9 ? deq_ffma(w[k][c], r, 0.0123f, -136.0f * 0.0123f)
                           : MODE == 6 || MODE == 7 ? deq_bf16(w[k][c], r, zc0, hi)
                           : MODE >= 10             ? deq(w[k][c], r, zc[c][r & 1], shi[c][r & 1], slo[c][r & 1])
                                                    : deq(w[k][c], r, zc0, hi, lo);
          if constexpr (kStore) {
            const uint32_t dst = base + kB + 8192 + ((k * CHAINS + c) * 128 * WG + threadIdx.x) * 16;
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(cur[k][c][0]), "r"(cur[k][c][1]),
                         "r"(cur[k][c][2]), "r"(cur[k][c][3])
                         : "memory");
          }
        }
      // the tensor cores read shared memory through the async proxy: generic stores must be fenced before a wgmma
      // could read them
      if constexpr (kStore) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    if constexpr (MODE == 4 || MODE == 9) return;
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int c = 0; c < CHAINS; ++c) {
        if constexpr (MODE == 2 || MODE == 5 || MODE == 7)
          mma_ss<N>(acc[c], da + 2 * k, db + 2 * k);
        else
          wgmma::mma_rs<N, __nv_bfloat16>(acc[c], cur[k][c][0], cur[k][c][1], cur[k][c][2], cur[k][c][3],
                                          db + 2 * k);
      }
    wgmma::commit();
    wgmma::wait<1>();
    if constexpr (MODE >= 12)
      if (it > 0) ptx::mbar_arrive(empty + (it - 1) % kStages * 8);  // the previous chunk's stage, as the kernel
    ++it;
    if constexpr (MODE >= 10) fetch(it);
  };
  for (int it = 0; it < iters; it += 2) {
    chunk(a[0]);
    chunk(a[1]);
  }
  wgmma::wait<0>();
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) wgmma::fence_operand(acc[c][e]);
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) s += acc[c][e];
  if (s == 12345.0f) sink[threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int N, int WG, int CHAINS, int MODE>
void run(int sms, const uint32_t* words, long long* cycles, float* sink, int random_fill = 0) {
  auto k = rate_kernel<N, WG, CHAINS, MODE>;
  constexpr int smem = N * 128 + 8192 + (MODE == 4 || MODE == 5 || MODE == 7 || MODE == 9 ? 4 * CHAINS * 128 * WG * 16
                                         : MODE >= 10                                       ? 8 * (8192 + 640) + 64
                                                                                            : 0);
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int iters = 2000;
  float ms = 0.0f;
  const long long mx =
      time_launch([&] { k<<<sms, 128 * WG, smem>>>(iters, words, cycles, sink, random_fill); }, sms, cycles, ms);
  const double per_sm = static_cast<double>(iters) * 4 * CHAINS * WG;  // wgmmas per SM
  const double ideal = N * 64.0 * 16.0 / 2048.0;
  static const char* modes[] = {"RS",
                                "RS + dequant",
                                "SS",
                                "RS + dequant in fp32",
                                "dequant + store, no wgmma",
                                "SS + dequant + store",
                                "RS + dequant, bf16 scales",
                                "SS + dequant + store, bf16 scales",
                                "RS + dequant by fp32 fma",
                                "dequant by fp32 fma + store, no wgmma",
                                "RS + dequant, words from shared memory",
                                "RS + dequant, words + group values from shared memory",
                                "RS + dequant, words + group values + stage releases"};
  std::printf("| %d | %d | %d | %s | %s | %.1f | %.0f | %.2f | %.1f | %.2f |\n", N, WG, CHAINS, modes[MODE],
              random_fill ? "random" : "zeros", mx / per_sm, ideal, ideal / (mx / per_sm), ms * 1e3,
              mx / (ms * 1e6));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) std::printf("error: %s\n", cudaGetErrorString(err));
}

int main(int argc, char** argv) {
  const bool dequant_set = argc > 1 && std::string(argv[1]) == "dequant";  // modes 4-7 against 1 and 2 only
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint32_t* words;
  long long* cycles;
  float* sink;
  cudaMalloc(&words, 4096);
  uint32_t host_words[1024];
  for (int i = 0; i < 1024; ++i) host_words[i] = static_cast<uint32_t>(i) * 2246822519u + 374761393u;
  cudaMemcpy(words, host_words, 4096, cudaMemcpyHostToDevice);
  cudaMalloc(&cycles, 1024 * sizeof(long long));
  cudaMalloc(&sink, 1024 * sizeof(float));
  std::printf("| N | warpgroups | chains | A | data | cycles per wgmma per SM | dense-rate cycles | of the dense rate | us "
              "| GHz |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  if (argc > 1 && std::string(argv[1]) == "overheads") {  // modes 10-12 against 1 (thirty-fourth session)
    run<64, 2, 2, 1>(sms, words, cycles, sink);
    run<64, 2, 2, 10>(sms, words, cycles, sink);
    run<64, 2, 2, 11>(sms, words, cycles, sink);
    run<64, 2, 2, 12>(sms, words, cycles, sink);
    run<128, 2, 2, 1>(sms, words, cycles, sink);
    run<128, 2, 2, 12>(sms, words, cycles, sink);
    return 0;
  }
  if (dequant_set) {
    run<64, 2, 2, 2>(sms, words, cycles, sink);
    run<64, 2, 2, 1>(sms, words, cycles, sink);
    run<64, 2, 2, 6>(sms, words, cycles, sink);
    run<64, 2, 2, 4>(sms, words, cycles, sink);
    run<64, 4, 1, 4>(sms, words, cycles, sink);
    run<64, 2, 2, 5>(sms, words, cycles, sink);
    run<64, 4, 1, 5>(sms, words, cycles, sink);
    run<64, 2, 2, 7>(sms, words, cycles, sink);
    run<64, 2, 2, 8>(sms, words, cycles, sink);
    run<64, 4, 1, 8>(sms, words, cycles, sink);
    run<64, 2, 2, 9>(sms, words, cycles, sink);
    run<128, 2, 2, 1>(sms, words, cycles, sink);
    run<128, 2, 2, 8>(sms, words, cycles, sink);
    run<128, 2, 2, 4>(sms, words, cycles, sink);
    return 0;
  }
  for (int fill = 0; fill < 2; ++fill) {
    run<64, 1, 1, 0>(sms, words, cycles, sink, fill);
    run<64, 2, 2, 0>(sms, words, cycles, sink, fill);
    run<64, 4, 1, 0>(sms, words, cycles, sink, fill);
    run<64, 2, 2, 2>(sms, words, cycles, sink, fill);
    run<64, 2, 2, 1>(sms, words, cycles, sink, fill);
    run<64, 4, 1, 1>(sms, words, cycles, sink, fill);
    run<64, 2, 2, 3>(sms, words, cycles, sink, fill);
    run<128, 2, 2, 0>(sms, words, cycles, sink, fill);
    run<128, 2, 2, 1>(sms, words, cycles, sink, fill);
    run<128, 2, 2, 3>(sms, words, cycles, sink, fill);
    run<256, 1, 1, 0>(sms, words, cycles, sink, fill);
    run<256, 2, 1, 0>(sms, words, cycles, sink, fill);
    run<256, 2, 1, 1>(sms, words, cycles, sink, fill);
    run<256, 2, 1, 3>(sms, words, cycles, sink, fill);
  }
  return 0;
}
