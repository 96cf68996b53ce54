// The backward's update entry points: each optimizer's kernels are in their own translation unit
// (backward_<optimizer>.cu); these pick one by `opt`.
#include "lookup.h"

#include <c10/util/Exception.h>

namespace {

const BackwardKernels& backward_kernels(int64_t opt) {
  TORCH_CHECK(opt >= -1 && opt <= 3, "unknown optimizer kind ", opt);
  static const BackwardKernels* const by_opt[] = {&kBackwardNone, &kBackwardSgd, &kBackwardAdagrad,
                                                  &kBackwardRowwiseAdagrad, &kBackwardAdam};
  return *by_opt[opt + 1];
}

}  // namespace

// The backward's piece and split-row kernels (see piece_kernel) on a plan_backward result.
// `opt` < 0 writes row gradients into `out`.
void piece_update(const at::Tensor& row_key, const at::Tensor& order, const at::Tensor& src, const at::Tensor& scale,
                  const at::Tensor& feature, const at::Tensor& bag_scale, int64_t packed_batch, const at::Tensor& grad,
                  const at::Tensor& meta, const at::Tensor& pieces, const at::Tensor& split_rows,
                  const at::Tensor& counts, int64_t n, const at::Tensor& partials, int64_t partial_stride,
                  const at::Tensor& out, const at::Tensor& state1, const at::Tensor& state2, const at::Tensor& hyper,
                  const at::Tensor& step, int64_t opt, int64_t max_dim, int64_t lanes,
                  const c10::optional<at::Tensor>& grad_rows) {
  backward_kernels(opt).pieces(row_key, order, src, scale, feature, bag_scale, packed_batch, grad, meta, pieces,
                               split_rows, counts, n, partials, partial_stride, out, state1, state2, hyper, step, opt,
                               max_dim, lanes, grad_rows);
}

// The lookups whose rows plan_backward left out of the pieces (one lookup in the batch), finished
// in bag order by singleton_kernel; the same arguments as piece_update where they mean the same.
void singleton_update(const at::Tensor& values, const at::Tensor& offsets, const c10::optional<at::Tensor>& psw,
                      const at::Tensor& meta, const at::Tensor& key_index, const at::Tensor& multi,
                      const at::Tensor& grad, int64_t batch_size, const at::Tensor& out, const at::Tensor& state1,
                      const at::Tensor& state2, const at::Tensor& hyper, const at::Tensor& step, int64_t opt,
                      int64_t max_dim, const c10::optional<at::Tensor>& grad_rows) {
  backward_kernels(opt).singletons(values, offsets, psw, meta, key_index, multi, grad, batch_size, out, state1,
                                   state2, hyper, step, opt, max_dim, grad_rows);
}
