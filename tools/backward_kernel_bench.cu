// The CUDA backward alone (csrc/lookup/kernels.cuh, without torch) on the sweep's synthetic
// layouts: the plan (expand, CUB sort, plan kernel) as plan_backward runs it, then the piece,
// split-row and long-row kernels as piece_update launches them, timed apart with CUDA events.
// Built by tools/backward_kernel_variants.py, which compiles source variants (launch bounds,
// rewrites, an older revision) and runs each on the same layouts: variants compare minutes apart
// on one machine without a torch extension build (~5 min) per variant.
//   backward_kernel_bench T ROWS DIM BATCH IDS ZIPF(0|1) OPT(0 SGD|2 row-wise Adagrad) [ITERS]
// Before timing, one update from zero weights with a gradient of ones is checked: SGD leaves
// -lr x (the row's lookups) in every element, row-wise Adagrad -lr x c / (c + eps) (c the same
// count: its mean square is c^2), so a variant that drops or doubles a lookup fails here.
#define RECOM_REC_KERNELS_ONLY
#ifndef PIECE_LANES  // a variant's lanes a piece (see main)
#define PIECE_LANES 0
#endif
#include KERNEL_SOURCE
#include "synthetic_layout.h"

namespace {

struct Plan {
  int32_t *row_key, *index, *sorted_key, *order, *counts;
  int64_t *pieces, *split_rows, *long_rows;
  float* bag_scale;
  void* temp;
  size_t temp_bytes;
  int bits;
};

Plan make_plan(int64_t n, int64_t features, int64_t batch, int64_t row_count) {
  Plan p{};
  CHECK(cudaMalloc(&p.row_key, sizeof(int32_t) * n));
  CHECK(cudaMalloc(&p.index, sizeof(int32_t) * n));
  CHECK(cudaMalloc(&p.sorted_key, sizeof(int32_t) * n));
  CHECK(cudaMalloc(&p.order, sizeof(int32_t) * n));
  CHECK(cudaMalloc(&p.counts, sizeof(int32_t) * 3));
  CHECK(cudaMalloc(&p.pieces, sizeof(int64_t) * n));
  CHECK(cudaMalloc(&p.split_rows, sizeof(int64_t) * (n / (PIECE + 1) + 1)));
  // (room for the most slices any lane shape makes: piece_update sizes it for its own)
  CHECK(cudaMalloc(&p.long_rows, sizeof(int64_t) * long_row_space(n, 8, 32).words()));
  CHECK(cudaMalloc(&p.bag_scale, sizeof(float) * features * batch));
  p.bits = 1;
  while ((int64_t(1) << p.bits) < row_count) ++p.bits;  // recom_rec's max(1, (rows - 1).bit_length())
  auto keys = reinterpret_cast<uint32_t*>(p.row_key);
  CHECK(cub::DeviceRadixSort::SortPairs(nullptr, p.temp_bytes, keys, reinterpret_cast<uint32_t*>(p.sorted_key),
                                        p.index, p.order, (int)n, 0, p.bits));
  CHECK(cudaMalloc(&p.temp, p.temp_bytes));
  return p;
}

// plan_backward's launches (packed payloads: no sample weights, keys in 32 bits).
void run_plan(Plan& p, const int64_t* values, const int64_t* offsets, const int64_t* meta, const int64_t* key_index,
              int64_t features, int64_t batch, int64_t total_dim, int64_t n) {
  CHECK(cudaMemsetAsync(p.counts, 0, sizeof(int32_t) * 3));
  const int block_bags = expand_bags(n, features, batch);
  const dim3 grid((unsigned)features, (unsigned)((batch + block_bags - 1) / block_bags));
  expand_kernel<int64_t, int32_t, true><<<grid, EXPAND_THREADS>>>(values, offsets, nullptr, meta, key_index, nullptr,
                                                       p.row_key, nullptr, nullptr, nullptr, p.index, p.bag_scale,
                                                       batch, total_dim, block_bags
#ifdef RECOM_REC_INPUT_CHECK
                                                       , n, features * batch, n
#endif
                                                       );
  CHECK(cub::DeviceRadixSort::SortPairs(p.temp, p.temp_bytes, reinterpret_cast<uint32_t*>(p.row_key),
                                        reinterpret_cast<uint32_t*>(p.sorted_key), p.index, p.order, (int)n, 0,
                                        p.bits));
  plan_kernel<int32_t><<<(unsigned)((n + PLAN_BLOCK - 1) / PLAN_BLOCK), PLAN_THREADS>>>(
      p.sorted_key, n, p.pieces, p.split_rows, p.counts, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) { std::fprintf(stderr, "usage: T ROWS DIM BATCH IDS ZIPF OPT [ITERS]\n"); return 2; }
  const int64_t T = atoll(argv[1]), rows = atoll(argv[2]), D = atoll(argv[3]), B = atoll(argv[4]);
  const int ids = atoi(argv[5]), opt = atoi(argv[7]);
  const bool zipf = atoi(argv[6]);
  const int iters = argc > 8 ? atoi(argv[8]) : 20;
  if (opt != 0 && opt != 2) { std::fprintf(stderr, "OPT: 0 (SGD) or 2 (row-wise Adagrad)\n"); return 2; }
  const SyntheticLayout lay = synthetic_layout(T, rows, D, B, ids, zipf, META_W);
  // The gradient's features at multiples of 4 columns, as the product pads them where a dim is off
  // a multiple of 4 (ops/gradient_layout.py): its rows read 16 bytes at a time, the weights' rows
  // (D a row) at any alignment.
  const int64_t grad_dim = (D + 3) / 4 * 4;
  std::vector<int64_t> meta = lay.meta;
  for (int64_t t = 0; t < T; ++t) meta[t * META_W + 2] = t * grad_dim;
  const int64_t n = lay.lookups(), total_dim = T * grad_dim, row_count = T * rows;
  int64_t *dv = to_device(lay.values), *doff = to_device(lay.offsets), *dmeta = to_device(meta),
          *dkey = to_device(lay.key_index);
  float* grad = to_device(std::vector<float>(B * total_dim, 1.f));
  float *weights, *state;
  CHECK(cudaMalloc(&weights, sizeof(float) * row_count * D));
  CHECK(cudaMalloc(&state, sizeof(float) * row_count));
  const float lr = 0.01f, eps = 1e-8f;
  float* hyper = to_device(std::vector<float>{lr, eps, 0.f, 0.f, 0.f, 0.f});
  Plan plan = make_plan(n, T, B, row_count);

  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // piece_update's shape: lanes sized by the widest row (PIECE_LANES 0, the product's), or (-1) the
  // fewest lanes that hold the row in four float4 each (its `lanes` argument): more pieces a warp.
  const int64_t lanes = PIECE_LANES >= 0 ? PIECE_LANES : D > 16 * 32 ? 0 : fewest_piece_lanes(D);
  const PieceShape shape = piece_shape(D, lanes, sms), rows_shape = piece_shape(D, 0, sms);  // as piece_update
  const int V = shape.V, VR = rows_shape.V;
  const int64_t block_d = std::max<int64_t>(16, int64_t(1) << (int)std::ceil(std::log2((double)D)));
  float* partials;
  CHECK(cudaMalloc(&partials, sizeof(float) * 2 * ((n - 1) / PIECE + 1) * block_d));
  const Payload pay = make_payload((int32_t)B, true, total_dim, dmeta, plan.bag_scale, nullptr, nullptr, nullptr);
  const LongRowSpace space = long_row_space(n, 8, 32);  // as make_plan allocated it
  const PieceArgs args{plan.pieces, plan.split_rows, space.rows(plan.long_rows), plan.counts, n, partials, block_d,
                       opt == 2 ? state : nullptr, nullptr, hyper, nullptr, dmeta, shape.G};
  PieceArgs row_args = args;
  row_args.G = rows_shape.G;
  row_args.long_counts = space.counts(plan.long_rows);
  row_args.slice_rows = space.slices(plan.long_rows);
  const int64_t most_long = space.most_long, most_slices = long_row_space(n, VR, rows_shape.G).most_slices;
  const void* piece_fn = nullptr;  // the piece kernel launched (its registers and occupancy are printed)
  auto pieces = [&](auto opt_c, auto v_c) {
    constexpr int OPT = decltype(opt_c)::value, VV = decltype(v_c)::value;
    piece_fn = (const void*)piece_kernel<float, int32_t, OPT, VV>;
    if (most_long > 0) CHECK(cudaMemsetAsync(plan.long_rows, 0, sizeof(int64_t)));
    const size_t ring = piece_ring_bytes(VV, shape.G);  // as piece_update
    if (ring > 48 * 1024)
      CHECK(cudaFuncSetAttribute(piece_kernel<float, int32_t, OPT, VV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)ring));
    piece_kernel<float, int32_t, OPT, VV><<<shape.grid(n), PIECE_THREADS, ring>>>(plan.sorted_key, plan.order, pay,
                                                                                  grad, args, weights);
  };
  auto split_rows = [&](auto opt_c, auto v_c) {  // at the widest row's lanes, as piece_update
    constexpr int OPT = decltype(opt_c)::value, VV = decltype(v_c)::value;
    split_row_kernel<float, int32_t, OPT, VV><<<rows_shape.grid(n / (PIECE + 1) + 1), PIECE_THREADS>>>(
        plan.sorted_key, plan.order, pay, row_args, weights);
    if (most_long > 0)
      long_row_kernel<float, int32_t, OPT, VV><<<rows_shape.long_grid(most_slices), PIECE_THREADS>>>(
          plan.sorted_key, plan.order, pay, row_args, weights);
  };
  auto by_v = [](int v, auto launch, auto opt_c) {  // V = 2: a variant's (the product has 1, 4, 8)
    if (v == 1) launch(opt_c, std::integral_constant<int, 1>{});
    else if (v == 2) launch(opt_c, std::integral_constant<int, 2>{});
    else if (v == 4) launch(opt_c, std::integral_constant<int, 4>{});
    else launch(opt_c, std::integral_constant<int, 8>{});
  };
  auto update = [&] {
    if (opt == 0) {
      by_v(V, pieces, std::integral_constant<int, 0>{});
      by_v(VR, split_rows, std::integral_constant<int, 0>{});
    } else {
      by_v(V, pieces, std::integral_constant<int, 2>{});
      by_v(VR, split_rows, std::integral_constant<int, 2>{});
    }
  };

  // The check: one update from zero weights and states.
  CHECK(cudaMemset(weights, 0, sizeof(float) * row_count * D));
  CHECK(cudaMemset(state, 0, sizeof(float) * row_count));
  run_plan(plan, dv, doff, dmeta, dkey, T, B, total_dim, n);
  update();
  CHECK(cudaGetLastError());
  std::vector<float> got(row_count * D);
  CHECK(cudaMemcpy(got.data(), weights, sizeof(float) * got.size(), cudaMemcpyDeviceToHost));
  std::vector<int64_t> count(row_count, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = lay.offsets[t * B]; i < lay.offsets[(t + 1) * B]; ++i) ++count[t * rows + lay.values[i]];
  double worst = 0;
  for (int64_t r = 0; r < row_count; ++r) {
    const float c = (float)count[r];
    const float want = opt == 0 ? -lr * c : (c > 0 ? -lr * c / (std::sqrt(c * c) + eps) : 0.f);
    for (int64_t d = 0; d < D; ++d) worst = std::max(worst, (double)std::fabs(got[r * D + d] - want));
  }
  if (worst > 1e-6) {
    std::printf("T=%lld rows=%lld D=%lld B=%lld ids=%d zipf=%d opt=%d: WRONG update, max error %.3g\n", (long long)T,
                (long long)rows, (long long)D, (long long)B, ids, (int)zipf, opt, worst);
    return 1;
  }

  cudaEvent_t a, b, c;
  CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b)); CHECK(cudaEventCreate(&c));
  double plan_ms = 0, update_ms = 0;
  for (int i = 0; i < iters + 2; ++i) {  // the first two warm up
    CHECK(cudaEventRecord(a));
    run_plan(plan, dv, doff, dmeta, dkey, T, B, total_dim, n);
    CHECK(cudaEventRecord(b));
    update();
    CHECK(cudaEventRecord(c));
    CHECK(cudaEventSynchronize(c));
    if (i >= 2) plan_ms += elapsed_ms(a, b), update_ms += elapsed_ms(b, c);
  }
  plan_ms /= iters;
  update_ms /= iters;
  // Bytes of the update at its floor: each touched row read and written once (row-wise: its state
  // too), each lookup's gradient row read once.
  int64_t touched = 0;
  for (int64_t r = 0; r < row_count; ++r) touched += count[r] > 0;
  const double bytes = (double)touched * D * 4 * 2 + (double)n * D * 4 + (opt == 2 ? touched * 8.0 : 0.0);
  const double ceiling = copy_gbs();
  const Occupancy occ = occupancy(piece_fn, PIECE_THREADS);
  std::printf("T=%lld rows=%lld D=%lld B=%lld ids=%d zipf=%d opt=%d: plan %.4f ms, update %.4f ms "
              "(%.2f of copy at %.0f GB/s); piece kernel %d regs, %d blocks/SM; update checked (max error %.2g)\n",
              (long long)T, (long long)rows, (long long)D, (long long)B, ids, (int)zipf, opt, plan_ms, update_ms,
              bytes / (update_ms * 1e6) / ceiling, ceiling, occ.registers, occ.blocks_per_sm, worst);
  return 0;
}
