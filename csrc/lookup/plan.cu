// The backward's plan (kernels.cuh: expand_kernel, a CUB radix sort, plan_kernel).
#include "kernels.cuh"
#include "lookup.h"

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
  const auto key_dtype = key64 ? at::kLong : at::kInt;
  const int64_t per_lookup = packed ? 0 : n;
  auto row_key = at::empty({n}, dev.dtype(key_dtype));
  auto src = at::empty({per_lookup}, dev.dtype(at::kLong));
  auto scale = at::empty({per_lookup}, dev.dtype(at::kFloat));
  auto feature = at::empty({per_lookup}, dev.dtype(at::kInt));
  auto bag_scale = at::empty({packed ? F * batch_size : 0}, dev.dtype(at::kFloat));
  auto index = at::empty({n}, dev.dtype(at::kInt));
  auto sorted_key = at::empty({n}, dev.dtype(key_dtype));
  auto order = at::empty({n}, dev.dtype(at::kInt));
  auto pieces = at::empty({n}, dev.dtype(at::kLong));
  auto split_rows = at::empty({n / (PIECE + 1) + 1}, dev.dtype(at::kLong));
  // The three counts (pieces, split rows, long rows: piece_update's) and the two bitmaps, zeroed by
  // one memset: at::zeros launched a fill kernel each through a TensorIterator, several microseconds
  // of host time apiece in a host-bound step (perf-notes v61).
  const int64_t multi_n = multi_words > 0 ? multi_words : 0, touched_n = touched_words > 0 ? touched_words : 0;
  auto zeroed = at::empty({3 + multi_n + touched_n}, dev.dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(zeroed.data_ptr(), 0, zeroed.numel() * sizeof(int32_t),
                                 at::cuda::getCurrentCUDAStream()));
  auto counts = zeroed.narrow(0, 0, 3);
  auto multi = zeroed.narrow(0, 3, multi_n);
  auto touched = zeroed.narrow(0, 3 + multi_n, touched_n);
  std::vector<at::Tensor> result{sorted_key, order, src, scale, feature, pieces, split_rows, counts, bag_scale, multi,
                                 touched};
  if (n == 0 || F == 0 || batch_size == 0) return result;
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = psw.has_value() ? psw->data_ptr<float>() : nullptr;
  const int64_t* fb = feature_base.has_value() ? feature_base->data_ptr<int64_t>() : nullptr;
  const int block_bags = expand_bags(n, F, batch_size);
  TORCH_CHECK((batch_size + block_bags - 1) / block_bags <= 65535, "recom_rec cuda backend: a batch of at most ",
              65535LL * EXPAND_BAGS, " bags, got ", batch_size);
  const dim3 grid((unsigned)F, (unsigned)((batch_size + block_bags - 1) / block_bags));
  const int bits = (int)key_bits;
  auto run = [&](auto kt, auto it) {
    using K = decltype(kt);
    using I = decltype(it);
    using U = typename std::make_unsigned<K>::type;  // keys are non-negative: sort them unsigned
    auto expand = packed ? expand_kernel<I, K, true> : expand_kernel<I, K, false>;
    expand<<<grid, EXPAND_THREADS, 0, stream>>>(
        values.data_ptr<I>(), offsets.data_ptr<I>(), w, meta.data_ptr<int64_t>(), key_index.data_ptr<int64_t>(), fb,
        reinterpret_cast<K*>(row_key.data_ptr()), src.data_ptr<int64_t>(), scale.data_ptr<float>(),
        feature.data_ptr<int32_t>(), index.data_ptr<int32_t>(), bag_scale.data_ptr<float>(), batch_size, total_dim,
        block_bags, values.numel(), offsets.numel() - 1, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const U* keys_in = reinterpret_cast<const U*>(row_key.data_ptr());
    U* keys_out = reinterpret_cast<U*>(sorted_key.data_ptr());
    size_t temp_bytes = 0;
    cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, index.data_ptr<int32_t>(),
                                    order.data_ptr<int32_t>(), (int)n, 0, bits, stream);
    auto temp = at::empty({(int64_t)temp_bytes}, dev.dtype(at::kByte));
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, keys_in, keys_out,
                                                   index.data_ptr<int32_t>(), order.data_ptr<int32_t>(), (int)n, 0,
                                                   bits, stream));
    plan_kernel<K><<<(unsigned)((n + PLAN_BLOCK - 1) / PLAN_BLOCK), PLAN_THREADS, 0, stream>>>(
        reinterpret_cast<const K*>(sorted_key.data_ptr()), n, pieces.data_ptr<int64_t>(),
        split_rows.data_ptr<int64_t>(), counts.data_ptr<int32_t>(),
        multi_words > 0 ? reinterpret_cast<uint32_t*>(multi.data_ptr<int32_t>()) : nullptr,
        touched_words > 0 ? reinterpret_cast<uint32_t*>(touched.data_ptr<int32_t>()) : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const bool v64 = values.scalar_type() == at::kLong;
  TORCH_CHECK(v64 || values.scalar_type() == at::kInt, "values must be int32 or int64");
  if (key64) {
    if (v64) run(int64_t{}, int64_t{}); else run(int64_t{}, int32_t{});
  } else {
    if (v64) run(int32_t{}, int64_t{}); else run(int32_t{}, int32_t{});
  }
  return result;
}
