// Do the Hopper W4A16 kernel's copies and its consumers' compute overlap? A stripped replica of awq_wgmma_kernel's
// warp-specialized main loop at N = 64 rows of x ((64, 2): two consumer warpgroups, two 64-column tiles each, a
// producer warpgroup that gives its registers to them), with synthetic data, one block per SM, every block on its own
// stream of chunks:
// * the producer (one thread) fills a ring of stages with bulk copies: the x tile (64 rows x 64 k, 8 KB) from a
//   1 MB buffer that stays in L2 (the x image), the 4 column blocks' words (4 x 2 KB, or one 8 KB copy: ONE_WORD_COPY)
//   from the block's own 4 MB region of DRAM, and a 640-byte group row (scales and zero words);
// * the consumers wait for a stage, read their words from it, convert the group's values every second chunk,
//   dequantize (shift, LOP3, subtract, multiply, fma: fp16 scales with bf16 x), issue 8 m64n64k16 RS wgmmas with the
//   stage's x tile as B, wait for the previous chunk's group and release its stage: the kernel's `fetch` / `chunk`.
// Modes: 0 copies and compute; 1 the copies alone (consumers wait and release at once); 2 the compute alone (the
// stages' contents as they are, no copies, no waits). Prints cycles per stage (the slowest block) and the clock.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -o /tmp/wgmma_overlap bench/wgmma_overlap.cu
//   /tmp/wgmma_overlap [chunks a block, default 1024]
// Thirty-fourth session: the kernel at 64 rows on 18432x7168 takes about 1,870 cycles a stage, its copies alone about
// 920 and its consumer loop alone (wgmma_rate.cu, mode 12) 832; this asks whether a replica of the two shows the same
// failure to overlap, and which change of the ring restores it.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "awq_mma.cuh"
#include "ptx_loads.cuh"
#include "wgmma.cuh"
#include "bench_timing.cuh"

using namespace torchforge;

constexpr int kN = 64;                   // rows of x (wgmma's N)
constexpr int kX = kN * 128;             // x tile: 64 rows x 64 k of bf16
constexpr int kW = 8192;                 // 4 column blocks x 4 k-steps x 32 lanes x 16 bytes
constexpr int kG = 640;                  // 256 fp16 scales + 32 zero words
constexpr int kStageBytes = 17408;       // (kX + kW + kG) rounded up to 1 KB, as Stage<64>::kBytes
constexpr int kRegionChunks = 512;       // a block's DRAM region: 512 chunks of words (4 MB)
constexpr int kXChunks = 112;            // the x image: 112 tiles (7168 k)

__device__ __forceinline__ uint32_t deq(uint32_t w, int r, uint32_t zc, uint32_t hi, uint32_t lo) {
  using P = awq_mma_detail::Pair<__nv_bfloat16>;
  const uint32_t d = P::sub(awq_mma_detail::and_or(w >> (4 * r), 0x000F000Fu, 0x43004300u), zc);
  return P::fma(d, hi, P::mul(d, lo));
}

template <int MODE, int STAGES, bool ONE_WORD_COPY>
__global__ void __launch_bounds__(384, 1) overlap_kernel(int iters, const uint8_t* __restrict__ dram,
                                                          const uint8_t* __restrict__ ximg,
                                                          const uint8_t* __restrict__ grows, long long* cycles,
                                                          float* sink) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ alignas(8) uint64_t bars[2 * STAGES];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  const uint32_t sbase = raw + pad;
  uint8_t* smem = smem_raw + pad;
  const uint32_t full = static_cast<uint32_t>(__cvta_generic_to_shared(bars)), empty = full + STAGES * 8;
  const int tid = threadIdx.x, warp = tid / 32 % 4, lane = tid % 32, tq = tid / 128, g = lane / 4;
  // stage contents for the compute-alone mode (and defined bytes before the first copies)
  for (int i = tid; i < STAGES * kStageBytes / 4; i += blockDim.x) {
    const uint32_t v = static_cast<uint32_t>(i) * 2246822519u + 374761393u;
    const int o = i * 4 % kStageBytes;
    const bool scale = o >= kX + kW && o < kX + kW + 512;  // small positive fp16 scales
    reinterpret_cast<uint32_t*>(smem)[i] = o < kX ? (v & 0x3FFF3FFFu) : scale ? 0x20002000u | (v & 0x03FF03FFu) : v;
  }
  if (tid == 0) {
    for (int i = 0; i < STAGES; ++i) {
      ptx::mbar_init(full + i * 8, 1);
      ptx::mbar_init(empty + i * 8, 256);
    }
    ptx::mbar_fence_init();
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const long long t0 = clock64();
  const uint8_t* region = dram + static_cast<size_t>(blockIdx.x) * kRegionChunks * kW;
  if (tid >= 256) {  // the producer warpgroup (its registers go to the consumers): one thread issues the copies
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (MODE != 2 && tid == 256) {
      for (int it = 0; it < iters; ++it) {
        const int s = it % STAGES;
        if (it >= STAGES) ptx::mbar_wait(empty + s * 8, (it / STAGES - 1) & 1);
        const uint32_t st = sbase + s * kStageBytes, bar = full + s * 8;
        ptx::mbar_expect_tx(bar, kX + kW + kG);
        ptx::bulk_copy(st, ximg + static_cast<size_t>(it % kXChunks) * kX, kX, bar);
        const int c = it % kRegionChunks;
        if (ONE_WORD_COPY) {  // the 4 column blocks' pieces of a chunk side by side: one contiguous 8 KB
          ptx::bulk_copy(st + kX, region + static_cast<size_t>(c) * kW, kW, bar);
        } else {  // the mma layout: each column block's K contiguous, so 4 streams of 2 KB pieces
          for (int i = 0; i < 4; ++i)
            ptx::bulk_copy(st + kX + i * 2048, region + (static_cast<size_t>(i) * kRegionChunks + c) * 2048, 2048, bar);
        }
        ptx::bulk_copy(st + kX + kW, grows + static_cast<size_t>(it % 64) * kG, kG, bar);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
  float acc[2][kN / 2];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) acc[c][e] = 0.0f;
  uint32_t a0[4][2][4], a1[4][2][4], w[4][2];
  uint32_t zc[2][2], shi[2][2], slo[2][2];
  const int zshift = awq_mma_detail::awq_shift(g);
  auto fetch = [&](int it) {
    const int s = it % STAGES;
    if (MODE != 2) ptx::mbar_wait(full + s * 8, (it / STAGES) & 1);
    const uint32_t ws = sbase + s * kStageBytes + kX + (warp * 128 + lane) * 16 + 8 * tq;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(w[k][0]), "=r"(w[k][1]) : "r"(ws + k * 512));
    if (it % 2 == 0) {
      using P = awq_mma_detail::Pair<__nv_bfloat16>;
      const uint32_t row = sbase + s * kStageBytes + kX + kW;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = 64 * warp + 16 * (tq * 2 + i) + g + 8 * h;
          uint32_t zw;
          unsigned short sb;
          asm volatile("ld.shared.b32 %0, [%1];" : "=r"(zw) : "r"(row + 512 + n / 8 * 4));
          asm volatile("ld.shared.u16 %0, [%1];" : "=h"(sb) : "r"(row + n * 2));
          const uint32_t z = awq_mma_detail::and_or(zw >> zshift, 0xFu, 0x4300u);
          zc[i][h] = z | (z << 16);
          const float sv = __half2float(__ushort_as_half(sb));
          shi[i][h] = P::splat(sv);
          slo[i][h] = P::splat(sv - P::low(shi[i][h]));
        }
    }
  };
  auto chunk = [&](int it, uint32_t(&a)[4][2][4]) {
    const int s = it % STAGES;
    if (MODE != 1) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int r = 0; r < 4; ++r) a[k][i][r] = deq(w[k][i], r, zc[i][r & 1], shi[i][r & 1], slo[i][r & 1]);
      const uint64_t desc = wgmma::desc_k_sw128(sbase + s * kStageBytes);
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          wgmma::mma_rs<kN, __nv_bfloat16>(acc[i], a[k][i][0], a[k][i][1], a[k][i][2], a[k][i][3], desc + 2 * k);
      wgmma::commit();
      wgmma::wait<1>();
    }
    if (it > 0 && MODE != 2) ptx::mbar_arrive(empty + (it - 1) % STAGES * 8);
    if (it + 1 < iters) fetch(it + 1);
  };
  fetch(0);
  for (int it = 0; it < iters; it += 2) {
    chunk(it, a0);
    chunk(it + 1, a1);
  }
  wgmma::wait<0>();
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) wgmma::fence_operand(acc[c][e]);
  asm volatile("bar.sync 1, 256;" ::: "memory");
  const long long t1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) sum += acc[c][e];
  if (sum == 12345.0f) sink[tid] = sum;
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int MODE, int STAGES, bool ONE>
void run(int sms, int iters, const uint8_t* dram, const uint8_t* ximg, const uint8_t* grows, long long* cycles,
         float* sink) {
  auto k = overlap_kernel<MODE, STAGES, ONE>;
  const int smem = STAGES * kStageBytes + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  float ms = 0.0f;
  const long long mx =
      time_launch([&] { k<<<sms, 384, smem>>>(iters, dram, ximg, grows, cycles, sink); }, sms, cycles, ms);
  static const char* modes[] = {"copies + compute", "copies alone", "compute alone"};
  const double dram_gbs = MODE == 2 ? 0.0 : static_cast<double>(sms) * iters * kW / (ms * 1e-3) / 1e9;
  std::printf("| %s | %d | %s | %.0f | %.2f | %.1f | %.0f |\n", modes[MODE], STAGES, ONE ? "one 8 KB" : "4 x 2 KB",
              static_cast<double>(mx) / iters, mx / (ms * 1e6), ms * 1e3, dram_gbs);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) std::printf("error: %s\n", cudaGetErrorString(err));
}

int main(int argc, char** argv) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t dram_bytes = static_cast<size_t>(sms) * kRegionChunks * kW;
  uint8_t *dram, *ximg, *grows;
  cudaMalloc(&dram, dram_bytes);
  cudaMalloc(&ximg, kXChunks * kX);
  cudaMalloc(&grows, 64 * kG);
  cudaMemset(dram, 0x5A, dram_bytes);
  cudaMemset(ximg, 0x11, kXChunks * kX);
  cudaMemset(grows, 0x20, 64 * kG);
  long long* cycles;
  float* sink;
  cudaMalloc(&cycles, 1024 * sizeof(long long));
  cudaMalloc(&sink, 1024 * sizeof(float));
  // chunks a block (even; the kernel's blocks at 64 rows on 18432x7168 run 61): a short stream shows the ring's ramp
  const int iters = argc > 1 ? std::atoi(argv[1]) / 2 * 2 : 1024;
  std::printf("%d chunks a block\n", iters);
  std::printf("| what runs | stages | word copies | cycles per stage | GHz | us | DRAM GB/s (words) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  run<2, 8, false>(sms, iters, dram, ximg, grows, cycles, sink);
  run<1, 8, false>(sms, iters, dram, ximg, grows, cycles, sink);
  run<0, 8, false>(sms, iters, dram, ximg, grows, cycles, sink);
  run<1, 8, true>(sms, iters, dram, ximg, grows, cycles, sink);
  run<0, 8, true>(sms, iters, dram, ximg, grows, cycles, sink);
  run<1, 12, false>(sms, iters, dram, ximg, grows, cycles, sink);
  run<0, 12, false>(sms, iters, dram, ximg, grows, cycles, sink);
  run<1, 4, false>(sms, iters, dram, ximg, grows, cycles, sink);
  run<0, 4, false>(sms, iters, dram, ximg, grows, cycles, sink);
  return 0;
}
