// Op schemas, the torch-facing wrappers and the CUDA registrations of the compiled extension
// torchforge._C.
//
// The Python side defines other ops in the same `torchforge` namespace through torch.library
// fragments, so everything here is a FRAGMENT as well (never TORCH_LIBRARY, which would claim
// the namespace). Importing torchforge._C runs the static registrations below.
//
// The wrappers live here and call plain launchers in the .cu files (which need no torch headers).
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>

namespace torchforge {

// csrc/awq_quantize.cu
cudaError_t awq_quantize_launch(int dtype, int64_t group_size, bool symmetric, const void* weight,
                                int32_t* qweight, void* scales, int32_t* qzeros, int64_t E,
                                int64_t OC, int64_t IC, cudaStream_t stream);

// csrc/awq_gemv.cu
cudaError_t awq_gemv_launch(int dtype, int rows, const void* x, const int32_t* qweight, const void* scales,
                            const int32_t* qzeros, const void* bias, void* out, float* partial,
                            unsigned int* tickets, int64_t N, int64_t K, int64_t group_size, int64_t splits,
                            cudaStream_t stream);

// csrc/awq_mma.cu, awq_mma_moe.cu
cudaError_t awq_mma_launch(int dtype, int scale_dtype, const void* x, const int32_t* qweight, const void* scales,
                           const int32_t* qzeros, const void* bias, void* out, float* partial,
                           unsigned int* tickets, int64_t M, int64_t N, int64_t K, int64_t group_size,
                           int64_t splits, int64_t item_chunks, int64_t warps, bool prefetch, cudaStream_t stream,
                           const int32_t* perm, void* x_perm, bool symmetric);

cudaError_t awq_mma_moe_launch(int dtype, int scale_dtype, int64_t block_rows, const void* x, const int32_t* qweight,
                               const void* scales, const int32_t* qzeros, const int32_t* shared_qweight,
                               const void* shared_scales, const int32_t* shared_qzeros, const int32_t* sorted_rows,
                               const int32_t* block_expert, float* partial, int64_t R, int64_t N, int64_t K,
                               int64_t E, int64_t B, int64_t x_row_div, int64_t group_size, int64_t splits,
                               int64_t item_chunks, int64_t warps, cudaStream_t stream, bool symmetric);

// csrc/awq_wgmma.cu (sm_90a)
int64_t awq_wgmma_image_rows(int64_t M, int64_t block_m);
int64_t awq_wgmma_tiles(int64_t M, int64_t N, int64_t block_m, int64_t tile_set);
int64_t awq_wgmma_block_outputs(int64_t block_m, int64_t tile_set);
bool awq_wgmma_g32_ready(int dtype, int scale_dtype, bool grouped);
cudaError_t awq_wgmma_launch(int dtype, int scale_dtype, const void* x, void* x_image, const int32_t* qweight,
                             const void* scales, const int32_t* qzeros, const void* bias, void* out, float* partial,
                             unsigned int* tickets, int64_t M, int64_t N, int64_t K, int64_t group_size,
                             int64_t splits, int64_t block_m, int64_t tile_set, int64_t group_m, bool producer_warp,
                             int64_t dp_tiles, cudaStream_t stream, const int32_t* perm, bool cluster);
int awq_wgmma_cluster_slots(int64_t block_m, int64_t tile_set, int64_t splits);
cudaError_t awq_wgmma_moe_launch(int dtype, int scale_dtype, const void* x, void* x_image, const int32_t* qweight,
                                 const void* scales, const int32_t* qzeros, const int32_t* shared_qweight,
                                 const void* shared_scales, const int32_t* shared_qzeros, const int32_t* sorted_rows,
                                 const int32_t* block_expert, float* partial, int64_t num_rows, int64_t x_row_div,
                                 int64_t blocks, int64_t N, int64_t K, int64_t E, int64_t group_size, int64_t block_m,
                                 int64_t tile_set, bool producer_warp, cudaStream_t stream);

// csrc/pdl.cuh: when the launchers use programmatic dependent launch.
namespace pdl {
namespace {
std::atomic<int>& pdl_level() {
  static std::atomic<int> v{[] {
    const char* e = std::getenv("TORCHFORGE_PDL");
    return e != nullptr && (std::string(e) == "0" || std::string(e) == "2") ? e[0] - '0' : 1;
  }()};
  return v;
}
}  // namespace
int level() { return pdl_level().load(std::memory_order_relaxed); }
std::atomic<int> start_prefetch_mode{-1};
int start_prefetch() { return start_prefetch_mode.load(std::memory_order_relaxed); }
}  // namespace pdl

// Sets how the decode kernel prefetches its first weights into L2 at its start (csrc/awq_mma.cu, pdl.cuh): -1 (the
// default) by its launcher's rule, else 0, 1 or 2 rounds of items on every launch; returns the previous mode.
int64_t set_start_prefetch(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 2, "set_start_prefetch: mode must be -1 (the launcher's rule), 0, 1 or 2, got ",
              std::to_string(mode));
  return pdl::start_prefetch_mode.exchange(static_cast<int>(mode));
}

// Whether the Hopper kernels can run groups of 32 with x of `dtype` and scales of `scale_dtype` on the current device
// (awq_wgmma_g32_ready in awq_wgmma.cu: their only instances are warp-specialized); grouped: awq_wgmma_moe_cuda's.
bool awq_wgmma_g32_ready_op(c10::ScalarType dtype, c10::ScalarType scale_dtype, bool grouped) {
  int device = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) return false;  // the kernels are built for sm_90a only
  const auto code = [](c10::ScalarType t) { return t == at::kBFloat16 ? 0 : t == at::kHalf ? 1 : 2; };
  return awq_wgmma_g32_ready(code(dtype), code(scale_dtype), grouped);
}

// How many clusters of `splits` blocks of awq_wgmma_cuda's (block_m, tile_set) K-slice kernel the current device runs
// at once (0: off sm_90, or where its slices cannot run as clusters): the rounds of clusters in the dispatch's time
// model, which takes cluster=True only where this is > 0 (a launch in clusters the device cannot place fails).
int64_t awq_wgmma_cluster_slots_op(int64_t block_m, int64_t tile_set, int64_t splits) {
  int device = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) return 0;
  return awq_wgmma_cluster_slots(block_m, tile_set, splits);
}

// Sets when the CUDA launchers use programmatic dependent launch (csrc/pdl.cuh: 0, 1 or 2); returns the previous
// level. Launches already captured in a CUDA graph keep the level they were captured with.
int64_t set_pdl(int64_t level) {
  TORCH_CHECK(level >= 0 && level <= 2, "set_pdl: level must be 0 (off), 1 (within an op) or 2 (every launch), got ",
              std::to_string(level));
  return pdl::pdl_level().exchange(static_cast<int>(level));
}

namespace {
// Error messages are assembled with std::to_string: streaming integers into TORCH_CHECK's
// message (std::ostream << long, instantiated in this library) segfaulted on the device image
// (torch 2.11+cu130), whatever compiler built the file; strings stream fine.
std::string i2s(int64_t v) { return std::to_string(v); }
std::string shape_str(at::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
}  // namespace

// RTN 4-bit AWQ quantization of weight [OC, IC] or [E, OC, IC] (fp16 / bf16 / fp32, contiguous)
// into vLLM AWQ layout: qweight int32 [(E,) IC, OC / 8], scales fp16 [(E,) IC / G, OC],
// qzeros int32 [(E,) IC / G, OC / 8]. NaN / Inf in the weight are checked on the Python side.
std::tuple<at::Tensor, at::Tensor, at::Tensor> awq_quantize_cuda(const at::Tensor& weight,
                                                                 int64_t group_size,
                                                                 bool symmetric) {
  TORCH_CHECK(weight.is_cuda(),
              "awq_quantize_cuda: weight must be a CUDA tensor, got " + weight.device().str());
  TORCH_CHECK(weight.dim() == 2 || weight.dim() == 3,
              "awq_quantize_cuda: weight must be [OC, IC] or [E, OC, IC], got shape " +
                  shape_str(weight.sizes()));
  const auto dt = weight.scalar_type();
  TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat,
              std::string("awq_quantize_cuda: weight dtype must be float16, bfloat16 or float32, got ") +
                  c10::toString(dt));
  TORCH_CHECK(weight.is_contiguous(), "awq_quantize_cuda: weight must be contiguous");
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256,
              "awq_quantize_cuda: group_size must be one of 32, 64, 128, 256, got " + i2s(group_size));
  const bool batched = weight.dim() == 3;
  const int64_t E = batched ? weight.size(0) : 1;
  const int64_t OC = weight.size(-2);
  const int64_t IC = weight.size(-1);
  TORCH_CHECK(OC % 8 == 0, "awq_quantize_cuda: OC (" + i2s(OC) +
                               ") must be a multiple of 8 (8 output channels per packed int32)");
  TORCH_CHECK(IC % group_size == 0, "awq_quantize_cuda: IC (" + i2s(IC) +
                                        ") must be a multiple of group_size (" + i2s(group_size) + ")");
  TORCH_CHECK(OC < (int64_t{1} << 30) && IC < (int64_t{1} << 30),
              "awq_quantize_cuda: OC and IC must be < 2^30, got " + i2s(OC) + " and " + i2s(IC));
  TORCH_CHECK(E * ((OC / 8 + 31) / 32) * ((IC + 127) / 128) < (int64_t{1} << 31),
              "awq_quantize_cuda: weight too large (more than 2^31 tiles of 256 x 128)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              "awq_quantize_cuda: weight data must be 16-byte aligned");

  const c10::cuda::OptionalCUDAGuard guard(weight.device());
  const auto i32 = weight.options().dtype(at::kInt);
  const auto f16 = weight.options().dtype(at::kHalf);
  const int64_t NG = IC / group_size;
  at::Tensor qw, sc, qz;
  if (batched) {
    qw = at::empty({E, IC, OC / 8}, i32);
    sc = at::empty({E, NG, OC}, f16);
    qz = at::empty({E, NG, OC / 8}, i32);
  } else {
    qw = at::empty({IC, OC / 8}, i32);
    sc = at::empty({NG, OC}, f16);
    qz = at::empty({NG, OC / 8}, i32);
  }
  if (weight.numel() == 0) return {qw, sc, qz};

  const int dtype_code = dt == at::kBFloat16 ? 0 : dt == at::kHalf ? 1 : 2;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();  // = at::cuda::getCurrentCUDAStream
  const cudaError_t err =
      awq_quantize_launch(dtype_code, group_size, symmetric, weight.data_ptr(),
                          qw.data_ptr<int32_t>(), sc.data_ptr(), qz.data_ptr<int32_t>(), E, OC,
                          IC, stream);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {qw, sc, qz};
}

namespace {
bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }
}  // namespace

// Batch-1 W4A16 GEMV (csrc/awq_gemv.cu): x with K elements (fp16 / bf16, contiguous), AWQ
// qweight [K, N/8], scales fp16 [K/G, N], qzeros [K/G, N/8], optional bias [N] in x's dtype;
// returns out [N] in x's dtype. `rows` (16, 32, 64) k-rows per work item, `splits` K slices.
at::Tensor awq_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& qzeros, int64_t group_size, const c10::optional<at::Tensor>& bias,
                         int64_t splits, int64_t rows) {
  const std::string op = "awq_gemv_cuda: ";
  TORCH_CHECK(x.is_cuda() && qweight.is_cuda() && scales.is_cuda() && qzeros.is_cuda(),
              op + "x, qweight, scales and qzeros must be CUDA tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op + "x must be bfloat16 or float16, got " + c10::toString(x.scalar_type()));
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qzeros.scalar_type() == at::kInt &&
                  scales.scalar_type() == at::kHalf,
              op + "qweight and qzeros must be int32 and scales float16");
  TORCH_CHECK(qweight.dim() == 2 && scales.dim() == 2 && qzeros.dim() == 2,
              op + "qweight, scales and qzeros must be 2-D");
  const int64_t K = qweight.size(0), N = qweight.size(1) * 8;
  TORCH_CHECK(x.numel() == K, op + "x has " + i2s(x.numel()) + " elements, qweight has K = " + i2s(K) + " rows");
  TORCH_CHECK(group_size > 0, op + "group_size must be positive, got " + i2s(group_size));  // before any K / G below
  TORCH_CHECK(K % group_size == 0 && scales.size(0) == K / group_size &&
                  scales.size(1) == N && qzeros.size(0) == K / group_size && qzeros.size(1) == N / 8,
              op + "scales must be [K/G, N] = [" + i2s(K / group_size) + ", " + i2s(N) + "] and qzeros [K/G, N/8], got " +
                  shape_str(scales.sizes()) + " and " + shape_str(qzeros.sizes()));
  TORCH_CHECK(N % 32 == 0, op + "N = " + i2s(N) + " must be a multiple of 32 (16-byte rows of 4 words)");
  TORCH_CHECK(rows == 16 || rows == 32 || rows == 64, op + "rows must be 16, 32 or 64, got " + i2s(rows));
  TORCH_CHECK(group_size % rows == 0, op + "rows = " + i2s(rows) + " must divide group_size = " + i2s(group_size));
  TORCH_CHECK(splits >= 1 && splits <= K / rows, op + "splits must be in [1, K / rows = " + i2s(K / rows) + "], got " + i2s(splits));
  TORCH_CHECK(splits <= 65535, op + "splits must be at most 65535 (grid dimension y), got " + i2s(splits));
  TORCH_CHECK(K < (int64_t{1} << 30) && N < (int64_t{1} << 30), op + "K and N must be < 2^30");
  TORCH_CHECK(qweight.device() == x.device() && scales.device() == x.device() && qzeros.device() == x.device(),
              op + "x, qweight, scales and qzeros must be on one device");
  TORCH_CHECK(x.is_contiguous() && qweight.is_contiguous() && scales.is_contiguous() && qzeros.is_contiguous(),
              op + "x, qweight, scales and qzeros must be contiguous");
  TORCH_CHECK(aligned16(qweight) && aligned16(scales) && aligned16(qzeros),
              op + "qweight, scales and qzeros must be 16-byte aligned");
  const void* bias_ptr = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.device() == x.device() && b.scalar_type() == x.scalar_type() && b.numel() == N,
                op + "bias must be a tensor of N = " + i2s(N) + " elements in x's dtype on x's device");
    bias_ptr = b.data_ptr();
  }
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor out = at::empty({N}, x.options());
  if (N == 0) return out;  // no output columns: nothing to launch (a grid of 0 blocks is a launch error)
  const int64_t tiles = (N / 8 + 31) / 32;
  at::Tensor tickets = at::zeros({tiles}, x.options().dtype(at::kInt));
  at::Tensor partial = at::empty({splits > 1 ? splits * N : 1}, x.options().dtype(at::kFloat));
  const cudaError_t err = awq_gemv_launch(
      x.scalar_type() == at::kBFloat16 ? 0 : 1, static_cast<int>(rows), x.data_ptr(), qweight.data_ptr<int32_t>(),
      scales.data_ptr(), qzeros.data_ptr<int32_t>(), bias_ptr, out.data_ptr(), partial.data_ptr<float>(),
      reinterpret_cast<unsigned int*>(tickets.data_ptr<int32_t>()), N, K, group_size, splits,
      c10::cuda::getCurrentCUDAStream());
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

namespace {
// The scale dtypes the mma kernels are built for (awq_mma.cuh dispatch_dtypes): fp16, or bf16 with bf16 x.
void check_mma_dtypes(const std::string& op, const at::Tensor& x, const at::Tensor& scales) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op + "x must be bfloat16 or float16, got " + c10::toString(x.scalar_type()));
  TORCH_CHECK(scales.scalar_type() == at::kHalf ||
                  (scales.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16),
              op + "scales must be float16 (or bfloat16 with bfloat16 x), got " +
                  c10::toString(scales.scalar_type()) + " with " + c10::toString(x.scalar_type()) +
                  " x: cast the scales to float16");
}
int dtype_code(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 0 : 1; }

// Arguments of the dense mma-layout ops; returns the bias pointer (null without one). b keeps the bias alive.
const void* check_mma_dense(const std::string& op, const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scales, const at::Tensor& qzeros, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, int64_t splits, int64_t item_chunks, at::Tensor& b,
                            bool allow_g32 = false) {
  TORCH_CHECK(x.is_cuda() && qweight.is_cuda() && scales.is_cuda() && qzeros.is_cuda(),
              op + "x, qweight, scales and qzeros must be CUDA tensors");
  check_mma_dtypes(op, x, scales);
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qzeros.scalar_type() == at::kInt,
              op + "qweight and qzeros must be int32");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && scales.dim() == 2 && qzeros.dim() == 2,
              op + "x, qweight, scales and qzeros must be 2-D");
  TORCH_CHECK(item_chunks == 1 || item_chunks == 2, op + "item_chunks must be 1 or 2, got " + i2s(item_chunks));
  TORCH_CHECK(group_size > 0 && (group_size % (64 * item_chunks) == 0 || (allow_g32 && group_size == 32 && item_chunks == 1)),
              op + "group_size must be a multiple of 64 * item_chunks = " + i2s(64 * item_chunks) +
                  (allow_g32 ? " (or 32 with item_chunks 1)" : "") + ", got " + i2s(group_size) + " with item_chunks " +
                  i2s(item_chunks));
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0) * 64;
  TORCH_CHECK(K % group_size == 0 && K % 64 == 0 && qweight.size(1) == K * 8,
              op + "qweight must be [N / 64, K * 8] with K = " + i2s(K) + " a multiple of 64 and of group_size, got " +
                  shape_str(qweight.sizes()));
  TORCH_CHECK(scales.size(0) == K / group_size && scales.size(1) == N && qzeros.size(0) == K / group_size &&
                  qzeros.size(1) == N / 8,
              op + "scales must be [K/G, N] = [" + i2s(K / group_size) + ", " + i2s(N) + "] and qzeros [K/G, N/8], got " +
                  shape_str(scales.sizes()) + " and " + shape_str(qzeros.sizes()));
  const int64_t items = K / (64 * item_chunks);
  TORCH_CHECK(splits >= 1 && splits <= items && splits <= 65535,
              op + "splits must be in [1, K / (64 * item_chunks) = " + i2s(items) + "], got " + i2s(splits));
  TORCH_CHECK(K < (int64_t{1} << 30) && N < (int64_t{1} << 22) && M < (int64_t{1} << 30) &&
                  x.numel() < (int64_t{1} << 34),
              op + "K and M must be < 2^30, N < 2^22 and x smaller than 2^34 elements (32-bit offsets in uint4)");
  TORCH_CHECK(qweight.device() == x.device() && scales.device() == x.device() && qzeros.device() == x.device(),
              op + "x, qweight, scales and qzeros must be on one device");
  TORCH_CHECK(x.is_contiguous() && qweight.is_contiguous() && scales.is_contiguous() && qzeros.is_contiguous(),
              op + "x, qweight, scales and qzeros must be contiguous");
  TORCH_CHECK(aligned16(x) && aligned16(qweight), op + "x and qweight must be 16-byte aligned");
  if (!bias.has_value()) return nullptr;
  b = bias->contiguous();
  TORCH_CHECK(b.device() == x.device() && b.scalar_type() == x.scalar_type() && b.numel() == N,
              op + "bias must be a tensor of N = " + i2s(N) + " elements in x's dtype on x's device");
  return b.data_ptr();
}
}  // namespace

// Optional perm: int32 [K], the order x is read in (x[:, perm], an act-order layer's input rows sorted by group);
// nullptr without. Its values are not checked here (a host sync): the gathers read a value outside [0, K) as NaN.
namespace {
const int32_t* check_perm(const std::string& op, const at::Tensor& x, const c10::optional<at::Tensor>& perm) {
  if (!perm.has_value()) return nullptr;
  TORCH_CHECK(perm->scalar_type() == at::kInt && perm->dim() == 1 && perm->numel() == x.size(1) &&
                  perm->is_contiguous() && perm->device() == x.device() && aligned16(*perm),
              op + "perm must be a contiguous, 16-byte aligned int32 tensor of K = " + i2s(x.size(1)) +
                  " elements on x's device, got " + shape_str(perm->sizes()) + " " +
                  std::string(c10::toString(perm->scalar_type())) + " on " + perm->device().str() +
                  (perm->is_contiguous() ? "" : ", not contiguous") + (aligned16(*perm) ? "" : ", not 16-byte aligned") +
                  " (pass perm.to(torch.int32).contiguous() on x's device)");
  return perm->data_ptr<int32_t>();
}
}  // namespace

// Tensor-core W4A16 for decode batches (csrc/awq_mma.cu): x [M, K] (fp16 / bf16, contiguous), AWQ codes in
// MMA fragment order qweight int32 [N / 64, K * 8] (torchforge.ops.awq_mma_layout), scales [K/G, N] (fp16, or bf16
// with bf16 x) and qzeros int32 [K/G, N/8] in AWQ layout, optional bias [N] in x's dtype; returns out [M, N] in x's
// dtype. Optional `tickets`: int32 zeros, at least ceil(M / 16) * N / 64 of them, used with K slices and left zero.
// group_size: 32 (awq_mma.cuh, item_dq; item_chunks 1) or a multiple of 64 * item_chunks.
// prefetch: the software-pipelined loop (awq_mma.cuh: accumulate with PF; items of 128 k only), same bits.
at::Tensor awq_mma_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& qzeros, int64_t group_size, const c10::optional<at::Tensor>& bias,
                        int64_t splits, int64_t item_chunks, const c10::optional<at::Tensor>& tickets_in,
                        int64_t warps, bool prefetch, const c10::optional<at::Tensor>& perm, bool symmetric) {
  at::Tensor b;
  const void* bias_ptr =
      check_mma_dense("awq_mma_cuda: ", x, qweight, scales, qzeros, group_size, bias, splits, item_chunks, b, true);
  TORCH_CHECK(warps == 4 || warps == 8, "awq_mma_cuda: warps must be 4 or 8, got " + i2s(warps));
  TORCH_CHECK(!prefetch || (item_chunks == 2 && group_size != 32),
              "awq_mma_cuda: prefetch needs item_chunks = 2 (items of 128 k) and groups of 64 rows or more, got "
              "item_chunks " + i2s(item_chunks) + ", group_size " + i2s(group_size));
  TORCH_CHECK(group_size != 32 || aligned16(qzeros),
              "awq_mma_cuda: with groups of 32, qzeros must be 16-byte aligned (its rows are read as 16-byte vectors)");
  const int32_t* perm_ptr = check_perm("awq_mma_cuda: ", x, perm);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0) * 64;
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int64_t tiles = (M + 15) / 16 * (N / 64);
  // K slices meet on one ticket per tile, which the last slice resets to 0. A caller's zeroed buffer (a module's,
  // kept across calls) saves the memset kernel of a fresh one; it is back to all zeros when the kernel returns.
  at::Tensor tickets;
  if (splits > 1 && tickets_in.has_value() && tickets_in->numel() >= tiles) {
    tickets = *tickets_in;
    TORCH_CHECK(tickets.scalar_type() == at::kInt && tickets.is_contiguous() && tickets.device() == x.device(),
                "awq_mma_cuda: tickets must be a contiguous int32 tensor of zeros on x's device");
  } else if (splits > 1) {
    tickets = at::zeros({tiles}, x.options().dtype(at::kInt));
  } else {  // one slice never takes a ticket: no memset
    tickets = at::empty({1}, x.options().dtype(at::kInt));
  }
  at::Tensor partial = at::empty({splits > 1 ? splits * M * N : 1}, x.options().dtype(at::kFloat));
  at::Tensor x_perm = perm_ptr != nullptr ? at::empty_like(x) : at::Tensor();
  const cudaError_t err = awq_mma_launch(
      dtype_code(x), dtype_code(scales), x.data_ptr(), qweight.data_ptr<int32_t>(), scales.data_ptr(),
      qzeros.data_ptr<int32_t>(), bias_ptr, out.data_ptr(), partial.data_ptr<float>(),
      reinterpret_cast<unsigned int*>(tickets.data_ptr<int32_t>()), M, N, K, group_size, splits, item_chunks, warps,
      prefetch, c10::cuda::getCurrentCUDAStream(), perm_ptr, perm_ptr != nullptr ? x_perm.data_ptr() : nullptr,
      symmetric);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

namespace {
// Arguments both grouped ops share (awq_mma_moe_cuda, awq_wgmma_moe_cuda): device, dtypes, ranks, the experts' shapes
// for groups of group_size (a multiple of group_multiple), where the routed rows read x, and contiguity.
void check_grouped(const std::string& op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const at::Tensor& qzeros, const at::Tensor& sorted_rows, const at::Tensor& block_expert,
                   int64_t num_rows, int64_t x_row_div, int64_t group_size, int64_t group_multiple,
                   const std::string& group_rule) {
  TORCH_CHECK(x.is_cuda() && qweight.is_cuda() && scales.is_cuda() && qzeros.is_cuda() && sorted_rows.is_cuda() &&
                  block_expert.is_cuda(),
              op + "all tensors must be CUDA tensors");
  check_mma_dtypes(op, x, scales);
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qzeros.scalar_type() == at::kInt &&
                  sorted_rows.scalar_type() == at::kInt && block_expert.scalar_type() == at::kInt,
              op + "qweight, qzeros, sorted_rows and block_expert must be int32");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 3 && scales.dim() == 3 && qzeros.dim() == 3 && sorted_rows.dim() == 1 &&
                  block_expert.dim() == 1,
              op + "expected x [X, K], qweight / scales / qzeros [E, ...], sorted_rows [B * block], block_expert [B]");
  TORCH_CHECK(group_size > 0 && group_size % group_multiple == 0,
              op + "group_size must be a multiple of " + group_rule + ", got " + i2s(group_size));
  const int64_t K = x.size(1), E = qweight.size(0), N = qweight.size(1) * 64;
  TORCH_CHECK(K % group_size == 0 && qweight.size(2) == K * 8,
              op + "qweight must be [E, N / 64, K * 8] with K = " + i2s(K) + " a multiple of group_size, got " +
                  shape_str(qweight.sizes()));
  TORCH_CHECK(scales.size(0) == E && scales.size(1) == K / group_size && scales.size(2) == N && qzeros.size(0) == E &&
                  qzeros.size(1) == K / group_size && qzeros.size(2) == N / 8,
              op + "scales must be [E, K/G, N] = [" + i2s(E) + ", " + i2s(K / group_size) + ", " + i2s(N) +
                  "] and qzeros [E, K/G, N/8], got " + shape_str(scales.sizes()) + " and " + shape_str(qzeros.sizes()));
  TORCH_CHECK(x_row_div >= 1 && num_rows >= 0 && x.size(0) * x_row_div >= num_rows,
              op + "x has " + i2s(x.size(0)) + " rows; routed rows r < " + i2s(num_rows) + " read x[r / " +
                  i2s(x_row_div) + "]");
  for (const at::Tensor* t : {&x, &qweight, &scales, &qzeros, &sorted_rows, &block_expert})
    TORCH_CHECK(t->device() == x.device() && t->is_contiguous(), op + "all tensors must be contiguous, on x's device");
}

// The optional shared expert (id E, stored apart): all three tensors or none, each of one routed expert's shape and
// dtype, contiguous on x's device; shared_qweight 16-byte aligned (and, with all_aligned, its scales and zeros: bulk
// copies). Returns whether there is one.
bool check_shared_expert(const std::string& op, const at::Tensor& x, const at::Tensor& qweight,
                         const at::Tensor& scales, const at::Tensor& qzeros,
                         const c10::optional<at::Tensor>& shared_qweight,
                         const c10::optional<at::Tensor>& shared_scales,
                         const c10::optional<at::Tensor>& shared_qzeros, bool all_aligned) {
  const bool shared = shared_qweight.has_value();
  TORCH_CHECK(shared == shared_scales.has_value() && shared == shared_qzeros.has_value(),
              op + "pass all three of shared_qweight, shared_scales and shared_qzeros, or none");
  if (!shared) return false;
  const at::Tensor &sq = *shared_qweight, &ss = *shared_scales, &sz = *shared_qzeros;
  TORCH_CHECK(sq.sizes() == qweight.sizes().slice(1) && ss.sizes() == scales.sizes().slice(1) &&
                  sz.sizes() == qzeros.sizes().slice(1),
              op + "the shared expert's tensors must have one routed expert's shapes " +
                  shape_str(qweight.sizes().slice(1)) + ", " + shape_str(scales.sizes().slice(1)) + ", " +
                  shape_str(qzeros.sizes().slice(1)) + ", got " + shape_str(sq.sizes()) + ", " +
                  shape_str(ss.sizes()) + ", " + shape_str(sz.sizes()));
  TORCH_CHECK(sq.scalar_type() == at::kInt && ss.scalar_type() == scales.scalar_type() &&
                  sz.scalar_type() == at::kInt,
              op + "the shared expert's qweight and qzeros must be int32 and its scales in the experts' dtype");
  for (const at::Tensor* t : {&sq, &ss, &sz})
    TORCH_CHECK(t->device() == x.device() && t->is_contiguous(),
                op + "the shared expert's tensors must be contiguous, on x's device");
  TORCH_CHECK(aligned16(sq) && (!all_aligned || (aligned16(ss) && aligned16(sz))),
              op + (all_aligned ? "the shared expert's tensors must be 16-byte aligned"
                                : "shared_qweight must be 16-byte aligned"));
  return true;
}
}  // namespace

// Grouped (MoE) form of awq_mma_cuda: x [X, K]; expert weights in the mma layout qweight [E, N / 64, K * 8],
// scales [E, K/G, N] (fp16, or bf16 with bf16 x), qzeros [E, K/G, N/8]; routed rows sorted by expert
// (torchforge.ops.moe_align with blocks of 8 or 16: sorted_rows int32 [B * block], block_expert int32 [B]; or,
// direct, sorted_rows empty and block_expert the expert id of each routed row, one row per block). Rows of blocks
// whose expert is out of range come out NaN. Routed row r < num_rows reads x[r / x_row_div]. Returns the fp32 sums
// of each K slice, partial [splits, num_rows, N]; every routed row must appear exactly once in sorted_rows
// (moe_align's contract), or its row of partial is left unwritten. Optional shared_qweight [N / 64, K * 8],
// shared_scales [K/G, N], shared_qzeros [K/G, N/8]: a shared expert, routed as expert id E.
at::Tensor awq_mma_moe_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const at::Tensor& qzeros, const at::Tensor& sorted_rows, const at::Tensor& block_expert,
                            c10::SymInt num_rows_sym, int64_t x_row_div, int64_t group_size, int64_t splits,
                            int64_t item_chunks, const c10::optional<at::Tensor>& shared_qweight,
                            const c10::optional<at::Tensor>& shared_scales,
                            const c10::optional<at::Tensor>& shared_qzeros, int64_t warps, bool symmetric) {
  const std::string op = "awq_mma_moe_cuda: ";
  // SymInt in the schema: an int there would pin the routed row count (the prefill length) under torch.compile
  // to one value per graph; here, running, it is always concrete
  const int64_t num_rows = num_rows_sym.expect_int();
  TORCH_CHECK(warps == 4 || warps == 8, op + "warps must be 4 or 8, got " + i2s(warps));
  TORCH_CHECK(item_chunks == 1 || item_chunks == 2, op + "item_chunks must be 1 or 2, got " + i2s(item_chunks));
  const bool g32 = group_size == 32 && item_chunks == 1;  // groups of 32: awq_mma.cuh, item_dq
  check_grouped(op, x, qweight, scales, qzeros, sorted_rows, block_expert, num_rows, x_row_div, group_size,
                g32 ? 32 : 64 * item_chunks, "64 * item_chunks = " + i2s(64 * item_chunks) + " (or 32 with item_chunks 1)");
  const int64_t K = x.size(1), E = qweight.size(0), N = qweight.size(1) * 64, B = block_expert.size(0);
  TORCH_CHECK(K % 64 == 0, op + "K = " + i2s(K) + " must be a multiple of 64 (the layout's chunks)");
  // direct mode: sorted_rows empty, block_expert = the expert id of each routed row (one row per block)
  const bool direct = sorted_rows.numel() == 0;
  TORCH_CHECK(!direct || B == num_rows,
              op + "with an empty sorted_rows, block_expert must hold the expert of each of the " + i2s(num_rows) +
                  " routed rows, got " + i2s(B));
  TORCH_CHECK(B <= 2147483647 && (direct || (B >= 1 && sorted_rows.numel() % B == 0)),
              op + "sorted_rows must hold B * block rows for B = " + i2s(B) + " blocks");
  const int64_t block_rows = direct ? 8 : sorted_rows.numel() / B;
  TORCH_CHECK(block_rows == 8 || block_rows == 16, op + "blocks of 8 or 16 rows, got " + i2s(block_rows));
  const int64_t items = K / (64 * item_chunks);
  TORCH_CHECK(splits >= 1 && splits <= items && splits <= 65535,
              op + "splits must be in [1, K / (64 * item_chunks) = " + i2s(items) + "], got " + i2s(splits));
  TORCH_CHECK(K < (int64_t{1} << 30) && N < (int64_t{1} << 22) && num_rows < (int64_t{1} << 30) &&
                  E < (int64_t{1} << 20) && x.numel() < (int64_t{1} << 34),
              op + "K, num_rows must be < 2^30, N < 2^22, E < 2^20 and x smaller than 2^34 elements");
  TORCH_CHECK(aligned16(x) && aligned16(qweight), op + "x and qweight must be 16-byte aligned");
  const bool shared = check_shared_expert(op, x, qweight, scales, qzeros, shared_qweight, shared_scales,
                                          shared_qzeros, false);
  TORCH_CHECK(!g32 || (aligned16(qzeros) && (!shared || aligned16(*shared_qzeros))),
              op + "with groups of 32, qzeros (and shared_qzeros) must be 16-byte aligned (rows read as 16-byte vectors)");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor partial = at::empty({splits, num_rows, N}, x.options().dtype(at::kFloat));
  if (num_rows == 0 || N == 0) return partial;
  const cudaError_t err = awq_mma_moe_launch(
      dtype_code(x), dtype_code(scales), block_rows, x.data_ptr(), qweight.data_ptr<int32_t>(),
      scales.data_ptr(), qzeros.data_ptr<int32_t>(), shared ? shared_qweight->data_ptr<int32_t>() : nullptr,
      shared ? shared_scales->data_ptr() : nullptr, shared ? shared_qzeros->data_ptr<int32_t>() : nullptr,
      direct ? nullptr : sorted_rows.data_ptr<int32_t>(),
      block_expert.data_ptr<int32_t>(), partial.data_ptr<float>(), num_rows, N, K, E, B, x_row_div, group_size,
      splits, item_chunks, warps, c10::cuda::getCurrentCUDAStream(), symmetric);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return partial;
}

// Prefill form of awq_mma_cuda on Hopper's warpgroup MMA (csrc/awq_wgmma.cu, sm_90 devices only): same tensors and
// result; block_m x tile_set in {64 x 4, 64 x 2, 128 x 2, 192 x 1, 256 x 1} (rows of x per block, column tiles per
// warp), group_m row blocks per raster group; producer_warp: the warp-specialized kernel (what the dispatch uses);
// dp_tiles > 0 (with splits > 1): tiles [0, dp_tiles) run whole and only the rest in K slices (their blocks first).
// splits == 0 (with producer_warp): stream-K, dp_tiles blocks (0: one per SM) sharing the tiles' pairs of chunks evenly;
// with an odd K / 64 (group_size 64) the kernel runs whole tiles instead.
// cluster (splits 2..8, dp_tiles 0, producer_warp): each tile's K slices run as one thread block cluster and add their
// sums through distributed shared memory (the same bits); where the block shape's ring cannot hold them, the launcher
// takes the partials below instead, so they are allocated either way.
// Optional `tickets`: int32 zeros, at least as many as the sliced tiles (stream-K: as the tiles; awq_mma_cuda's kept
// buffer is enough for every configuration up to 512 rows), left zero; without, a fresh zeroed buffer costs a memset
// kernel per call. Optional `perm` as for awq_mma_cuda (the x image kernel reads x through it).
at::Tensor awq_wgmma_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& qzeros, int64_t group_size, const c10::optional<at::Tensor>& bias,
                          int64_t splits, int64_t block_m, int64_t tile_set, int64_t group_m, bool producer_warp,
                          int64_t dp_tiles, const c10::optional<at::Tensor>& tickets_in,
                          const c10::optional<at::Tensor>& perm, bool cluster) {
  const std::string op = "awq_wgmma_cuda: ";
  TORCH_CHECK(!cluster || (splits >= 2 && splits <= 8 && dp_tiles == 0 && producer_warp),
              op + "cluster=True runs every tile in 2..8 K slices (got splits = " + i2s(splits) + ", dp_tiles = " +
                  i2s(dp_tiles) + ") on the warp-specialized kernel (producer_warp=True)");
  at::Tensor b;
  TORCH_CHECK(splits >= 0, op + "splits must be 0 (stream-K) or in [1, K / 64], got " + i2s(splits));
  // splits == 0: stream-K (the kernel's own check of the rest is that of splits == 1)
  const void* bias_ptr = check_mma_dense(op, x, qweight, scales, qzeros, group_size, bias, splits == 0 ? 1 : splits,
                                         1, b, true);
  TORCH_CHECK(group_size != 32 || producer_warp, op + "groups of 32 run the warp-specialized kernel: producer_warp=True");
  TORCH_CHECK(splits > 0 || producer_warp, op + "splits == 0 (stream-K) needs producer_warp=True");
  TORCH_CHECK((block_m == 64 && (tile_set == 4 || tile_set == 2)) || (block_m == 128 && tile_set == 2) ||
                  ((block_m == 192 || block_m == 256) && tile_set == 1),
              op + "(block_m, tile_set) must be (64, 4), (64, 2), (128, 2), (192, 1) or (256, 1), got (" +
                  i2s(block_m) + ", " + i2s(tile_set) + ")");
  TORCH_CHECK(group_m >= 1, op + "group_m must be >= 1, got " + i2s(group_m));
  TORCH_CHECK(dp_tiles >= 0, op + "dp_tiles must be >= 0, got " + i2s(dp_tiles));
  group_m = std::min(group_m, (x.size(0) + block_m - 1) / block_m);  // more is the same raster; keeps 32-bit math
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, x.get_device()));
  TORCH_CHECK(major == 9 && minor == 0,
              op + "needs an sm_90 (Hopper) GPU, got sm_" + i2s(major * 10 + minor) + ": use awq_mma_cuda");
  TORCH_CHECK(aligned16(scales) && aligned16(qzeros), op + "scales and qzeros must be 16-byte aligned");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0) * 64;
  // the kernel finds a chunk's quantization group by a high multiply, exact while chunks x chunks per group < 2^32
  TORCH_CHECK((K / 64) * (group_size / 64) < (int64_t{1} << 32),
              op + "(K / 64) * (group_size / 64) must be < 2^32, got K = " + i2s(K) + ", group_size = " +
                  i2s(group_size) + ": use awq_mma_cuda");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int64_t tiles = awq_wgmma_tiles(M, N, block_m, tile_set);
  TORCH_CHECK(tiles < (int64_t{1} << 31), op + "too many blocks: " + i2s(tiles));
  // An odd K / 64 cannot be cut into stream-K's pairs of chunks: the launcher runs whole tiles, so no stream-K caps,
  // tickets or partials here either.
  if (splits == 0 && (K / 64) % 2 != 0) splits = 1, dp_tiles = 0;
  if (splits == 0) {  // stream-K: dp_tiles is the number of blocks (0: one per SM), at most one per pair of chunks
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()));
    TORCH_CHECK(tiles * (K / 64) < (int64_t{1} << 31), op + "too many chunks of work for stream-K: " +
                                                            i2s(tiles * (K / 64)) + "; use splits >= 1");
    dp_tiles = std::min(dp_tiles > 0 ? dp_tiles : sms, std::max<int64_t>(1, tiles * (K / 128)));
  }
  TORCH_CHECK(splits == 0 || (dp_tiles >= 0 && dp_tiles < tiles),
              op + "dp_tiles must be in [0, " + i2s(tiles) + ") (the blocks of this call), got " + i2s(dp_tiles));
  if (splits == 1) dp_tiles = 0;
  const int64_t split_tiles = splits == 0 ? tiles : tiles - dp_tiles;
  TORCH_CHECK(splits == 1 || split_tiles * splits + dp_tiles < (int64_t{1} << 31),
              op + "too many blocks: " + i2s(split_tiles) + " tiles in " + i2s(splits) + " K slices");
  const bool parts = splits != 1;  // tiles in parts that meet on a ticket: K slices or stream-K
  at::Tensor tickets;
  if (parts && tickets_in.has_value() && tickets_in->numel() >= split_tiles) {
    tickets = *tickets_in;
    TORCH_CHECK(tickets.scalar_type() == at::kInt && tickets.is_contiguous() && tickets.device() == x.device(),
                op + "tickets must be a contiguous int32 tensor of zeros on x's device");
  } else {
    tickets = at::zeros({parts ? split_tiles : 1}, x.options().dtype(at::kInt));
  }
  // stream-K: a block writes the partials of at most two tiles (the tail of its first, the head of its last)
  const int64_t part_slots = splits == 0 ? 2 * dp_tiles : splits > 1 ? splits * split_tiles : 0;
  at::Tensor partial = at::empty({part_slots > 0 ? part_slots * awq_wgmma_block_outputs(block_m, tile_set) : 1},
                                 x.options().dtype(at::kFloat));
  at::Tensor x_image = at::empty({awq_wgmma_image_rows(M, block_m), K}, x.options());
  const cudaError_t err = awq_wgmma_launch(
      dtype_code(x), dtype_code(scales), x.data_ptr(), x_image.data_ptr(), qweight.data_ptr<int32_t>(), scales.data_ptr(),
      qzeros.data_ptr<int32_t>(), bias_ptr, out.data_ptr(), partial.data_ptr<float>(),
      reinterpret_cast<unsigned int*>(tickets.data_ptr<int32_t>()), M, N, K, group_size, splits, block_m, tile_set,
      group_m, producer_warp, dp_tiles, c10::cuda::getCurrentCUDAStream(), check_perm(op, x, perm), cluster);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Grouped (MoE) form of awq_wgmma_cuda for prefill (many routed rows per expert): the tensors of awq_mma_moe_cuda,
// with the rows sorted by moe_align into blocks of block_m (64 or 128, tile_set 2) instead of 8 or 16. Returns the
// fp32 sums partial [1, num_rows, N] (one K slice: awq_mma_moe_cuda's output with splits = 1); rows of blocks whose
// expert is out of range (moe_align's last bucket) come out NaN. Each weight is decoded once per block_m routed rows
// (the mma.sync kernel: once per 8 or 16). sm_90 devices only.
at::Tensor awq_wgmma_moe_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const at::Tensor& qzeros, const at::Tensor& sorted_rows, const at::Tensor& block_expert,
                              c10::SymInt num_rows_sym, int64_t x_row_div, int64_t group_size, int64_t block_m,
                              int64_t tile_set, const c10::optional<at::Tensor>& shared_qweight,
                              const c10::optional<at::Tensor>& shared_scales,
                              const c10::optional<at::Tensor>& shared_qzeros, bool producer_warp) {
  const std::string op = "awq_wgmma_moe_cuda: ";
  // SymInt in the schema, as for awq_mma_moe_cuda
  const int64_t num_rows = num_rows_sym.expect_int();
  TORCH_CHECK((block_m == 64 || block_m == 128) && tile_set == 2,
              op + "(block_m, tile_set) must be (64, 2) or (128, 2), got (" + i2s(block_m) + ", " + i2s(tile_set) + ")");
  check_grouped(op, x, qweight, scales, qzeros, sorted_rows, block_expert, num_rows, x_row_div, group_size,
                group_size == 32 ? 32 : 64, "64 (or 32)");
  const int64_t K = x.size(1), E = qweight.size(0), N = qweight.size(1) * 64, B = block_expert.size(0);
  TORCH_CHECK(K > 0 && K % 64 == 0, op + "K must be a positive multiple of 64 (x [X, K]), got K = " + i2s(K));
  TORCH_CHECK(group_size != 32 || producer_warp, op + "groups of 32 run the warp-specialized kernel: producer_warp=True");
  TORCH_CHECK(sorted_rows.numel() == B * block_m,
              op + "sorted_rows must hold B * block_m = " + i2s(B) + " * " + i2s(block_m) + " rows (moe_align with "
                   "block_m), got " + i2s(sorted_rows.numel()));
  TORCH_CHECK(K < (int64_t{1} << 30) && N < (int64_t{1} << 22) && num_rows < (int64_t{1} << 30) &&
                  B * block_m < (int64_t{1} << 30) && E < (int64_t{1} << 20) && x.numel() < (int64_t{1} << 34) &&
                  (K / 64) * (group_size / 64) < (int64_t{1} << 32),
              op + "K, num_rows and the sorted rows must be < 2^30, N < 2^22, E < 2^20, x smaller than 2^34 elements "
                   "and (K / 64) (group_size / 64) < 2^32");
  TORCH_CHECK(aligned16(x) && aligned16(qweight) && aligned16(scales) && aligned16(qzeros),
              op + "x, qweight, scales and qzeros must be 16-byte aligned");
  const bool shared = check_shared_expert(op, x, qweight, scales, qzeros, shared_qweight, shared_scales,
                                          shared_qzeros, true);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, x.get_device()));
  TORCH_CHECK(major == 9 && minor == 0,
              op + "needs an sm_90 (Hopper) GPU, got sm_" + i2s(major * 10 + minor) + ": use awq_mma_moe_cuda");
  at::Tensor partial = at::empty({1, num_rows, N}, x.options().dtype(at::kFloat));
  if (num_rows == 0 || N == 0 || B == 0) return partial;
  TORCH_CHECK(awq_wgmma_tiles(B * block_m, N, block_m, tile_set) < (int64_t{1} << 31), op + "too many blocks");
  at::Tensor x_image = at::empty({B * block_m, K}, x.options());
  const cudaError_t err = awq_wgmma_moe_launch(
      dtype_code(x), dtype_code(scales), x.data_ptr(), x_image.data_ptr(), qweight.data_ptr<int32_t>(),
      scales.data_ptr(), qzeros.data_ptr<int32_t>(), shared ? shared_qweight->data_ptr<int32_t>() : nullptr,
      shared ? shared_scales->data_ptr() : nullptr, shared ? shared_qzeros->data_ptr<int32_t>() : nullptr,
      sorted_rows.data_ptr<int32_t>(), block_expert.data_ptr<int32_t>(), partial.data_ptr<float>(), num_rows,
      x_row_div, B, N, K, E, group_size, block_m, tile_set, producer_warp, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return partial;
}

}  // namespace torchforge

TORCH_LIBRARY_FRAGMENT(torchforge, m) {
  m.def("set_pdl(int level) -> int", &torchforge::set_pdl);
  m.def("set_start_prefetch(int mode) -> int", &torchforge::set_start_prefetch);
  m.def("awq_wgmma_g32_ready(ScalarType dtype, ScalarType scale_dtype, bool grouped) -> bool",
        &torchforge::awq_wgmma_g32_ready_op);
  m.def(
      "awq_quantize_cuda(Tensor weight, int group_size, bool symmetric) -> (Tensor, Tensor, "
      "Tensor)");
  m.def(
      "awq_gemv_cuda(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, Tensor? bias, "
      "int splits, int rows) -> Tensor");
  m.def(
      "awq_mma_cuda(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, Tensor? bias, "
      "int splits, int item_chunks, Tensor? tickets=None, int warps=8, bool prefetch=False, Tensor? perm=None, "
      "bool symmetric=False) -> Tensor");
  m.def(
      "awq_mma_moe_cuda(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, Tensor sorted_rows, "
      "Tensor block_expert, SymInt num_rows, int x_row_div, int group_size, int splits, int item_chunks, "
      "Tensor? shared_qweight=None, Tensor? shared_scales=None, Tensor? shared_qzeros=None, int warps=4, "
      "bool symmetric=False) -> Tensor");
  m.def(
      "awq_wgmma_cuda(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, Tensor? bias, "
      "int splits, int block_m, int tile_set, int group_m, bool producer_warp=False, int dp_tiles=0, "
      "Tensor? tickets=None, Tensor? perm=None, bool cluster=False) -> Tensor");
  m.def("awq_wgmma_cluster_slots(int block_m, int tile_set, int splits) -> int",
        &torchforge::awq_wgmma_cluster_slots_op);
  m.def(
      "awq_wgmma_moe_cuda(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, Tensor sorted_rows, "
      "Tensor block_expert, SymInt num_rows, int x_row_div, int group_size, int block_m, int tile_set, "
      "Tensor? shared_qweight=None, Tensor? shared_scales=None, Tensor? shared_qzeros=None, "
      "bool producer_warp=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchforge, CUDA, m) {
  m.impl("awq_quantize_cuda", &torchforge::awq_quantize_cuda);
  m.impl("awq_gemv_cuda", &torchforge::awq_gemv_cuda);
  m.impl("awq_mma_cuda", &torchforge::awq_mma_cuda);
  m.impl("awq_mma_moe_cuda", &torchforge::awq_mma_moe_cuda);
  m.impl("awq_wgmma_cuda", &torchforge::awq_wgmma_cuda);
  m.impl("awq_wgmma_moe_cuda", &torchforge::awq_wgmma_moe_cuda);
}

// An empty Python module, so that `import torchforge._C` loads the shared library (and with it
// the registrations above). Everything is reached through torch.ops.torchforge.*.
static struct PyModuleDef torchforge_c_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "torchforge compiled ops (registered in torch.ops.torchforge)",
    -1,
    nullptr,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&torchforge_c_module); }
