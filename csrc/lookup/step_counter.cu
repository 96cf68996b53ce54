// The fused optimizer's step counter (recom_rec/ops/step_counter.py), counted on the device so that
// a CUDA graph's replay counts too. torch's add_ on it loaded torch's binary-op kernels at its first
// launch in a process, 19-23 ms of a first training step (perf-notes v59-v60).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "lookup.h"

namespace {

__global__ void count_step_kernel(int64_t* step) { *step += 1; }

}  // namespace

void count_step(const at::Tensor& step) {
  TORCH_CHECK(step.is_cuda() && step.scalar_type() == at::kLong && step.numel() == 1,
              "recom_rec cuda backend: count_step takes a one-element int64 CUDA tensor");
  c10::cuda::CUDAGuard guard(step.device());
  count_step_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(step.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
