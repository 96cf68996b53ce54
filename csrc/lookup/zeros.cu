// The dense backward's zeros (kernels.cuh: zero_untouched_kernel).
#include "kernels.cuh"
#include "lookup.h"

void zero_untouched_rows(const at::Tensor& out, const at::Tensor& touched, const at::Tensor& meta) {
  c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(out.is_contiguous() && out.data_ptr() != nullptr && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "recom_rec cuda backend: the gradient buffer must be contiguous and 16-byte aligned");
  TORCH_CHECK(touched.scalar_type() == at::kInt && meta.scalar_type() == at::kLong && meta.is_contiguous(),
              "recom_rec cuda backend: zero_untouched_rows takes an int32 bitmap and int64 meta");
  TORCH_CHECK(meta.size(0) < (int64_t)INT32_MAX, "recom_rec cuda backend: too many features");
  const int64_t numel = out.numel();
  if (numel == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_weight(out.scalar_type(), [&](auto wt) {
    using W = decltype(wt);
    constexpr int64_t per_block = (int64_t)ZERO_THREADS * ZERO_ITEMS * (64 / sizeof(W));  // elements a CTA
    const int64_t blocks = (numel + per_block - 1) / per_block;
    TORCH_CHECK(blocks <= (int64_t)INT32_MAX, "recom_rec cuda backend: gradient buffer too large");
    zero_untouched_kernel<W><<<(unsigned)blocks, ZERO_THREADS, 0, stream>>>(
        wptr<W>(out), numel, reinterpret_cast<const uint32_t*>(touched.data_ptr<int32_t>()), meta.data_ptr<int64_t>(),
        (int)meta.size(0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}
