// How fast shared memory fills from L2 on Hopper with the copies the W4A16 kernel (csrc/awq_wgmma.cu) could use for
// its x tiles, apart from everything else that kernel does. Every block runs a ring of STAGES stages of BYTES each,
// the way the kernel's producer and consumers do: a stage is refilled only once it is released, and with clusters
// only once both blocks of the pair have released it (a remote mbarrier arrive, as in the kernel's trial). Modes:
//   0: plain bulk copy (cp.async.bulk), each block copies its whole stage (what the kernel does today);
//   1: clusters of 2, each block copies half of the stage into both blocks with cp.async.bulk .multicast::cluster
//      (the twenty-sixth session's trial: 1.7-2.1x slower than mode 0 in the kernel, for half the L2 reads);
//   2: clusters of 2, the same halves as 2-D TMA tensor copies with .multicast::cluster and a tensor map (what
//      CUTLASS does on Hopper; not tried in the kernel);
//   3: mode 1 with the kernel trial's remote arrive, mbarrier.arrive.release.cluster: ptxas puts MEMBAR.ALL.GPU
//      (+ ERRBAR, CGAERRBAR) before it, which modes 1 and 2 (CUTLASS's ClusterBarrier::arrive form, default
//      .release.cta) do not have.
// The source is SRC_MB of global memory (default 4, so it stays in L2, as the kernel's x tiles do: every block of a
// row block reads the same ones); block b reads stage-sized pieces from its own offset on. Prints, per mode, the bytes
// landed in shared memory per second and the bytes read from L2 per second (half of it with multicast).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -o /tmp/multicast_rate bench/multicast_rate.cu
//   /tmp/multicast_rate [SRC_MB]
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdio>
#include <cstdlib>

#include "ptx_loads.cuh"

using namespace torchforge;

constexpr int kBytes = 32768;     // one stage: the x tile of a 256-row block (256 rows x 128 bytes)
constexpr int kStages = 4;        // (256, 1)'s ring
constexpr int kRowBytes = 128;    // a tile row (64 bf16 of k)
constexpr int kHalfRows = kBytes / 2 / kRowBytes;  // rows a block copies for the pair: 128 (a TMA box dimension <= 256)

__device__ __forceinline__ void multicast_bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(static_cast<uint16_t>(0x3))
      : "memory");
}
__device__ __forceinline__ void multicast_tensor(uint32_t dst, const CUtensorMap* map, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst), "l"(map), "r"(0), "r"(row), "r"(bar),
      "h"(static_cast<uint16_t>(0x3))
      : "memory");
}
// kGpuFence: .release.cluster, which compiles to MEMBAR.ALL.GPU + ERRBAR + CGAERRBAR before the arrive (waiting for
// every memory access the thread has outstanding); otherwise the default semantics (.release.cta), as CUTLASS's
// ClusterBarrier::arrive(cta_id) does for a consumer releasing a stage that its peer's TMA multicast refills.
template <bool kGpuFence>
__device__ __forceinline__ void arrive_remote(uint32_t bar, uint32_t rank) {
  if constexpr (kGpuFence)
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}" ::"r"(bar), "r"(rank)
        : "memory");
  else
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(bar), "r"(rank)
        : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// One warp a block; lane 0 is producer and consumer: issue stage it, then wait for stage it - (kStages - 1) and
// release it, so that kStages - 1 to kStages stages are in flight.
template <int MODE>
__global__ void __launch_bounds__(32, 1) copy_kernel(const uint8_t* src, long long src_rows, int iters,
                                                     const __grid_constant__ CUtensorMap map) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ alignas(8) uint64_t full[kStages], empty[kStages];
  constexpr bool kCluster = MODE != 0;
  const uint32_t rank = kCluster ? cluster_rank() : 0;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t full0 = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  const uint32_t empty0 = static_cast<uint32_t>(__cvta_generic_to_shared(empty));
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      ptx::mbar_init(full0 + 8 * i, 1);
      ptx::mbar_init(empty0 + 8 * i, kCluster ? 2 : 1);
    }
    ptx::mbar_fence_init();
  }
  if constexpr (kCluster)
    cluster_sync();
  else
    __syncthreads();
  if (threadIdx.x == 0) {
    const long long pair = blockIdx.x / (kCluster ? 2 : 1);
    const long long rows_per_stage = kBytes / kRowBytes;
    for (int it = 0; it < iters + kStages - 1; ++it) {
      if (it < iters) {
        const int st = it % kStages;
        if (it >= kStages) ptx::mbar_wait(empty0 + 8 * st, (it / kStages - 1) & 1);
        ptx::mbar_expect_tx(full0 + 8 * st, kBytes);
        // the pair's stage it: kBytes from row (pair * 7 + it) * rows_per_stage, wrapped in the source
        const long long row = ((pair * 7 + it) * rows_per_stage) % (src_rows - rows_per_stage + 1);
        const uint32_t dst = base + st * kBytes;
        if constexpr (MODE == 0) {
          ptx::bulk_copy(dst, src + row * kRowBytes, kBytes, full0 + 8 * st);
        } else if constexpr (MODE == 1 || MODE == 3) {
          multicast_bulk(dst + rank * (kBytes / 2), src + (row + rank * kHalfRows) * kRowBytes, kBytes / 2,
                         full0 + 8 * st);
        } else {
          multicast_tensor(dst + rank * (kBytes / 2), &map, static_cast<int>(row + rank * kHalfRows), full0 + 8 * st);
        }
      }
      const int done = it - (kStages - 1);
      if (done >= 0) {
        const int st = done % kStages;
        ptx::mbar_wait(full0 + 8 * st, (done / kStages) & 1);
        ptx::mbar_arrive(empty0 + 8 * st);
        if constexpr (kCluster) arrive_remote<MODE == 3>(empty0 + 8 * st, rank ^ 1);
      }
    }
  }
  __syncwarp();
  if constexpr (kCluster) cluster_sync();  // no block exits while the other may still arrive on its barriers
}

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));  \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

template <int MODE>
float run(const uint8_t* src, long long src_rows, int blocks, int iters, const CUtensorMap& map) {
  auto kernel = copy_kernel<MODE>;
  const int smem = kStages * kBytes + 1024;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(32);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = MODE == 0 ? 1 : 2, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  if (MODE != 0) {  // clusters that cannot all be resident run in a second wave: the time would not be a rate
    int max_clusters = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &cfg));
    if (max_clusters < blocks / 2)
      std::printf("warning: mode %d: %d clusters of 2, only %d resident at once\n", MODE, blocks / 2, max_clusters);
  }
  for (int w = 0; w < 2; ++w) CHECK(cudaLaunchKernelEx(&cfg, kernel, src, src_rows, iters, map));
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  constexpr int kReps = 10;
  CHECK(cudaEventRecord(a));
  for (int r = 0; r < kReps; ++r) CHECK(cudaLaunchKernelEx(&cfg, kernel, src, src_rows, iters, map));
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return ms / kReps;
}

int main(int argc, char** argv) {
  const int src_mb = argc > 1 ? std::atoi(argv[1]) : 4;
  if (src_mb < 1) {
    std::printf("SRC_MB must be >= 1\n");
    return 1;
  }
  const long long src_bytes = static_cast<long long>(src_mb) << 20;
  const long long src_rows = src_bytes / kRowBytes;
  uint8_t* src = nullptr;
  CHECK(cudaMalloc(&src, src_bytes));
  CHECK(cudaMemset(src, 1, src_bytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  // The tensor map: the source as rows of 128 bytes, boxes of kHalfRows rows (one block's half of a stage).
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  cudaDriverEntryPointQueryResult qres;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                         cudaEnableDefault, &qres));
  if (encode == nullptr || qres != cudaDriverEntryPointSuccess) {
    std::printf("cuTensorMapEncodeTiled not found\n");
    return 1;
  }
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kRowBytes), static_cast<cuuint64_t>(src_rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kRowBytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kRowBytes), static_cast<cuuint32_t>(kHalfRows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, src, dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(r));
    return 1;
  }

  const int iters = 2000;
  std::printf("source %d MB, stages %d x %d KB, %d iterations a block\n", src_mb, kStages, kBytes / 1024, iters);
  std::printf("| mode | blocks | ms | smem fill TB/s | L2 read TB/s |\n|---|---|---|---|---|\n");
  const char* names[4] = {"plain bulk copy", "bulk copy, multicast to 2", "TMA tensor, multicast to 2",
                          "bulk copy, multicast to 2, release.cluster arrive"};
  for (int blocks : {sms - sms % 2, 66}) {
    const float t[4] = {run<0>(src, src_rows, blocks, iters, map), run<1>(src, src_rows, blocks, iters, map),
                        run<2>(src, src_rows, blocks, iters, map), run<3>(src, src_rows, blocks, iters, map)};
    for (int m = 0; m < 4; ++m) {
      const double landed = static_cast<double>(blocks) * iters * kBytes;
      const double read = m == 0 ? landed : landed / 2;
      std::printf("| %s | %d | %.3f | %.2f | %.2f |\n", names[m], blocks, t[m], landed / t[m] / 1e9,
                  read / t[m] / 1e9);
    }
  }
  CHECK(cudaFree(src));
  return 0;
}
