// The backward's update launches, one instantiation per optimizer (OPT as in kernels.cuh's
// apply1): piece_update_for / singleton_update_for<OPT> are piece_update / singleton_update
// (backward.cu) for one optimizer. Each backward_<optimizer>.cu instantiates one OPT, so the
// ~70 kernels of an optimizer compile in their own translation unit, in parallel with the others.
#pragma once
#include "kernels.cuh"
#include "lookup.h"

namespace {

// The backward's piece and split-row kernels (see piece_kernel) on a plan_backward result.
// `opt` < 0 writes row gradients into `out`.
template <int OPT>
void piece_update_for(const at::Tensor& row_key, const at::Tensor& order, const at::Tensor& src,
                      const at::Tensor& scale, const at::Tensor& feature, const at::Tensor& bag_scale,
                      int64_t packed_batch, const at::Tensor& grad, const at::Tensor& meta, const at::Tensor& pieces,
                      const at::Tensor& split_rows, const at::Tensor& counts, int64_t n, const at::Tensor& partials,
                      int64_t partial_stride, const at::Tensor& out, const at::Tensor& state1,
                      const at::Tensor& state2, const at::Tensor& hyper, const at::Tensor& step, int64_t opt,
                      int64_t max_dim, int64_t lanes, const c10::optional<at::Tensor>& grad_rows) {
  c10::cuda::CUDAGuard guard(out.device());
  // lanes -1: each piece at its own row's fewest lanes, a launch a lane class (piece_class_count_kernel)
  const bool by_width = lanes == -1;
  TORCH_CHECK((by_width && max_dim <= 32 * 32) ||
                  lanes == 0 || (lanes > 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0 && 16 * lanes >= max_dim),
              "piece lanes must be -1 (by width, max_dim <= 1024) or a power of two <= 32 covering max_dim in four "
              "float4s, got ", lanes, " at max_dim ", max_dim);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // `lanes` shapes the piece kernel only: the split and long rows take the widest row's lanes
  // whatever it is, so which rows are long and how their partials are grouped (hence the bits) do
  // not depend on it (the pieces' partial sums are stored by column, readable by any lanes).
  const PieceShape shape = piece_shape(max_dim, by_width ? 0 : lanes, sms), rows = piece_shape(max_dim, 0, sms);
  const bool rows_four = rows.V == 4, rows_eight = rows.V == 8;
  TORCH_CHECK(counts.numel() >= 3, "piece_update takes plan_backward's three counts");
  // The long rows' list, their slices and the two counts, emptied here: a plan run through twice
  // must not append its long rows twice. Fewer lookups than a long row needs: no list, no launch.
  const LongRowSpace space = long_row_space(n, rows.V, rows.G);
  auto long_space = at::empty({space.words()}, pieces.options());
  int64_t* long_base = long_space.data_ptr<int64_t>();
  auto stream = at::cuda::getCurrentCUDAStream();
  if (space.most_long > 0) C10_CUDA_CHECK(cudaMemsetAsync(long_base, 0, sizeof(int64_t), stream));
  TORCH_CHECK(packed_batch >= 0 && packed_batch < (int64_t)INT32_MAX, "packed_batch out of range");
  const bool grad_vec = reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16 == 0 && grad.size(1) % 4 == 0;
  TORCH_CHECK(!grad_rows.has_value() || (packed_batch > 0 && grad_rows->is_cuda() &&
                                          grad_rows->scalar_type() == at::kLong && grad_rows->numel() >= packed_batch),
              "piece_update: grad_rows are int64 on the GPU, a bag each, with a packed plan");
  const Payload pay = make_payload((int32_t)packed_batch, grad_vec, grad.size(1), meta.data_ptr<int64_t>(),
                                   bag_scale.data_ptr<float>(), src.data_ptr<int64_t>(), scale.data_ptr<float>(),
                                   feature.data_ptr<int32_t>(),
                                   grad_rows.has_value() ? grad_rows->data_ptr<int64_t>() : nullptr);
  const PieceArgs args{pieces.data_ptr<int64_t>(), split_rows.data_ptr<int64_t>(), space.rows(long_base),
                       counts.data_ptr<int32_t>(), n,
                       partials.data_ptr<float>(), partial_stride,
                       state1.scalar_type() == at::kFloat ? state1.data_ptr<float>() : nullptr,
                       state2.scalar_type() == at::kFloat ? state2.data_ptr<float>() : nullptr,
                       hyper.scalar_type() == at::kFloat ? hyper.data_ptr<float>() : nullptr,
                       step.scalar_type() == at::kLong ? step.data_ptr<int64_t>() : nullptr,
                       meta.data_ptr<int64_t>(), shape.G};
  PieceArgs row_args = args;
  row_args.G = rows.G;
  row_args.long_counts = space.counts(long_base);
  row_args.slice_rows = space.slices(long_base);
  dispatch_weight(out.scalar_type(), [&](auto wt) {
    using W = decltype(wt);
    auto launch = [&](auto kt) {
      using K = decltype(kt);
      const K* keys = reinterpret_cast<const K*>(row_key.data_ptr());
      auto pieces_at = [&](const PieceArgs& at, int V, int G) {
        auto pk = V == 8   ? piece_kernel<W, K, OPT, 8>
                  : V == 4 ? piece_kernel<W, K, OPT, 4>
                           : piece_kernel<W, K, OPT, 1>;
        const size_t ring = piece_ring_bytes(V, G);
        if (ring > 48 * 1024)  // past the default limit of a block's dynamic shared memory
          C10_CUDA_CHECK(cudaFuncSetAttribute(pk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ring));
        pk<<<PieceShape{V, G, sms}.grid(n), PIECE_THREADS, ring, stream>>>(
            keys, order.data_ptr<int32_t>(), pay, grad.data_ptr<float>(), at, wptr<W>(out));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (!by_width) {
        pieces_at(args, shape.V, shape.G);
      } else {
        const int classes = piece_lane_class(max_dim) + 1;  // through the widest row's class
        TORCH_CHECK(classes <= MAX_LANE_CLASSES, "piece lanes by width: at most ", MAX_LANE_CLASSES, " lane classes");
        auto cls = at::empty({n}, pieces.options().dtype(at::kByte));
        auto lists = at::empty({n}, pieces.options());
        const int blocks = (int)std::max<int64_t>(
            1, std::min<int64_t>({sms * 8, (int64_t)MAX_CLASS_BLOCKS, (n + CLASS_THREADS - 1) / CLASS_THREADS}));
        auto block_counts = at::empty({(int64_t)classes * blocks}, counts.options());
        auto info = at::empty({2 * classes}, counts.options());  // each class's size, then where its list begins
        int32_t* cc = info.data_ptr<int32_t>();
        piece_class_count_kernel<<<blocks, CLASS_THREADS, 0, stream>>>(
            pieces.data_ptr<int64_t>(), counts.data_ptr<int32_t>(), order.data_ptr<int32_t>(), pay, classes,
            cls.data_ptr<uint8_t>(), block_counts.data_ptr<int32_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        piece_class_scan_kernel<<<1, CLASS_SCAN_THREADS, 0, stream>>>(block_counts.data_ptr<int32_t>(), blocks,
                                                                     classes, cc);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        piece_class_scatter_kernel<<<blocks, CLASS_THREADS, 0, stream>>>(
            pieces.data_ptr<int64_t>(), counts.data_ptr<int32_t>(), cls.data_ptr<uint8_t>(), classes,
            block_counts.data_ptr<int32_t>(), lists.data_ptr<int64_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        for (int c = 0; c < classes; ++c) {
          PieceArgs of_class = args;
          of_class.pieces = lists.data_ptr<int64_t>();
          of_class.counts = cc + c;  // the piece kernel reads counts[0] only
          of_class.begin = cc + classes + c;
          const bool wide = c == WIDE_PIECE_CLASS;
          of_class.G = wide ? 32 : 1 << c;
          pieces_at(of_class, wide ? 8 : 4, of_class.G);
        }
      }
      auto sk = rows_eight ? split_row_kernel<W, K, OPT, 8>
                           : rows_four ? split_row_kernel<W, K, OPT, 4> : split_row_kernel<W, K, OPT, 1>;
      sk<<<rows.grid(split_rows.numel()), PIECE_THREADS, 0, stream>>>(keys, order.data_ptr<int32_t>(), pay, row_args,
                                                                       wptr<W>(out));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (space.most_long > 0) {
        auto lk = rows_eight ? long_row_kernel<W, K, OPT, 8>
                             : rows_four ? long_row_kernel<W, K, OPT, 4> : long_row_kernel<W, K, OPT, 1>;
        lk<<<rows.long_grid(space.most_slices), PIECE_THREADS, 0, stream>>>(keys, order.data_ptr<int32_t>(), pay,
                                                                            row_args, wptr<W>(out));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    if (row_key.scalar_type() == at::kInt) launch(int32_t{});
    else launch(int64_t{});
  });
}

// The lookups whose rows plan_backward left out of the pieces (one lookup in the batch), finished
// in bag order by singleton_kernel; the same arguments as piece_update where they mean the same.
template <int OPT>
void singleton_update_for(const at::Tensor& values, const at::Tensor& offsets,
                          const c10::optional<at::Tensor>& psw, const at::Tensor& meta, const at::Tensor& key_index,
                          const at::Tensor& multi, const at::Tensor& grad, int64_t batch_size, const at::Tensor& out,
                          const at::Tensor& state1, const at::Tensor& state2, const at::Tensor& hyper,
                          const at::Tensor& step, int64_t opt, int64_t max_dim,
                          const c10::optional<at::Tensor>& grad_rows) {
  c10::cuda::CUDAGuard guard(out.device());
  const int64_t F = meta.size(0);
  if (F == 0 || batch_size == 0) return;
  TORCH_CHECK(!grad_rows.has_value() || (grad_rows->is_cuda() && grad_rows->scalar_type() == at::kLong &&
                                         grad_rows->numel() >= batch_size),
              "singleton_update: grad_rows are int64 on the GPU, a bag each");
  TORCH_CHECK(F <= 65535, "singleton_update takes at most 65535 features a group");
  TORCH_CHECK(values.scalar_type() == offsets.scalar_type(), "values and offsets must share a dtype");
  const PieceShape pieces = piece_shape(max_dim, 0, 0);  // piece_update's chunks a lane (V) and lanes a piece (a.G)
  const int V = pieces.V, g = pieces.G;
  constexpr int threads = PIECE_THREADS;
  const int64_t bags_per_block = (32 / g) * (threads / 32);
  const dim3 grid((unsigned)std::min<int64_t>((batch_size + bags_per_block - 1) / bags_per_block, INT32_MAX),
                  (unsigned)F);
  const bool grad_vec = reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16 == 0 && grad.size(1) % 4 == 0;
  const PieceArgs args{nullptr, nullptr, nullptr, nullptr, 0, nullptr, 0,
                       state1.scalar_type() == at::kFloat ? state1.data_ptr<float>() : nullptr,
                       state2.scalar_type() == at::kFloat ? state2.data_ptr<float>() : nullptr,
                       hyper.scalar_type() == at::kFloat ? hyper.data_ptr<float>() : nullptr,
                       step.scalar_type() == at::kLong ? step.data_ptr<int64_t>() : nullptr,
                       meta.data_ptr<int64_t>(), g};
  const float* w = psw.has_value() ? psw->data_ptr<float>() : nullptr;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(multi.data_ptr<int32_t>());
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_weight(out.scalar_type(), [&](auto wt) {
    using W = decltype(wt);
    auto launch = [&](auto it) {
      using I = decltype(it);
      auto k = V == 8 ? singleton_kernel<W, I, OPT, 8> : V == 4 ? singleton_kernel<W, I, OPT, 4>
                                                              : singleton_kernel<W, I, OPT, 1>;
      k<<<grid, threads, 0, stream>>>(values.data_ptr<I>(), offsets.data_ptr<I>(), w, key_index.data_ptr<int64_t>(),
                                      bits, grad.data_ptr<float>(),
                                      grad_rows.has_value() ? grad_rows->data_ptr<int64_t>() : nullptr, args,
                                      batch_size, grad.size(1), grad_vec,
                                      wptr<W>(out), values.numel());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (values.scalar_type() == at::kLong) launch(int64_t{});
    else launch(int32_t{});
  });
}

}  // namespace
