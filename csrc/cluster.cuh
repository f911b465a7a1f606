// Thread block clusters (sm_90): the cluster barrier and loads from another block's shared memory (distributed shared
// memory, DSMEM). PTX ISA: "barrier.cluster", "mapa", "ld" with the .shared::cluster state space.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace torchforge {
namespace cluster {

// arrive.release + wait.acquire: every thread's shared-memory writes before it are visible to every block of the
// cluster after it. Threads that have exited count as arrived (PTX ISA, "exit"), so a warp-specialized block's
// producer, which leaves early, holds nothing up. Returns 0, for loads that must not move above it (ld_v4).
__device__ __forceinline__ uint32_t sync() {
  uint32_t token;
  asm volatile(
      "barrier.cluster.arrive.release;\n"
      "barrier.cluster.wait.acquire;\n"
      "mov.u32 %0, 0;" : "=r"(token) :: "memory");
  return token;
}
// The second half of a sync for a block about to exit: its shared memory must outlive the other blocks' loads. With
// release semantics, this thread's loads from the others are done before they can pass their wait (.relaxed would
// not order a load whose value was never used).
__device__ __forceinline__ void arrive() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void wait() { asm volatile("barrier.cluster.wait;" ::: "memory"); }
// The shared::cluster address of shared::cta address `addr` in block `rank` of the cluster.
__device__ __forceinline__ uint32_t map(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// 16 bytes from a shared::cluster address. Not volatile, so that the compiler may batch several before their first
// use; the caller makes the address depend on sync()'s token, so none goes above the barrier.
__device__ __forceinline__ float4 ld_v4(uint32_t addr) {
  float4 v;
  asm("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
  return v;
}

}  // namespace cluster
}  // namespace torchforge
