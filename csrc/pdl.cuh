// Programmatic dependent launch (PDL, sm_90): a kernel launched with the programmatic stream serialization attribute
// may start while the kernel before it in the stream is still running, once every block of that kernel has called
// launch_dependents() or exited. Until its griddepcontrol.wait returns, the earlier kernel's writes are not visible,
// and it may still be reading memory that this kernel will write. So the kernels here do only this before wait():
// prefetch their own weights into L2 (a hint: L2 is where writes land, so nothing stale can be read through it later).
// They read x and write out, partials and tickets only after it. Under CUDA graphs the launch attribute becomes a
// programmatic edge. A kernel launched without the attribute returns from wait() at once.
//
// Measured (H100, twenty-second session, BENCHMARKS.md; bench/w4a16_linear.py --pdl-check): level 1 makes the wgmma
// path 1-3% faster (its kernel launches during the x image kernel and prefetches its first stages). Level 2 makes back
// to back calls 1-7% faster (4096x4096 at M = 16: 7.8 against 8.3 us), but calls after a foreign kernel (a norm) 0-3%
// slower, and a model's projections follow foreign kernels; so level 1 is the default.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace torchforge {
namespace pdl {

// Waits until the kernels this one depends on have finished and their writes are visible.
// (No-ops in a device pass for an architecture before sm_90, where these instructions do not exist: setup.py's
// TORCHFORGE_CUDA_ARCH builds for other GPUs, which launch without the attribute anyway.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TORCHFORGE_PDL_ASM(...)
#else
#define TORCHFORGE_PDL_ASM(...) asm volatile(__VA_ARGS__)
#endif
__device__ __forceinline__ void wait() { TORCHFORGE_PDL_ASM("griddepcontrol.wait;" ::: "memory"); }
// Lets the next kernel in the stream launch (if it was launched with PDL) once every block of this one has called it
// or exited. Safe at any point: the next kernel still waits for this one's completion before touching its data.
__device__ __forceinline__ void launch_dependents() {
  TORCHFORGE_PDL_ASM("griddepcontrol.launch_dependents;" ::: "memory");
}
// Asks for `bytes` (a multiple of 16, 16-byte aligned) from global memory into L2; one instruction, no completion.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  TORCHFORGE_PDL_ASM("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// When the launchers below set the attribute (defined in ops.cpp): level 0 never; 1 (the default) only on a kernel
// whose predecessor is a kernel of the same op (the wgmma kernel after its x image kernel); 2 on every launch, also
// on the first kernel of an op, after whatever ran before it. TORCHFORGE_PDL=0/1/2 in the environment sets it when the
// extension loads; the op torchforge::set_pdl changes it at run time (benchmarks time the levels).
int level();
// How many rounds of items the decode kernel prefetches into L2 at its start: -1 (the default) its launcher's rule,
// 0, 1 or 2 on every launch (the op torchforge::set_start_prefetch, for benchmarks that time them).
int start_prefetch();

// kernel<<<grid, block, smem, stream>>>(args...) in clusters of cluster_x blocks along x (1: no clusters), with the
// PDL attribute where the level asks for it; first_of_op: the op's first kernel (its predecessor is another op's).
template <typename... Params, typename... Args>
cudaError_t launch_clusters(void (*kernel)(Params...), bool first_of_op, unsigned cluster_x, dim3 grid, dim3 block,
                            size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (level() >= (first_of_op ? 2 : 1)) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), bool first_of_op, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  return launch_clusters(kernel, first_of_op, 1u, grid, block, smem, stream, std::forward<Args>(args)...);
}

}  // namespace pdl
}  // namespace torchforge
