// The CUDA lookup extension's host entry points (torch tensors in, kernels launched on the current
// stream), bound to Python in module.cu; kernels.cuh explains what they compute.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>
#include <vector>

at::Tensor pooled_forward(const at::Tensor& flat, const at::Tensor& values, const at::Tensor& offsets,
                          const c10::optional<at::Tensor>& psw, const at::Tensor& meta, const at::Tensor& key_index,
                          int64_t batch_size, int64_t total_dim, int64_t max_dim, bool bag_major,
                          int64_t rows_in_flight, int64_t rounds, const c10::optional<at::Tensor>& claim,
                          const c10::optional<at::Tensor>& report);

std::vector<at::Tensor> plan_backward(const at::Tensor& values, const at::Tensor& offsets,
                                      const c10::optional<at::Tensor>& psw, const at::Tensor& meta,
                                      const at::Tensor& key_index, const c10::optional<at::Tensor>& feature_base,
                                      int64_t batch_size, int64_t total_dim, int64_t n, int64_t key_bits, bool key64,
                                      bool packed, int64_t multi_words, int64_t touched_words);

// The dense backward's zeros (kernels.cuh: zero_untouched_kernel): every element of `out` outside
// the rows marked in `touched` (plan_backward's last result), before the piece kernels write those.
void zero_untouched_rows(const at::Tensor& out, const at::Tensor& touched, const at::Tensor& meta);

void piece_update(const at::Tensor& row_key, const at::Tensor& order, const at::Tensor& src, const at::Tensor& scale,
                  const at::Tensor& feature, const at::Tensor& bag_scale, int64_t packed_batch, const at::Tensor& grad,
                  const at::Tensor& meta, const at::Tensor& pieces, const at::Tensor& split_rows,
                  const at::Tensor& counts, int64_t n, const at::Tensor& partials, int64_t partial_stride,
                  const at::Tensor& out, const at::Tensor& state1, const at::Tensor& state2, const at::Tensor& hyper,
                  const at::Tensor& step, int64_t opt, int64_t max_dim, int64_t lanes,
                  const c10::optional<at::Tensor>& grad_rows);

void singleton_update(const at::Tensor& values, const at::Tensor& offsets, const c10::optional<at::Tensor>& psw,
                      const at::Tensor& meta, const at::Tensor& key_index, const at::Tensor& multi,
                      const at::Tensor& grad, int64_t batch_size, const at::Tensor& out, const at::Tensor& state1,
                      const at::Tensor& state2, const at::Tensor& hyper, const at::Tensor& step, int64_t opt,
                      int64_t max_dim, const c10::optional<at::Tensor>& grad_rows);

// The variable-batch expansion (expand.cu; recom_rec/ops/expand_bags.py): out[b, c] =
// pooled[inverse[col_feature[c], b], c], and its gradient back to the bags in fp32. `whole_chunks`:
// every feature's columns split into whole 16-byte units (the caller knows the dims).
// With `limits` (each feature's bags in this batch, int64 [F]), `claim` and `report` (the input check's,
// as pooled_forward's), an inverse index outside a feature's bags is reported.
at::Tensor expand_rows_forward(const at::Tensor& pooled, const at::Tensor& inverse, const at::Tensor& col_feature,
                               bool whole_chunks, const c10::optional<at::Tensor>& limits,
                               const c10::optional<at::Tensor>& claim, const c10::optional<at::Tensor>& report);
// In place where the pooled rows are as many as the output's (S == B): `bags` (int64 [F]) each
// feature's own bags, the check as above without limits (the bags are them); returns the output
// (`pooled`) and each feature's moved flag (int32 [F]: 0 where every row b takes bag b), which the
// backward may take instead of finding them again.
std::tuple<at::Tensor, at::Tensor> expand_rows_forward_in_place(const at::Tensor& pooled, const at::Tensor& inverse,
                                                                 const at::Tensor& col_feature, const at::Tensor& bags,
                                                                 bool whole_chunks,
                                                                 const c10::optional<at::Tensor>& claim,
                                                                 const c10::optional<at::Tensor>& report);
at::Tensor expand_rows_backward(const at::Tensor& grad, const at::Tensor& inverse, const at::Tensor& col_feature,
                                int64_t num_bags, bool whole_chunks, const c10::optional<at::Tensor>& moved);

// The variable-batch padding (pad_offsets.cu; recom_rec/ops/variable_batch.pad_to_uniform): a
// KJT's offsets padded to `width` bags a key; `per_key` int64 [first; strides].
at::Tensor pad_offsets(const at::Tensor& offsets, const at::Tensor& per_key, int64_t width, int64_t bags);

// One optimizer's backward updates (backward_<optimizer>.cu): piece_update and singleton_update
// with the kernels of that optimizer only.
struct BackwardKernels {
  decltype(&piece_update) pieces;
  decltype(&singleton_update) singletons;
};
extern const BackwardKernels kBackwardNone, kBackwardSgd, kBackwardAdagrad, kBackwardRowwiseAdagrad, kBackwardAdam;

// The backward's padded gradient (padded_gradient.cu): padded[r, column[c]] = grad[r, c].
void pad_gradient_columns(const at::Tensor& grad, const at::Tensor& column, const at::Tensor& padded);

// The fused optimizer's step counter plus one (step_counter.cu).
void count_step(const at::Tensor& step);

// The unpooled lookup (unpooled.cu; recom_rec/kernels/unpooled_triton.py has the same in Triton):
// `segments` int64 [4, F + 1] as ops/unpooled_embedding.py builds it. The forward's fp32 rows, one
// per id; the row keys, with `grad_table` (int64 [2, F]) also each row's gradient row. With
// `claim` and `report` (the input check's, as pooled_forward's) and the KJT's `offsets`, a bad id
// is reported with its feature and batch index. `count`: the fused optimizer's step counter, plus
// one in the same launch (count_step's work without a launch of its own).
at::Tensor unpooled_forward(const at::Tensor& flat, const at::Tensor& values, const at::Tensor& segments,
                            const at::Tensor& meta, int64_t num_outputs, int64_t dim,
                            const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& claim,
                            const c10::optional<at::Tensor>& report, const c10::optional<at::Tensor>& count);
std::vector<at::Tensor> unpooled_row_keys(const at::Tensor& values, const at::Tensor& segments,
                                          const at::Tensor& meta, int64_t num_outputs,
                                          const c10::optional<at::Tensor>& grad_table,
                                          const c10::optional<at::Tensor>& offsets,
                                          const c10::optional<at::Tensor>& claim,
                                          const c10::optional<at::Tensor>& report);

// The eager unpooled backward in one call (unpooled_backward.cu): unpooled_row_keys with the
// gradient rows, plan_backward, piece_update and (`singletons`) singleton_update on bags of one id.
void unpooled_backward(const at::Tensor& values, const at::Tensor& segments, const at::Tensor& meta,
                       int64_t num_outputs, const at::Tensor& grad_table, const at::Tensor& grad,
                       const at::Tensor& offsets, const at::Tensor& whole_meta, const at::Tensor& first_key,
                       const at::Tensor& out, const c10::optional<at::Tensor>& state1,
                       const c10::optional<at::Tensor>& state2, const c10::optional<at::Tensor>& hyper,
                       const c10::optional<at::Tensor>& step, int64_t opt, int64_t dim, int64_t num_rows,
                       bool singletons, int64_t lanes, bool zero_untouched);
