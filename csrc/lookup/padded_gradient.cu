// The backward's padded gradient (recom_rec/ops/gradient_layout.py): each column of a group's
// output gradient copied to its padded column, so that every feature's gradient rows start 16 bytes
// aligned. torch's index_copy_ did it before: its first launch in a process loaded torch's
// indexing kernels, ~22 ms of a first training step (perf-notes v60); this unit's load is small.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "lookup.h"

namespace {

constexpr int PAD_THREADS = 256;  // columns a block
constexpr int PAD_ROWS = 4;       // rows a block takes in turn (more loads in flight a thread)

// padded[r, column[c]] = grad[r, c]: a thread a column, its block's rows strided by the grid.
template <typename T>
__global__ void pad_columns_kernel(const T* __restrict__ grad, const int64_t* __restrict__ column,
                                   T* __restrict__ padded, int64_t rows, int64_t width, int64_t padded_width) {
  const int64_t c = (int64_t)blockIdx.x * PAD_THREADS + threadIdx.x;
  if (c >= width) return;
  const int64_t to = column[c];
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    padded[r * padded_width + to] = grad[r * width + c];
  }
}

}  // namespace

void pad_gradient_columns(const at::Tensor& grad, const at::Tensor& column, const at::Tensor& padded) {
  c10::cuda::CUDAGuard guard(grad.device());
  TORCH_CHECK(grad.dim() == 2 && padded.dim() == 2 && grad.size(0) == padded.size(0) && grad.is_contiguous() &&
                  padded.is_contiguous() && grad.scalar_type() == padded.scalar_type(),
              "recom_rec cuda backend: pad_gradient_columns takes two contiguous [rows, width] gradients of one dtype");
  TORCH_CHECK(column.scalar_type() == at::kLong && column.is_contiguous() && column.numel() == grad.size(1),
              "recom_rec cuda backend: pad_gradient_columns takes an int64 padded column per gradient column");
  const int64_t rows = grad.size(0), width = grad.size(1);
  if (rows == 0 || width == 0) return;
  const int64_t column_blocks = (width + PAD_THREADS - 1) / PAD_THREADS;
  TORCH_CHECK(column_blocks <= (int64_t)INT32_MAX, "recom_rec cuda backend: gradient too wide");
  const dim3 grid((unsigned)column_blocks, (unsigned)std::min<int64_t>((rows + PAD_ROWS - 1) / PAD_ROWS, 65535));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "pad_gradient_columns", [&] {
    pad_columns_kernel<scalar_t><<<grid, PAD_THREADS, 0, stream>>>(
        grad.data_ptr<scalar_t>(), column.data_ptr<int64_t>(), padded.data_ptr<scalar_t>(), rows, width,
        padded.size(1));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
