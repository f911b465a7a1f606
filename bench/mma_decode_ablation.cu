// Where the mma-layout decode kernel's time goes (csrc/awq_mma.cu as it is, built with one TORCHFORGE_MMA_ABLATE
// setting: awq_mma.cuh lists the bits; the outputs are wrong in ablation builds and only the times count): the
// kernel through its own launcher (awq_mma_launch, bf16 x, fp16 scales) on random words, timed as a CUDA graph of
// `reps` launches that cycle through enough weight copies to keep every launch's words out of L2.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc -DTORCHFORGE_MMA_ABLATE=0 \
//        -o /tmp/ablate0 bench/mma_decode_ablation.cu
//   /tmp/ablate0 OC IC M splits item_chunks warps prefetch symmetric   (prints us per launch, then the sum and the sum
//   of |out| of one launch: a check between builds whose arithmetic should agree)
// bench/mma_decode_ablation.sh builds several settings in parallel and runs a list of configurations on each.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../csrc/awq_mma.cu"

namespace torchforge {
namespace pdl {
int level() { return 1; }            // the extension's default: no PDL on the decode kernel's own launch
int start_prefetch() { return -1; }  // the launcher's rule
}  // namespace pdl
}  // namespace torchforge

#define CHECK(call)                                                                    \
  do {                                                                                 \
    const cudaError_t e_ = (call);                                                     \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__global__ void fill_words(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B9u ^ seed;
    h ^= h >> 15;
    p[i] = h * 0x85EBCA6Bu;
  }
}

__global__ void fill_halves(unsigned short* p, size_t n, unsigned short v) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = v ^ static_cast<unsigned short>(i & 7);
}

int main(int argc, char** argv) {
  if (argc < 9) {
    std::fprintf(stderr, "usage: %s OC IC M splits item_chunks warps prefetch symmetric [reps]\n", argv[0]);
    return 2;
  }
  const int N = std::atoi(argv[1]), K = std::atoi(argv[2]), M = std::atoi(argv[3]);
  const int splits = std::atoi(argv[4]), chunks = std::atoi(argv[5]), warps = std::atoi(argv[6]);
  const bool prefetch = std::atoi(argv[7]) != 0, sym = std::atoi(argv[8]) != 0;
  const int reps = argc > 9 ? std::atoi(argv[9]) : 40;
  const int G = 128;
  const size_t words = static_cast<size_t>(N) * K / 8;
  const size_t weight_bytes = words * 4 + static_cast<size_t>(K / G) * N * 2 + static_cast<size_t>(K / G) * N / 2;
  const int copies = static_cast<int>(std::max<size_t>(2, (200u << 20) / weight_bytes + 1));  // > 3x the L2
  std::vector<uint32_t*> qw(copies), qz(copies);
  std::vector<unsigned short*> sc(copies);
  for (int c = 0; c < copies; ++c) {
    CHECK(cudaMalloc(&qw[c], words * 4));
    CHECK(cudaMalloc(&sc[c], static_cast<size_t>(K / G) * N * 2));
    CHECK(cudaMalloc(&qz[c], static_cast<size_t>(K / G) * N / 2));
    fill_words<<<1024, 256>>>(qw[c], words, 17u * c + 1u);
    fill_halves<<<256, 256>>>(sc[c], static_cast<size_t>(K / G) * N, 0x2000u);  // small positive fp16 scales
    CHECK(cudaMemset(qz[c], 0x88, static_cast<size_t>(K / G) * N / 2));
  }
  unsigned short *x, *out;
  float* partial;
  unsigned int* tickets;
  CHECK(cudaMalloc(&x, static_cast<size_t>(M) * K * 2));
  CHECK(cudaMalloc(&out, static_cast<size_t>(M) * N * 2));
  CHECK(cudaMalloc(&partial, static_cast<size_t>(splits) * M * N * 4));
  CHECK(cudaMalloc(&tickets, static_cast<size_t>((M + 15) / 16) * (N / 64) * 4));
  fill_halves<<<256, 256>>>(x, static_cast<size_t>(M) * K, 0x3C00u);  // bf16 near 0.0078
  CHECK(cudaMemset(tickets, 0, static_cast<size_t>((M + 15) / 16) * (N / 64) * 4));
  CHECK(cudaDeviceSynchronize());

  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto launch = [&](int c) {
    return torchforge::awq_mma_launch(0, 1, x, reinterpret_cast<const int32_t*>(qw[c]), sc[c],
                                      reinterpret_cast<const int32_t*>(qz[c]), nullptr, out, partial, tickets, M, N, K,
                                      G, splits, chunks, warps, prefetch, stream, nullptr, nullptr, sym);
  };
  CHECK(launch(0));
  CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < reps; ++r) CHECK(launch(r % copies));
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int w = 0; w < 3; ++w) CHECK(cudaGraphLaunch(exec, stream));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> per;
  for (int t = 0; t < 9; ++t) {
    CHECK(cudaEventRecord(e0, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    per.push_back(1e3f * ms / reps);
  }
  std::sort(per.begin(), per.end());
  // the output of copy 0 as a check between builds of the same arithmetic class: sum and sum of |out| (bf16)
  CHECK(launch(0));
  CHECK(cudaStreamSynchronize(stream));
  std::vector<unsigned short> h(static_cast<size_t>(M) * N);
  CHECK(cudaMemcpy(h.data(), out, h.size() * 2, cudaMemcpyDeviceToHost));
  double sum = 0.0, sum_abs = 0.0;
  for (unsigned short b : h) {
    const uint32_t bits = static_cast<uint32_t>(b) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    sum += v;
    sum_abs += std::fabs(v);
  }
  std::printf("%.2f %.6e %.6e\n", per[per.size() / 2], sum, sum_abs);  // median us per launch, checks
  return 0;
}
