// Inline-PTX loads shared by the kernels in csrc/.
#pragma once
#include <cuda_runtime.h>

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

}  // namespace ptx
}  // namespace torchforge
