// The CUDA forward kernel alone (csrc/lookup/kernels.cuh, without torch), on synthetic shapes:
// the sweep's table layouts, timed with CUDA events, with the device-to-device copy rate as the
// ceiling. Built by tools/forward_kernel_variants.py, which compiles source variants of the kernel
// (launch bounds, rewrites) and runs each on the same shapes, so variants compare in one process
// tree, minutes after each other, without a torch extension build (~6 min) per variant.
//   forward_kernel_bench T ROWS DIM BATCH IDS ZIPF(0|1) BAG_MAJOR(0|1) [ITERS]
// IDS = 1: exactly one id a bag; else ragged lengths uniform in [0, 2 * IDS].
#define RECOM_REC_KERNELS_ONLY
#include KERNEL_SOURCE
#include "synthetic_layout.h"

int main(int argc, char** argv) {
  if (argc < 8) { std::fprintf(stderr, "usage: T ROWS DIM BATCH IDS ZIPF BAG_MAJOR [ITERS]\n"); return 2; }
  const int64_t T = atoll(argv[1]), rows = atoll(argv[2]), D = atoll(argv[3]), B = atoll(argv[4]);
  const int ids = atoi(argv[5]); const bool zipf = atoi(argv[6]), bag_major = atoi(argv[7]);
  const int iters = argc > 8 ? atoi(argv[8]) : 50;
  const SyntheticLayout lay = synthetic_layout(T, rows, D, B, ids, zipf, META_W);
  const int64_t n = lay.lookups(), total_dim = lay.total_dim();
  float *flat, *out;
  const int64_t flat_numel = T * rows * D;
  CHECK(cudaMalloc(&flat, sizeof(float) * flat_numel));
  CHECK(cudaMalloc(&out, sizeof(float) * B * total_dim));
  CHECK(cudaMemset(flat, 0, sizeof(float) * flat_numel));
  int64_t *dv = to_device(lay.values), *doff = to_device(lay.offsets), *dmeta = to_device(lay.meta),
          *dkey = to_device(lay.key_index);

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
#ifdef RECOM_REC_INPUT_CHECK  // kernels that check ids: reporting as the product does, unless FORWARD_NO_REPORT
  int32_t* claim = nullptr;
  int64_t* report = nullptr;
#ifndef FORWARD_NO_REPORT
  CHECK(cudaMalloc(&claim, sizeof(int32_t)));
  CHECK(cudaMemset(claim, 0, sizeof(int32_t)));
  CHECK(cudaHostAlloc(&report, 8 * sizeof(int64_t), cudaHostAllocMapped));
#endif
  const InputCheck chk{n, T * B, claim, report};
  auto launch = [&] {
#if defined(RECOM_REC_FORWARD_FLAT_NUMEL)  // kernels of v55-v57, which took the buffer's length
    kernel<<<shape.grid, FORWARD_THREADS>>>(flat, dv, doff, nullptr, dmeta, dkey, out, B, total_dim, bag_major,
                                            shape.round_bag_blocks, shape.items, chk, flat_numel);
#elif defined(RECOM_REC_FORWARD_ROUNDS)
    kernel<<<shape.grid, FORWARD_THREADS>>>(flat, dv, doff, nullptr, dmeta, dkey, out, B, total_dim, bag_major,
                                            shape.round_bag_blocks, shape.items, chk);
#else
    kernel<<<shape.grid, FORWARD_THREADS>>>(flat, dv, doff, nullptr, dmeta, dkey, out, B, total_dim, bag_major, chk);
#endif
  };
#else
  auto launch = [&] {
    kernel<<<shape.grid, FORWARD_THREADS>>>(flat, dv, doff, nullptr, dmeta, dkey, out, B, total_dim, bag_major);
  };
#endif
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) launch();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  const double ms = elapsed_ms(a, b) / iters;
  const double bytes = (double)n * D * 4 + (double)B * total_dim * 4;
  const double ceiling = copy_gbs();

  const Occupancy occ = occupancy((const void*)kernel, FORWARD_THREADS);
  std::printf("T=%lld rows=%lld D=%lld B=%lld ids=%d zipf=%d bag_major=%d: %.4f ms, %.0f GB/s, %.2f of copy (%.0f GB/s); "
              "%d regs, %d blocks/SM\n", (long long)T, (long long)rows, (long long)D, (long long)B, ids, (int)zipf,
              (int)bag_major, ms, bytes / (ms * 1e6), bytes / (ms * 1e6) / ceiling, ceiling, occ.registers, occ.blocks_per_sm);
  return 0;
}
