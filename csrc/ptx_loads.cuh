// Inline-PTX loads shared by the kernels in csrc/.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace torchforge {
namespace ptx {

// 16 bytes of a weight stream that is read once: kept out of L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// 16 bytes global -> shared (address from __cvta_generic_to_shared) without a register round trip, bypassing L1;
// valid false: nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// wait until at most N of this thread's cp.async groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace ptx
}  // namespace torchforge
