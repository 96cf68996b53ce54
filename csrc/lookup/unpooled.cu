// The unpooled lookup's kernels (recom_rec.EmbeddingCollection; recom_rec/kernels/unpooled_triton.py
// holds the same two in Triton, and its docstring the layout): the forward's gather, one fp32 row
// per id, and each output row's row key (with, for the eager backward, where its gradient row is).
// The same reads and bits as the Triton kernels; here because a Triton launch cost 100-117 us of a
// sequence model's host-bound training step against a few for an extension call (perf-notes v61).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "input_check.cuh"
#include "lookup.h"

namespace {

constexpr int UNPOOLED_META_W = 7;  // ops/layout.py's META_WIDTH (kernels.cuh's META_W)
constexpr int META_ROWS = 4, META_ROW_BASE = 5;
constexpr int UNPOOLED_THREADS = 256;

// The per-batch tables (segments; the eager backward's gradient rows, int64 [2, F]) travel in the
// launch's parameters when the host holds them and they fit, and each block stages them in shared
// memory: no pinned buffer and host-to-device copy a table, which cost 70-84 us each of a sequence
// model's host-bound step (perf-notes v61). Larger or device-resident tables are read in place.
constexpr int HOST_WORDS = 368;  // 2,944 bytes: with the other arguments under the 4 KB of parameters
struct HostWords {
  int64_t w[HOST_WORDS];
};
struct TableSource {
  int num_words;          // words of `host` staged (0: none)
  int seg_at, grad_at;    // each table's first word in `host`, or -1: read at the pointer below
  const int64_t* segments;
  const int64_t* grad;
};

// The tables in shared memory (those passed in the parameters) or where they lie; called by every
// thread of the block before any returns.
__device__ __forceinline__ void stage_tables(const HostWords& host, const TableSource& src, int64_t* staged,
                                             const int64_t*& segments, const int64_t*& grad) {
  if (src.num_words > 0) {
    for (int i = threadIdx.x; i < src.num_words; i += blockDim.x) staged[i] = host.w[i];
    __syncthreads();
  }
  segments = src.seg_at >= 0 ? staged + src.seg_at : src.segments;
  grad = src.grad_at >= 0 ? staged + src.grad_at : src.grad;
}

// Where one output row reads (segments: int64 [4, F + 1], ops/unpooled_embedding.py): its feature
// (the last f whose first output row is at or before r), its position in the KJT's values, its id
// and table's rows, and its row key (row 0 of the table for a bad id).
struct RowLookup {
  int64_t feature, pos, id, rows, key;
  bool bad;
};

template <typename V>
__device__ __forceinline__ RowLookup row_lookup(const V* __restrict__ values, const int64_t* segments,
                                                int64_t seg_stride, const int64_t* __restrict__ meta,
                                                int64_t num_features, int64_t r) {
  int64_t lo = 0, hi = num_features - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (segments[mid] <= r) lo = mid; else hi = mid - 1;
  }
  RowLookup l;
  l.feature = lo;
  l.pos = segments[seg_stride + lo] + r - segments[lo];
  l.id = (int64_t)__ldg(values + l.pos);
  l.rows = __ldg(meta + lo * UNPOOLED_META_W + META_ROWS);
  l.bad = (uint64_t)l.id >= (uint64_t)l.rows;
  l.key = __ldg(meta + lo * UNPOOLED_META_W + META_ROW_BASE) + (l.bad ? 0 : l.id);
  return l;
}

// The input check's report of a bad id: its feature, the batch index of the bag holding it (a
// binary search of its key's offsets; only a lookup that met a bad id pays it), the id, the rows.
__device__ void report_bad_id(const InputCheck& chk, const int64_t* segments, int64_t seg_stride,
                              const void* offsets, bool offsets64, const RowLookup& l) {
  const int64_t first_bag = segments[2 * seg_stride + l.feature];
  int64_t lo = first_bag, hi = first_bag + segments[3 * seg_stride + l.feature] - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    const int64_t at = offsets64 ? static_cast<const int64_t*>(offsets)[mid]
                                 : (int64_t) static_cast<const int32_t*>(offsets)[mid];
    if (at <= l.pos) lo = mid; else hi = mid - 1;
  }
  report_bad(chk, REPORT_ID, l.feature, lo - first_bag, l.id, l.rows);
}

// The check of the bags' lengths: a row's ids are found from its key's summed lengths, so a negative
// length among lengths that add up would pass into the output's JaggedTensors unseen. The grid's
// threads read the KJT's offsets, a stride of the grid apart, and report a negative length with the
// first feature reading its key (a bag of a key no feature reads is not this module's).
__device__ void check_lengths(const InputCheck& chk, const int64_t* segments, int64_t seg_stride,
                              int64_t num_features, const void* offsets, bool offsets64) {
  auto offset = [&](int64_t i) {
    return offsets64 ? static_cast<const int64_t*>(offsets)[i] : (int64_t) static_cast<const int32_t*>(offsets)[i];
  };
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < chk.last_offset; b += step) {
    const int64_t length = offset(b + 1) - offset(b);
    if (length >= 0) continue;
    for (int64_t f = 0; f < num_features; ++f) {
      const int64_t first_bag = segments[2 * seg_stride + f];
      if (first_bag <= b && b < first_bag + segments[3 * seg_stride + f]) {
        report_bad(chk, REPORT_LENGTH, f, b - first_bag, length, 0);
        return;
      }
    }
  }
}

template <typename T, int VEC>
struct Chunk;  // VEC elements of a row, read at once and widened to fp32
template <>
struct Chunk<float, 4> {
  __device__ __forceinline__ static float4 load(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
};
template <typename T>
struct Chunk<T, 4> {  // 16-bit rows: 8 bytes
  __device__ __forceinline__ static float4 load(const T* p) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
    const T* h = reinterpret_cast<const T*>(&raw);
    return make_float4((float)h[0], (float)h[1], (float)h[2], (float)h[3]);
  }
};

// out[r] = flat[key(r)] in fp32, a group of G lanes a row (G: the row's chunks up to a warp), its
// chunks VEC elements each (4 where every row starts aligned to them, else 1).
template <typename T, typename V, int VEC>
__global__ void __launch_bounds__(UNPOOLED_THREADS) unpooled_forward_kernel(
    const T* __restrict__ flat, const V* __restrict__ values, const __grid_constant__ HostWords host,
    TableSource tables, int64_t seg_stride, const int64_t* __restrict__ meta, int64_t num_features,
    float* __restrict__ out, int64_t num_outputs, int64_t dim, int lanes_log2, InputCheck chk, const void* offsets,
    bool offsets64, int64_t* __restrict__ count) {
  __shared__ int64_t staged[HOST_WORDS];
  const int64_t* segments;
  const int64_t* unused;
  if (count != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *count += 1;
  stage_tables(host, tables, staged, segments, unused);
  const int lanes = 1 << lanes_log2;
  const int64_t r = ((int64_t)blockIdx.x * UNPOOLED_THREADS + threadIdx.x) >> lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  if (chk.claim != nullptr) check_lengths(chk, segments, seg_stride, num_features, offsets, offsets64);
  if (r >= num_outputs) return;
  const RowLookup l = row_lookup(values, segments, seg_stride, meta, num_features, r);
  if (l.bad && lane == 0 && chk.claim != nullptr) report_bad_id(chk, segments, seg_stride, offsets, offsets64, l);
  const T* src = flat + l.key * dim;
  float* dst = out + r * dim;
  const int64_t chunks = dim / VEC;
#pragma unroll 4
  for (int64_t c = lane; c < chunks; c += lanes) {
    if constexpr (VEC == 4) {
      reinterpret_cast<float4*>(dst)[c] = Chunk<T, 4>::load(src + c * 4);
    } else {
      dst[c] = (float)src[c];
    }
  }
}

// keys[r] = row key of output row r; with grad_table (int64 [2, F]: each feature's start and
// stride), grad_rows[r] = start[f] + r * stride[f], where the eager backward finds its gradient.
template <typename V>
__global__ void __launch_bounds__(UNPOOLED_THREADS) unpooled_row_keys_kernel(
    const V* __restrict__ values, const __grid_constant__ HostWords host, TableSource tables, int64_t seg_stride,
    const int64_t* __restrict__ meta, int64_t num_features, int64_t* __restrict__ keys,
    int64_t* __restrict__ grad_rows, int64_t num_outputs, InputCheck chk, const void* offsets, bool offsets64) {
  __shared__ int64_t staged[HOST_WORDS];
  const int64_t* segments;
  const int64_t* grad_table;
  stage_tables(host, tables, staged, segments, grad_table);
  const int64_t r = (int64_t)blockIdx.x * UNPOOLED_THREADS + threadIdx.x;
  if (chk.claim != nullptr) check_lengths(chk, segments, seg_stride, num_features, offsets, offsets64);
  if (r >= num_outputs) return;
  const RowLookup l = row_lookup(values, segments, seg_stride, meta, num_features, r);
  if (l.bad && chk.claim != nullptr) report_bad_id(chk, segments, seg_stride, offsets, offsets64, l);
  keys[r] = l.key;
  if (grad_rows != nullptr) {
    grad_rows[r] = grad_table[l.feature] + r * grad_table[num_features + l.feature];
  }
}

void check_lookup_inputs(const at::Tensor& values, const at::Tensor& segments, const at::Tensor& meta,
                         int64_t num_outputs, const c10::optional<at::Tensor>& claim,
                         const c10::optional<at::Tensor>& report, const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK(values.is_cuda() && values.is_contiguous() &&
                  (values.scalar_type() == at::kLong || values.scalar_type() == at::kInt),
              "recom_rec cuda backend: the unpooled lookup takes contiguous int32 or int64 CUDA ids");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(0) == 4 &&
                  segments.is_contiguous() && segments.size(1) == meta.size(0) + 1 &&
                  (segments.is_cpu() || segments.device() == values.device()),
              "recom_rec cuda backend: the unpooled lookup takes int64 segments [4, F + 1], on the host or "
              "the ids' device");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.is_contiguous() && meta.dim() == 2 &&
                  meta.size(1) == UNPOOLED_META_W,
              "recom_rec cuda backend: the unpooled lookup takes int64 feature metadata [F, 7]");
  TORCH_CHECK(num_outputs >= 0 && num_outputs < (int64_t)INT32_MAX * UNPOOLED_THREADS,
              "recom_rec cuda backend: too many unpooled lookups");
  TORCH_CHECK(claim.has_value() == report.has_value() && (!claim.has_value() || offsets.has_value()),
              "recom_rec cuda backend: an input check takes its claim, its report and the KJT's offsets");
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->is_contiguous() && (offsets->scalar_type() == at::kLong || offsets->scalar_type() == at::kInt),
                "recom_rec cuda backend: the KJT's offsets must be contiguous int32 or int64");
  }
}

InputCheck input_check(const at::Tensor& values, const c10::optional<at::Tensor>& claim,
                       const c10::optional<at::Tensor>& report, const c10::optional<at::Tensor>& offsets) {
  return InputCheck{values.numel(), offsets.has_value() ? offsets->numel() - 1 : 0,
                    claim.has_value() ? claim->data_ptr<int32_t>() : nullptr,
                    report.has_value() ? report->data_ptr<int64_t>() : nullptr};
}

// Where the kernels read the tables: host tensors (CPU) in the parameters while they fit, else
// on the device (a host tensor copied there first, through pinned memory); `keep` holds copies made.
TableSource table_source(HostWords& host, const at::Tensor& segments, const c10::optional<at::Tensor>& grad,
                         const at::Device& device, std::vector<at::Tensor>& keep) {
  TableSource src{0, -1, -1, nullptr, nullptr};
  auto place = [&](const at::Tensor& t, int& at, const int64_t*& ptr) {
    if (t.is_cpu() && src.num_words + t.numel() <= HOST_WORDS) {
      std::copy(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel(), host.w + src.num_words);
      at = src.num_words;
      src.num_words += (int)t.numel();
    } else if (t.is_cpu()) {
      keep.push_back(t.pin_memory().to(device, /*non_blocking=*/true));
      ptr = keep.back().data_ptr<int64_t>();
    } else {
      ptr = t.data_ptr<int64_t>();
    }
  };
  place(segments, src.seg_at, src.segments);
  if (grad.has_value()) place(*grad, src.grad_at, src.grad);
  return src;
}

}  // namespace

at::Tensor unpooled_forward(const at::Tensor& flat, const at::Tensor& values, const at::Tensor& segments,
                            const at::Tensor& meta, int64_t num_outputs, int64_t dim,
                            const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& claim,
                            const c10::optional<at::Tensor>& report, const c10::optional<at::Tensor>& count) {
  c10::cuda::CUDAGuard guard(flat.device());
  check_lookup_inputs(values, segments, meta, num_outputs, claim, report, offsets);
  TORCH_CHECK(flat.is_cuda() && flat.is_contiguous() && dim > 0, "recom_rec cuda backend: a contiguous CUDA buffer");
  TORCH_CHECK(!count.has_value() || (count->is_cuda() && count->scalar_type() == at::kLong && count->numel() == 1 &&
                                     count->device() == flat.device()),
              "recom_rec cuda backend: the step counter is a one-element int64 tensor on the buffer's device");
  auto out = at::empty({num_outputs, dim}, flat.options().dtype(at::kFloat));
  const int64_t num_features = meta.size(0);
  if (num_outputs == 0 || num_features == 0) {
    if (count.has_value()) count_step(*count);  // (no block to count in)
    return out;
  }
  const int64_t elem_bytes = flat.element_size();
  // rows of 4 elements read at once where every row starts on such a chunk
  const bool vec = dim % 4 == 0 && reinterpret_cast<uintptr_t>(flat.data_ptr()) % (4 * elem_bytes) == 0;
  const int64_t chunks = vec ? dim / 4 : dim;
  int lanes_log2 = 0;
  while ((1 << lanes_log2) < chunks && lanes_log2 < 5) ++lanes_log2;
  const int64_t rows_a_block = UNPOOLED_THREADS >> lanes_log2;
  const int64_t blocks = (num_outputs + rows_a_block - 1) / rows_a_block;
  const InputCheck chk = input_check(values, claim, report, offsets);
  const void* offs = offsets.has_value() ? offsets->data_ptr() : nullptr;
  const bool offs64 = offsets.has_value() && offsets->scalar_type() == at::kLong;
  auto stream = c10::cuda::getCurrentCUDAStream();
  HostWords host;
  std::vector<at::Tensor> keep;
  const TableSource tables = table_source(host, segments, c10::nullopt, flat.device(), keep);
  auto launch = [&](auto t, auto v) {
    using T = decltype(t);
    using V = decltype(v);
    auto kernel = vec ? unpooled_forward_kernel<T, V, 4> : unpooled_forward_kernel<T, V, 1>;
    kernel<<<(unsigned)blocks, UNPOOLED_THREADS, 0, stream>>>(
        static_cast<const T*>(flat.data_ptr()), values.data_ptr<V>(), host, tables, segments.size(1),
        meta.data_ptr<int64_t>(), num_features, out.data_ptr<float>(), num_outputs, dim, lanes_log2, chk, offs, offs64,
        count.has_value() ? count->data_ptr<int64_t>() : nullptr);
  };
  auto by_ids = [&](auto t) {
    if (values.scalar_type() == at::kLong) launch(t, int64_t{}); else launch(t, int32_t{});
  };
  switch (flat.scalar_type()) {
    case at::kFloat: by_ids(float{}); break;
    case at::kHalf: by_ids(at::Half{}); break;
    case at::kBFloat16: by_ids(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "recom_rec cuda backend: the unpooled lookup reads fp32, fp16 or bf16 rows");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::vector<at::Tensor> unpooled_row_keys(const at::Tensor& values, const at::Tensor& segments,
                                          const at::Tensor& meta, int64_t num_outputs,
                                          const c10::optional<at::Tensor>& grad_table,
                                          const c10::optional<at::Tensor>& offsets,
                                          const c10::optional<at::Tensor>& claim,
                                          const c10::optional<at::Tensor>& report) {
  c10::cuda::CUDAGuard guard(values.device());
  check_lookup_inputs(values, segments, meta, num_outputs, claim, report, offsets);
  const int64_t num_features = meta.size(0);
  if (grad_table.has_value()) {
    TORCH_CHECK(grad_table->scalar_type() == at::kLong && grad_table->is_contiguous() &&
                    grad_table->numel() == 2 * num_features &&
                    (grad_table->is_cpu() || grad_table->device() == values.device()),
                "recom_rec cuda backend: the gradient rows' table is int64 [2, F], on the host or the ids' device");
  }
  auto keys = at::empty({num_outputs}, values.options().dtype(at::kLong));
  auto grad_rows = grad_table.has_value() ? at::empty_like(keys) : at::Tensor();
  std::vector<at::Tensor> result{keys};
  if (grad_table.has_value()) result.push_back(grad_rows);
  if (num_outputs == 0 || num_features == 0) return result;
  const InputCheck chk = input_check(values, claim, report, offsets);
  const void* offs = offsets.has_value() ? offsets->data_ptr() : nullptr;
  const bool offs64 = offsets.has_value() && offsets->scalar_type() == at::kLong;
  const unsigned blocks = (unsigned)((num_outputs + UNPOOLED_THREADS - 1) / UNPOOLED_THREADS);
  auto stream = c10::cuda::getCurrentCUDAStream();
  HostWords host;
  std::vector<at::Tensor> keep;
  const TableSource tables = table_source(host, segments, grad_table, values.device(), keep);
  int64_t* rows = grad_table.has_value() ? grad_rows.data_ptr<int64_t>() : nullptr;
  auto launch = [&](auto v) {
    using V = decltype(v);
    unpooled_row_keys_kernel<V><<<blocks, UNPOOLED_THREADS, 0, stream>>>(
        values.data_ptr<V>(), host, tables, segments.size(1), meta.data_ptr<int64_t>(), num_features,
        keys.data_ptr<int64_t>(), rows, num_outputs, chk, offs, offs64);
  };
  if (values.scalar_type() == at::kLong) launch(int64_t{}); else launch(int32_t{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return result;
}
