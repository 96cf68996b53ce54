// The variable-batch padding (recom_rec/ops/variable_batch.py, pad_to_uniform) on the CUDA
// extension: a VBE KJT's offsets padded so that each of its K keys has `width` bags, the missing
// ones empty at the key's end. The same gather as the Triton kernel (kernels/pad_offsets_triton.py),
// here because a C++ call costs the host less than Triton's Python launch (perf-notes v64: the
// padding 81 -> 66 us of a VBE step's host time).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "lookup.h"

namespace {

constexpr int PAD_THREADS = 256;

// Padded position p = k * width + i takes offsets[first[k] + min(i, s_k)]; the last (p = K * width)
// offsets[bags]. per_key: int64 [first; strides], 2 * K.
template <typename T>
__global__ void __launch_bounds__(PAD_THREADS) pad_offsets_kernel(const T* __restrict__ offsets,
                                                                  const int64_t* __restrict__ per_key,
                                                                  T* __restrict__ out, int64_t num_keys, int64_t width,
                                                                  int64_t bags, int64_t n) {
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += (int64_t)gridDim.x * blockDim.x) {
    int64_t src = bags;
    if (p < n - 1) {
      const int64_t k = p / width, i = p - k * width;
      const int64_t stride = per_key[num_keys + k];
      src = per_key[k] + (i < stride ? i : stride);
    }
    out[p] = offsets[src];
  }
}

}  // namespace

at::Tensor pad_offsets(const at::Tensor& offsets, const at::Tensor& per_key, int64_t width, int64_t bags) {
  c10::cuda::CUDAGuard guard(offsets.device());
  TORCH_CHECK(offsets.is_cuda() && offsets.dim() == 1 && offsets.is_contiguous() &&
                  (offsets.scalar_type() == at::kLong || offsets.scalar_type() == at::kInt),
              "recom_rec cuda backend: pad_offsets takes contiguous int32 or int64 offsets");
  TORCH_CHECK(per_key.is_cuda() && per_key.scalar_type() == at::kLong && per_key.is_contiguous() &&
                  per_key.numel() % 2 == 0,
              "recom_rec cuda backend: pad_offsets takes int64 [first; strides], two entries a key");
  TORCH_CHECK(width >= 0 && bags >= 0 && bags < offsets.numel(),
              "recom_rec cuda backend: pad_offsets' width and bags must fit the offsets");
  const int64_t num_keys = per_key.numel() / 2, n = num_keys * width + 1;
  auto out = at::empty({n}, offsets.options());
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const unsigned grid = (unsigned)std::max<int64_t>(1, std::min<int64_t>((n + PAD_THREADS - 1) / PAD_THREADS, sms * 8));
  auto stream = at::cuda::getCurrentCUDAStream();
  if (offsets.scalar_type() == at::kLong) {
    pad_offsets_kernel<int64_t><<<grid, PAD_THREADS, 0, stream>>>(offsets.data_ptr<int64_t>(),
                                                                  per_key.data_ptr<int64_t>(), out.data_ptr<int64_t>(),
                                                                  num_keys, width, bags, n);
  } else {
    pad_offsets_kernel<int32_t><<<grid, PAD_THREADS, 0, stream>>>(offsets.data_ptr<int32_t>(),
                                                                  per_key.data_ptr<int64_t>(), out.data_ptr<int32_t>(),
                                                                  num_keys, width, bags, n);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
