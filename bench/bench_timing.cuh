// Shared by the micro-benchmarks (wgmma_rate.cu, wgmma_overlap.cu): one launch after a warm-up one, timed with CUDA
// events; every block writes its own cycle count to cycles[blockIdx.x].
#pragma once
#include <cuda_runtime.h>

// The slowest block's cycles of the timed launch, and its elapsed milliseconds in `ms`.
template <typename Launch>
long long time_launch(Launch&& launch, int blocks, const long long* cycles, float& ms) {
  launch();  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  launch();
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  ms = 0.0f;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  long long c[1024];
  cudaMemcpy(c, cycles, blocks * sizeof(long long), cudaMemcpyDeviceToHost);
  long long mx = 0;
  for (int i = 0; i < blocks; ++i) mx = c[i] > mx ? c[i] : mx;
  return mx;
}
