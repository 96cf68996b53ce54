// The CUDA forward kernel alone (csrc/lookup/pooled_cuda.cu, without torch), on synthetic shapes:
// the sweep's table layouts, timed with CUDA events, with the device-to-device copy rate as the
// ceiling. Built by tools/forward_kernel_variants.py, which compiles source variants of the kernel
// (launch bounds, rewrites) and runs each on the same shapes, so variants compare in one process
// tree, minutes after each other, without a torch extension build (~6 min) per variant.
//   forward_kernel_bench T ROWS DIM BATCH IDS ZIPF(0|1) BAG_MAJOR(0|1) [ITERS]
// IDS = 1: exactly one id a bag; else ragged lengths uniform in [0, 2 * IDS].
#define RECOM_REC_KERNELS_ONLY
#include KERNEL_SOURCE
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)

static float time_ms(cudaEvent_t a, cudaEvent_t b) { float ms; CHECK(cudaEventElapsedTime(&ms, a, b)); return ms; }

int main(int argc, char** argv) {
  if (argc < 8) { std::fprintf(stderr, "usage: T ROWS DIM BATCH IDS ZIPF BAG_MAJOR [ITERS]\n"); return 2; }
  const int64_t T = atoll(argv[1]), rows = atoll(argv[2]), D = atoll(argv[3]), B = atoll(argv[4]);
  const int ids = atoi(argv[5]); const bool zipf = atoi(argv[6]), bag_major = atoi(argv[7]);
  const int iters = argc > 8 ? atoi(argv[8]) : 50;
  std::mt19937_64 rng(0);
  std::vector<int64_t> offsets(T * B + 1, 0);
  std::uniform_int_distribution<int> len(0, 2 * ids);
  for (int64_t i = 0; i < T * B; ++i) offsets[i + 1] = offsets[i] + (ids == 1 ? 1 : len(rng));
  const int64_t n = offsets.back();
  std::vector<int64_t> values(n);
  std::vector<double> cdf;
  if (zipf) {  // Zipf(1.1) over the rows, hot ranks scattered by a multiplicative hash (as the sweep)
    cdf.resize(rows);
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) cdf[r] = (s += std::pow((double)(r + 1), -1.1));
    for (auto& c : cdf) c /= s;
  }
  std::uniform_real_distribution<double> u01(0, 1);
  std::uniform_int_distribution<int64_t> row(0, rows - 1);
  for (int64_t i = 0; i < n; ++i) {
    if (zipf) {
      const int64_t r = std::lower_bound(cdf.begin(), cdf.end(), u01(rng)) - cdf.begin();
      values[i] = (int64_t)(((unsigned long long)std::min<int64_t>(r, rows - 1) * 2654435761ull) % rows);
    } else {
      values[i] = row(rng);
    }
  }
  // meta rows: dim, element base, output column, pooling (0 sum), rows, row base, table
  std::vector<int64_t> meta(T * META_W), key_index(T);
  for (int64_t t = 0; t < T; ++t) {
    int64_t* m = &meta[t * META_W];
    m[0] = D; m[1] = t * rows * D; m[2] = t * D; m[3] = 0; m[4] = rows; m[5] = t * rows; m[6] = t;
    key_index[t] = t;
  }
  const int64_t total_dim = T * D;
  float *flat, *out; int64_t *dv, *doff, *dmeta, *dkey;
  CHECK(cudaMalloc(&flat, sizeof(float) * T * rows * D));
  CHECK(cudaMalloc(&out, sizeof(float) * B * total_dim));
  CHECK(cudaMalloc(&dv, sizeof(int64_t) * n));
  CHECK(cudaMalloc(&doff, sizeof(int64_t) * offsets.size()));
  CHECK(cudaMalloc(&dmeta, sizeof(int64_t) * meta.size()));
  CHECK(cudaMalloc(&dkey, sizeof(int64_t) * T));
  CHECK(cudaMemset(flat, 0, sizeof(float) * T * rows * D));
  CHECK(cudaMemcpy(dv, values.data(), sizeof(int64_t) * n, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(doff, offsets.data(), sizeof(int64_t) * offsets.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dmeta, meta.data(), sizeof(int64_t) * meta.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dkey, key_index.data(), sizeof(int64_t) * T, cudaMemcpyHostToDevice));

  const ForwardShape shape = forward_shape(T, B, D, bag_major);  // the product's (pooled_forward's)
#ifndef FORWARD_ROWS
#define FORWARD_ROWS 8  // rows in flight a lane on the one-chunk path (4: the tuner's other launch)
#endif
#ifdef FORWARD_MAXV  // one kernel for every dim (the product before v17 held every path)
  auto kernel = pooled_forward_kernel<float, int64_t, FORWARD_MAXV, 8>;
#else  // the product's choice: the most chunks a lane of the widest feature holds
  auto kernel = shape.lane_chunks <= 1 ? pooled_forward_kernel<float, int64_t, 1, FORWARD_ROWS>
              : shape.lane_chunks == 2 ? pooled_forward_kernel<float, int64_t, 2, 8>
                                       : pooled_forward_kernel<float, int64_t, 4, 8>;
#endif
  auto launch = [&] {
    kernel<<<shape.grid, FORWARD_THREADS>>>(flat, dv, doff, nullptr, dmeta, dkey, out, B, total_dim, bag_major);
  };
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) launch();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  const double ms = time_ms(a, b) / iters;
  const double bytes = (double)n * D * 4 + (double)B * total_dim * 4;

  // Ceiling: a 1 GiB device-to-device copy, bytes read + written.
  const size_t cb = size_t(1) << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, cb)); CHECK(cudaMalloc(&dst, cb));
  CHECK(cudaMemcpy(dst, src, cb, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < 10; ++i) CHECK(cudaMemcpy(dst, src, cb, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  const double copy_gbs = 2.0 * cb * 10 / (time_ms(a, b) * 1e6);

  cudaFuncAttributes attr;
  CHECK(cudaFuncGetAttributes(&attr, kernel));
  int blocks_per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, FORWARD_THREADS, 0));
  std::printf("T=%lld rows=%lld D=%lld B=%lld ids=%d zipf=%d bag_major=%d: %.4f ms, %.0f GB/s, %.2f of copy (%.0f GB/s); "
              "%d regs, %d blocks/SM\n", (long long)T, (long long)rows, (long long)D, (long long)B, ids, (int)zipf,
              (int)bag_major, ms, bytes / (ms * 1e6), bytes / (ms * 1e6) / copy_gbs, copy_gbs, attr.numRegs, blocks_per_sm);
  return 0;
}
