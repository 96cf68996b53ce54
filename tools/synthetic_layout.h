// The sweep's synthetic table layouts on the host, for the kernel benches built without torch
// (tools/forward_kernel_bench.cu, tools/backward_kernel_bench.cu): T tables of `rows` rows of dim
// D, one feature each, batch B; IDS = 1: exactly one id a bag, else ragged lengths uniform in
// [0, 2 * IDS]; uniform ids or Zipf(1.1) with the hot ranks scattered by a multiplicative hash
// (recom_rec/bench/sweep.py's make_kjt draws the same kinds of layout).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)

struct SyntheticLayout {
  int64_t T, rows, D, B;
  std::vector<int64_t> offsets, values;
  std::vector<int64_t> meta, key_index;  // META_W int64 a feature (the kernels' feature_meta)
  int64_t lookups() const { return offsets.back(); }
  int64_t total_dim() const { return T * D; }
};

inline SyntheticLayout synthetic_layout(int64_t T, int64_t rows, int64_t D, int64_t B, int ids, bool zipf,
                                        int meta_width) {
  SyntheticLayout s{T, rows, D, B, std::vector<int64_t>(T * B + 1, 0), {}, std::vector<int64_t>(T * meta_width),
                    std::vector<int64_t>(T)};
  std::mt19937_64 rng(0);
  std::uniform_int_distribution<int> len(0, 2 * ids);
  for (int64_t i = 0; i < T * B; ++i) s.offsets[i + 1] = s.offsets[i] + (ids == 1 ? 1 : len(rng));
  const int64_t n = s.offsets.back();
  s.values.resize(n);
  std::vector<double> cdf;
  if (zipf) {
    cdf.resize(rows);
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) cdf[r] = (sum += std::pow((double)(r + 1), -1.1));
    for (auto& c : cdf) c /= sum;
  }
  std::uniform_real_distribution<double> u01(0, 1);
  std::uniform_int_distribution<int64_t> row(0, rows - 1);
  for (int64_t i = 0; i < n; ++i) {
    if (zipf) {
      const int64_t r = std::lower_bound(cdf.begin(), cdf.end(), u01(rng)) - cdf.begin();
      s.values[i] = (int64_t)(((unsigned long long)std::min<int64_t>(r, rows - 1) * 2654435761ull) % rows);
    } else {
      s.values[i] = row(rng);
    }
  }
  // meta rows: dim, element base, output column, pooling (0 sum), rows, row base, table
  for (int64_t t = 0; t < T; ++t) {
    int64_t* m = &s.meta[t * meta_width];
    m[0] = D; m[1] = t * rows * D; m[2] = t * D; m[3] = 0; m[4] = rows; m[5] = t * rows; m[6] = t;
    s.key_index[t] = t;
  }
  return s;
}

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* dev;
  CHECK(cudaMalloc(&dev, sizeof(T) * std::max<size_t>(1, host.size())));
  CHECK(cudaMemcpy(dev, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice));
  return dev;
}

inline float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

// A kernel's registers and resident blocks an SM at `threads` a block (what the benches print).
struct Occupancy {
  int registers, blocks_per_sm;
};
inline Occupancy occupancy(const void* kernel, int threads) {
  cudaFuncAttributes attr;
  CHECK(cudaFuncGetAttributes(&attr, kernel));
  int blocks = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  return {attr.numRegs, blocks};
}

// The device-to-device copy rate (bytes read + written, GB/s) of a 1 GiB copy: the gather's ceiling.
inline double copy_gbs() {
  const size_t cb = size_t(1) << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, cb));
  CHECK(cudaMalloc(&dst, cb));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaMemcpy(dst, src, cb, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < 10; ++i) CHECK(cudaMemcpy(dst, src, cb, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  return 2.0 * cb * 10 / (elapsed_ms(a, b) * 1e6);
}
