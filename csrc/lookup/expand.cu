// The variable-batch expansion (recom_rec/ops/expand_bags.py) on the CUDA extension: each output
// element from its bag's pooled row, out[b, c] = pooled[inverse[feature(c), b], c], and the
// gradient's way back. The same contract and bits as the Triton kernels (expand_triton.py); here
// because a Triton launch costs ~20-40 us of Python on the host and the VBE training step is
// host-bound (perf-notes v54): two C++ calls replace three Triton launches and two torch fills.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "input_check.cuh"
#include "lookup.h"

namespace {

constexpr int EXPAND_ROW_THREADS = 256;
constexpr int MOVED_THREADS = 1024;

// Output unit q of a row of `units` (one thread's): its column unit u, its feature f from the
// unit's first column (`per_unit` columns a unit), and its bag from the feature's inverse indices.
// A bag outside [0, num_bags) is bag 0: both kernels stay in bounds (eagerly on the CPU the module
// checks the inverse indices, variable_batch.check_inverse_indices; on the GPU the forward reports
// them: expand_forward_kernel).
struct UnitBag {
  int64_t u, f, raw, bag;
};
__device__ __forceinline__ UnitBag unit_bag(int64_t q, int64_t units, int per_unit, const int32_t* col_feature,
                                            const int64_t* inverse, int64_t batch, int64_t num_bags) {
  const int64_t b = q / units, u = q - b * units;
  const int64_t f = col_feature[u * per_unit];
  const int64_t bag = inverse[f * batch + b];
  return {u, f, bag, bag >= 0 && bag < num_bags ? bag : 0};
}

// One unit (16 bytes where every feature's columns split into whole 16-byte units, else one
// element) of the output a thread, from its bag's pooled row. With `limits` (each feature's bags
// in this batch), an inverse index outside [0, limits[f]) is reported to `chk` (REPORT_INVERSE:
// feature, output row, bag, limit); past a feature's own bags but inside the padded ones it reads
// an empty bag, as without the check.
template <typename U>
__global__ void __launch_bounds__(EXPAND_ROW_THREADS) expand_forward_kernel(
    const U* __restrict__ pooled, const int64_t* __restrict__ inverse, const int32_t* __restrict__ col_feature,
    U* __restrict__ out, int64_t batch, int64_t units, int per_unit, int64_t num_bags,
    const int64_t* __restrict__ limits, InputCheck chk) {
  const int64_t total = batch * units;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (int64_t)gridDim.x * blockDim.x) {
    const UnitBag at = unit_bag(q, units, per_unit, col_feature, inverse, batch, num_bags);
    out[q] = pooled[at.bag * units + at.u];
    if (limits != nullptr && (at.raw < 0 || at.raw >= limits[at.f])) {
      report_bad(chk, REPORT_INVERSE, at.f, q / units, at.raw, limits[at.f]);
    }
  }
}

// moved[f] = 1 where some row b of feature f takes a bag other than b (or row b has no bag b: more
// rows than bags), else 0 (every flag written: no memset). A block a feature: a warp's vote per 32
// rows, then the block's.
__global__ void __launch_bounds__(MOVED_THREADS) moved_features_kernel(const int64_t* __restrict__ inverse,
                                                                       int32_t* __restrict__ moved, int64_t batch,
                                                                       int64_t num_bags) {
  __shared__ int any;
  if (threadIdx.x == 0) any = 0;
  __syncthreads();
  const int64_t* row = inverse + (int64_t)blockIdx.x * batch;
  bool mine = false;
  for (int64_t b = threadIdx.x; b < batch && !mine; b += blockDim.x) mine = row[b] != b || b >= num_bags;
  if (__any_sync(0xffffffffu, mine) && (threadIdx.x & 31) == 0) any = 1;
  __syncthreads();
  if (threadIdx.x == 0) moved[blockIdx.x] = any;
}

// In place, where the pooled rows are as many as the output's (S == B): a feature that did not move
// is its own expansion and is left alone; a moved feature's own bags (rows below bags[f]: a padded
// bag is empty, read as zeros) are staged to `scratch` first, then its output rows gathered from
// there. Where most features come at the full batch this writes only the moved features' columns,
// not the whole [B, C] (perf-notes v64).
template <typename U>
__global__ void __launch_bounds__(EXPAND_ROW_THREADS) expand_stage_kernel(
    const U* __restrict__ pooled, const int32_t* __restrict__ col_feature, const int32_t* __restrict__ moved,
    const int64_t* __restrict__ bags, U* __restrict__ scratch, int64_t rows, int64_t units, int per_unit) {
  const int64_t total = rows * units;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (int64_t)gridDim.x * blockDim.x) {
    const int64_t s = q / units, f = col_feature[(q - s * units) * per_unit];
    if (moved[f] && s < bags[f]) scratch[q] = pooled[q];
  }
}

template <typename U>
__global__ void __launch_bounds__(EXPAND_ROW_THREADS) expand_in_place_kernel(
    U* __restrict__ pooled, const U* __restrict__ scratch, const int64_t* __restrict__ inverse,
    const int32_t* __restrict__ col_feature, const int32_t* __restrict__ moved, const int64_t* __restrict__ bags,
    int64_t batch, int64_t units, int per_unit, bool check, InputCheck chk) {
  const int64_t total = batch * units;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (int64_t)gridDim.x * blockDim.x) {
    const UnitBag at = unit_bag(q, units, per_unit, col_feature, inverse, batch, batch);
    if (moved[at.f]) pooled[q] = at.bag < bags[at.f] ? scratch[at.bag * units + at.u] : U{};
    if (check && (at.raw < 0 || at.raw >= bags[at.f])) {
      report_bad(chk, REPORT_INVERSE, at.f, q / units, at.raw, bags[at.f]);
    }
  }
}

// Zeros where the backward's stores do not write: a moved feature's bags (its rows add by atomics)
// and an unmoved feature's bags past the batch (no row takes them). The rest of each unmoved
// feature's bags is stored whole by expand_backward_kernel: zeroing the whole [S, C] first wrote
// those bytes twice (perf-notes v64).
template <int V>
__global__ void __launch_bounds__(EXPAND_ROW_THREADS) expand_backward_zero_kernel(
    const int32_t* __restrict__ col_feature, const int32_t* __restrict__ moved, float* __restrict__ grad_pooled,
    int64_t num_bags, int64_t units, int64_t batch) {
  const int64_t total = num_bags * units;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (int64_t)gridDim.x * blockDim.x) {
    const int64_t s = q / units;
    if (!moved[col_feature[(q - s * units) * V]] && s < batch) continue;
    if (V == 4) {
      reinterpret_cast<float4*>(grad_pooled)[q] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
      grad_pooled[q] = 0.f;
    }
  }
}

// The gradient's way back, in fp32: a feature whose inverse indices are the identity (a feature at
// the full batch: torchrec's VBE gives it arange(B)) stores its rows (its bag b takes row b alone:
// a store's cost, the same bits); the others add theirs by atomics into the zeroed bags. V floats
// a thread (4 where every feature's columns split into whole float4s).
template <int V>
__global__ void __launch_bounds__(EXPAND_ROW_THREADS) expand_backward_kernel(
    const float* __restrict__ grad, const int64_t* __restrict__ inverse, const int32_t* __restrict__ col_feature,
    const int32_t* __restrict__ moved, float* __restrict__ grad_pooled, int64_t batch, int64_t units,
    int64_t num_bags) {
  const int64_t total = batch * units;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (int64_t)gridDim.x * blockDim.x) {
    const UnitBag at = unit_bag(q, units, V, col_feature, inverse, batch, num_bags);
    float* to = grad_pooled + (at.bag * units + at.u) * V;
    if (V == 4) {
      const float4 g = __ldg(reinterpret_cast<const float4*>(grad) + q);
      if (moved[at.f]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(to), g);  // (one vector atomic: sm_90's, global memory)
#else
        atomicAdd(to, g.x); atomicAdd(to + 1, g.y); atomicAdd(to + 2, g.z); atomicAdd(to + 3, g.w);
#endif
      } else {
        *reinterpret_cast<float4*>(to) = g;
      }
    } else {
      const float g = grad[q];
      if (moved[at.f]) atomicAdd(to, g); else *to = g;
    }
  }
}

// Blocks for a grid-stride loop over `total` items: enough to fill the GPU a few times over.
unsigned grid_for(int64_t total) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (total + EXPAND_ROW_THREADS - 1) / EXPAND_ROW_THREADS;
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>(wanted, sms * 16));
}

void check_expand_args(const at::Tensor& inverse, const at::Tensor& col_feature, int64_t cols) {
  TORCH_CHECK(inverse.dim() == 2 && inverse.scalar_type() == at::kLong && inverse.is_contiguous(),
              "recom_rec cuda backend: the expansion's inverse indices are a contiguous int64 [F, B]");
  TORCH_CHECK(col_feature.dim() == 1 && col_feature.scalar_type() == at::kInt && col_feature.is_contiguous() &&
                  col_feature.size(0) == cols,
              "recom_rec cuda backend: the expansion takes an int32 feature per column");
}

// Each feature's moved flag (moved_features_kernel), int32 [F] on the device.
at::Tensor moved_features(const at::Tensor& inverse, int64_t batch, int64_t num_bags, const at::TensorOptions& like) {
  const int64_t features = inverse.size(0);
  TORCH_CHECK(features < (int64_t)INT32_MAX, "recom_rec cuda backend: too many features");
  auto moved = at::empty({features}, like.dtype(at::kInt));
  if (features == 0) return moved;
  moved_features_kernel<<<(unsigned)features, MOVED_THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
      inverse.data_ptr<int64_t>(), moved.data_ptr<int32_t>(), batch, num_bags);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return moved;
}

}  // namespace

at::Tensor expand_rows_forward(const at::Tensor& pooled, const at::Tensor& inverse, const at::Tensor& col_feature,
                               bool whole_chunks, const c10::optional<at::Tensor>& limits,
                               const c10::optional<at::Tensor>& claim, const c10::optional<at::Tensor>& report) {
  c10::cuda::CUDAGuard guard(pooled.device());
  TORCH_CHECK(limits.has_value() == claim.has_value() && claim.has_value() == report.has_value(),
              "recom_rec cuda backend: the expansion's check takes limits, claim and report together");
  if (limits.has_value()) {
    // (the report's pinning is input_check.KernelReport's to guarantee, as in pooled_forward)
    TORCH_CHECK(limits->is_cuda() && limits->scalar_type() == at::kLong && limits->is_contiguous() &&
                    limits->numel() == inverse.size(0) && claim->is_cuda() && claim->scalar_type() == at::kInt &&
                    !report->is_cuda() && report->scalar_type() == at::kLong,
                "recom_rec cuda backend: the expansion's check takes int64 limits a feature on the device, an "
                "int32 device claim and a pinned int64 report");
  }
  const InputCheck chk{-1, -1, claim.has_value() ? claim->data_ptr<int32_t>() : nullptr,
                       report.has_value() ? report->data_ptr<int64_t>() : nullptr};
  TORCH_CHECK(pooled.dim() == 2 && pooled.is_contiguous(), "recom_rec cuda backend: the expansion's pooled rows are "
              "a contiguous [S, C]");
  const int64_t cols = pooled.size(1), batch = inverse.size(1), num_bags = pooled.size(0);
  check_expand_args(inverse, col_feature, cols);
  auto out = at::empty({batch, cols}, pooled.options());
  if (batch == 0 || cols == 0) return out;
  if (num_bags == 0) return out.zero_();  // (no bags at all: every row reads nothing)
  const int64_t esize = pooled.element_size();
  auto stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto unit) {
    using U = decltype(unit);
    const int per_unit = (int)(sizeof(U) / esize);
    const int64_t units = cols / per_unit;
    expand_forward_kernel<U><<<grid_for(batch * units), EXPAND_ROW_THREADS, 0, stream>>>(
        reinterpret_cast<const U*>(pooled.data_ptr()), inverse.data_ptr<int64_t>(), col_feature.data_ptr<int32_t>(),
        reinterpret_cast<U*>(out.data_ptr()), batch, units, per_unit, num_bags,
        limits.has_value() ? limits->data_ptr<int64_t>() : nullptr, chk);
  };
  // 16-byte units where the caller saw every feature's columns split into them (whole_chunks: the
  // dims, and so the column starts, multiples of 16 bytes) and the buffers are aligned
  const bool aligned = reinterpret_cast<uintptr_t>(pooled.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  if (whole_chunks && aligned && (cols * esize) % 16 == 0) launch(uint4{});
  else if (esize == 8) launch(0ULL);
  else if (esize == 4) launch(uint32_t{});
  else if (esize == 2) launch(uint16_t{});
  else TORCH_CHECK(false, "recom_rec cuda backend: the expansion copies 2-, 4- or 8-byte elements");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> expand_rows_forward_in_place(const at::Tensor& pooled, const at::Tensor& inverse,
                                                                 const at::Tensor& col_feature, const at::Tensor& bags,
                                                                 bool whole_chunks,
                                                                 const c10::optional<at::Tensor>& claim,
                                                                 const c10::optional<at::Tensor>& report) {
  c10::cuda::CUDAGuard guard(pooled.device());
  TORCH_CHECK(claim.has_value() == report.has_value(),
              "recom_rec cuda backend: the expansion's check takes claim and report together");
  TORCH_CHECK(bags.is_cuda() && bags.scalar_type() == at::kLong && bags.is_contiguous() &&
                  bags.numel() == inverse.size(0),
              "recom_rec cuda backend: the expansion takes int64 bags a feature on the device");
  if (claim.has_value()) {
    TORCH_CHECK(claim->is_cuda() && claim->scalar_type() == at::kInt && !report->is_cuda() &&
                    report->scalar_type() == at::kLong,
                "recom_rec cuda backend: the expansion's check takes an int32 device claim and a pinned int64 report");
  }
  const InputCheck chk{-1, -1, claim.has_value() ? claim->data_ptr<int32_t>() : nullptr,
                       report.has_value() ? report->data_ptr<int64_t>() : nullptr};
  TORCH_CHECK(pooled.dim() == 2 && pooled.is_contiguous(), "recom_rec cuda backend: the expansion's pooled rows are "
              "a contiguous [S, C]");
  const int64_t cols = pooled.size(1), batch = inverse.size(1);
  check_expand_args(inverse, col_feature, cols);
  TORCH_CHECK(pooled.size(0) == batch, "recom_rec cuda backend: the expansion in place takes as many pooled rows as "
              "output rows");
  auto moved = moved_features(inverse, batch, batch, pooled.options());
  if (batch == 0 || cols == 0) return {pooled, moved};
  auto scratch = at::empty_like(pooled);
  const int64_t esize = pooled.element_size();
  auto stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto unit) {
    using U = decltype(unit);
    const int per_unit = (int)(sizeof(U) / esize);
    const int64_t units = cols / per_unit;
    const unsigned grid = grid_for(batch * units);
    expand_stage_kernel<U><<<grid, EXPAND_ROW_THREADS, 0, stream>>>(
        reinterpret_cast<const U*>(pooled.data_ptr()), col_feature.data_ptr<int32_t>(), moved.data_ptr<int32_t>(),
        bags.data_ptr<int64_t>(), reinterpret_cast<U*>(scratch.data_ptr()), batch, units, per_unit);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    expand_in_place_kernel<U><<<grid, EXPAND_ROW_THREADS, 0, stream>>>(
        reinterpret_cast<U*>(pooled.data_ptr()), reinterpret_cast<const U*>(scratch.data_ptr()),
        inverse.data_ptr<int64_t>(), col_feature.data_ptr<int32_t>(), moved.data_ptr<int32_t>(),
        bags.data_ptr<int64_t>(), batch, units, per_unit, claim.has_value(), chk);
  };
  // (as expand_rows_forward: 16-byte units where every feature's columns split into them)
  const bool aligned = reinterpret_cast<uintptr_t>(pooled.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(scratch.data_ptr()) % 16 == 0;
  if (whole_chunks && aligned && (cols * esize) % 16 == 0) launch(uint4{});
  else if (esize == 8) launch(0ULL);
  else if (esize == 4) launch(uint32_t{});
  else if (esize == 2) launch(uint16_t{});
  else TORCH_CHECK(false, "recom_rec cuda backend: the expansion copies 2-, 4- or 8-byte elements");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {pooled, moved};
}

at::Tensor expand_rows_backward(const at::Tensor& grad, const at::Tensor& inverse, const at::Tensor& col_feature,
                                int64_t num_bags, bool whole_chunks, const c10::optional<at::Tensor>& moved_given) {
  c10::cuda::CUDAGuard guard(grad.device());
  TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous() && grad.scalar_type() == at::kFloat,
              "recom_rec cuda backend: the expansion's gradient is a contiguous fp32 [B, C]");
  const int64_t batch = grad.size(0), cols = grad.size(1);
  check_expand_args(inverse, col_feature, cols);
  TORCH_CHECK(inverse.size(1) == batch, "recom_rec cuda backend: the gradient's rows and the inverse indices differ");
  auto grad_pooled = at::empty({num_bags, cols}, grad.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  if (grad_pooled.numel() == 0) return grad_pooled;
  if (batch == 0) return grad_pooled.zero_();
  const int64_t features = inverse.size(0);
  at::Tensor moved;
  if (moved_given.has_value()) {  // (the forward's, expand_rows_forward_in_place: the same inverse and bags)
    moved = *moved_given;
    TORCH_CHECK(moved.is_cuda() && moved.scalar_type() == at::kInt && moved.numel() == features,
                "recom_rec cuda backend: the expansion's moved flags are int32, one a feature");
  } else {
    moved = moved_features(inverse, batch, num_bags, grad.options());
  }
  const bool vec = whole_chunks && cols % 4 == 0 && reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(grad_pooled.data_ptr()) % 16 == 0;
  auto launch = [&](auto v) {
    constexpr int V = decltype(v)::value;
    const int64_t units = cols / V;
    expand_backward_zero_kernel<V><<<grid_for(num_bags * units), EXPAND_ROW_THREADS, 0, stream>>>(
        col_feature.data_ptr<int32_t>(), moved.data_ptr<int32_t>(), grad_pooled.data_ptr<float>(), num_bags, units,
        batch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    expand_backward_kernel<V><<<grid_for(batch * units), EXPAND_ROW_THREADS, 0, stream>>>(
        grad.data_ptr<float>(), inverse.data_ptr<int64_t>(), col_feature.data_ptr<int32_t>(),
        moved.data_ptr<int32_t>(), grad_pooled.data_ptr<float>(), batch, units, num_bags);
  };
  if (vec) launch(std::integral_constant<int, 4>{});
  else launch(std::integral_constant<int, 1>{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_pooled;
}
