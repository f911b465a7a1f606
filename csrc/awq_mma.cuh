// Device pieces shared by the mma-layout W4A16 kernels (awq_mma.cu dense, awq_mma_moe.cu grouped). The layout and
// the arithmetic are described at the top of awq_mma.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ptx_loads.cuh"

namespace torchforge {
namespace awq_mma_detail {

using ptx::ld_stream;

// Timing-only builds (bench/mma_decode_ablation.cu; the results are wrong, only the times count), bits of
// TORCHFORGE_MMA_ABLATE: 1 = every lane reads row 0's x (awq_mma.cu, the dense kernel only); 2 = x is not read (each
// chunk's fragment made from the item index); 4 = scales and zero words are not read (the fold's are constants; groups
// of 32 still read theirs, load_group_z16); 8 = no dequantization nor MMAs (each word XOR-ed into one sum); 16 = the
// weight words are not read (made from the item index); 32 = no MMAs for the sums of x (xs); 64 = one more bf16x2 /
// f16x2 subtract per A register; 128 = the MMAs of column tiles 2 and 3 left out (their A registers XOR-ed into one
// sum).
#ifndef TORCHFORGE_MMA_ABLATE
#define TORCHFORGE_MMA_ABLATE 0
#endif
constexpr int kMmaAblate = TORCHFORGE_MMA_ABLATE;

constexpr int kCols = 64;  // output columns of one layout column block: 4 MMA tiles of 16

template <typename T>
struct Traits;
template <>
struct Traits<__nv_bfloat16> {
  static constexpr uint32_t kMagic2 = 0x43004300u;  // (128, 128)
  static constexpr uint32_t kOnes2 = 0x3F803F80u;   // (1, 1)
  static constexpr float kMagic = 128.0f;
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  // all-ones A (sum of x over k): one register in all four A slots
  static __device__ __forceinline__ void mma_ones(float* c, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %4, %4, %4}, {%5, %6}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(kOnes2), "r"(b0), "r"(b1));
  }
};
template <>
struct Traits<__half> {
  static constexpr uint32_t kMagic2 = 0x64006400u;  // (1024, 1024)
  static constexpr uint32_t kOnes2 = 0x3C003C00u;
  static constexpr float kMagic = 1024.0f;
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ void mma_ones(float* c, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %4, %4, %4}, {%5, %6}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(kOnes2), "r"(b0), "r"(b1));
  }
};

// Packed pairs of x's dtype (awq_wgmma.cu's dequantization, and this file's for groups of 32). The two
// specializations differ only in the PTX type (bf16x2, f16x2) and in `low`.
// splat: v rounded, twice: one cvt that packs the pair (F2FP, a full-rate ALU op; rounding to one half and shifting it
// over went through F2F on the slow conversion pipe, on the dequantization's critical path at every group start).
#define TORCHFORGE_PAIR_OPS(TY)                                                  \
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) {       \
    uint32_t r;                                                                  \
    asm("sub.rn." TY " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));                 \
    return r;                                                                    \
  }                                                                              \
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {       \
    uint32_t r;                                                                  \
    asm("mul.rn." TY " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));                 \
    return r;                                                                    \
  }                                                                              \
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) { \
    uint32_t r;                                                                  \
    asm("fma.rn." TY " %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));     \
    return r;                                                                    \
  }                                                                              \
  static __device__ __forceinline__ uint32_t splat(float v) {                    \
    uint32_t r;                                                                  \
    asm("cvt.rn." TY ".f32 %0, %1, %1;" : "=r"(r) : "f"(v));                     \
    return r;                                                                    \
  }
template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  TORCHFORGE_PAIR_OPS("bf16x2")
  static __device__ __forceinline__ float low(uint32_t pair) { return __uint_as_float(pair << 16); }
};
template <>
struct Pair<__half> {
  TORCHFORGE_PAIR_OPS("f16x2")
  static __device__ __forceinline__ float low(uint32_t pair) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(pair & 0xFFFFu)));
  }
};
#undef TORCHFORGE_PAIR_OPS

// Quiet NaN bits of an fp16 / bf16 value.
template <typename T>
constexpr uint32_t kNaN16 = std::is_same<T, __half>::value ? 0x7E00u : 0x7FC0u;

// Element i of a row of K values of x (global memory: read through the read-only cache; else shared), as the low half
// of a word, for the act-order gathers (awq_mma.cu, awq_wgmma.cu): a permutation value outside [0, K) reads as NaN
// instead of past the row (the CUDA paths do not check perm's values: that would be a host sync).
template <typename T, bool kGlobal>
__device__ __forceinline__ uint32_t perm_elem(const unsigned short* row, int i, int K) {
  if (static_cast<unsigned>(i) >= static_cast<unsigned>(K)) return kNaN16<T>;
  return kGlobal ? __ldg(row + i) : row[i];
}

// Scales are fp16 (AWQ checkpoints) or, after model.to(bfloat16), bf16; either is widened to fp32 once per group.
__device__ __forceinline__ float scale_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float scale_f(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// (a & mask) | magic in one LOP3: written out because ptxas, given both constants as immediates, emits an AND and an
// OR (LOP3 takes one immediate), which made the dequantization the ALU pipe's largest load (ncu, 2026-11-22).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));  // 0xEA = (0xF0 & 0xCC) | 0xAA
  return r;
}

// AWQ packs column 8w + j of a zero word at nibble (j / 2) + 4 (j % 2).
__device__ __forceinline__ int awq_shift(int col) { return 4 * (((col & 7) >> 1) + 4 * (col & 1)); }

// The B fragments of k-step s for each row tile j, from this lane's x of the chunk (xv[j]: its 16 k, two uint4).
template <int NT>
__device__ __forceinline__ void b_frags(uint32_t (&b0)[NT], uint32_t (&b1)[NT], const uint4 (&xv)[NT][2], int s) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    b0[j] = word(xv[j][s / 2], 2 * (s % 2));
    b1[j] = word(xv[j][s / 2], 2 * (s % 2) + 1);
  }
}

// One work item (CPG chunks of 64 k, inside one quantization group) of this lane's C fragments: part = sum_k x (magic
// + q) for 4 column tiles x NT tiles of 8 rows, xs = sum_k x in the same fragment positions (all-ones A).
// w: the item's layout words of this lane (chunk c, k-step s at 4 c + s); xload(c, j, v): this lane's B-fragment x
// of chunk c, row tile j into v[0..1] (x[row, 64 c + 16 t .. + 15]). done(c, s), after the MMAs of k-step s of chunk
// c: w[4 c + s] (and at s = 3 chunk c's x) are no longer read, so the caller may load its next item's into them.
struct NoOp {
  __device__ __forceinline__ void operator()(int, int) const {}
};
// ZA (symmetric codes, two row tiles): the zero point goes into A instead, each register (magic + q) - (magic + 8) =
// q - 8 (exact: small integers), so part = sum_k x (q - 8) and xs is not computed (no all-ones MMAs; see fold).
template <typename T, int NT, int CPG, bool ZA = false, typename XLoad, typename Done = NoOp>
__device__ __forceinline__ void item_sums(float (&part)[4][NT][4], float (&xs)[NT][4], const uint4 (&w)[CPG * 4],
                                          XLoad&& xload, Done&& done = Done{}) {
  using Tr = Traits<T>;
  constexpr uint32_t kMagic8 = Tr::kMagic2 + 0x00080008u;  // (magic + 8, magic + 8)
  // XS16 (two row tiles, zeros read): the two row tiles' B fragments are, as they are, the A fragment of x's 16 rows
  // (a0..a3 = b0[0], b0[1], b1[0], b1[1]), so one MMA against all-ones B gives sum_k x for all 16 rows instead of one
  // all-ones-A MMA per tile; lane 4 r holds row r's sum in c0 and row 8 + r's in c2, moved to the fold's fragment
  // positions (row 8 j + 2 t + e % 2) by four shuffles per item. 72 instead of 80 MMAs per item, 4 more moves per
  // k-step (the A quad must be 4 consecutive registers); the same output sums in bench/mma_decode_ablation.sh. H200:
  // 18432x7168 at 16 rows 29.7 -> 28.7 us, 12 rows 29.4 -> 28.4, 64 rows 92.4 -> 89.3; 7168x7168 at 16 rows 13.6 ->
  // 13.5 (forty-fifth session). The grouped kernel's 128-k two-tile loop went from 80-92 bytes spilled to 16.
  constexpr bool kXs16 = NT == 2 && !ZA;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      xs[j][e] = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) part[i][j][e] = 0.0f;
    }
  }
#pragma unroll
  for (int c = 0; c < CPG; ++c) {
    uint4 xv[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) xload(c, j, xv[j]);
    if constexpr ((kMmaAblate & 8) != 0) {  // the loads without the arithmetic (timing only)
      uint32_t h = __float_as_uint(part[0][0][0]);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint4 ws = w[c * 4 + s];
        h ^= ws.x ^ ws.y ^ ws.z ^ ws.w;
        done(c, s);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) h ^= xv[j][0].x ^ xv[j][1].w;
      part[0][0][0] = __uint_as_float(h);
      continue;
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t b0[NT], b1[NT];
      b_frags(b0, b1, xv, s);
      if constexpr ((kMmaAblate & 32) == 0 && kXs16) {
        Tr::mma(xs[0], b0[0], b0[1], b1[0], b1[1], Tr::kOnes2, Tr::kOnes2);
      } else if constexpr ((kMmaAblate & 32) == 0 && !ZA) {
#pragma unroll
        for (int j = 0; j < NT; ++j) Tr::mma_ones(xs[j], b0[j], b1[j]);
      }
      const uint4 ws = w[c * 4 + s];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t wv = word(ws, i);
        uint32_t a0 = and_or(wv, 0x000F000Fu, Tr::kMagic2);
        uint32_t a1 = and_or(wv >> 4, 0x000F000Fu, Tr::kMagic2);
        uint32_t a2 = and_or(wv >> 8, 0x000F000Fu, Tr::kMagic2);
        uint32_t a3 = and_or(wv >> 12, 0x000F000Fu, Tr::kMagic2);
        auto subtract = [&](uint32_t pair) {
          a0 = Pair<T>::sub(a0, pair);
          a1 = Pair<T>::sub(a1, pair);
          a2 = Pair<T>::sub(a2, pair);
          a3 = Pair<T>::sub(a3, pair);
        };
        if constexpr (ZA) subtract(kMagic8);
        if constexpr ((kMmaAblate & 64) != 0) subtract(Tr::kMagic2);  // one more pair op per A register (timing only)
        if constexpr ((kMmaAblate & 128) != 0) {  // half the column tiles' MMAs (timing only)
          if (i >= 2) {
            part[i][0][0] = __uint_as_float(__float_as_uint(part[i][0][0]) ^ a0 ^ a1 ^ a2 ^ a3);
            continue;
          }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) Tr::mma(part[i][j], a0, a1, a2, a3, b0[j], b1[j]);
      }
      done(c, s);
    }
  }
  if constexpr (kXs16) {
    const int src = 8 * (threadIdx.x & 3);  // lanes 8 t (rows 2 t, 8 + 2 t) and 8 t + 4 (rows 2 t + 1, 9 + 2 t)
    const float r0 = __shfl_sync(0xFFFFFFFFu, xs[0][0], src), r1 = __shfl_sync(0xFFFFFFFFu, xs[0][0], src + 4);
    const float r8 = __shfl_sync(0xFFFFFFFFu, xs[0][2], src), r9 = __shfl_sync(0xFFFFFFFFu, xs[0][2], src + 4);
    xs[0][0] = xs[0][2] = r0;
    xs[0][1] = xs[0][3] = r1;
    xs[1][0] = xs[1][2] = r8;
    xs[1][1] = xs[1][3] = r9;
  }
}

// The scales and zero words of one group for this lane's columns of column block cb: C rows g (s[2 i]) and g + 8
// (s[2 i + 1]) of each column tile i, and the zero words z[2 i], z[2 i + 1] that hold them.
template <typename S>
struct GroupVals {
  S s[8];
  uint32_t z[8];
};

// SYM: every zero point is 8 (symmetric codes), so the zero words are not read (fold uses 8).
template <bool SYM, typename S>
__device__ __forceinline__ void load_group(GroupVals<S>& v, const S* __restrict__ sc, const uint32_t* __restrict__ qz,
                                           int N, int cb, int group, int g) {
  if constexpr ((kMmaAblate & 4) != 0) {  // timing only: constant scales and zeros, not read
    const unsigned short one = std::is_same<S, __half>::value ? 0x3C00u : 0x3F80u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v.s[i] = *reinterpret_cast<const S*>(&one);
      v.z[i] = 0x88888888u;
    }
    return;
  }
  const S* srow = sc + static_cast<size_t>(group) * N + cb * kCols + g;
  const uint32_t* zrow = qz + static_cast<size_t>(group) * (N / 8) + cb * (kCols / 8);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v.s[2 * i] = srow[16 * i];
    v.s[2 * i + 1] = srow[16 * i + 8];
    if constexpr (!SYM) {
      v.z[2 * i] = zrow[2 * i];
      v.z[2 * i + 1] = zrow[2 * i + 1];
    }
  }
}

// load_group with the 8 zero words (32 contiguous bytes) read as two 16-byte loads: qz 16-byte aligned (ops.cpp checks
// it where the G32 kernels use this). A group's values are loaded per chunk there, twice as often as with groups of 64.
template <typename S>
__device__ __forceinline__ void load_group_z16(GroupVals<S>& v, const S* __restrict__ sc,
                                               const uint32_t* __restrict__ qz, int N, int cb, int group, int g) {
  const S* srow = sc + static_cast<size_t>(group) * N + cb * kCols + g;
  const uint4* zrow = reinterpret_cast<const uint4*>(qz + static_cast<size_t>(group) * (N / 8) + cb * (kCols / 8));
  const uint4 z0 = __ldg(zrow), z1 = __ldg(zrow + 1);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v.s[2 * i] = srow[16 * i];
    v.s[2 * i + 1] = srow[16 * i + 8];
    v.z[i] = word(z0, i);
    v.z[4 + i] = word(z1, i);
  }
}

// magic + z for the zero at bit zshift of a zero word, as a float.
template <typename T>
__device__ __forceinline__ float magic_plus_zero(uint32_t zword, int zshift) {
  return static_cast<float>(and_or(zword >> zshift, 0xFu, static_cast<uint32_t>(Traits<T>::kMagic)));
}

// acc += s * (part - (magic + z) * xs) with the group's scales and zeros; C rows g (e < 2) and g + 8 (e >= 2) of
// each column tile. Columns 64 cb + 16 i + g (+ 8) share their nibble position in the zero words
// (zshift = awq_shift(g)), and magic + z = z | magic since z < 16 <= magic.
// R1 (one row of x, NT = 1): only C elements 0 and 2 (x row 2t) can hold a real row, row 0 of lanes t = 0; elements 1
// and 3 (row 2t + 1) never do, so they are left out (zero; their rows are not stored). SYM: z = 8 (load_group).
// SASS instructions per item of the one-row decode loop, 4 warps, items of 128 k (nvcc 13.0, sm_90a): 449; 410 with
// R1; 370 with R1 and SYM.
template <typename T, int NT, bool R1, bool SYM, bool ZA = false, typename S>
__device__ __forceinline__ void fold(float (&acc)[4][NT][4], const float (&part)[4][NT][4], const float (&xs)[NT][4],
                                     const GroupVals<S>& v, int zshift) {
  using Tr = Traits<T>;
  static_assert(!R1 || NT == 1, "one row of x is one row tile");
  static_assert(!ZA || (SYM && !R1), "the zero in A is 8: symmetric codes");
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float s0 = scale_f(v.s[2 * i]);
    const float s1 = scale_f(v.s[2 * i + 1]);
    if constexpr (ZA) {  // part = sum x (q - 8) already (item_sums)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = fmaf(e < 2 ? s0 : s1, part[i][j][e], acc[i][j][e]);
      continue;
    }
    const float zc0 = SYM ? Tr::kMagic + 8.0f : magic_plus_zero<T>(v.z[2 * i], zshift);
    const float zc1 = SYM ? Tr::kMagic + 8.0f : magic_plus_zero<T>(v.z[2 * i + 1], zshift);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      acc[i][j][0] = fmaf(s0, part[i][j][0] - zc0 * xs[j][0], acc[i][j][0]);
      acc[i][j][2] = fmaf(s1, part[i][j][2] - zc1 * xs[j][2], acc[i][j][2]);
      if constexpr (!R1) {
        acc[i][j][1] = fmaf(s0, part[i][j][1] - zc0 * xs[j][1], acc[i][j][1]);
        acc[i][j][3] = fmaf(s1, part[i][j][3] - zc1 * xs[j][3], acc[i][j][3]);
      }
    }
  }
}

// Groups of 32 rows (G32). A 64-k chunk c holds two groups, and lane t's 16 k of it (16 t .. 16 t + 15 in the
// layout's k order) all lie in group 2 c + t / 2. The magic-number form above cannot split an MMA's sum over k between
// two groups, so here each A register is dequantized as awq_wgmma.cu does: (magic + q) - (magic + z), exact, times the
// scale rounded once to x's dtype (fp16 scales with bf16 x as s = hi + lo in bf16: fma(d, hi, d lo) is still one
// rounding of the exact product), which is the reference's weight. The MMAs accumulate into acc directly: no sums of
// x, no fold. lane_deq: a group's magic + z and scale of this lane's C rows 2 i + h (column 16 i + g + 8 h), as pairs.
template <typename S>
struct LaneDeq {
  uint32_t zc[8], shi[8], slo[8];
};

template <typename T, typename S>
__device__ __forceinline__ void lane_deq(LaneDeq<S>& d, const GroupVals<S>& v, int zshift) {
  using Tr = Traits<T>;
  using P = Pair<T>;
  constexpr bool kSplit = !std::is_same<T, S>::value;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t z = and_or(v.z[k] >> zshift, 0xFu, Tr::kMagic2 & 0xFFFFu);
    d.zc[k] = z | (z << 16);
    const float sv = scale_f(v.s[k]);
    d.shi[k] = P::splat(sv);
    d.slo[k] = kSplit ? P::splat(sv - P::low(d.shi[k])) : 0u;
  }
}

// One work item of CPG chunks with groups of 32: acc += x W for this lane's C fragments, W dequantized per register
// (gv[c]: the values of this lane's group in chunk c).
template <typename T, typename S, int NT, int CPG, typename XLoad>
__device__ __forceinline__ void item_dq(float (&acc)[4][NT][4], const uint4 (&w)[CPG * 4],
                                        const GroupVals<S> (&gv)[CPG], int zshift, XLoad&& xload) {
  using Tr = Traits<T>;
  using P = Pair<T>;
  constexpr bool kSplit = !std::is_same<T, S>::value;
#pragma unroll
  for (int c = 0; c < CPG; ++c) {
    LaneDeq<S> d;
    lane_deq<T, S>(d, gv[c], zshift);
    uint4 xv[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) xload(c, j, xv[j]);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t b0[NT], b1[NT];
      b_frags(b0, b1, xv, s);
      const uint4 ws = w[c * 4 + s];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t wv = word(ws, i);
        uint32_t a[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // register r: nibbles r, r + 4, column 16 i + g + 8 (r & 1)
          const int k = 2 * i + (r & 1);
          const uint32_t dd = P::sub(and_or(wv >> (4 * r), 0x000F000Fu, Tr::kMagic2), d.zc[k]);
          a[r] = kSplit ? P::fma(dd, d.shi[k], P::mul(dd, d.slo[k])) : P::mul(dd, d.shi[k]);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) Tr::mma(acc[i][j], a[0], a[1], a[2], a[3], b0[j], b1[j]);
      }
    }
  }
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[4][NT][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
}

// The words, x and group values of one work item, loaded ahead of their use (the prefetching loop, below).
template <typename S, int NT, int CPG>
struct ItemRegs {
  uint4 w[CPG * 4];
  uint4 x[CPG][NT][2];
  GroupVals<S> gv;
};

// sum_k x[row] * W[col] for this lane's C fragments, x read straight from global memory: the warp takes work items
// first, first + workers, ... of `items`. wbase: this column block's words + lane; xoff: this lane's B-fragment rows of
// x as offsets in uint4 from xb = x + 16 t (a row that does not exist reads row 0: an MMA never mixes rows of x, and
// those outputs are not stored).
// PF (the dense kernel's prefetching loop, items of 128 k): software-pipelined, the loads of a warp's next item in
// flight while it computes this one, from two register buffers (the loop is unrolled by two so that they need no
// copies). ncu on the plain loop (H100, thirteenth session): where the grid gives about 8 warps per SM (7168x7168 up
// to 16 rows: 112 blocks of 8 warps; 18432x7168: 288 of 4), DRAM ran at 36-58% of peak and half of every warp's
// stall cycles waited on its own loads, since each item's loads went out only after the previous item's arithmetic.
// Same arithmetic in the same order, same bits.
// G32: groups of 32 rows (item_dq, the plain loop only; chunks_per_group unused). R1: one row of x; SYM: every zero
// point 8 (fold, load_group).
template <typename T, typename S, int NT, int CPG, bool PF = false, bool G32 = false, bool R1 = false, bool SYM = false>
__device__ __forceinline__ void accumulate(float (&acc)[4][NT][4], const uint4* __restrict__ wbase,
                                           const S* __restrict__ sc, const uint32_t* __restrict__ qz,
                                           const uint4* __restrict__ xb, const int (&xoff)[NT], int N, int cb,
                                           int items, int first, int workers, int chunks_per_group, int g) {
  zero_acc(acc);
  const int zshift = awq_shift(g);
  // Two row tiles of symmetric codes: the 8 in A (item_sums ZA). H200, 18432x7168 at 16 rows in 3 slices of 4 warps
  // 28.8 -> 27.0 us, 12 rows 28.7 -> 26.6, 7168x7168 at 16 rows (2 slices of 8 warps) 13.1 -> 12.9 (forty-third
  // session, bench/mma_decode_ablation.sh). Not with one row tile: there the MMAs barely count (TORCHFORGE_MMA_ABLATE
  // 32, no all-ones MMAs: 22.1 -> 22.0 us at one row; 128, half the others: 21.8), while the extra subtracts do (64:
  // 22.7); at 16 rows 32 gave 26.2 and 128 25.9 from 28.8. Against XS16's sums with the 8 in the fold instead: 26.9
  // against 27.8 us (forty-fifth session).
  constexpr bool ZA = SYM && NT == 2 && !G32;
  // this lane's layout word i of an item, and its x of chunk c of an item for row tile j (two uint4)
  auto word_at = [&](int item, int i) {
    if constexpr ((kMmaAblate & 16) != 0) {  // timing only: words made, not read
      const uint32_t h = static_cast<uint32_t>(item * CPG * 4 + i) * 0x9E3779B9u;
      return make_uint4(h, h ^ 0x11111111u, h ^ 0x22222222u, h ^ 0x44444444u);
    }
    return ld_stream(wbase + (static_cast<size_t>(item) * CPG * 4 + i) * 32);
  };
  auto x_at = [&](int item, int c, int j, uint4(&v)[2]) {
    if constexpr ((kMmaAblate & 2) != 0) {  // timing only: x made, not read
      const uint32_t h = 0x3F803F80u ^ (static_cast<uint32_t>(item * CPG + c + j) & 0x00070007u);
      v[0] = make_uint4(h, h, h, h);
      v[1] = v[0];
      return;
    }
    const uint4* p = xb + xoff[j] + (item * CPG + c) * 8;
    v[0] = __ldg(p);
    v[1] = __ldg(p + 1);
  };
  if constexpr (G32) {
    static_assert(!PF && !R1 && !SYM, "groups of 32 run the plain loop, whose item_dq has no fold");
    const int half = (threadIdx.x >> 1) & 1;  // t / 2: which of a chunk's two groups this lane's k lie in
    for (int item = first; item < items; item += workers) {
      uint4 w[CPG * 4];
#pragma unroll
      for (int i = 0; i < CPG * 4; ++i) w[i] = word_at(item, i);
      GroupVals<S> gv[CPG];
#pragma unroll
      for (int c = 0; c < CPG; ++c) load_group_z16(gv[c], sc, qz, N, cb, 2 * (item * CPG + c) + half, g);
      item_dq<T, S, NT, CPG>(acc, w, gv, zshift, [&](int c, int j, uint4(&v)[2]) { x_at(item, c, j, v); });
    }
    return;
  }
  const int items_per_group = chunks_per_group / CPG;
  const bool pow2 = (items_per_group & (items_per_group - 1)) == 0;  // groups of 64, 128, 256, ...: a shift
  const int group_shift = __ffs(items_per_group) - 1;
  auto fold_group = [&](const float(&part)[4][NT][4], const float(&xs)[NT][4], int item) {
    GroupVals<S> gv;
    load_group<SYM>(gv, sc, qz, N, cb, pow2 ? item >> group_shift : item / items_per_group, g);
    fold<T, NT, R1, SYM, ZA>(acc, part, xs, gv, zshift);
  };

  if constexpr (!PF && NT == 1) {
    // Rolling registers (one 8-row tile of x): each word (and each chunk's x) of the warp's next item is requested as
    // soon as the MMAs of this item are done with the register that holds it, without a second buffer (127 registers;
    // with two row tiles 364 bytes spilled, so those keep the loop below). That is the PTX order; ptxas (CUDA 13.0,
    // sm_90a) moves all of the next item's loads after this item's last MMAs, also with the loads unpredicated, at 168
    // registers, or behind asm memory barriers. So what this loop measurably gained (awq_mma.cu) is that they go out
    // before the fold's scale and zero loads and its arithmetic, not during the MMAs. Holding them between the MMAs
    // with an untaken trap branch per chunk or per k-step cost 10-20% more instructions and was 11-15% slower (H200,
    // thirty-ninth session, BENCHMARKS.md).
    uint4 w[CPG * 4];
    uint4 xr[CPG][NT][2];
    auto load_w = [&](int item, int i) { w[i] = word_at(item, i); };
    auto load_x = [&](int item, int c) {
#pragma unroll
      for (int j = 0; j < NT; ++j) x_at(item, c, j, xr[c][j]);
    };
    if (first < items) {
#pragma unroll
      for (int i = 0; i < CPG * 4; ++i) load_w(first, i);
#pragma unroll
      for (int c = 0; c < CPG; ++c) load_x(first, c);
    }
    for (int item = first; item < items; item += workers) {
      const int next = item + workers;
      const bool more = next < items;
      float part[4][NT][4];
      float xs[NT][4];
      item_sums<T, NT, CPG, ZA>(
          part, xs, w,
          [&](int c, int j, uint4(&v)[2]) {
            v[0] = xr[c][j][0];
            v[1] = xr[c][j][1];
          },
          [&](int c, int s) {
            if (!more) return;
            load_w(next, 4 * c + s);
            if (s == 3) load_x(next, c);
          });
      fold_group(part, xs, item);
    }
  } else if constexpr (!PF) {
    for (int item = first; item < items; item += workers) {
      uint4 w[CPG * 4];
#pragma unroll
      for (int i = 0; i < CPG * 4; ++i) w[i] = word_at(item, i);
      float part[4][NT][4];
      float xs[NT][4];
      item_sums<T, NT, CPG, ZA>(part, xs, w, [&](int c, int j, uint4(&v)[2]) { x_at(item, c, j, v); });
      fold_group(part, xs, item);
    }
  } else {
    auto load = [&](ItemRegs<S, NT, CPG>& r, int item) {
#pragma unroll
      for (int i = 0; i < CPG * 4; ++i) r.w[i] = word_at(item, i);
#pragma unroll
      for (int c = 0; c < CPG; ++c)
#pragma unroll
        for (int j = 0; j < NT; ++j) x_at(item, c, j, r.x[c][j]);
      load_group<SYM>(r.gv, sc, qz, N, cb, pow2 ? item >> group_shift : item / items_per_group, g);
    };
    auto compute = [&](const ItemRegs<S, NT, CPG>& r) {
      float part[4][NT][4];
      float xs[NT][4];
      item_sums<T, NT, CPG, ZA>(part, xs, r.w, [&](int c, int j, uint4(&v)[2]) {
        v[0] = r.x[c][j][0];
        v[1] = r.x[c][j][1];
      });
      fold<T, NT, R1, SYM, ZA>(acc, part, xs, r.gv, zshift);
    };
    ItemRegs<S, NT, CPG> a, b;
    int item = first;
    if (item < items) load(a, item);
    for (; item < items; item += 2 * workers) {
      const int next = item + workers;
      if (next < items) load(b, next);
      compute(a);
      if (next >= items) break;
      if (next + workers < items) load(a, next + workers);
      compute(b);
    }
  }
}

// Both kernels: 4 or 8 warps split K on one column block and 16 rows of x, then sum through shared memory
// red[warp][row][column].
constexpr int kRows = 16;  // rows of x per block: 2 MMA tiles of 8
constexpr int kPad = kCols + 4;

// C fragments of the block's warps -> red: element e is column 16 i + g + 8 (e / 2), row 8 j + 2 t + (e % 2).
template <int NT>
__device__ __forceinline__ void stash(float* red, const float (&acc)[4][NT][4], int warp, int g, int t) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        red[(warp * kRows + 8 * j + 2 * t + (e & 1)) * kPad + 16 * i + g + 8 * (e >> 1)] = acc[i][j][e];
}

// The (x, scales) dtype pairs the kernels are built for: dtype codes 0 = bf16, 1 = fp16. bf16 x takes fp16 (AWQ
// checkpoints) or bf16 scales; fp16 x takes fp16 scales. F is a generic lambda called with (T{}, S{}).
template <typename F>
cudaError_t dispatch_dtypes(int dtype, int scale_dtype, F&& f) {
  if (dtype == 0 && scale_dtype == 1) return f(__nv_bfloat16{}, __half{});
  if (dtype == 0 && scale_dtype == 0) return f(__nv_bfloat16{}, __nv_bfloat16{});
  if (dtype == 1 && scale_dtype == 1) return f(__half{}, __half{});
  return cudaErrorInvalidValue;
}

}  // namespace awq_mma_detail
}  // namespace torchforge
