// The backward's plan (kernels.cuh: expand_kernel, a CUB radix sort, plan_kernel).
#include "kernels.cuh"
#include "lookup.h"
#include "workspace.cuh"

// The backward's plan of a group (kernels.cuh): returns sorted row keys, the sort's
// payloads (int32), the expand arrays src, scale and feature (empty when the payload is packed),
// the piece list, the split-row list, their two counts (on the device: no sync) and the packed
// payloads' bag scales. `packed` (the caller's choice: no sample weights, features x batch below
// 2^31) selects the packed payload, feature * batch_size + bag. `feature_base` is absent when
// every key is read by one feature (a lookup's index is then its position in values); `key_bits`
// bounds the row keys (the group's rows), `key64` their width. `multi_words` > 0 (a bitmap of that
// many 32-bit words, one bit per row, the last result) leaves rows of one lookup out of the pieces
// for singleton_update and marks the others. `touched_words` > 0: a bitmap of that many words
// marking every row a lookup reads (the dense backward's zeros skip them), after `multi`.
std::vector<at::Tensor> plan_backward(const at::Tensor& values, const at::Tensor& offsets,
                                      const c10::optional<at::Tensor>& psw, const at::Tensor& meta,
                                      const at::Tensor& key_index, const c10::optional<at::Tensor>& feature_base,
                                      int64_t batch_size, int64_t total_dim, int64_t n, int64_t key_bits, bool key64,
                                      bool packed, int64_t multi_words, int64_t touched_words) {
  c10::cuda::CUDAGuard guard(values.device());
  TORCH_CHECK(n < (int64_t)INT32_MAX, "recom_rec cuda backend: a group's backward takes at most 2^31 - 1 lookups");
  TORCH_CHECK(values.scalar_type() == offsets.scalar_type(), "values and offsets must share a dtype");
  const int64_t F = meta.size(0);
  TORCH_CHECK(!packed || (!psw.has_value() && F * batch_size < (int64_t)INT32_MAX),
              "recom_rec cuda backend: packed payloads take no sample weights and under 2^31 feature-bags");
  const auto dev = values.options();
  const int64_t per_lookup = packed ? 0 : n;
  const int64_t multi_n = multi_words > 0 ? multi_words : 0, touched_n = touched_words > 0 ? touched_words : 0;
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = psw.has_value() ? psw->data_ptr<float>() : nullptr;
  const int64_t* fb = feature_base.has_value() ? feature_base->data_ptr<int64_t>() : nullptr;
  const bool run_kernels = n > 0 && F > 0 && batch_size > 0;
  const int block_bags = run_kernels ? expand_bags(n, F, batch_size) : 1;
  TORCH_CHECK(!run_kernels || (batch_size + block_bags - 1) / block_bags <= 65535,
              "recom_rec cuda backend: a batch of at most ", 65535LL * EXPAND_BAGS, " bags, got ", batch_size);
  const int bits = (int)key_bits;
  auto run = [&](auto kt, auto it) -> std::vector<at::Tensor> {
    using K = decltype(kt);
    using I = decltype(it);
    using U = typename std::make_unsigned<K>::type;  // keys are non-negative: sort them unsigned
    const auto key_dtype = sizeof(K) == 8 ? at::kLong : at::kInt;
    size_t temp_bytes = 0;
    if (run_kernels) {
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, (const U*)nullptr, (U*)nullptr, (const int32_t*)nullptr,
                                      (int32_t*)nullptr, (int)n, 0, bits, stream);
    }
    // Every array in two allocations (views of two workspaces): a dozen at::empty calls cost the
    // host of a host-bound step tens of microseconds (perf-notes v62). `ws` holds the results, kept
    // until the backward ends; `scratch` the sort's inputs and CUB's storage (16-28 bytes a lookup,
    // ~1 GB at a batch of DLRM-DCNv2), freed on return.
    Workspace ws(dev), scratch(dev);
    const auto row_key = scratch.add(n, key_dtype);
    const auto src = ws.add(per_lookup, at::kLong);
    const auto scale = ws.add(per_lookup, at::kFloat);
    const auto feature = ws.add(per_lookup, at::kInt);
    const auto bag_scale = ws.add(packed ? F * batch_size : 0, at::kFloat);
    const auto index = scratch.add(n, at::kInt);
    const auto sorted_key = ws.add(n, key_dtype);
    const auto order = ws.add(n, at::kInt);
    const auto pieces = ws.add(n, at::kLong);
    const auto split_rows = ws.add(n / (PIECE + 1) + 1, at::kLong);
    // The three counts (pieces, split rows, long rows: piece_update's) and the two bitmaps, adjacent
    // and zeroed by one memset.
    const auto zeroed = ws.add(3 + multi_n + touched_n, at::kInt);
    const auto temp = scratch.add((int64_t)temp_bytes, at::kByte);
    ws.allocate();
    C10_CUDA_CHECK(cudaMemsetAsync(ws.ptr(zeroed), 0, (3 + multi_n + touched_n) * sizeof(int32_t), stream));
    auto counts = ws.view(zeroed, 0, 3);
    auto multi = ws.view(zeroed, 3, multi_n);
    auto touched = ws.view(zeroed, 3 + multi_n, touched_n);
    std::vector<at::Tensor> result{ws.view(sorted_key), ws.view(order), ws.view(src), ws.view(scale),
                                   ws.view(feature), ws.view(pieces), ws.view(split_rows), counts,
                                   ws.view(bag_scale), multi, touched};
    if (!run_kernels) return result;
    scratch.allocate();
    const dim3 grid((unsigned)F, (unsigned)((batch_size + block_bags - 1) / block_bags));
    auto expand = packed ? expand_kernel<I, K, true> : expand_kernel<I, K, false>;
    expand<<<grid, EXPAND_THREADS, 0, stream>>>(
        values.data_ptr<I>(), offsets.data_ptr<I>(), w, meta.data_ptr<int64_t>(), key_index.data_ptr<int64_t>(), fb,
        (K*)scratch.ptr(row_key), (int64_t*)ws.ptr(src), (float*)ws.ptr(scale), (int32_t*)ws.ptr(feature),
        (int32_t*)scratch.ptr(index), (float*)ws.ptr(bag_scale), batch_size, total_dim, block_bags, values.numel(),
        offsets.numel() - 1, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch.ptr(temp), temp_bytes, (const U*)scratch.ptr(row_key),
                                                   (U*)ws.ptr(sorted_key), (const int32_t*)scratch.ptr(index),
                                                   (int32_t*)ws.ptr(order), (int)n, 0, bits, stream));
    plan_kernel<K><<<(unsigned)((n + PLAN_BLOCK - 1) / PLAN_BLOCK), PLAN_THREADS, 0, stream>>>(
        (const K*)ws.ptr(sorted_key), n, (int64_t*)ws.ptr(pieces), (int64_t*)ws.ptr(split_rows),
        (int32_t*)ws.ptr(zeroed), multi_n > 0 ? (uint32_t*)ws.ptr(zeroed, 3) : nullptr,
        touched_n > 0 ? (uint32_t*)ws.ptr(zeroed, 3 + multi_n) : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return result;
  };
  const bool v64 = values.scalar_type() == at::kLong;
  TORCH_CHECK(v64 || values.scalar_type() == at::kInt, "values must be int32 or int64");
  if (key64) return v64 ? run(int64_t{}, int64_t{}) : run(int64_t{}, int32_t{});
  return v64 ? run(int32_t{}, int64_t{}) : run(int32_t{}, int32_t{});
}
