// Grouped (MoE) W4A16 on tensor cores from the mma layout: the dense kernel's arithmetic (awq_mma.cu) on blocks of
// routed rows of one expert each. This file needs only the CUDA headers: the torch op is in ops.cpp.
#include <type_traits>

#include "awq_mma.cuh"
#include "pdl.cuh"

namespace torchforge {
namespace awq_mma_detail {

// Grouped form for MoE experts: routed rows sorted by expert into blocks of NT * 8 (torchforge.ops.moe_align).
// Block b holds routed rows sorted_rows[b * NT * 8 + i] (R where padding) of expert block_expert[b] (the sentinel for
// the rows of out-of-range ids, which come out NaN, and for the empty blocks past the end); routed row r reads
// x[r / x_row_div]. Each K slice writes its fp32 sums to
// partial[slice, r, :]; the caller's reduce kernel adds the slices and applies the epilogue (SiLU * up, or the
// router-weighted combine). Direct mode (sorted_rows null, decode: no more routed rows than experts): block b
// is routed row b alone, with expert block_expert[b] = expert_ids[b]; no sort, one 8-row MMA tile.
// With shared_qw (and shared_sc, shared_qz: one expert's tensors) expert id E is a shared expert stored apart from
// the E routed ones: the caller routes every token to it as one more pick, so it costs no launch of its own.
// W warps per block, 4 or 8 as in awq_mma.cu: 16 warps per SM either way. launch_awq_mma_moe_cuda passes 4 (the
// op's schema default is 8, what it ran before warps became an argument). G32: groups of 32 rows (awq_mma.cuh, item_dq;
// items of one chunk).
template <typename T, typename S, int NT, int CPG, int W, bool G32, bool R1, bool SYM>
__global__ void __launch_bounds__(32 * W, 16 / W)
    awq_mma_moe_kernel(const T* __restrict__ x, const uint4* __restrict__ qw, const S* __restrict__ sc,
                       const uint32_t* __restrict__ qz, const uint4* __restrict__ shared_qw,
                       const S* __restrict__ shared_sc, const uint32_t* __restrict__ shared_qz,
                       const int32_t* __restrict__ sorted_rows, const int32_t* __restrict__ block_expert,
                       float* __restrict__ partial, int R, int N, int K, int E, int x_row_div, int chunks_per_group,
                       int splits) {
  constexpr int kBlockThreads = 32 * W;
  __shared__ float red[W * kRows * kPad];
  const int b = blockIdx.x;
  const int cb = blockIdx.y;
  const int slice = blockIdx.z;
  // PDL (pdl.cuh, level 2): the expert ids, the rows and x come from the kernels before this one, so nothing is read
  // early; only the launch overlaps their end. The next kernel launches as this one's blocks exit.
  pdl::wait();
  const int e = block_expert[b];
  const bool direct = R1 || sorted_rows == nullptr;  // decode: block b is routed row b alone, block_expert its ids
  const bool shared = e == E && shared_qw != nullptr;  // expert id E: the shared expert, stored on its own
  if (!shared && (e < 0 || e >= E)) {  // expert ids out of range come out as NaN rows (no host sync to check the ids): in
    // direct mode this block's row; sorted, the real rows of moe_align's bucket for them (past the end: none)
    for (int i = threadIdx.x; i < NT * 8 * kCols; i += kBlockThreads) {
      const int row = i / kCols;
      const int r = direct ? (row == 0 ? b : R) : sorted_rows[b * NT * 8 + row];
      if (r >= 0 && r < R)
        partial[(static_cast<size_t>(slice) * R + r) * N + cb * kCols + i % kCols] = __int_as_float(0x7fc00000);
    }
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int chunks = K / 64;
  const int items = chunks / CPG;
  const size_t groups = static_cast<size_t>(G32 ? K / 32 : K / (64 * chunks_per_group));
  const size_t ex = shared ? 0 : static_cast<size_t>(e);
  const uint4* wbase = (shared ? shared_qw : qw) + (ex * (N / kCols) + cb) * chunks * 128 + lane;
  const S* sce = (shared ? shared_sc : sc) + ex * groups * N;
  const uint32_t* qze = (shared ? shared_qz : qz) + ex * groups * (N / 8);
  const uint4* xb = reinterpret_cast<const uint4*>(x + 16 * t);
  int xoff[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {  // padding (and, in direct mode, rows 1..) read x row 0: their sums are not stored
    const int r = direct ? (8 * j + g == 0 ? b : R) : sorted_rows[b * NT * 8 + 8 * j + g];
    xoff[j] = (r >= 0 && r < R ? r / x_row_div : 0) * (K / 8);
  }
  float acc[4][NT][4];
  accumulate<T, S, NT, CPG, false, G32, R1, SYM>(acc, wbase, sce, qze, xb, xoff, N, cb, items, slice * W + warp,
                                                  splits * W, chunks_per_group, g);
  stash<NT>(red, acc, warp, g, t);
  __syncthreads();
  constexpr int kPer = NT * 8 * kCols / kBlockThreads;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int idx = threadIdx.x + q * kBlockThreads;
    const int row = idx / kCols, col = idx % kCols;
    const int r = direct ? (row == 0 ? b : R) : sorted_rows[b * NT * 8 + row];
    if (r < 0 || r >= R) continue;
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < W; ++wi) v += red[(wi * kRows + row) * kPad + col];
    partial[(static_cast<size_t>(slice) * R + r) * N + cb * kCols + col] = v;
  }
}

template <typename T, typename S, int NT, int CPG, int W, bool G32, bool R1 = false, bool SYM = false>
cudaError_t launch_moe(const void* x, const int32_t* qw, const void* sc, const int32_t* qz, const int32_t* sqw,
                       const void* ssc, const int32_t* sqz, const int32_t* rows, const int32_t* block_expert,
                       float* partial, int R, int N, int K, int E, int B, int x_row_div, int group_size, int splits,
                       cudaStream_t stream) {
  const dim3 grid(B, N / kCols, splits);
  return pdl::launch(awq_mma_moe_kernel<T, S, NT, CPG, W, G32, R1, SYM>, true, grid, dim3(32 * W), 0, stream,
                     static_cast<const T*>(x), reinterpret_cast<const uint4*>(qw), static_cast<const S*>(sc),
                     reinterpret_cast<const uint32_t*>(qz), reinterpret_cast<const uint4*>(sqw),
                     static_cast<const S*>(ssc), reinterpret_cast<const uint32_t*>(sqz), rows, block_expert, partial, R,
                     N, K, E, x_row_div, group_size / 64, splits);
}

}  // namespace awq_mma_detail

// Grouped (MoE) launcher; dtype and scale_dtype as in awq_mma_launch. The caller has checked shapes and alignment;
// block_rows (8 or 16) = sorted_rows.numel() / B; partial holds splits * R * N floats; warps 4 or 8 per block; groups of
// 32 with item_chunks 1 only (and qzeros 16-byte aligned), else group_size a multiple of 64 * item_chunks.
cudaError_t awq_mma_moe_launch(int dtype, int scale_dtype, int64_t block_rows, const void* x, const int32_t* qweight,
                               const void* scales, const int32_t* qzeros, const int32_t* shared_qweight,
                               const void* shared_scales, const int32_t* shared_qzeros, const int32_t* sorted_rows,
                               const int32_t* block_expert, float* partial, int64_t R, int64_t N, int64_t K,
                               int64_t E, int64_t B, int64_t x_row_div, int64_t group_size, int64_t splits,
                               int64_t item_chunks, int64_t warps, cudaStream_t stream, bool symmetric) {
  using namespace awq_mma_detail;
  const int r = static_cast<int>(R), n = static_cast<int>(N), k = static_cast<int>(K), e = static_cast<int>(E);
  const int b = static_cast<int>(B), xd = static_cast<int>(x_row_div), g = static_cast<int>(group_size);
  const int s = static_cast<int>(splits);
  if ((block_rows != 8 && block_rows != 16) || (item_chunks != 1 && item_chunks != 2) || (warps != 4 && warps != 8))
    return cudaErrorInvalidValue;
  return dispatch_dtypes(dtype, scale_dtype, [&](auto t, auto sv) {
    using T = decltype(t);
    using S = decltype(sv);
    auto run = [&](auto nt, auto cpg, auto sym) {
      constexpr int NT = decltype(nt)::value, CPG = decltype(cpg)::value;
      constexpr bool SYM = decltype(sym)::value;
      auto go = [&](auto kernel_launch) {
        return kernel_launch(x, qweight, scales, qzeros, shared_qweight, shared_scales, shared_qzeros, sorted_rows,
                             block_expert, partial, r, n, k, e, b, xd, g, s, stream);
      };
      if (g == 32) {
        if constexpr (CPG == 1 && !SYM)
          return warps == 4 ? go(launch_moe<T, S, NT, CPG, 4, true>) : go(launch_moe<T, S, NT, CPG, 8, true>);
        return cudaErrorInvalidValue;
      }
      // direct mode (one routed row per block): the fold of one row (awq_mma.cuh, fold R1)
      if constexpr (NT == 1) {
        if (sorted_rows == nullptr)
          return warps == 4 ? go(launch_moe<T, S, NT, CPG, 4, false, true, SYM>)
                            : go(launch_moe<T, S, NT, CPG, 8, false, true, SYM>);
      }
      return warps == 4 ? go(launch_moe<T, S, NT, CPG, 4, false, false, SYM>)
                        : go(launch_moe<T, S, NT, CPG, 8, false, false, SYM>);
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    // symmetric: the caller's word that every zero point (routed and shared experts) is 8; not read then
    auto pick = [&](auto nt, auto cpg) {
      return symmetric && g != 32 ? run(nt, cpg, std::true_type{}) : run(nt, cpg, std::false_type{});
    };
    if (block_rows == 8) return item_chunks == 1 ? pick(I1{}, I1{}) : pick(I1{}, I2{});
    return item_chunks == 1 ? pick(I2{}, I1{}) : pick(I2{}, I2{});
  });
}

}  // namespace torchforge
