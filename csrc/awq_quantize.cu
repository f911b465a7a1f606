// AWQ 4-bit round-to-nearest quantization + vLLM AWQ packing, fused in one pass.
//
//   weight  [(E,) OC, IC]          fp16 / bf16 / fp32, contiguous (nn.Linear layout)
//   qweight [(E,) IC, OC/8]        int32, 8 output channels per word
//   scales  [(E,) IC/G, OC]        fp16
//   qzeros  [(E,) IC/G, OC/8]      int32, same packing as qweight
//
// Bit-exact with the plain-torch fp32 reference on CPU: fp32 math, IEEE division (no fast-math),
// round half to even, codes from the scale as stored in fp16:
//   sym:  s = amax / 7 (1 if amax == 0; at least 2^-24 so fp16(s) != 0), sf = fp32(fp16(s)),
//         q = clamp(rint(w / sf), -8, 7) + 8, zero point 8 in every nibble (0x88888888). The zero
//         point is 8 and not 0 because vLLM / AutoAWQ dequantize (q - z) * s on UNSIGNED
//         nibbles: a signed code with z = 0 would turn every negative weight positive.
//   asym: s = max(max - min, 1e-5) / 15, z = clamp(rint(-min / sf), 0, 15),
//         q = clamp(rint(w / sf) + z, 0, 15).
// Packing (qweight and qzeros): output column 8c + j sits in nibble [0, 4, 1, 5, 2, 6, 3, 7][j]
// of word c (AutoAWQ / vLLM packing order [0, 2, 4, 6, 1, 3, 5, 7]).
//
// One tile = 256 output rows x 128 input columns (x 256 for G = 256), 256 threads, persistent
// grid-stride loop over tiles (the expert dim E is part of the tile index: one launch per layer).
//   * Each thread owns "items" of 8 output rows x 8 input columns (one 16-byte vector per row for
//     16-bit inputs). Consecutive lanes take consecutive 8-column chunks, so a warp reads whole
//     256-byte row segments, and the G/8 lanes of a group form one aligned lane range.
//   * Loads: cp.async (16 B, L2 only) into a per-thread ring of 3 item stages in shared memory,
//     two items ahead, so HBM stays busy while the SM computes (a thread reads back only its own
//     copies: no block barrier).
//   * Per-(row, group) max / min: packed bf16x2 / f16x2 max-min in the thread, then a butterfly
//     __shfl_xor_sync over the group's lanes. Each lane of a group computes the scale (IEEE
//     division) of one row, the 8 results are gathered with __shfl_sync.
//   * Codes: w / sf through the compiler's own div.rn main path with the reciprocal hoisted per
//     row (see quantize_fast), round via the 1.5 * 2^23 trick, packed with one shift-add per code.
//     The thread already holds the 8 consecutive output rows of each of its 8 input columns, so it
//     assembles 8 whole qweight words without any exchange.
//   * The words go through shared memory (XOR-swizzled: conflict-free on both sides) so that a
//     warp stores one 128-byte row segment of qweight[ic, oc/8 .. oc/8 + 31] per instruction.
// The weight is read once and every output byte written once.
//
// This file needs only the CUDA headers: the torch op (argument checks, output allocation,
// stream, device guard) is in ops.cpp, compiled by the host C++ compiler, which calls
// awq_quantize_launch() below.
// Defining AWQ_KERNEL_ONLY before including this file drops the launcher (standalone timing).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include "ptx_loads.cuh"

#ifndef AWQ_MIN_BLOCKS
#define AWQ_MIN_BLOCKS 2  // __launch_bounds__ min blocks per SM (register cap 65536/(256*this))
#endif

#ifndef AWQ_CARVEOUT
#define AWQ_CARVEOUT 100  // cudaFuncAttributePreferredSharedMemoryCarveout (percent)
#endif

namespace torchforge {
namespace awq_detail {

constexpr int kThreads = 256;
constexpr int kRowBlocks = 32;  // 8-row blocks per tile -> 256 output rows, one 128-B qweight row
// 1.5 * 2^23 and its bit pattern: RN(x + kMagic) for |x| < 2^22 is rint(x) (round half to even,
// kMagic is even) held in the low mantissa bits; float bits are monotonic for positive values,
// so clamping the bits clamps the rounded value even where x leaves that range.
constexpr float kMagic = 12582912.0f;
constexpr int kMagicBits = 0x4B400000;
// Path flags of a row, above its (s16 | z << 16) word: quantize_exact for the whole item, or the
// clamped fast path (asymmetric rows whose codes could leave [0, 15]).
constexpr uint32_t kExactFlag = 1u << 31;
constexpr uint32_t kClampFlag = 1u << 30;
// The zero point of a row word (bits 16..19, below the flags).
__device__ __forceinline__ uint32_t row_zero(uint32_t v) { return (v >> 16) & 15u; }

// Nibble position of logical output column j (0..7) inside a packed word: AutoAWQ / vLLM
// packing order [0, 2, 4, 6, 1, 3, 5, 7] (nibble k holds column order[k]), inverted.
__host__ __device__ constexpr int awq_shift(int j) {
  return 4 * ((j & 1) * 4 + (j >> 1));  // j = 0..7 -> nibble 0, 4, 1, 5, 2, 6, 3, 7
}

// ---- element types: 8 consecutive elements of a row = kW 16-byte vectors ----
template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kW = 1;
  static constexpr bool kPacked = true;  // statistics on packed 16-bit pairs
  using P2 = __nv_bfloat162;
  __device__ static float lo(uint32_t u) { return __uint_as_float(u << 16); }
  __device__ static float hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
};
template <>
struct Elem<__half> {
  static constexpr int kW = 1;
  static constexpr bool kPacked = true;
  using P2 = __half2;
  __device__ static float lo(uint32_t u) { return __half2float(__ushort_as_half((unsigned short)(u & 0xffffu))); }
  __device__ static float hi(uint32_t u) { return __half2float(__ushort_as_half((unsigned short)(u >> 16))); }
};
template <>
struct Elem<float> {
  static constexpr int kW = 2;
  static constexpr bool kPacked = false;
  using P2 = void;
};

// element k (0..7) of one item row held as kW uint4
template <typename T>
__device__ __forceinline__ float elem(const uint4 (&v)[Elem<T>::kW], int k);

template <typename T>
__device__ __forceinline__ uint32_t word_of(const uint4 (&v)[Elem<T>::kW], int w) {
  const uint4& q = v[w >> 2];
  const int i = w & 3;
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

template <typename T>
__device__ __forceinline__ float elem(const uint4 (&v)[Elem<T>::kW], int k) {
  if constexpr (Elem<T>::kPacked) {
    const uint32_t u = word_of<T>(v, k >> 1);
    return (k & 1) ? Elem<T>::hi(u) : Elem<T>::lo(u);
  } else {
    return __uint_as_float(word_of<T>(v, k));
  }
}

template <typename P2>
__device__ __forceinline__ uint32_t pmax(uint32_t a, uint32_t b) {
  P2 x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  const P2 r = __hmax2(x, y);
  uint32_t u;
  memcpy(&u, &r, 4);
  return u;
}
// max(|a|, |b|) per half, with the sign bit the XOR of the inputs' (PTX max.xorsign.abs, sm_86+): one instruction
// where masking both inputs first took three; the sign bits are cleared once, after the reduction.
template <typename P2>
__device__ __forceinline__ uint32_t pmax_abs(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (std::is_same<P2, __nv_bfloat162>::value) {
    asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  } else {
    asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  }
  return r;
}
template <typename P2>
__device__ __forceinline__ uint32_t pmin(uint32_t a, uint32_t b) {
  P2 x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  const P2 r = __hmin2(x, y);
  uint32_t u;
  memcpy(&u, &r, 4);
  return u;
}

template <typename T, int G>
struct TileCfg {
  static constexpr int kCols = G > 128 ? G : 128;  // input columns per tile
  static constexpr int kChunks = kCols / 8;        // 8-column chunks per tile row (16 / 32)
  static constexpr int kItems = kRowBlocks * kChunks / kThreads;  // items per thread (2 / 4)
  static constexpr int kLanes = G / 8;             // lanes sharing one group (4..32)
  static constexpr int kRowBlocksPerWarp = 32 / kChunks;
  static constexpr int kW = Elem<T>::kW;
  static constexpr int kStageBytes = 8 * kW * 16 * kThreads;  // one item for every thread
  static constexpr int kSwBytes = kCols * 32 * 4;
  // 2 blocks / SM for 16-bit inputs: 16 KB + 3 x 32 KB (G <= 128), 32 KB + 2 x 32 KB (G = 256)
#ifdef AWQ_STAGES
  static constexpr int kStages = AWQ_STAGES;
#else
  static constexpr int kStages = (kW == 1 && kCols == 128) ? 3 : 2;
#endif
  static constexpr int kSmemBytes = kSwBytes + kStages * kStageBytes;
  static_assert(kChunks % kLanes == 0 && 32 % kChunks == 0, "bad tile");
  static_assert(kStages - 1 <= kItems, "prefetch reaches at most one tile ahead");
};

// Shared-memory word tile sw[ic][b] (ic < kCols, b < 32), stored at column b ^ swz(ic).
// Writers: for a fixed word index i a warp writes rows ic = 8c + i for its kChunks chunks c and
// its kRowBlocksPerWarp row blocks b; swz(ic) = c * kRowBlocksPerWarp puts those 32 lanes in 32
// distinct banks. Readers: a warp reads one row ic, lane b -> a permutation of the 32 banks.
template <int kRowBlocksPerWarp>
__device__ __forceinline__ int swz(int ic) {
  return ((ic >> 3) * kRowBlocksPerWarp) & 31;
}

using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;

__device__ __forceinline__ float rcp_approx(float x) {  // max error 1 ulp (PTX ISA)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// 1 / x after one Newton step on rcp.approx, as in div.rn.f32's main path (see quantize_fast)
__device__ __forceinline__ float rcp_newton(float x) {
  const float r0 = rcp_approx(x);
  return fmaf(r0, fmaf(-x, r0, 1.0f), r0);
}

// A tile's position, and the element offsets of its first weight, scale and zero word (the thread's own part of
// each is added by the kernel): the 64-bit address arithmetic once per tile, not per item (it was about a tenth of
// the item loop's instructions).
struct TileInfo {
  int b0;    // first 8-row block
  int ic0;   // first input column
  bool ok;
  int64_t w;  // weight + w: row 8 b0, column ic0 of the tile's expert
  int64_t s;  // scales + s: group ic0 / G, column 8 b0
  int64_t z;  // qzeros + z: group ic0 / G, word b0
  int64_t q;  // qweight + q: row ic0, word b0
};

template <int kCols, int G>
__device__ __forceinline__ TileInfo decode_tile(int64_t tile, int64_t num_tiles, int n_oc_tiles, int n_ic_tiles,
                                                int OC, int IC) {
  TileInfo t;
  t.ok = tile < num_tiles;
  const uint32_t tt = t.ok ? (uint32_t)tile : 0u;  // host guarantees num_tiles < 2^31
  const uint32_t rest = tt / (uint32_t)n_ic_tiles;
  const int ict = (int)(tt - rest * (uint32_t)n_ic_tiles);
  t.ic0 = ict * kCols;
  const uint32_t e = rest / (uint32_t)n_oc_tiles;
  t.b0 = (int)(rest - e * (uint32_t)n_oc_tiles) * kRowBlocks;
  const int OC8 = OC >> 3;
  const int64_t g0 = (int64_t)e * (IC / G) + ict * (kCols / G);  // kCols is a multiple of G
  t.w = ((int64_t)e * OC + 8 * t.b0) * IC + t.ic0;
  t.s = g0 * OC + 8 * t.b0;
  t.z = g0 * OC8 + t.b0;
  t.q = ((int64_t)e * IC + t.ic0) * OC8 + t.b0;
  return t;
}

// sum over rows r of (kMagicBits << awq_shift(r)), mod 2^32: what the magic constant adds to a
// word when the rounded bits of all 8 rows are accumulated with shift-and-add (below).
__host__ __device__ constexpr uint32_t magic_word() {
  uint32_t k = 0u;
  for (int r = 0; r < 8; ++r) k += (uint32_t)kMagicBits << awq_shift(r);
  return k;
}

// Codes of one item (8 rows x 8 columns) packed into 8 words (word i = input column i, nibble
// awq_shift(r) = row r).
//
// Division: fl(w / sf) is computed with the main path of the compiler's own IEEE division
// (div.rn.f32): r1 = one Newton step on rcp.approx(sf) (per row), q0 = RN(w * r1),
// rem = w - sf * q0 (exact, FMA), q1 = RN(q0 + r1 * rem). That sequence is correctly rounded
// except where div.rn's range check (FCHK) sends operands to its slow path: denormal / zero /
// huge operands or quotients. Here sf is a normal fp32 number (>= 2^-24), a zero or denormal w
// gives |q1| < 0.5 either way (code unchanged), and rows whose quotient could overflow go to
// quantize_exact (see the caller). Rounding: RN(q1 + 1.5 * 2^23) = rint(q1), bits kMagicBits + k.
// Packing: word_i = sum_r bits_r << awq_shift(r) - magic_word() (mod 2^32; each code fits its
// nibble, so nothing carries), one shift-and-add per element.
// Symmetric (normal fp16 scale): |w / sf| <= 7 (1 + 2^-11) / (1 - 2^-11) < 7.5, so rint(x)
// stays in [-7, 7] and needs no clamp; adding 8 to the magic constant gives the code directly.
// Asymmetric: clamp(rint(x) + z, 0, 15) = clamp(rint(x), -z, 15 - z) + z; the clamp runs on the
// bits (monotonic in x for t > 0, negative ints for t < 0), and the z's come back as the packed
// zero word. Rows whose codes already lie in [0, 15] (all but groups of one sign and rare
// round-ups at the maximum: see kClampFlag's caller) take kClamp = false, two instructions
// fewer per element.
template <typename T, bool kSym, bool kClamp>
__device__ __forceinline__ void quantize_fast(const uint4 (&raw)[8][Elem<T>::kW], const float (&sf)[8],
                                              const float (&r1)[8], const uint32_t (&vrow)[8],
                                              uint32_t zword, uint32_t (&words)[8]) {
  constexpr float C = kSym ? kMagic + 8.0f : kMagic;
  uint32_t acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0u;
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const int sh = awq_shift(r);
    const int zr = (int)row_zero(vrow[r]);
    const int lob = kMagicBits - zr, hib = kMagicBits + 15 - zr;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float f = elem<T>(raw[r], i);
      const float q0 = __fmul_rn(f, r1[r]);
      const float rem = fmaf(-sf[r], q0, f);
      const float q1 = fmaf(r1[r], rem, q0);
      int b = __float_as_int(__fadd_rn(q1, C));
      if (kClamp) b = min(max(b, lob), hib);
      acc[i] += (uint32_t)b << sh;
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) words[i] = acc[i] - magic_word() + (kSym ? 0u : zword);
}

// Reference path: IEEE division, exactly the definition. Rarely taken, so kept out of line (the
// hot loop stays small in the instruction cache): it reloads the item from its stage in shared
// memory, gets the 8 (s16 | z << 16 | flags) row words as scalars and writes word i to out[32 * i]
// (the item's column of the shared word tile).
template <typename T, bool kSym>
__device__ __noinline__ void quantize_exact(const uint4* __restrict__ st, uint32_t* out, uint32_t v0, uint32_t v1, uint32_t v2,
                                            uint32_t v3, uint32_t v4, uint32_t v5, uint32_t v6,
                                            uint32_t v7) {
  constexpr int kW = Elem<T>::kW;
  const uint32_t v[8] = {v0, v1, v2, v3, v4, v5, v6, v7};
  uint32_t words[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) words[i] = 0u;
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    uint4 raw[kW];
#pragma unroll
    for (int k = 0; k < kW; ++k) raw[k] = st[(r * kW + k) * kThreads];
    const float sf = __half2float(__ushort_as_half((unsigned short)(v[r] & 0xffffu)));
    const float z = (float)row_zero(v[r]);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = rintf(__fdiv_rn(elem<T>(raw, i), sf));
      const float q = kSym ? fminf(fmaxf(x, -8.0f), 7.0f) + 8.0f : fminf(fmaxf(x + z, 0.0f), 15.0f);
      words[i] |= (uint32_t)q << awq_shift(r);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) out[32 * i] = words[i];
}

template <typename T, int G, bool kSym>
__global__ void __launch_bounds__(kThreads, AWQ_MIN_BLOCKS)
    awq_quantize_kernel(const T* __restrict__ weight, int32_t* __restrict__ qweight,
                        __half* __restrict__ scales, int32_t* __restrict__ qzeros, int OC, int IC,
                        int64_t num_tiles, int n_oc_tiles, int n_ic_tiles) {
  using Cfg = TileCfg<T, G>;
  using E = Elem<T>;
  constexpr int kW = Cfg::kW;
  constexpr int kS = Cfg::kStages;
  constexpr int kL = Cfg::kLanes;

  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t(*sw)[32] = reinterpret_cast<uint32_t(*)[32]>(smem);
  // stage s, vector v (= r * kW + k) of thread t: uint4 at ((s * 8 * kW + v) * kThreads + t):
  // consecutive threads hit consecutive 16 bytes (conflict-free). Each thread reads back only
  // what its own cp.async wrote, so the stages need no block barrier.
  uint4* stage = reinterpret_cast<uint4*>(smem + Cfg::kSwBytes);
  const uint32_t stage_addr = (uint32_t)__cvta_generic_to_shared(stage);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int OC8 = OC >> 3;
  const int64_t stride = gridDim.x;
  const int64_t first = blockIdx.x;
  if (first >= num_tiles) return;
  const int64_t my_tiles = (num_tiles - 1 - first) / stride + 1;

  // item j of this thread: chunk c (8 input columns: the same for every j, as kThreads % kChunks == 0), row block
  // b = j * kBPer + b_t (8 output rows)
  constexpr int kBPer = kThreads / Cfg::kChunks;
  const int c = tid % Cfg::kChunks;
  const int b_t = tid / Cfg::kChunks;
  const int64_t row_bytes = (int64_t)IC * sizeof(T);
  const int64_t w_t = (int64_t)(8 * b_t) * IC + 8 * c;           // this thread's part of a tile's weight offset
  const int64_t w_j = (int64_t)(8 * kBPer) * IC;                 // ... and an item's
  const int g_t = (8 * c) / G;                                   // group of the thread's chunk within the tile
  const int64_t s_t = (int64_t)g_t * OC + 8 * b_t, z_t = (int64_t)g_t * OC8 + b_t;

  auto issue = [&](const TileInfo& t, int j, int n) {
    const int s = (int)(n % kS);
    const int b = j * kBPer + b_t;
    const bool valid = t.ok && (t.b0 + b < OC8) && (t.ic0 + 8 * c < IC);
    // an item that does not exist reads nothing (src size 0) from the tensor's start
    const char* p = reinterpret_cast<const char*>(weight + (valid ? t.w + w_t + j * w_j : 0));
    const int64_t step = valid ? row_bytes : 0;
    const uint32_t dst = stage_addr + (uint32_t)((s * 8 * kW * kThreads + tid) * 16);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
#pragma unroll
      for (int k = 0; k < kW; ++k) cp_async16(dst + (uint32_t)((r * kW + k) * kThreads * 16), p + 16 * k, valid);
      p += step;
    }
  };
  auto load_item = [&](int n, uint4 (&raw)[8][kW]) {
    const int s = (int)(n % kS);
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int k = 0; k < kW; ++k) raw[r][k] = stage[(s * 8 * kW + r * kW + k) * kThreads + tid];
  };

  TileInfo cur = decode_tile<Cfg::kCols, G>(first, num_tiles, n_oc_tiles, n_ic_tiles, OC, IC);
  TileInfo nxt = decode_tile<Cfg::kCols, G>(first + stride, num_tiles, n_oc_tiles, n_ic_tiles, OC, IC);
#pragma unroll
  for (int q = 0; q < kS - 1; ++q) {
    issue(q < Cfg::kItems ? cur : nxt, q % Cfg::kItems, q);
    cp_async_commit();
  }

  for (int64_t k = 0; k < my_tiles; ++k) {
#pragma unroll 1
    for (int j = 0; j < Cfg::kItems; ++j) {
      const int n = (int)k * Cfg::kItems + j;
      {  // prefetch the item kS - 1 ahead (possibly of the next tile)
        const int q = j + kS - 1;
        issue(q < Cfg::kItems ? cur : nxt, q % Cfg::kItems, n + kS - 1);
        cp_async_commit();
      }
      cp_async_wait<kS - 1>();

      uint4 raw[8][kW];
      load_item(n, raw);
      const int b = j * kBPer + b_t;

      // ---- per-(row, group) statistics, reduced over the kL lanes of the group ----
      float hi[8], lo[8];  // sym: hi = amax; asym: hi = max, lo = min
      if constexpr (E::kPacked) {
        using P2 = typename E::P2;
        if constexpr (kSym) {
          uint32_t m[8];  // magnitudes of the row's maxima, sign bits meaningless until the mask below
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            const uint4 v = raw[r][0];
            m[r] = pmax_abs<P2>(pmax_abs<P2>(v.x, v.y), pmax_abs<P2>(v.z, v.w));
          }
          uint32_t pr[4];  // (amax[2p], amax[2p+1])
#pragma unroll
          for (int p = 0; p < 4; ++p)
            pr[p] = pmax_abs<P2>(__byte_perm(m[2 * p], m[2 * p + 1], 0x5410),
                                 __byte_perm(m[2 * p], m[2 * p + 1], 0x7632));
#pragma unroll
          for (int off = kL / 2; off > 0; off >>= 1)
#pragma unroll
            for (int p = 0; p < 4; ++p) pr[p] = pmax_abs<P2>(pr[p], __shfl_xor_sync(0xffffffffu, pr[p], off));
#pragma unroll
          for (int p = 0; p < 4; ++p) pr[p] &= 0x7fff7fffu;
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            hi[2 * p] = E::lo(pr[p]);
            hi[2 * p + 1] = E::hi(pr[p]);
            lo[2 * p] = lo[2 * p + 1] = 0.0f;
          }
        } else {
          uint32_t st[8];  // (max[r], -min[r])
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            const uint4 v = raw[r][0];
            const uint32_t mx = pmax<P2>(pmax<P2>(v.x, v.y), pmax<P2>(v.z, v.w));
            const uint32_t mn = pmin<P2>(pmin<P2>(v.x, v.y), pmin<P2>(v.z, v.w)) ^ 0x80008000u;
            st[r] = pmax<P2>(__byte_perm(mx, mn, 0x5410), __byte_perm(mx, mn, 0x7632));
          }
#pragma unroll
          for (int off = kL / 2; off > 0; off >>= 1)
#pragma unroll
            for (int r = 0; r < 8; ++r) st[r] = pmax<P2>(st[r], __shfl_xor_sync(0xffffffffu, st[r], off));
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            hi[r] = E::lo(st[r]);
            lo[r] = -E::hi(st[r]);
          }
        }
      } else {
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          float a = elem<T>(raw[r], 0), bmin = a;
          if (kSym) a = fabsf(a);
#pragma unroll
          for (int i = 1; i < 8; ++i) {
            const float f = elem<T>(raw[r], i);
            if (kSym) {
              a = fmaxf(a, fabsf(f));
            } else {
              a = fmaxf(a, f);
              bmin = fminf(bmin, f);
            }
          }
          hi[r] = a;
          lo[r] = bmin;
        }
#pragma unroll
        for (int off = kL / 2; off > 0; off >>= 1) {
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            hi[r] = fmaxf(hi[r], __shfl_xor_sync(0xffffffffu, hi[r], off));
            if (!kSym) lo[r] = fminf(lo[r], __shfl_xor_sync(0xffffffffu, lo[r], off));
          }
        }
      }

      // ---- scales and zero points: each lane of a group computes 8 / min(kL, 8) rows (IEEE
      // division, as defined) and that row's path flags, then all lanes gather the 8
      // (s16 | z << 16 | flags) words ----
      constexpr int kOwn = kL >= 8 ? 1 : 2;
      const int gl = lane & (kL - 1);
      const int gbase = lane & ~(kL - 1);
      uint32_t own[kOwn];
#pragma unroll
      for (int o = 0; o < kOwn; ++o) {
        const int row = (kL >= 8 ? (gl & 7) : gl + 4 * o);
        float h = hi[0], l = lo[0];
#pragma unroll
        for (int r = 1; r < 8; ++r) {
          if (row == r) {
            h = hi[r];
            l = lo[r];
          }
        }
        float s;
        if (kSym) {
          // clamp at the smallest fp16 subnormal (2^-24) so that a tiny nonzero group never
          // stores a zero scale (a division by zero); changes nothing where fp16(s) != 0
          s = h == 0.0f ? 1.0f : fmaxf(__fdiv_rn(h, 7.0f), 0x1p-24f);
        } else {
          s = __fdiv_rn(fmaxf(h - l, 1e-5f), 15.0f);
        }
        const __half s16 = __float2half_rn(s);
        const uint32_t h16 = __half_as_ushort(s16);
        uint32_t zz = 8u, flags;
        if (kSym) {
          // fp16-subnormal scale (amax < 7 * 2^-14: the unclamped symmetric path could leave
          // [-8, 7]) or infinite scale (amax / 7 > 65504)
          flags = ((h16 < 0x0400u) | (h16 >= 0x7c00u)) ? kExactFlag : 0u;
        } else {
          const float sfo = __half2float(s16);
          const float zq = rintf(__fdiv_rn(-l, sfo));
          const float zc = fminf(fmaxf(zq, 0.0f), 15.0f);
          zz = (uint32_t)zc;
          // The row's codes lie in [code(min), code(max)] (rint of a correctly rounded quotient
          // is monotonic). Unless z itself was clamped from above, code(min) = rint(min / sf) + z
          // >= 0: exactly 0 where z was not clamped (fl(-a / b) = -fl(a / b), rint is odd), above
          // 0 where it was clamped to 0 (min > 0). So only code(max) can then leave [0, 15]:
          // where it does not, the row needs no clamp.
          const bool clamp = (zq > 15.0f) | (rintf(__fdiv_rn(h, sfo)) + zc > 15.0f);
          // infinite scale, or quotients that could overflow fp32 in q0 = w * r1
          const bool exact = (h16 >= 0x7c00u) | (fmaxf(fabsf(h), fabsf(l)) * rcp_newton(sfo) > 0x1p100f);
          flags = (exact ? kExactFlag : 0u) | (clamp ? kClampFlag : 0u);
        }
        own[o] = h16 | (zz << 16) | flags;
      }
      float sf[8], r1[8];
      uint32_t vrow[8];
      uint32_t s16w[4];
      uint32_t zword = 0u;
      uint32_t flags = 0u;  // OR of the 8 rows' path flags
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const uint32_t v = __shfl_sync(0xffffffffu, own[kL >= 8 ? 0 : (r >> 2)],
                                       gbase | (kL >= 8 ? r : (r & 3)));
        vrow[r] = v;
        flags |= v;
        const uint32_t h16 = v & 0xffffu;
        sf[r] = __half2float(__ushort_as_half((unsigned short)h16));
        r1[r] = rcp_newton(sf[r]);
        if (!kSym) zword |= row_zero(v) << awq_shift(r);
        if (r & 1) s16w[r >> 1] |= h16 << 16; else s16w[r >> 1] = h16;
      }
      if (kSym) zword = 0x88888888u;

      // ---- codes -> this item's column of the shared word tile: word i at sw[8c + i][col] ----
      uint32_t* out = &sw[8 * c][b ^ swz<Cfg::kRowBlocksPerWarp>(8 * c)];
      if (!(flags & kExactFlag)) {
        uint32_t words[8];
        if constexpr (!kSym) {
          if (flags & kClampFlag) quantize_fast<T, false, true>(raw, sf, r1, vrow, zword, words);
          else quantize_fast<T, false, false>(raw, sf, r1, vrow, zword, words);
        } else {
          quantize_fast<T, true, false>(raw, sf, r1, vrow, zword, words);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) out[32 * i] = words[i];
      } else {
        quantize_exact<T, kSym>(stage + (int)(n % kS) * 8 * kW * kThreads + tid, out, vrow[0], vrow[1],
                                vrow[2], vrow[3], vrow[4], vrow[5], vrow[6], vrow[7]);
      }

      const bool valid = (cur.b0 + b < OC8) && (cur.ic0 + 8 * c < IC);
      if (valid && gl == 0) {
        __stcs(reinterpret_cast<uint4*>(scales + cur.s + s_t + 8 * j * kBPer),
               make_uint4(s16w[0], s16w[1], s16w[2], s16w[3]));
        __stcs(reinterpret_cast<unsigned int*>(qzeros + cur.z + z_t + j * kBPer), zword);
      }
    }
    __syncthreads();

    // ---- coalesced qweight stores: one 128-byte row segment per warp instruction ----
    if (cur.b0 + lane < OC8) {
      unsigned int* qwt = reinterpret_cast<unsigned int*>(qweight + cur.q + (int64_t)warp * OC8 + lane);
      const int64_t step = (int64_t)(kThreads / 32) * OC8;
      const int rows = min(Cfg::kCols, IC - cur.ic0);
#pragma unroll 4
      for (int ic = warp; ic < rows; ic += kThreads / 32) {
        __stcs(qwt, sw[ic][lane ^ swz<Cfg::kRowBlocksPerWarp>(ic)]);
        qwt += step;
      }
    }
    __syncthreads();
    cur = nxt;
    nxt = decode_tile<Cfg::kCols, G>(first + (k + 2) * stride, num_tiles, n_oc_tiles, n_ic_tiles, OC, IC);
  }
  cp_async_wait<0>();
}

// Grid-stride launch over all tiles (persistent grid: as many blocks as fit on the device).
// Returns the first CUDA error of the configuration calls; the launch itself is checked by the
// caller (cudaGetLastError / C10_CUDA_KERNEL_LAUNCH_CHECK).
template <typename T, int G, bool kSym>
cudaError_t launch_awq_quantize(const T* w, int32_t* qw, __half* sc, int32_t* qz, int64_t E, int OC,
                                int IC, cudaStream_t stream) {
  using Cfg = TileCfg<T, G>;
  const int n_oc_tiles = (OC / 8 + kRowBlocks - 1) / kRowBlocks;
  const int n_ic_tiles = (IC + Cfg::kCols - 1) / Cfg::kCols;
  const int64_t num_tiles = E * (int64_t)n_oc_tiles * n_ic_tiles;
  if (num_tiles == 0) return cudaSuccess;
  if (num_tiles >= ((int64_t)1 << 31)) return cudaErrorInvalidValue;

  auto kernel = awq_quantize_kernel<T, G, kSym>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  // all of L1 as shared memory: two blocks of ~112 KB per SM
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, AWQ_CARVEOUT);
  if (err != cudaSuccess) return err;
  int blocks_per_sm = 0, dev = 0, sms = 0;
  if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreads, Cfg::kSmemBytes)) != cudaSuccess) return err;
  if ((err = cudaGetDevice(&dev)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return err;
  const int64_t max_grid = (int64_t)sms * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  const int grid = (int)(num_tiles < max_grid ? num_tiles : max_grid);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(w, qw, sc, qz, OC, IC, num_tiles, n_oc_tiles, n_ic_tiles);
  return cudaSuccess;
}

}  // namespace awq_detail
}  // namespace torchforge

#ifndef AWQ_KERNEL_ONLY
// ---- host launcher (plain CUDA runtime; the torch op around it lives in ops.cpp) ----
namespace torchforge {
namespace {
template <typename T, bool kSym>
cudaError_t launch_g(int64_t G, const void* w, int32_t* qw, void* sc, int32_t* qz, int64_t E,
                     int OC, int IC, cudaStream_t stream) {
  using namespace awq_detail;
  const T* wt = static_cast<const T*>(w);
  __half* s = static_cast<__half*>(sc);
  switch (G) {
    case 32: return launch_awq_quantize<T, 32, kSym>(wt, qw, s, qz, E, OC, IC, stream);
    case 64: return launch_awq_quantize<T, 64, kSym>(wt, qw, s, qz, E, OC, IC, stream);
    case 128: return launch_awq_quantize<T, 128, kSym>(wt, qw, s, qz, E, OC, IC, stream);
    case 256: return launch_awq_quantize<T, 256, kSym>(wt, qw, s, qz, E, OC, IC, stream);
    default: return cudaErrorInvalidValue;
  }
}
template <typename T>
cudaError_t launch_t(int64_t G, bool sym, const void* w, int32_t* qw, void* sc, int32_t* qz,
                     int64_t E, int OC, int IC, cudaStream_t stream) {
  return sym ? launch_g<T, true>(G, w, qw, sc, qz, E, OC, IC, stream)
             : launch_g<T, false>(G, w, qw, sc, qz, E, OC, IC, stream);
}
}  // namespace

// dtype: 0 = bfloat16, 1 = float16, 2 = float32. Arguments are validated by the caller
// (ops.cpp); returns the first CUDA error of the launch configuration (cudaErrorInvalidValue
// for an unsupported group size / dtype). The launch itself is checked by the caller.
cudaError_t awq_quantize_launch(int dtype, int64_t group_size, bool symmetric, const void* weight,
                                int32_t* qweight, void* scales, int32_t* qzeros, int64_t E,
                                int64_t OC, int64_t IC, cudaStream_t stream) {
  const int oc = (int)OC, ic = (int)IC;
  switch (dtype) {
    case 0: return launch_t<__nv_bfloat16>(group_size, symmetric, weight, qweight, scales, qzeros, E, oc, ic, stream);
    case 1: return launch_t<__half>(group_size, symmetric, weight, qweight, scales, qzeros, E, oc, ic, stream);
    case 2: return launch_t<float>(group_size, symmetric, weight, qweight, scales, qzeros, E, oc, ic, stream);
    default: return cudaErrorInvalidValue;
  }
}
}  // namespace torchforge
#endif  // AWQ_KERNEL_ONLY
