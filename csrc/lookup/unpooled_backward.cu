// The eager EmbeddingCollection's backward in one call (recom_rec/ops/unpooled_embedding.py,
// _EagerLookup): each output row's row key and gradient row (unpooled_row_keys), the plan
// (plan_backward), the piece and split-row kernels (piece_update) and, on the singletons path, the
// rows of one lookup (singleton_update). Each id is a bag of one over the group's whole buffer, one
// virtual table whose row key k starts at element k * dim, as the Python chain through the pooled
// backward runs it (pooled_cuda._run_backward): the same kernels, launches and bits. One crossing
// instead of four, and none of the chain's Python, in a step whose host sets its time (perf-notes v63).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kernels.cuh"
#include "lookup.h"

// `grad` is the first of the tensors holding the gradient rows that `grad_table` (int64 [2, F], on
// the host or the device) points at; `offsets` is 0..num_outputs (int64), `whole_meta` the one
// virtual table's meta row and `first_key` a zero (int64 [1]). `out` is the flat buffer (opt >= 0,
// updated in place with its optimizer state) or the dense gradient (opt < 0; `zero_untouched`: it
// is uninitialised, and the rows no lookup touches get their zeros here). `singletons`: the rows of
// one lookup are finished in bag order; `lanes` is piece_update's.
void unpooled_backward(const at::Tensor& values, const at::Tensor& segments, const at::Tensor& meta,
                       int64_t num_outputs, const at::Tensor& grad_table, const at::Tensor& grad,
                       const at::Tensor& offsets, const at::Tensor& whole_meta, const at::Tensor& first_key,
                       const at::Tensor& out, const c10::optional<at::Tensor>& state1,
                       const c10::optional<at::Tensor>& state2, const c10::optional<at::Tensor>& hyper,
                       const c10::optional<at::Tensor>& step, int64_t opt, int64_t dim, int64_t num_rows,
                       bool singletons, int64_t lanes, bool zero_untouched) {
  c10::cuda::CUDAGuard guard(values.device());
  TORCH_CHECK(num_rows >= 1 && dim > 0 && out.numel() >= num_rows * dim,
              "recom_rec cuda backend: the unpooled backward's buffer holds num_rows rows of dim");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() == num_outputs + 1,
              "recom_rec cuda backend: the unpooled backward takes int64 offsets 0..num_outputs");
  TORCH_CHECK(opt >= 0 || !(state1.has_value() || state2.has_value()),
              "recom_rec cuda backend: a dense backward takes no optimizer state");
  const auto keyed = unpooled_row_keys(values, segments, meta, num_outputs, grad_table, c10::nullopt, c10::nullopt,
                                       c10::nullopt);
  const at::Tensor& keys = keyed[0];
  const at::Tensor& rows = keyed[1];
  // pooled_cuda._cuda_plan's arguments for bags of one lookup: one feature, positional lookups,
  // keys of just the bits the rows need, the payload packed (no sample weights).
  const int64_t words = (num_rows + 31) / 32;
  const int64_t key_bits = std::max<int64_t>(1, 64 - __builtin_clzll((unsigned long long)std::max<int64_t>(num_rows - 1, 1)));
  const bool packed = num_outputs < (int64_t)INT32_MAX;
  const auto plan = plan_backward(keys, offsets, c10::nullopt, whole_meta, first_key, c10::nullopt, num_outputs, dim,
                                  num_outputs, key_bits, num_rows >= (1LL << 31), packed,
                                  singletons ? words : 0, zero_untouched ? words : 0);
  // plan: sorted keys, order, src, scale, feature, pieces, split rows, counts, bag scales, multi, touched
  if (zero_untouched) zero_untouched_rows(out, plan[10], whole_meta);
  const int64_t n = plan[0].numel();
  if (n == 0) return;
  int64_t block_d = 16;  // pooled_triton._block_d: the partial sums' row stride
  while (block_d < dim) block_d *= 2;
  const auto partials = at::empty({2 * ((n - 1) / PIECE + 1) * block_d}, grad.options().dtype(at::kFloat));
  const at::Tensor& s1 = state1.has_value() ? *state1 : out;
  const at::Tensor& s2 = state2.has_value() ? *state2 : out;
  const at::Tensor& h = hyper.has_value() ? *hyper : partials;
  const at::Tensor& st = step.has_value() ? *step : partials;
  piece_update(plan[0], plan[1], plan[2], plan[3], plan[4], plan[8], packed ? num_outputs : 0, grad, whole_meta,
               plan[5], plan[6], plan[7], n, partials, block_d, out, s1, s2, h, st, opt, dim, lanes, rows);
  if (singletons) {
    singleton_update(keys, offsets, c10::nullopt, whole_meta, first_key, plan[9], grad, num_outputs, out, s1, s2, h,
                     st, opt, dim, rows);
  }
}
