// The pooled forward's host entry point (kernels.cuh: pooled_forward_kernel).
#include "kernels.cuh"
#include "lookup.h"

// Pooled forward of a group: out [batch_size, total_dim] fp32, any dim. The caller has converted
// offsets to values' dtype and per-sample weights to fp32. `bag_major`, `rows_in_flight` (8, or
// 4 where max_dim <= 128) and `rounds` (1, or bag-major in that many rounds) choose among launches
// that give the same bits (the launch tuner's).
// `claim` (device int32) and `report` (pinned host int64, REPORT_WORDS) turn on the input check's
// report (kernels.cuh: InputCheck); without them bad ids are clamped silently.
at::Tensor pooled_forward(const at::Tensor& flat, const at::Tensor& values, const at::Tensor& offsets,
                          const c10::optional<at::Tensor>& psw, const at::Tensor& meta, const at::Tensor& key_index,
                          int64_t batch_size, int64_t total_dim, int64_t max_dim, bool bag_major,
                          int64_t rows_in_flight, int64_t rounds, const c10::optional<at::Tensor>& claim,
                          const c10::optional<at::Tensor>& report) {
  c10::cuda::CUDAGuard guard(flat.device());
  auto out = at::empty({batch_size, total_dim}, flat.options().dtype(at::kFloat));
  const int64_t F = meta.size(0);
  if (F == 0 || batch_size == 0) return out.zero_();
  TORCH_CHECK(values.scalar_type() == offsets.scalar_type(), "values and offsets must share a dtype");
  TORCH_CHECK(!bag_major || F <= 65535, "bag-major forward takes at most 65535 features a group");
  TORCH_CHECK(rounds >= 1, "recom_rec cuda backend: the forward's rounds must be at least 1");
  const ForwardShape shape = forward_shape(F, batch_size, max_dim, bag_major, rounds);
  const dim3 grid = shape.grid;
  const int lane_chunks = shape.lane_chunks;
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = psw.has_value() ? psw->data_ptr<float>() : nullptr;
  TORCH_CHECK(claim.has_value() == report.has_value(), "the input check takes both claim and report");
  // The report's pinning is input_check.KernelReport's to guarantee (it allocates the words
  // pinned): is_pinned() here cost a cudaPointerGetAttributes every call (perf-notes v38).
  TORCH_CHECK(!report.has_value() || (report->device().is_cpu() && report->scalar_type() == at::kLong &&
                                      claim->is_cuda() && claim->scalar_type() == at::kInt),
              "the input check's report is pinned int64 host memory, its claim an int32 device word");
  // Pinned memory is mapped into the device's address space at the same address (UVA).
  const InputCheck chk{values.numel(), offsets.numel() - 1, claim.has_value() ? claim->data_ptr<int32_t>() : nullptr,
                       report.has_value() ? report->data_ptr<int64_t>() : nullptr};
  TORCH_CHECK(values.scalar_type() == at::kLong || values.scalar_type() == at::kInt, "values must be int32 or int64");
  TORCH_CHECK(rows_in_flight == 8 || (rows_in_flight == 4 && lane_chunks <= 1 && rounds == 1),
              "recom_rec cuda backend: the forward keeps 8 rows in flight a lane, or 4 where rows take one "
              "chunk a lane (not in rounds)");
  dispatch_weight(flat.scalar_type(), [&](auto wt) {
    using W = decltype(wt);
    auto launch = [&](auto index, auto maxv, auto rows, auto in_rounds) {
      using I = decltype(index);
      pooled_forward_kernel<W, I, decltype(maxv)::value, decltype(rows)::value, decltype(in_rounds)::value>
          <<<grid, FORWARD_THREADS, 0, stream>>>(
              wptr<W>(flat), values.data_ptr<I>(), offsets.data_ptr<I>(), w, meta.data_ptr<int64_t>(),
              key_index.data_ptr<int64_t>(), out.data_ptr<float>(), batch_size, total_dim, bag_major,
              shape.round_bag_blocks, shape.items, chk);
    };
    auto by_rounds = [&](auto index, auto maxv, auto rows) {
      if (rounds > 1) launch(index, maxv, rows, std::true_type{});
      else launch(index, maxv, rows, std::false_type{});
    };
    auto by_width = [&](auto index) {
      using Eight = std::integral_constant<int, 8>;
      using One = std::integral_constant<int, 1>;
      using Four = std::integral_constant<int, 4>;
      if (lane_chunks <= 1 && rows_in_flight == 4) launch(index, One{}, Four{}, std::false_type{});
      else if (lane_chunks <= 1) by_rounds(index, One{}, Eight{});
      else if (lane_chunks == 2) by_rounds(index, std::integral_constant<int, 2>{}, Eight{});
      else by_rounds(index, Four{}, Eight{});
    };
    if (values.scalar_type() == at::kLong) by_width(int64_t{});
    else by_width(int32_t{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
