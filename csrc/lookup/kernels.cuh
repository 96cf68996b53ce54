#pragma once
// Fused pooled embedding lookups in CUDA C++ (backend="cuda"), the device code: the forward, and
// the backward with the optimizer fused in. The host entry points that launch these kernels are in
// forward.cu, plan.cu and backward.cu (one translation unit per optimizer: backward_*.cu, so that
// nvcc compiles them in parallel); every kernel here has internal linkage, each unit its own copy. Same contract as recom_rec/kernels/pooled_triton.py: one flat weight
// buffer per group, `feature_meta` rows of META_W int64 (dim, element base, output column,
// pooling, rows, row base, table), a KJT's values/offsets. The backward's plan (sorted row keys,
// pieces of at most PIECE lookups, split rows) cuts rows as the Triton backend does, in one host
// call here: expand and plan kernels, and a CUB radix sort of only the key bits the group's rows
// need, carrying a 32-bit payload (the lookup's feature and bag, or its index with sample weights).
//
// Why a second implementation: Triton runs the lanes of a program in lock-step over a fixed
// [bags x BLOCK_D] tile, so a dim-8 table in a launch whose widest table is 128 wastes 15/16 of its
// lanes, and the backward's dependent loads (piece -> key -> order -> source -> gradient row) are
// serialised per program. Here the forward gives each bag a group of lanes sized by its own
// table's dim at run time; the backward gives each piece a group sized by the group's widest dim,
// computes its lookups' gradient rows from the sort's payload, and keeps four lookups' loads in
// flight, with 16-byte accesses where the addresses allow.
#ifndef RECOM_REC_KERNELS_ONLY  // defined by tests that compile the kernels without torch's headers
#include <ATen/ATen.h>  // not torch/extension.h: its autograd and Python headers took ~55 s of nvcc a unit
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "input_check.cuh"

namespace {

constexpr int META_W = 7;
constexpr int PIECE = 32;      // must equal pooled_triton.PIECE (the plan's piece length)

// ---- element access: fp32 / fp16 / bf16 weights, always fp32 arithmetic --------------------
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float4 load4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
template <typename T>
__device__ __forceinline__ float4 load4(const T* p) {
  // Two-byte types: one 8-byte load.
  uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  const T* h = reinterpret_cast<const T*>(&u);
  return make_float4(to_f(h[0]), to_f(h[1]), to_f(h[2]), to_f(h[3]));
}
// Loads of rows the same kernel writes (the optimizer's weights and states): no read-only cache.
__device__ __forceinline__ float4 load4_rw(const float* p) { return *reinterpret_cast<const float4*>(p); }
template <typename T>
__device__ __forceinline__ float4 load4_rw(const T* p) {
  uint2 u = *reinterpret_cast<const uint2*>(p);
  const T* h = reinterpret_cast<const T*>(&u);
  return make_float4(to_f(h[0]), to_f(h[1]), to_f(h[2]), to_f(h[3]));
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
template <typename T>
__device__ __forceinline__ void store4(T* p, float4 v) {
  uint2 u;
  T* h = reinterpret_cast<T*>(&u);
  h[0] = from_f<T>(v.x); h[1] = from_f<T>(v.y); h[2] = from_f<T>(v.z); h[3] = from_f<T>(v.w);
  *reinterpret_cast<uint2*>(p) = u;
}
// The backward's row loads and stores, evict-first in L2 (float rows: ld/st.global.cs): a launch
// reads and writes each weight row about once, while the gradient rows are read by every lookup
// of their bag; hinting the rows out first keeps the gradients' lines (v70: 2-4% of the update at
// rows of 256-512 columns, level at 64-128). Two-byte rows load and store as before.
__device__ __forceinline__ float4 load4_streaming(const float* p) { return __ldcs(reinterpret_cast<const float4*>(p)); }
template <typename T>
__device__ __forceinline__ float4 load4_streaming(const T* p) { return load4_rw(p); }
__device__ __forceinline__ void store4_streaming(float* p, float4 v) { __stcs(reinterpret_cast<float4*>(p), v); }
template <typename T>
__device__ __forceinline__ void store4_streaming(T* p, float4 v) { store4(p, v); }
// Component e of v (e known at compile time once unrolled: no local memory).
__device__ __forceinline__ float& comp(float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}
__device__ __forceinline__ float4 fma4(float4 g, float s, float4 acc) {
  return make_float4(acc.x + g.x * s, acc.y + g.y * s, acc.z + g.z * s, acc.w + g.w * s);
}

// 16-byte copies global -> shared that take no registers while in flight (cp.async, sm_80+; .cg:
// through L2 only), in commit groups a thread waits for: its own copies only, so a lane that
// reads back only what it copied needs no barrier.
__device__ __forceinline__ void copy16_async(float4* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Lanes per bag or piece: enough chunks for the dim, a power of two, at most a warp.
__host__ __device__ __forceinline__ int group_lanes(int chunks) {
  int g = 1;
  while (g < chunks && g < 32) g <<= 1;
  return g;
}

// The fewest lanes a piece of a row `dim` wide takes at four 16-byte chunks a lane: the lane class
// of the "lanes by width" paths (class c: 1 << c lanes), in the partition kernel and its launch.
__host__ __device__ __forceinline__ int fewest_piece_lanes(int64_t dim) { return group_lanes((int)((dim + 15) / 16)); }
// A piece's lane class: c < WIDE_PIECE_CLASS takes 1 << c lanes at four float4 a lane (rows of up
// to 512 columns); WIDE_PIECE_CLASS the wider rows, at eight float4 on 32 lanes, the widest shape.
constexpr int WIDE_PIECE_CLASS = 6;
__host__ __device__ __forceinline__ int piece_lane_class(int64_t dim) {
  if (dim > 16 * 32) return WIDE_PIECE_CLASS;
  int c = 0;
  for (int g = fewest_piece_lanes(dim); g > 1; g >>= 1) ++c;
  return c;
}

// ---- the input check: input_check.cuh ------------------------------------------------------
#define RECOM_REC_INPUT_CHECK 1  // tools/*_kernel_bench.cu: the kernels take an InputCheck
#define RECOM_REC_FORWARD_ROUNDS 1  // tools/forward_kernel_bench.cu: the forward takes round_bag_blocks, items

// An id clamped into its table; with TRACK, `bad` notes that it was not. The bag is searched for
// the id to report after the loops (report_bad_ids). Rows of one 16-byte chunk a lane carry the
// flag through their loop (no spills there); wider rows do not: the flag spilled in their paths
// (up to 6% slower), and a second read of the bag's ids by all of the group's lanes costs them
// less (0-2.5%), while at narrow rows with long bags (1-4 lanes a bag) it cost up to 2x (v24).
template <bool TRACK, typename I>
__device__ __forceinline__ int64_t checked_id(const I* __restrict__ values, int64_t i, int64_t rows, bool& bad) {
  const int64_t id = (int64_t)values[i];
  const bool ok = (uint64_t)id < (uint64_t)rows;
  if (TRACK) bad |= !ok;
  return ok ? id : 0;
}

// The bag's ids again (read just before: cache hits), lane `sl` of `stride` taking every stride-th,
// reporting one outside the table.
template <typename I>
__device__ __forceinline__ void report_bad_ids(const InputCheck& c, const I* __restrict__ values, int64_t start,
                                               int64_t end, int sl, int stride, int64_t rows, int64_t feature,
                                               int64_t bag) {
  for (int64_t i = start + sl; i < end; i += stride) {
    const int64_t id = (int64_t)values[i];
    if ((uint64_t)id >= (uint64_t)rows) {
      report_bad(c, REPORT_ID, feature, bag, id, rows);
      return;
    }
  }
}

// ---- forward ---------------------------------------------------------------------------------
// One bag's sum over chunks c0, c0 + G, ... (V of them, those below `chunks`) of 16-byte columns,
// U rows a step: V * U loads in flight a lane. Rows are added in input order (bit-identical to the
// one-chunk loop, to the scalar layout's and to the Triton kernel in fp32). `table` is 16-byte
// aligned: the table's start, or `shift` elements before it, so that chunk c holds columns 4c -
// shift .. 4c + 3 - shift (those outside [0, dim) are read, summed and not stored). The sums are
// stored 16 bytes at a time where the feature's output columns are aligned (`out_vec`), else
// column by column.
template <typename W, typename I, int V, int U, bool TRACK, bool PREFETCH = false>
__device__ __forceinline__ void pool_vec(const W* __restrict__ table, const I* __restrict__ values,
                                         const float* __restrict__ psw, int64_t start, int64_t end, int64_t dim,
                                         int c0, int G, int chunks, float inv, float* __restrict__ o, int64_t rows,
                                         bool& bad, int shift = 0, bool out_vec = true) {
  float4 acc[V];
  bool on[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    on[k] = c0 + k * G < chunks;
  }
  int64_t i = start;
  for (; i + U <= end; i += U) {
    float4 r[U][V];
    if (PREFETCH) {
      // The line of ids two steps on, asked for now: a step then waits for its rows alone, not
      // for ids from DRAM first every other step (a 128-byte line holds two steps' ids).
      const I* ahead = values + (i + 2 * U < end ? i + 2 * U : end - 1);
      asm volatile("prefetch.global.L1 [%0];" ::"l"(ahead));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const W* w = table + checked_id<TRACK>(values, i + u, rows, bad) * dim + 4 * c0;
#pragma unroll
      for (int k = 0; k < V; ++k) r[u][k] = on[k] ? load4(w + 4 * k * G) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float s = psw ? psw[i + u] : 1.f;
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = fma4(r[u][k], s, acc[k]);
    }
  }
  if (i < end) {  // the last rows (fewer than U): their loads issued together, added in order
    float4 r[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool in = i + u < end;
      const W* w = table + (in ? checked_id<TRACK>(values, i + u, rows, bad) * dim : 0) + 4 * c0;
#pragma unroll
      for (int k = 0; k < V; ++k) r[u][k] = (in && on[k]) ? load4(w + 4 * k * G) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i + u < end) {
        const float s = psw ? psw[i + u] : 1.f;
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = fma4(r[u][k], s, acc[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (on[k]) {
      acc[k].x *= inv; acc[k].y *= inv; acc[k].z *= inv; acc[k].w *= inv;
      const int c = 4 * (c0 + k * G) - shift;  // the chunk's first column
      if (out_vec) {
        store4(o + c, acc[k]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (c + e >= 0 && c + e < dim) o[c + e] = comp(acc[k], e);
      }
    }
  }
}

// One bag's sum over columns c0, c0 + G, ... (V of them, those below dim) of rows in the scalar
// layout (rows not 16-byte aligned, or an output width off a multiple of 4), U rows a step: V * U
// loads in flight a lane and the bag's ids read once per V columns. One column a pass over the bag
// had 4 loads in flight a lane: at dims 584-771 a bag was a chain of 1,400-2,700 round trips (its
// forward ~550 ns a step, 0.60-0.79x fbgemm's on drawn layouts, perf-notes v55). Each column's rows
// are added in input order, with the one-column loop's arithmetic: the same bits.
template <typename W, typename I, int V, int U>
__device__ __forceinline__ void pool_scalar(const W* __restrict__ table, const I* __restrict__ values,
                                            const float* __restrict__ psw, int64_t start, int64_t end, int64_t dim,
                                            int c0, int G, float inv, float* __restrict__ o, int64_t rows, bool& bad) {
  float acc[V];
  bool on[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    acc[k] = 0.f;
    on[k] = c0 + k * G < dim;
  }
  for (int64_t i = start; i < end; i += U) {
    float r[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool in = i + u < end;
      const W* w = table + (in ? checked_id<true>(values, i + u, rows, bad) * dim : 0) + c0;
#pragma unroll
      for (int k = 0; k < V; ++k) r[u][k] = (in && on[k]) ? to_f(w[k * G]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i + u < end) {
        if (psw) {
          const float s = psw[i + u];
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] += r[u][k] * s;
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] += r[u][k];
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (on[k]) o[c0 + k * G] = acc[k] * inv;
}

// Columns 4c .. 4c + 3 of a row whose aligned chunk c holds columns 4c - s .. 4c + 3 - s (`a`), the
// next chunk being `n` (its last element is never needed).
__device__ __forceinline__ float4 realign(float4 a, float4 n, int s) {
  return make_float4(s == 0 ? a.x : s == 1 ? a.y : s == 2 ? a.z : a.w,
                     s == 0 ? a.y : s == 1 ? a.z : s == 2 ? a.w : n.x,
                     s == 0 ? a.z : s == 1 ? a.w : s == 2 ? n.x : n.y,
                     s == 0 ? a.w : s == 1 ? n.x : s == 2 ? n.y : n.z);
}
// Lane `src`'s first three elements of v, among the G lanes of `mask`.
__device__ __forceinline__ float4 shfl3(unsigned mask, float4 v, int src, int G) {
  return make_float4(__shfl_sync(mask, v.x, src, G), __shfl_sync(mask, v.y, src, G), __shfl_sync(mask, v.z, src, G),
                     0.f);
}

// One bag's sum over output chunk cb + sl (4 columns) of rows that start at any element (a dim off
// a multiple of 4: each row its own offset s = start % 4), U rows a step. Each lane reads the row's
// aligned 16-byte chunk at its index (columns 4c - s .. 4c + 3 - s) and takes the rest of its
// columns from the next chunk, which the next lane read; the group's last lane only feeds (the
// caller's passes advance by G - 1 chunks). So odd rows are read 16 bytes at a time, where column
// by column they took 4x the load instructions (v57: a dim-333 table read from L2 at half
// fbgemm's rate). Each column's rows are added in input order with pool_scalar's arithmetic: the
// same bits. All G lanes of the group call it (the shuffle).
template <typename W, typename I, int U>
__device__ __forceinline__ void pool_realigned(const W* __restrict__ flat, const I* __restrict__ values,
                                               const float* __restrict__ psw, int64_t start, int64_t end,
                                               int64_t base, int64_t dim, int cb, int sl, int G, unsigned mask,
                                               float inv, float* __restrict__ o, int64_t rows, bool& bad) {
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int c = cb + sl;  // this lane's chunk
  for (int64_t i = start; i < end; i += U) {
    float4 r[U];
    int s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool in = i + u < end;
      const int64_t at = base + (in ? checked_id<true>(values, i + u, rows, bad) : 0) * dim;
      s[u] = (int)(at & 3);
      const bool held = 4 * c < dim + s[u];  // the chunk holds some of the row
      r[u] = (in && held) ? load4(flat + (at - s[u]) + 4 * c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i + u < end) {  // the same for the group's lanes (one bag)
        const float sc = psw ? psw[i + u] : 1.f;
        acc = fma4(realign(r[u], shfl3(mask, r[u], (sl + 1) & (G - 1), G), s[u]), sc, acc);
      }
    }
  }
  if (sl < G - 1 && 4 * c < dim) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (4 * c + e < dim) o[4 * c + e] = comp(acc, e) * inv;
  }
}

// Grid (features, blocks of bags), or (blocks of bags, features) when `bag_major`: blocks are
// scheduled x-fastest, so feature-major runs every feature's first bags at once (the output rows
// of those bags are written together) and bag-major runs one feature's bags at once (its table's
// repeated rows are read while they are in L2). Bag-major in rounds (ROUNDS, `items` > 0): a 1-D
// grid of items / rounds blocks, each pooling the items (feature, bag block of `round_bag_blocks`)
// it is dealt in feature order, so that a round runs a 1/rounds share of the features at once.
// Where the whole grid fits the GPU at once, plain bag-major runs every table together; rounds
// keep fewer tables' rows competing for L2 (H100, 16 tables of 32-byte rows, 200 ids a bag: L2
// hit rate 28% against fbgemm's 63%, DRAM reads 1.5x the rows' bytes; perf-notes v26). The rounds
// kernel runs at two blocks an SM (it runs fewer blocks anyway): its loop state would spill the
// one-pass kernels at their 40-64 registers. Every group of G lanes pools one bag: G = lanes
// for the feature's dim, so narrow tables pack several bags per warp. A bag's ids are summed in
// input order in fp32 (the same order as the Triton kernel: equal results in fp32).
// MAXV: the most 16-byte chunks a lane holds in one pass, from the group's widest dim (1 up to 128,
// 2 up to 256, else 4). A kernel holding only the paths its group needs keeps to 64 registers, so
// 4 blocks (32 warps) fit an SM: the gather is latency-bound, and the kernel with every path (99
// registers, 2 blocks) ran the 4000-table forward at 1.84 ms against 1.21 (perf-notes v17).
// ROWS: rows in flight a lane on the one-chunk path. 4 instead of 8 fits 6 blocks an SM (40
// registers; 5 blocks with int32 ids, which spill 72 bytes at 40): faster on short bags, slower
// on long bags of narrow rows (few lanes a bag), so the launch tuner measures both where the
// group's rows take one chunk a lane.
template <typename W, typename I, int MAXV, int ROWS, bool ROUNDS = false>
__global__ void __launch_bounds__(256, ROUNDS ? 2 : ROWS == 4 ? (sizeof(I) == 8 ? 6 : 5) : 4) pooled_forward_kernel(
    const W* __restrict__ flat, const I* __restrict__ values, const I* __restrict__ offsets,
    const float* __restrict__ psw, const int64_t* __restrict__ meta, const int64_t* __restrict__ key_index,
    float* __restrict__ out, int64_t batch_size, int64_t total_dim, bool bag_major, int64_t round_bag_blocks,
    int64_t items, InputCheck chk) {
  for (int64_t item = ROUNDS ? blockIdx.x : 0; !ROUNDS || item < items; item += gridDim.x) {
    const unsigned feature = ROUNDS ? (unsigned)(item / round_bag_blocks) : bag_major ? blockIdx.y : blockIdx.x;
    const int64_t bag_block = ROUNDS ? item % round_bag_blocks : bag_major ? blockIdx.x : blockIdx.y;
    const int64_t bag_blocks = ROUNDS ? round_bag_blocks : bag_major ? gridDim.x : gridDim.y;
    const int64_t* m = meta + (int64_t)feature * META_W;
    const int64_t dim = m[0], base = m[1], col = m[2], rows = m[4];
    const bool mean = m[3] == 1;
    const int64_t key = key_index[feature];
    // Rows are read 16 bytes at a time (8 for two-byte types) where dim is a multiple of 4: from the
    // aligned address at or before the table's base, `shift` = base % 4 elements (the same for every
    // row; one chunk more where it is not 0), in the one-chunk kernel only where the extra chunk
    // still fits a warp. Rows of other dims start at any offset: pool_realigned reads them 16 bytes
    // at a time too. An aligned read that holds an element of the buffer stays on that element's
    // page, so the up to 3 elements read past the buffer's last row cannot fault; they are summed
    // into columns that are not stored. (Until v58 a shifted table last in its buffer, and every
    // odd dim, were read element by element: a drawn layout's forward at 0.56x fbgemm's.)
    // The 4-rows kernel keeps the rule of v55 (16-byte reads only where base, column and width are
    // aligned, else element by element): its 40 registers spilled 24 bytes with the shift.
    constexpr bool SHIFTS = ROWS != 4;
    const int shift = (int)(base & 3);
    const bool out_vec = shift == 0 && col % 4 == 0 && total_dim % 4 == 0;
    const bool vec = dim % 4 == 0 && (SHIFTS ? shift == 0 || MAXV > 1 || dim / 4 < 32 : out_vec);
    const bool realign = SHIFTS && !vec;
    const W* table = flat + base - (vec ? shift : 0);
    if (chk.claim && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {  // lengths adding up to the values
      const int64_t first = offsets[0], last = offsets[chk.last_offset];
      if (first != 0 || last != chk.num_values) report_bad(chk, REPORT_TOTAL, -1, -1, first, last);
    }
    const int out_chunks = (int)((dim + 3) / 4);
    const int chunks = vec ? (int)(dim / 4) + (shift ? 1 : 0) : realign ? out_chunks + 1 : (int)dim;
    const int G = group_lanes(chunks);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane / G, sl = lane % G;
    const int bags_per_warp = 32 / G;
    const int bags_per_block = bags_per_warp * (blockDim.x >> 5);
    for (int64_t b = bag_block * bags_per_block + warp * bags_per_warp + sub; b < batch_size;
         b += bag_blocks * bags_per_block) {
      const int64_t bag = key * batch_size + b;
      int64_t start = offsets[bag], end = offsets[bag + 1];
      if (!bag_in_values(start, end, chk.num_values)) {
        if (sl == 0) report_bad(chk, REPORT_BAG, feature, b, start, end);
        start = end = 0;
      }
      const float inv = (mean && end > start) ? 1.0f / (float)(end - start) : 1.0f;
      float* o = out + b * total_dim + col;
      if (vec) {
        // A lane holds up to four of the row's 16-byte chunks (dims up to 512 in one pass at G = 32;
        // wider rows take more passes) and walks the bag once per pass: 4 to 8 rows' loads in flight
        // a lane, the bag's ids read once rather than once per chunk (v13, perf-notes). The rounds
        // kernel of rows past 256 columns (two blocks an SM, 128 registers) keeps more rows in
        // flight: 3 of 4 chunks, 8 of 2. A small batch's long bags of wide rows are each one warp's
        // chain of dependent loads (v59's bench, 4 and 8 rows at two blocks an SM: dims 300-696 at
        // B = 115-256 with 100-250 ids a bag 12-31% faster; at four blocks an SM those passes
        // spilled 1.7 KB, and two blocks slowed large batches' odd dims by 30%, so only the rounds
        // kernel, which runs at two anyway; 4 rows of 4 chunks spilled 16 bytes there, 3 none).
        const int per_lane = (chunks + G - 1) / G;
        if (MAXV == 1 || per_lane == 1) {  // one chunk a lane: the flag through the loop
          bool bad = false;
          // The ids prefetched a line ahead where a warp pools at most 8 bags (G >= 4), in the
          // 8-rows kernel of rows up to 128 wide (the long bags'): 2-9% faster at dims 16-128 with
          // 50-200 ids a bag. At 1-2 lanes a bag a warp's 16-32 bags each prefetch their own line,
          // and it was up to 14% slower; the 4-rows kernel spills with it at its 40 registers,
          // the wide rows' kernel more than before (perf-notes v29).
          if (sl < chunks && MAXV == 1 && ROWS == 8 && G >= 4)
            pool_vec<W, I, 1, ROWS, true, true>(table, values, psw, start, end, dim, sl, G, chunks, inv, o, rows, bad,
                                                shift, out_vec);
          else if (sl < chunks)
            pool_vec<W, I, 1, ROWS, true>(table, values, psw, start, end, dim, sl, G, chunks, inv, o, rows, bad,
                                          shift, out_vec);
          if (bad && chk.claim) report_bad_ids(chk, values, start, end, 0, 1, rows, feature, b);
        } else {
          bool unused = false;
          for (int c0 = sl; c0 < chunks; c0 += MAXV * G) {
            const int left = per_lane - (c0 - sl) / G;  // this lane's chunks from c0 on
            if (MAXV >= 4 && left >= 3) {
              pool_vec<W, I, 4, ROUNDS ? 3 : 2, false>(table, values, psw, start, end, dim, c0, G, chunks, inv, o,
                                                       rows, unused, shift, out_vec);
            } else if (MAXV >= 2 && left >= 2) {
              pool_vec<W, I, 2, ROUNDS && MAXV >= 4 ? 8 : 4, false>(table, values, psw, start, end, dim, c0, G,
                                                                    chunks, inv, o, rows, unused, shift, out_vec);
            } else {
              pool_vec<W, I, 1, ROWS, false>(table, values, psw, start, end, dim, c0, G, chunks, inv, o, rows, unused,
                                             shift, out_vec);
            }
          }
          if (chk.claim) {  // re-read rather than kept through the loops (registers)
            const int64_t s = offsets[bag], e = offsets[bag + 1];
            if (bag_in_values(s, e, chk.num_values)) report_bad_ids(chk, values, s, e, sl, G, rows, feature, b);
          }
        }
      } else if (realign) {
        // Passes of one chunk a lane, advancing by the group's chunks less the one that only feeds
        // its neighbour; 4 rows in flight a lane in the one-chunk kernel, 2 in the wider ones (4
        // spilled 36-80 bytes there, as did passes of 2 or 4 chunks a lane: 28-92), 8 in the rounds
        // kernel of rows past 256 columns (128 registers, see the 16-byte passes above).
        bool bad = false;
        const unsigned mask = G == 32 ? 0xffffffffu : ((1u << G) - 1) << (sub * G);
        for (int cb = 0; cb < out_chunks; cb += G - 1)
          pool_realigned<W, I, MAXV == 1 ? 4 : ROUNDS && MAXV >= 4 ? 8 : 2>(flat, values, psw, start, end, base, dim,
                                                                            cb, sl, G, mask, inv, o, rows, bad);
        if (bad && chk.claim) report_bad_ids(chk, values, start, end, 0, 1, rows, feature, b);
      } else {
        // Scalar columns (the 4-rows kernel's unaligned rows): a lane's columns up to MAXV at a time
        // (as many as its 16-byte path holds), four rows' loads in flight each.
        bool bad = false;
        for (int c0 = sl; c0 < dim; c0 += MAXV * G)
          pool_scalar<W, I, MAXV, 4>(table, values, psw, start, end, dim, c0, G, inv, o, rows, bad);
        if (bad && chk.claim) report_bad_ids(chk, values, start, end, 0, 1, rows, feature, b);
      }
    }
    if (!ROUNDS) break;  // a 2-D grid's block: its one (feature, bag block)
  }
}

// The forward's launch shape (pooled_forward's, and tools/forward_kernel_bench.cu's): blocks of
// FORWARD_THREADS, bags per block for the group's widest table (narrower features stride over
// more bags a block), and the most 16-byte chunks a lane of that table holds (the kernel's MAXV).
// rounds > 1: bag-major in rounds, the kernel's `items` (feature, bag block) pairs dealt to
// items / rounds blocks.
constexpr int FORWARD_THREADS = 256;
struct ForwardShape {
  dim3 grid;
  int lane_chunks;
  int64_t round_bag_blocks, items;  // 0, 0 unless in rounds
};
inline ForwardShape forward_shape(int64_t features, int64_t batch_size, int64_t max_dim, bool bag_major,
                                  int64_t rounds = 1) {
  const int g = group_lanes((int)((max_dim + 3) / 4));
  const int64_t bags_per_block = (32 / g) * (FORWARD_THREADS / 32);
  const int64_t bag_blocks = (batch_size + bags_per_block - 1) / bags_per_block;
  const int lane_chunks = (int)(((max_dim + 3) / 4 + g - 1) / g);
  if (rounds > 1) {
    const int64_t items = features * bag_blocks;
    const int64_t blocks = std::min<int64_t>((items + rounds - 1) / rounds, INT32_MAX);
    return ForwardShape{dim3((unsigned)blocks), lane_chunks, bag_blocks, items};
  }
  const dim3 grid = bag_major ? dim3((unsigned)std::min<int64_t>(bag_blocks, INT32_MAX), (unsigned)features)
                              : dim3((unsigned)features, (unsigned)std::min<int64_t>(bag_blocks, 65535));
  return ForwardShape{grid, lane_chunks, 0, 0};
}

// ---- backward: the piece and split-row kernels ----------------------------------------------
struct Hyper {
  float lr, eps, beta1, beta2, wd, decoupled;
};

// The fused optimizer on one 4-wide (or scalar) chunk of a row; `g` already includes the
// coupled weight decay; `row_step` is row-wise Adagrad's lr / (sqrt(accumulator) + eps), once a
// row (fbgemm's `multiplier`): one division a row instead of one a column, which cost the piece
// kernel's row-wise updates 12-16% at dims 256-1024 (v20). Same formulas as optim/rows.py and
// pooled_triton._apply_rows.
template <int OPT>
__device__ __forceinline__ float apply1(float w, float g, float* s1, float* s2, int64_t at, float row_step,
                                        const Hyper& h, float t) {
  if (OPT == 0) return w - h.lr * g;
  if (OPT == 1) {
    const float a = s1[at] + g * g;
    s1[at] = a;
    return w - h.lr * g / (sqrtf(a) + h.eps);
  }
  if (OPT == 2) return w - row_step * g;
  const float mm = h.beta1 * s1[at] + (1.f - h.beta1) * g;
  const float vv = h.beta2 * s2[at] + (1.f - h.beta2) * g * g;
  s1[at] = mm;
  s2[at] = vv;
  const float m_hat = mm / (1.f - expf(t * logf(h.beta1)));
  const float v_hat = vv / (1.f - expf(t * logf(h.beta2)));
  return w - h.lr * (m_hat / (sqrtf(v_hat) + h.eps)) - h.lr * h.wd * h.decoupled * w;
}

// Which columns of a row one lane of a group of G covers. It holds V float4 chunks: chunk k is
// columns 4 * (sl + k * G) .. + 3 where the gradient rows are 16-byte aligned ("vec"), else
// element e of chunk k is column sl + (4 * k + e) * G. V = 1 covers dims up to 128 (G = 32) with
// few registers; V = 4 covers 512. Partial sums are stored by column, so any kernel reads back
// what another wrote. The row's own accesses (weights, states, partial sums) are 16 bytes wide
// only where its addresses are aligned too ("rows16": dim and base multiples of 4); else column by
// column at the same columns. So a row of any dim or base reads its gradient 16 bytes at a time
// where the gradient's layout allows (ops/gradient_layout.py pads it so): before (v57), a dim or
// base off a multiple of 4 took the scalar layout, 4 bytes a lookup a lane. An odd dim's last chunk
// also sums up to 3 columns past the row's end (the next feature's, or the padding): never stored,
// and zeroed (`tail`) where a row is finished, before its sum of squares and its update (masking
// each load instead spilled the piece kernel at V = 1, 36 bytes with row-wise Adagrad).
struct RowLanes {
  bool vec, rows16;
  int sl, G;
  int64_t dim;
  // Column of element e of chunk k, or -1 past the row's end.
  __device__ __forceinline__ int at(int k, int e) const {
    const int c = vec ? 4 * (sl + k * G) + e : sl + (4 * k + e) * G;
    return c < dim ? c : -1;
  }
  // v with the columns of chunk k past the row's end zeroed (vec: an odd dim's last chunk sums
  // the next feature's columns or the padding).
  __device__ __forceinline__ float4 tail(int k, float4 v) const {
    if (vec && (dim & 3)) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (at(k, e) < 0) comp(v, e) = 0.f;
    }
    return v;
  }
  // store and load_rw stream (load4_streaming) unless PLAIN: the singleton kernel asks PLAIN, where
  // the hint made its SGD instantiation at V = 1 spill 176 bytes (v69).
  template <bool PLAIN = false, typename T>
  __device__ __forceinline__ void store(T* dst, int k, float4 v) const {
    if (rows16) {
      if (at(k, 0) >= 0) {
        if (PLAIN) store4(dst + at(k, 0), v);
        else store4_streaming(dst + at(k, 0), v);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (at(k, e) >= 0) dst[at(k, e)] = from_f<T>(comp(v, e));
    }
  }
  template <bool PLAIN = false, typename T>
  __device__ __forceinline__ float4 load_rw(const T* src, int k) const {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rows16) {
      if (at(k, 0) >= 0) v = PLAIN ? load4_rw(src + at(k, 0)) : load4_streaming(src + at(k, 0));
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (at(k, e) >= 0) comp(v, e) = to_f(src[at(k, e)]);
    }
    return v;
  }
  // load_rw from L2, past the SM's L1: for sums another block wrote in the same launch (its
  // address may be in this SM's L1 from an earlier read of what was there before).
  __device__ __forceinline__ float4 load_l2(const float* src, int k) const {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rows16) {
      if (at(k, 0) >= 0) v = __ldcg(reinterpret_cast<const float4*>(src + at(k, 0)));
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (at(k, e) >= 0) comp(v, e) = __ldcg(src + at(k, e));
    }
    return v;
  }
  // Adds chunk k of gradient row g, scaled. In the vec layout the row's address is checked too:
  // features that share a table can sit at output columns of different alignment, and the piece's
  // layout follows its first lookup's feature. ODD false: the caller's vec rows have dims that are
  // multiples of 4 (the singleton kernel: the odd dims' masks spilled it).
  template <bool ODD = true>
  __device__ __forceinline__ void add(float4& acc, const float* g, int k, float s) const {
    if (vec) {
      const int c = at(k, 0);
      if (c >= 0) {
        const float* q = g + c;
        if ((reinterpret_cast<uintptr_t>(q) & 15) == 0) {
          acc = fma4(load4(q), s, acc);
        } else if (!ODD || (dim & 3) == 0) {
          acc.x += __ldg(q) * s; acc.y += __ldg(q + 1) * s; acc.z += __ldg(q + 2) * s; acc.w += __ldg(q + 3) * s;
        } else {  // an odd dim's last chunk: its columns past the row's end may lie past the buffer's
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (at(k, e) >= 0) comp(acc, e) += __ldg(q + e) * s;
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (at(k, e) >= 0) comp(acc, e) += __ldg(g + at(k, e)) * s;
    }
  }
  // All V chunks of gradient row g, scaled, added to acc. In the vec layout with g 16-byte aligned
  // the V loads are issued before the first add (per-chunk `add` would branch on each address and
  // serialise them: V round trips a lookup on wide rows). Same sums, same order per chunk.
  template <int V, bool ODD = true>
  __device__ __forceinline__ void add_row(float4 (&acc)[V], const float* g, float s) const {
    if (vec && (reinterpret_cast<uintptr_t>(g) & 15) == 0) {
      float4 v[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[k] = at(k, 0) >= 0 ? load4(g + at(k, 0)) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (at(k, 0) >= 0) acc[k] = fma4(v[k], s, acc[k]);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) add<ODD>(acc[k], g, k, s);
    }
  }
};

// The 4-wide column layout where the gradient rows are aligned (`grad_vec`: grad_output's start,
// its width and the feature's column): where they are not, lane-per-column scalar loads stay
// coalesced, and four scalar loads a lane would not. The row's own accesses are 16 bytes wide
// where its addresses are aligned too: dim and base multiples of 4. Either layout writes partial
// sums by column, so the pieces of one row may differ.
__device__ __forceinline__ RowLanes row_lanes(int64_t dim, int64_t base, bool grad_vec, int sl, int G) {
  return RowLanes{grad_vec, grad_vec && dim % 4 == 0 && base % 4 == 0, sl, G, dim};
}

// Row-wise Adagrad's sum of squares of a row, the same bits for every lane layout (G lanes of V
// chunks): a fixed tree over the row's slot index, pairing its highest bit first. A slot is a
// 16-byte chunk, (x^2 + y^2) + (z^2 + w^2), in the 4-wide layout, else a column; a lane's slots
// are the index's high bits (chunk sl + k * G; column sl + s * G), the group's shuffles its low
// bits. Slots past the row's end hold zeros and adding a zero is exact, so layouts with more slots
// give the same sum. The piece kernels' lanes are a measured choice (pooled_cuda.BACKWARD_PATHS),
// so every choice must give one result; explicit roundings keep nvcc from contracting the tree.
// q[0] = the sum of q[0 .. 2H) by the tree that adds q[i + H] to q[i] first, then halves H.
// A level a template instance, so every index is a constant and q stays in registers.
template <int H, int N>
__device__ __forceinline__ void pair_down(float (&q)[N]) {
  if constexpr (H >= 1) {
#pragma unroll
    for (int i = 0; i < H; ++i) q[i] = __fadd_rn(q[i], q[i + H]);
    pair_down<H / 2, N>(q);
  }
}

template <int V>
__device__ __forceinline__ float row_sum_of_squares(float4 (&acc)[V], const RowLanes& L) {
  float sq;
  if (L.vec) {
    float q[V];
#pragma unroll
    for (int k = 0; k < V; ++k)
      q[k] = __fadd_rn(__fadd_rn(__fmul_rn(acc[k].x, acc[k].x), __fmul_rn(acc[k].y, acc[k].y)),
                       __fadd_rn(__fmul_rn(acc[k].z, acc[k].z), __fmul_rn(acc[k].w, acc[k].w)));
    pair_down<V / 2, V>(q);
    sq = q[0];
  } else {
    float q[4 * V];  // slot s = 4 * k + e: column sl + s * G
#pragma unroll
    for (int k = 0; k < V; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) q[4 * k + e] = __fmul_rn(comp(acc[k], e), comp(acc[k], e));
    pair_down<2 * V, 4 * V>(q);
    sq = q[0];
  }
  for (int off = L.G / 2; off > 0; off >>= 1) sq = __fadd_rn(sq, __shfl_xor_sync(0xffffffffu, sq, off));
  return sq;
}

// Row-wise Adagrad's accumulator of row `key`, read by the caller when the row's key is known
// (0 where this group does not finish the row or another optimizer runs): the load overlaps the
// gradient sum instead of following it, one DRAM round trip fewer at the end of each row's chain.
// Only the group that finishes a row reads or writes its accumulator, so the early read is the
// value finish_row would have read.
template <int OPT>
__device__ __forceinline__ float row_state(const float* s1, int64_t key, bool finish) {
  return OPT == 2 && finish ? s1[key] : 0.f;
}

// Finishes a row from its summed gradient `acc`, its weights `w` and row-wise Adagrad's
// accumulator `state` (both read by the caller, early: row_state): the optimizer (OPT >= 0) or the
// gradient written as the row (OPT < 0). Every lane of the warp calls it (row-wise Adagrad's
// shuffles); `finish` says whether this group's row is done here.
template <typename W, int OPT, int V, bool ODD = true, bool PLAIN = false>
__device__ __forceinline__ void finish_row(float4 (&acc)[V], float4 (&w)[V], float state, const RowLanes& L,
                                           bool finish, W* out, int64_t row_at, int64_t key, float* s1, float* s2,
                                           const Hyper& h, float t) {
  W* row = out + row_at;
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (ODD) acc[k] = L.tail(k, acc[k]);  // an odd dim's last chunk: only the row's columns (ODD false:
                                          // the caller's 4-wide rows have dims that are multiples of 4)
  if (OPT < 0) {
    if (finish) {
#pragma unroll
      for (int k = 0; k < V; ++k) L.store<PLAIN>(row, k, acc[k]);
    }
    return;
  }
  const float wd = h.wd * (1.f - h.decoupled);  // coupled weight decay joins the gradient
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = fma4(w[k], wd, acc[k]);
  float row_step = 0.f;
  if (OPT == 2) {
    const float sq = row_sum_of_squares<V>(acc, L);
    if (finish) {
      const float row_acc = state + sq / (float)L.dim;
      if (L.sl == 0) s1[key] = row_acc;
      row_step = h.lr / (sqrtf(row_acc) + h.eps);
    }
  }
  if (!finish) return;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    float4 nw;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = L.at(k, e);  // (vec: an odd dim's last chunk has columns past the row's end)
      comp(nw, e) = c >= 0 ? apply1<OPT>(comp(w[k], e), comp(acc[k], e), s1, s2, row_at + c, row_step, h, t) : 0.f;
    }
    L.store<PLAIN>(row, k, nw);
  }
}

// n / d for every n in [0, 2^31) by a multiply and a shift, d >= 1 fixed per launch (Granlund and
// Montgomery 1994, theorem 4.2 with N = 31: magic = ceil(2^(31 + l) / d), l = ceil(log2 d), fits 32
// bits, and n * magic fits 63). A division by a kernel argument is ~20 dependent instructions, and
// the piece kernels take one for every lookup's payload (10% of their instructions at dims 16-64,
// Nsight Compute's source counters, perf-notes v36). Exact: the same quotients, the same bits.
struct BatchDivisor {
  uint32_t magic;
  int shift;
  __host__ __device__ __forceinline__ uint32_t divide(uint32_t n) const {
    return (uint32_t)(((uint64_t)n * magic) >> shift);
  }
};
inline BatchDivisor batch_divisor(uint32_t d) {
  int l = 0;
  while ((uint64_t(1) << l) < d) ++l;
  const uint64_t two = uint64_t(1) << (31 + l);
  return BatchDivisor{(uint32_t)((two + d - 1) / d), 31 + l};
}

// Where the sort's payload `o` takes its gradient row from, and its scale. Two payload forms:
// - packed (packed_batch = B > 0): o = feature * B + bag. The gradient row is computed from the
//   feature's output column, the scale is 1 (sum) or the bag's 1/L from `bag_scale` (mean): no
//   gather through the payload but `bag_scale` for mean pooling. Used without sample weights.
// - indexed (packed_batch = 0): o indexes the expand arrays src, scale, feature.
// Built by make_payload, which sets `batch` from packed_batch.
// `grad_rows` (packed only; null: bag * total_dim): where bag b's gradient row starts, in elements
// from grad_output's start. The unpooled lookup's backward takes its features' gradients where
// autograd left them, one tensor a feature, instead of a copy of them into one block (perf-notes v48).
struct Payload {
  int32_t packed_batch;  // 32-bit: o / B is in the chain of every lookup (by `batch`'s multiply)
  bool grad_vec;         // grad_output's start and width (and every row grad_rows names) allow 16-byte rows
  int64_t total_dim;
  const int64_t* meta;
  const float* bag_scale;
  const int64_t* src;
  const float* scale;
  const int32_t* feature;
  const int64_t* grad_rows;
  BatchDivisor batch;
  __device__ __forceinline__ int32_t feature_of(int32_t o) const {
    return packed_batch ? (int32_t)batch.divide((uint32_t)o) : feature[o];
  }
  __device__ __forceinline__ int64_t source(int32_t o, float& s) const {
    if (packed_batch) {
      const int32_t f = (int32_t)batch.divide((uint32_t)o);
      const int64_t b = o - f * packed_batch;
      const int64_t* m = meta + (int64_t)f * META_W;
      s = __ldg(m + 3) == 1 ? bag_scale[o] : 1.f;
      return (grad_rows ? __ldg(grad_rows + b) : b * total_dim) + __ldg(m + 2);
    }
    s = scale[o];
    return src[o];
  }
};
inline Payload make_payload(int32_t packed_batch, bool grad_vec, int64_t total_dim, const int64_t* meta,
                            const float* bag_scale, const int64_t* src, const float* scale, const int32_t* feature,
                            const int64_t* grad_rows = nullptr) {
  return Payload{packed_batch, grad_vec, total_dim, meta, bag_scale, src, scale, feature, grad_rows,
                 batch_divisor(packed_batch > 0 ? (uint32_t)packed_batch : 1u)};
}

struct PieceArgs {
  const int64_t* pieces;  // (start << 2 | split << 1 | first)
  const int64_t* split_rows;
  int64_t* long_rows;  // (start, pieces) of the split rows for long_row_kernel (see LONG_ROW_LOADS)
  int32_t* counts;     // pieces, split rows, long rows (on the device; the last bumped by split_row_kernel)
  int64_t n;
  float* partials;
  int64_t partial_stride;
  float* s1;
  float* s2;
  const float* hyper;
  const int64_t* step;
  const int64_t* meta;
  int G;
  // Where the piece kernel's list starts in `pieces` (on the device: a lane class's list,
  // piece_class_scatter_kernel), or nullptr: at its start.
  const int32_t* begin = nullptr;
  // The long rows' two counts (rows, slices; zeroed before split_row_kernel appends to them) and
  // each slice's long row (long_row_space).
  int32_t* long_counts = nullptr;
  int64_t* slice_rows = nullptr;
};

// The fused optimizer's hyper-parameters, and Adam's step in `t` (OPT < 0: none).
template <int OPT>
__device__ __forceinline__ Hyper read_hyper(const PieceArgs& a, float& t) {
  t = 0.f;
  if (OPT < 0) return Hyper{0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (OPT == 3) t = (float)a.step[0];
  return Hyper{a.hyper[0], a.hyper[1], a.hyper[2], a.hyper[3], a.hyper[4], a.hyper[5]};
}

// The warp's groups of G lanes over a list whose length is on the device: group `sub` of the
// warp takes item r0 + sub, and every warp of the grid strides over the list together, so the
// loop stays warp-uniform around the shuffles.
struct LaneGroups {
  int G, sub, sl;
  int64_t first, stride;
  __device__ __forceinline__ explicit LaneGroups(int g) : G(g) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per_warp = 32 / g;
    sub = lane / g;
    sl = lane % g;
    first = ((int64_t)blockIdx.x * (blockDim.x >> 5) + warp) * per_warp;
    stride = (int64_t)gridDim.x * (blockDim.x >> 5) * per_warp;
  }
};

// Lookups a group of the piece kernel sums a step from registers (U); whether its lanes resolve
// their lookups' sources together (G >= 2U, see the kernel); and how many lookups' gradient rows
// it keeps in flight through shared memory where they do (its ring; cp.async copies, which hold
// no registers while in flight). In registers V = 4 had room for about one lookup's four chunks
// (nvcc interleaves the loads with the adds to fit 80 registers; the SASS showed four loads in
// flight a lane, not eight). Measured against registers only (v21, H200,
// tools/backward_kernel_variants.py): V = 4's ring of three lookups ran ~200-id bags at dim 256
// 22% faster and Zipf ids 25%; V = 1's of four dims 64-128 at ~200 ids 11-12%, 500 and 4000
// tables 3-4% (dims 4-32 0-2% slower: their groups are too narrow to share, no ring); V = 8's of
// two (64 KB a block) dim 1024 10%. Rings of eight at V = 1 gained less than four.
__host__ __device__ constexpr int piece_unroll(int V) { return V >= 8 ? 1 : V == 4 ? 2 : 4; }
__host__ __device__ constexpr int piece_ring(int V) { return V == 8 ? 2 : V == 4 ? 3 : V == 1 ? 4 : 0; }
__host__ __device__ constexpr bool piece_groups_share(int V, int G) {
  return piece_unroll(V) == 1 || G >= 2 * piece_unroll(V);
}
constexpr int PIECE_THREADS = 256;
// The piece kernel's dynamic shared memory for groups of G lanes at V chunks a lane: its ring.
inline size_t piece_ring_bytes(int V, int G) {
  return piece_groups_share(V, G) ? (size_t)piece_ring(V) * V * PIECE_THREADS * sizeof(float4) : 0;
}

// One group of G lanes per piece (a run of at most PIECE sorted lookups of one row), groups
// looping over the piece list, whose length is on the device. A group sums its piece's scaled
// gradient rows in sorted order (the row's input order: deterministic) with several lookups' loads
// in flight; a piece that is a whole row applies the optimizer (OPT >= 0) or writes the row's
// gradient (OPT < 0); a piece of a split row leaves its sum in its partial slot for the split-row
// kernel. The row's weights are read before its gradient rows, so both loads are in flight
// together (the chain is piece -> key and payload -> gradient and weight rows), except at V >= 4
// (rows of 129-1024 columns): there weights, sum and gradient rows held together took up to 236
// registers at V = 8 (one block a SM), 128 with 24-36 bytes of spill at V = 4 (two); read after
// the sum, V = 8 fits 128 registers (two blocks, no spill) and V = 4 80 (three blocks), whose
// updates ran 5-14% faster than at two blocks (v19, dims 256 and 512); V = 4 keeps two lookups'
// gradient rows in flight, not four: its updates ran 7-14% faster (v20: dims 256-512, ~10 and
// ~200 ids; Zipf the same), and it spills 4 (SGD) to 16 bytes (row-wise Adagrad), not 64-68.
// At V = 1 the bounds hold the 64 registers (four blocks a SM) the kernel had before the narrow
// groups' path below joined it.
// Control flow stays warp-uniform around the shuffles (row-wise Adagrad's row sum).
template <typename W, typename K, int OPT, int V>
__global__ void __launch_bounds__(256, V >= 8 ? 2 : V == 4 ? 3 : 4)
    piece_kernel(const K* __restrict__ row_key, const int32_t* __restrict__ order, Payload pay,
                 const float* __restrict__ grad, PieceArgs a, W* __restrict__ out) {
  const int64_t n = a.n;
  LaneGroups lg(a.G);
  int64_t num = a.counts[0];
  if (a.begin) {  // a lane class's list: pieces[*begin, *begin + counts[0])
    const int64_t list_at = *a.begin;
    lg.first += list_at;
    num += list_at;
  }
  const int G = lg.G, sl = lg.sl;
  const unsigned gmask = G == 32 ? 0xffffffffu : (((1u << G) - 1u) << (lg.sub * G));
  float t;
  const Hyper h = read_hyper<OPT>(a, t);
  constexpr bool LATE_WEIGHTS = V >= 4;
  constexpr int RING = piece_ring(V);
  // piece_ring_bytes of it; a lane's chunk k of slot s at ring[(s * V + k) * PIECE_THREADS + its thread]
  extern __shared__ float4 ring[];
  for (int64_t r0 = lg.first; r0 < num; r0 += lg.stride) {
    const int64_t r = r0 + lg.sub;
    const bool active = r < num;
    const int64_t packed = active ? a.pieces[r] : 0;
    const int64_t start = packed >> 2;
    const bool split = (packed & 2) != 0;
    const K key = row_key[start];
    const int32_t o_first = order[start];
    // The piece's length: the run of `key` from start, at most PIECE (the keys are sorted).
    int len = 0;
    for (int j0 = 0; j0 < PIECE; j0 += G) {
      const int64_t p = start + j0 + sl;
      const bool eq = active && p < n && row_key[p] == key;
      const unsigned bal = __ballot_sync(0xffffffffu, eq) & gmask;
      len += __popc(bal);
      if (__all_sync(0xffffffffu, bal != gmask)) break;
    }
    const int32_t f = active ? pay.feature_of(o_first) : 0;
    const int64_t* m = a.meta + (int64_t)f * META_W;
    // (an odd dim's last chunk reads up to 3 columns past the row: inside the output's row, or the
    // padded copy's, but not past a row that grad_rows names, which may end its buffer)
    const RowLanes L = row_lanes(active ? m[0] : 1, m[1],
                                 pay.grad_vec && m[2] % 4 == 0 && (m[0] % 4 == 0 || pay.grad_rows == nullptr), sl, G);
    const bool finish = active && !split;
    const int64_t row_at = m[1] + ((int64_t)key - m[5]) * L.dim;
    const float state = row_state<OPT>(a.s1, (int64_t)key, finish);
    float4 acc[V], w[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      w[k] = (OPT >= 0 && finish && !LATE_WEIGHTS) ? L.load_rw(out + row_at, k) : acc[k];
    }
    // Sum the piece in sorted order. Where the rows are 16-byte aligned, U lookups' chunks are all
    // loaded (predicated past the piece's end) before any is added: V * U loads in flight a lane; U
    // shrinks as V grows to bound the registers (U = 4, 2, 1 at V = 1, 4, 8). Their sources come
    // through the sort's payload (order -> source, a round trip before the gradient rows). With G
    // >= 2U lanes the group resolves G lookups' sources at once, lane i the i-th, and hands them
    // out by shuffles: one payload round trip per G lookups instead of per U (~200-id bags at dims
    // 64 and 128 ran 10-15% faster, v18). Narrower groups (dims up to 16 at V = 1) resolve U
    // lookups, each lane all of them: one round trip serves one batch of U either way, and at G < U
    // sharing would leave fewer loads in flight (dim 4 with ~200 ids ran 9-18% slower). Groups
    // that share take the ring instead of U register loads (piece_ring). The shuffles take the
    // group's mask: its lanes share the piece, so they run this loop together.
    constexpr int U = piece_unroll(V);
    const bool together = piece_groups_share(V, G);
    const int span = together ? G : U;
    int j = 0;
    if (L.vec) {
      for (int j0 = 0; j0 < len; j0 += span) {
        float my_c = 0.f;
        const int64_t my_q = together && j0 + sl < len ? pay.source(order[start + j0 + sl], my_c) : 0;
        const int here = min(span, len - j0);
        int jj = 0;
        if (RING > 0 && together) {  // the ring (piece_ring_bytes > 0 exactly here)
          // Lookup jj's chunks go to slot jj % RING; RING - 1 lookups ahead are in flight while
          // one is added (same lookups, same order, same fma as below: the same bits).
          if (__ballot_sync(gmask, j0 + sl < len && (my_q & 3) != 0)) break;  // unaligned: the loop below
          float4* mine = ring + threadIdx.x;
          auto issue = [&](int i) {  // every lane of the group: the shuffle
            const int64_t qi = __shfl_sync(gmask, my_q, i, G);
            if (i < here) {
#pragma unroll
              for (int k = 0; k < V; ++k)
                if (L.at(k, 0) >= 0)
                  copy16_async(mine + ((i % RING) * V + k) * PIECE_THREADS, grad + qi + L.at(k, 0));
            }
            copy_commit();
          };
#pragma unroll
          for (int i = 0; i < RING - 1; ++i) issue(i);
          for (; jj < here; ++jj) {
            issue(jj + RING - 1);
            copy_wait<RING - 1>();  // lookup jj's group is done
            const float c = __shfl_sync(gmask, my_c, jj, G);
#pragma unroll
            for (int k = 0; k < V; ++k)
              if (L.at(k, 0) >= 0) acc[k] = fma4(mine[((jj % RING) * V + k) * PIECE_THREADS], c, acc[k]);
          }
          copy_wait<0>();
          j = j0 + here;
          continue;
        }
        for (; jj < here; jj += U) {
          int64_t q[U];
          float cs[U];
          bool aligned = true;
#pragma unroll
          for (int u = 0; u < U; ++u) {
            cs[u] = 0.f;
            q[u] = 0;
            if (together) {
              const int64_t qs = __shfl_sync(gmask, my_q, jj + u, G);
              const float c = __shfl_sync(gmask, my_c, jj + u, G);
              if (jj + u < here) q[u] = qs, cs[u] = c;
            } else if (jj + u < here) {
              q[u] = pay.source(order[start + j0 + jj + u], cs[u]);
            }
            aligned = aligned && (q[u] & 3) == 0;
          }
          if (!aligned) break;  // a feature at an unaligned column: the loop below takes the rest
          float4 g[U][V];
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int k = 0; k < V; ++k)
              g[u][k] = jj + u < here && L.at(k, 0) >= 0 ? load4(grad + q[u] + L.at(k, 0))
                                                         : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int k = 0; k < V; ++k)
              if (jj + u < here && L.at(k, 0) >= 0) acc[k] = fma4(g[u][k], cs[u], acc[k]);
        }
        j = j0 + min(jj, here);
        if (jj < here) break;
      }
    }
    for (; j < len; ++j) {
      float c;
      const int64_t q = pay.source(j == 0 ? o_first : order[start + j], c);
#pragma unroll
      for (int k = 0; k < V; ++k) L.add(acc[k], grad + q, k, c);
    }
    if (split) {  // a piece of a long row: leave its sum for the split-row kernel
      float* dst = a.partials + (2 * (start / PIECE) + (packed & 1)) * a.partial_stride;
#pragma unroll
      for (int k = 0; k < V; ++k) L.store(dst, k, acc[k]);
    }
    if (OPT >= 0 && finish && LATE_WEIGHTS) {
#pragma unroll
      for (int k = 0; k < V; ++k) w[k] = L.load_rw(out + row_at, k);
    }
    finish_row<W, OPT, V>(acc, w, state, L, finish, out, row_at, (int64_t)key, a.s1, a.s2, h, t);
  }
}

// ---- pieces in lists by lane width ------------------------------------------------------------
// The piece kernel gives every piece of a launch G lanes, enough for the group's widest row. In a
// group of mixed widths that leaves lanes idle and fewer pieces in flight a warp on its narrower
// rows. The "lanes by width" paths (pooled_cuda.BACKWARD_PATHS) partition the piece list into one
// list a lane class (piece_lane_class, by the feature of the piece's first lookup, as the piece
// kernel lays the row out: 1 << c lanes at four float4 a lane, rows past 512 columns at eight on
// 32), and launch the piece kernel once a class at its own lanes. Lanes and chunks a lane only
// decide which lane adds which columns: every path gives the same bits. The partition is stable:
// a class's list keeps the pieces' order, so one table's pieces stay together and its gradient
// rows in L2 (perf-notes v35: a partition in the order of per-warp atomics interleaved the whole
// list, and the piece kernels ran no faster). At the mixed workload the piece kernels took 2,330
// us instead of 2,585 and the partition 113 (~250 MB read and written, 2.2 TB/s); on drawn groups
// of dims 4-1013 (v55) 2.2-3.6x less than at the widest row's shape. Dealing pieces to a warp by
// width inside one launch (v32) had run 11% slower. Three kernels: each block counts the classes
// of a contiguous share of the list, one block scans the counts, and each block writes its share
// into the lists.
constexpr int MAX_LANE_CLASSES = WIDE_PIECE_CLASS + 1;  // groups of 1, 2, 4, 8, 16, 32 lanes; 32 at eight float4
constexpr int CLASS_THREADS = 256, CLASS_ITEMS = 4;  // a tile: CLASS_ITEMS rows of CLASS_THREADS pieces
constexpr int CLASS_TILE = CLASS_THREADS * CLASS_ITEMS, CLASS_SLOTS = CLASS_TILE / 32;  // a slot: a warp's row
constexpr int CLASS_SCAN_THREADS = 1024, CLASS_SCAN_ITEMS = 8;
// The most blocks whose (class, block) counts one scan block takes.
constexpr int MAX_CLASS_BLOCKS = CLASS_SCAN_THREADS * CLASS_SCAN_ITEMS / MAX_LANE_CLASSES;

// Block b's share of a list of `num`: [lo, hi).
__device__ __forceinline__ void class_share(int64_t num, int64_t& lo, int64_t& hi) {
  const int64_t per = (num + gridDim.x - 1) / gridDim.x;
  lo = min(num, (int64_t)blockIdx.x * per);
  hi = min(num, lo + per);
}

// Each piece's lane class into `cls`, and each block's count of each class into
// block_counts[class * gridDim.x + block] (class-major: one exclusive scan then gives every
// block's place in every list). A thread resolves CLASS_ITEMS pieces at once, their loads in
// flight together (piece -> payload -> feature's dim); it ran no faster than one at a time at
// mixed (v35), where both partition kernels are bound by their bytes.
__global__ void __launch_bounds__(CLASS_THREADS) piece_class_count_kernel(
    const int64_t* __restrict__ pieces, const int32_t* __restrict__ counts, const int32_t* __restrict__ order,
    Payload pay, int classes, uint8_t* __restrict__ cls,
    int32_t* __restrict__ block_counts) {
  __shared__ int32_t tally[MAX_LANE_CLASSES];
  if (threadIdx.x < MAX_LANE_CLASSES) tally[threadIdx.x] = 0;
  __syncthreads();
  int64_t lo, hi;
  class_share(counts[0], lo, hi);
  for (int64_t t0 = lo; t0 < hi; t0 += CLASS_TILE) {  // block-uniform, so whole warps match
    int64_t start[CLASS_ITEMS];
    int32_t o[CLASS_ITEMS];
#pragma unroll
    for (int i = 0; i < CLASS_ITEMS; ++i) {
      const int64_t r = t0 + i * CLASS_THREADS + threadIdx.x;
      start[i] = r < hi ? pieces[r] >> 2 : -1;
    }
#pragma unroll
    for (int i = 0; i < CLASS_ITEMS; ++i) o[i] = start[i] >= 0 ? order[start[i]] : 0;
#pragma unroll
    for (int i = 0; i < CLASS_ITEMS; ++i) {
      const int64_t r = t0 + i * CLASS_THREADS + threadIdx.x;
      int c = classes;
      if (start[i] >= 0) {
        const int64_t dim = __ldg(pay.meta + (int64_t)pay.feature_of(o[i]) * META_W);
        c = min(classes - 1, piece_lane_class(dim));
        cls[r] = (uint8_t)c;
      }
      const unsigned peers = __match_any_sync(0xffffffffu, c);
      if (c < classes && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(tally + c, __popc(peers));
    }
  }
  __syncthreads();
  if (threadIdx.x < classes) block_counts[(int64_t)threadIdx.x * gridDim.x + blockIdx.x] = tally[threadIdx.x];
}

// One block: block_counts (classes x blocks, class-major) to their exclusive sums in place, and
// each class's size and the start of its list into info[0, classes) and info[classes, 2 classes).
__global__ void __launch_bounds__(CLASS_SCAN_THREADS) piece_class_scan_kernel(int32_t* __restrict__ block_counts,
                                                                             int blocks, int classes,
                                                                             int32_t* __restrict__ info) {
  using Scan = cub::BlockScan<int32_t, CLASS_SCAN_THREADS>;
  __shared__ typename Scan::TempStorage tmp;
  const int total = blocks * classes;
  int32_t v[CLASS_SCAN_ITEMS];
#pragma unroll
  for (int i = 0; i < CLASS_SCAN_ITEMS; ++i) {
    const int at = threadIdx.x * CLASS_SCAN_ITEMS + i;
    v[i] = at < total ? block_counts[at] : 0;
  }
  int32_t all;
  Scan(tmp).ExclusiveSum(v, v, all);
#pragma unroll
  for (int i = 0; i < CLASS_SCAN_ITEMS; ++i) {
    const int at = threadIdx.x * CLASS_SCAN_ITEMS + i;
    if (at < total) {
      block_counts[at] = v[i];
      if (at % blocks == 0) info[classes + at / blocks] = v[i];  // where class at / blocks begins
    }
  }
  __syncthreads();
  if (threadIdx.x < classes) {
    const int c = threadIdx.x;
    info[c] = (c + 1 < classes ? info[classes + c + 1] : all) - info[classes + c];
  }
}

// Each block copies its share of the list into the classes' lists, in order, a tile at a time: a
// piece's place in its list is the block's running place for its class, plus the pieces of its
// class in the tile's slots before its own (a warp scan over the slots, a warp a class), plus the
// lanes before it in its slot.
__global__ void __launch_bounds__(CLASS_THREADS) piece_class_scatter_kernel(
    const int64_t* __restrict__ pieces, const int32_t* __restrict__ counts, const uint8_t* __restrict__ cls,
    int classes, const int32_t* __restrict__ block_starts, int64_t* __restrict__ lists) {
  static_assert(CLASS_SLOTS == 32 && CLASS_THREADS / 32 >= MAX_LANE_CLASSES, "a warp scans a class's slots");
  __shared__ int32_t place[MAX_LANE_CLASSES];
  __shared__ int32_t tally[CLASS_SLOTS][MAX_LANE_CLASSES];  // a slot's pieces of each class, then their exclusive sums
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x < classes) place[threadIdx.x] = block_starts[(int64_t)threadIdx.x * gridDim.x + blockIdx.x];
  int64_t lo, hi;
  class_share(counts[0], lo, hi);
  for (int64_t t0 = lo; t0 < hi; t0 += CLASS_TILE) {  // block-uniform
    for (int k = threadIdx.x; k < CLASS_SLOTS * MAX_LANE_CLASSES; k += CLASS_THREADS) (&tally[0][0])[k] = 0;
    int c[CLASS_ITEMS];
    int64_t piece[CLASS_ITEMS];
    unsigned peers[CLASS_ITEMS];
#pragma unroll
    for (int i = 0; i < CLASS_ITEMS; ++i) {
      const int64_t r = t0 + i * CLASS_THREADS + threadIdx.x;
      c[i] = r < hi ? cls[r] : classes;
      piece[i] = r < hi ? pieces[r] : 0;
    }
    __syncthreads();  // the tallies are zero
#pragma unroll
    for (int i = 0; i < CLASS_ITEMS; ++i) {
      peers[i] = __match_any_sync(0xffffffffu, c[i]);
      if (c[i] < classes && lane == __ffs(peers[i]) - 1)
        tally[i * (CLASS_THREADS / 32) + warp][c[i]] = __popc(peers[i]);
    }
    __syncthreads();
    int32_t tile = 0;
    if (warp < classes) {  // warp c: class c's slots, one a lane, to exclusive sums
      const int32_t mine = tally[lane][warp];
      int32_t sum = mine;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int32_t up = __shfl_up_sync(0xffffffffu, sum, d);
        if (lane >= d) sum += up;
      }
      tally[lane][warp] = sum - mine;
      tile = __shfl_sync(0xffffffffu, sum, 31);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < CLASS_ITEMS; ++i) {
      if (c[i] < classes)
        lists[place[c[i]] + tally[i * (CLASS_THREADS / 32) + warp][c[i]] + __popc(peers[i] & ((1u << lane) - 1u))] =
            piece[i];
    }
    __syncthreads();  // every place read
    if (warp < classes && lane == 0) place[warp] += tile;
  }
}

// Whether row `key` is marked in one of the plan kernel's bitmaps: `multi` (more than one lookup
// in the batch) or `touched` (any lookup).
__device__ __forceinline__ bool row_marked(const uint32_t* __restrict__ bitmap, int64_t key) {
  return (__ldg(bitmap + (key >> 5)) >> (key & 31)) & 1u;
}

// Rows read by exactly one lookup of the batch, in bag order: the plan gives them no piece, and
// here the lanes of a bag (a group sized by its feature's dim, as in the forward) finish each of
// its lookups whose row is not marked multi. The bag's gradient row is read from L1/L2 once per
// lookup instead of from DRAM (sorted by row, the lookups of one bag scatter over the whole piece
// list, and each read of its gradient row costs a DRAM round trip); the arithmetic is the piece
// kernel's for a one-lookup piece (acc = g * scale, then finish_row), so either path gives the
// same bits (row-wise Adagrad's sum of squares too: row_sum_of_squares is the same for any lanes).
// The group's lanes first load G of the bag's ids, their marks and scales at once (lane l: lookup
// j0 + l), so a lookup's weight row waits on one round trip, not on its id, then its mark, then
// the row; UNROLL lookups' weight rows are then in flight together, their keys shuffled from the
// lanes that loaded them (4 at one chunk a lane, except row-wise Adagrad's 1 there, and 1 above).
// Unbounded, nvcc took 96-198 registers (1-2 blocks an SM, a latency-bound kernel);
// singleton_min_blocks asks for 2-4 where the optimizer's kernel fits them without spilling (or,
// at V = 4, barely: 28 bytes). More lookups in flight spilled under these bounds. Grid: (blocks
// of bags, features).
template <int OPT, int V>
constexpr int singleton_min_blocks() {
  return V >= 8 ? 1 : V >= 4 ? (OPT == 1 ? 1 : 2) : OPT == 0 ? 3 : (OPT == 2 && V == 1) ? 4 : 2;
}

template <typename W, typename I, int OPT, int V>
__global__ void __launch_bounds__(256, singleton_min_blocks<OPT, V>()) singleton_kernel(
    const I* __restrict__ values, const I* __restrict__ offsets, const float* __restrict__ psw,
    const int64_t* __restrict__ key_index, const uint32_t* __restrict__ multi, const float* __restrict__ grad,
    const int64_t* __restrict__ grad_rows, PieceArgs a, int64_t batch_size, int64_t total_dim, bool grad_vec,
    W* __restrict__ out, int64_t num_values) {
  constexpr int UNROLL = V == 1 ? (OPT == 2 ? 1 : 4) : 1;
  const int64_t feature = blockIdx.y;
  const int64_t* m = a.meta + feature * META_W;
  const int64_t dim = m[0], base = m[1], col = m[2], row_base = m[5];
  const bool mean = m[3] == 1;
  const int64_t key_at = key_index[feature] * batch_size;
  const bool row_vec = dim % 4 == 0 && base % 4 == 0 && grad_vec && col % 4 == 0;
  const int own = group_lanes((int)((dim + 4 * V - 1) / (4 * V)));  // 4 * V * G columns cover the dim
  // Row-wise Adagrad takes the piece kernel's width a.G where rows are not 4-aligned or V = 4 (any
  // width gives the same bits; with its own width there, nvcc spilled at 48 registers).
  const int G = (OPT == 2 && (V != 1 || !row_vec)) ? a.G : own;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / G, sl = lane % G;
  const int per_warp = 32 / G;
  // Row-wise Adagrad: the piece kernel's layout for the row (every path must give a row the same
  // bits, and its sum of squares follows the layout); its 4-wide gradient rows are aligned here (a
  // bag's row at an aligned column of an aligned width; not where grad_rows name the rows and the
  // dim is odd), so add_row never takes the unaligned loads an odd dim would need guarded. The
  // other optimizers' bits do not depend on the layout: the 4-wide one only where the row is
  // aligned too (the odd dims' masks spilled this kernel, 28 bytes at V = 1 with SGD).
  constexpr bool ODD = OPT == 2;
  const RowLanes L = ODD ? row_lanes(dim, base, grad_vec && col % 4 == 0 && (dim % 4 == 0 || grad_rows == nullptr),
                                     sl, G)
                         : RowLanes{row_vec, row_vec, sl, G, dim};
  float t;
  const Hyper h = read_hyper<OPT>(a, t);
  const int64_t stride = (int64_t)gridDim.x * (blockDim.x >> 5) * per_warp;
  for (int64_t b0 = ((int64_t)blockIdx.x * (blockDim.x >> 5) + warp) * per_warp; b0 < batch_size; b0 += stride) {
    const int64_t b = b0 + sub;
    const bool live = b < batch_size;
    int64_t start = live ? (int64_t)offsets[key_at + b] : 0;
    int64_t end = live ? (int64_t)offsets[key_at + b + 1] : 0;
    if (!bag_in_values(start, end, num_values)) start = end = 0;  // the forward reported it
    const int len = (int)(end - start);
    int most = len;  // the warp's longest bag: the loops below stay warp-uniform (shuffles, finish_row's)
    for (int off = 16; off > 0; off >>= 1) most = max(most, __shfl_xor_sync(0xffffffffu, most, off));
    const float bag_scale = mean ? 1.f / (float)(len > 1 ? len : 1) : 1.f;
    const float* g = grad + (grad_rows ? (live ? grad_rows[b] : 0) : b * total_dim) + col;  // (Payload's grad_rows)
    for (int j0 = 0; j0 < most; j0 += G) {
      // lane sl of the group: lookup j0 + sl's row, whether it is finished here, its scale
      const bool mine = j0 + sl < len;
      const long long my_key = row_base + (mine ? clamp_id((int64_t)values[start + j0 + sl], m[4]) : 0);
      const bool my_fin = mine && !row_marked(multi, my_key);
      const float my_s = psw && my_fin ? bag_scale * psw[start + j0 + sl] : bag_scale;
      const int count = min(G, most - j0);  // warp-uniform
      for (int u0 = 0; u0 < count; u0 += UNROLL) {
        int64_t key[UNROLL];
        float s[UNROLL];
        unsigned fin = 0;  // bit u: lookup j0 + u0 + u is live and its row has no other lookup
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int from = u0 + u < G ? u0 + u : 0;  // a group's lane (the shuffle's width is G)
          key[u] = __shfl_sync(0xffffffffu, my_key, from, G);
          s[u] = __shfl_sync(0xffffffffu, my_s, from, G);
          fin |= (__shfl_sync(0xffffffffu, (int)my_fin, from, G) && u0 + u < count) ? 1u << u : 0u;
        }
        float4 w[UNROLL][V];
        float state[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) state[u] = row_state<OPT>(a.s1, key[u], fin >> u & 1);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
          for (int k = 0; k < V; ++k)
            w[u][k] = (OPT >= 0 && (fin >> u & 1)) ? L.load_rw<true>(out + base + (key[u] - row_base) * dim, k)
                                                         : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const bool f = fin >> u & 1;
          float4 acc[V];
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (f) L.add_row<V, false>(acc, g, s[u]);
          finish_row<W, OPT, V, ODD, true>(acc, w[u], state[u], L, f, out, base + (key[u] - row_base) * dim, key[u],
                                           a.s1, a.s2, h, t);
        }
      }
    }
  }
}

// Rows of more than PIECE lookups (hot ids, tiny tables) leave one partial sum per piece. Piece j
// of the row starting at sorted position `start` has its slot at 2 * ((start + j * PIECE) / PIECE)
// (+ 1 for the first piece, which may share its PIECE-block with an earlier row's piece).
__device__ __forceinline__ const float* partial_of(const PieceArgs& a, int64_t start, int64_t j) {
  return a.partials + (2 * ((start + j * PIECE) / PIECE) + (j == 0 ? 1 : 0)) * a.partial_stride;
}

// Adds partials j0 .. j1 - 1 of a split row to acc, in piece order; the per-component order of
// the additions is the same in both forms. A row read 20k times (dlrm-kaggle's 3-row tables) has
// 700 of them, so several are loaded before they are added:
// - HOIST false (split_row_kernel): UNROLL partials a chunk, chunk after chunk (V round trips a
//   step at V > 1; few registers, so many rows a SM), the last ones one by one;
// - HOIST true (long_row_kernel): all V chunks of UNROLL partials, the last step's predicated,
//   then the adds (one round trip a step; V * UNROLL float4 in flight a lane).
template <int V, bool HOIST>
__device__ __forceinline__ void add_partials(float4 (&acc)[V], const RowLanes& L, const PieceArgs& a, int64_t start,
                                             int64_t j0, int64_t j1) {
  constexpr int UNROLL = V == 1 ? 8 : (HOIST && V == 8) ? 1 : 2;
  int64_t j = j0;
  if constexpr (HOIST) {
    for (; j < j1; j += UNROLL) {
      float4 v[UNROLL][V];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int k = 0; k < V; ++k)
          v[u][k] = j + u < j1 ? L.load_rw(partial_of(a, start, j + u), k) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int k = 0; k < V; ++k)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (j + u < j1) {
            acc[k].x += v[u][k].x; acc[k].y += v[u][k].y; acc[k].z += v[u][k].z; acc[k].w += v[u][k].w;
          }
        }
    }
  } else {
    for (; j + UNROLL <= j1; j += UNROLL) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = L.load_rw(partial_of(a, start, j + u), k);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          acc[k].x += v[u].x; acc[k].y += v[u].y; acc[k].z += v[u].z; acc[k].w += v[u].w;
        }
      }
    }
    for (; j < j1; ++j) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float4 v = L.load_rw(partial_of(a, start, j), k);
        acc[k].x += v.x; acc[k].y += v.y; acc[k].z += v.z; acc[k].w += v.w;
      }
    }
  }
}

// A split row goes to long_row_kernel (a block a row) when one group adding its partials in
// split_row_kernel would make a chain of more than LONG_ROW_LOADS dependent loads (~30 us at a
// loaded HBM round trip, ~0.5 us): more than 512 pieces at V = 1 (eight partials a round trip),
// 32 at V = 4, 16 at V = 8 (two partials a step, a round trip a chunk). Shorter chains cost about
// the ~20 loads of the binary search every split row pays first, and a block would idle most of
// its groups for them and hold a block's registers (one or two blocks a SM at V >= 4); the extra
// launch and block rounds cost more than they save (zipf's rows of ~50 pieces at D=32). Zipf's
// hottest rows at D=256 have hundreds of pieces: one group's chain of ~1,700 loads ran 0.9 ms
// while the rest of the GPU idled (v16 in docs/perf-notes.md).
constexpr int64_t LONG_ROW_LOADS = 64;
template <int V>
__host__ __device__ constexpr int64_t one_group_loads(int64_t pieces) {
  return V == 1 ? (pieces + 7) / 8 : (pieces + 1) / 2 * V;
}
constexpr int64_t MIN_LONG_ROW_LOOKUPS = 16 * PIECE + 1;  // the shortest long row (V = 8)

// A long row of more pieces than a block adds in a short chain is cut into slices, a block each
// (long_row_kernel): Zipf's hottest row can be read 440k times in a batch (13.8k pieces), and one
// block adding them all was a chain of ~430 round trips a group, 382 us of a 1.9 ms step, while
// the other SMs idled (perf-notes v66). A slice holds long_slice_group_pieces pieces for each of
// the block's groups: ~16 round trips a group at its loads in flight (add_partials<V, true>).
template <int V>
__host__ __device__ constexpr int64_t long_slice_group_pieces() { return V == 1 ? 128 : V == 8 ? 16 : 32; }
template <int V>
__host__ __device__ constexpr int64_t long_slice_pieces(int G) {
  return long_slice_group_pieces<V>() * (PIECE_THREADS / G);
}
inline int64_t long_slice_pieces(int V, int G) {
  return V == 1 ? long_slice_pieces<1>(G) : V == 8 ? long_slice_pieces<8>(G) : long_slice_pieces<4>(G);
}
// The long rows' workspace, in int64 words: their two int32 counts (one word, to be zeroed), then
// LONG_ROW_WORDS words a long row (start, pieces, first slice, slices done), then a word a slice
// (its long row). n lookups have at most n / MIN_LONG_ROW_LOOKUPS long rows, whose pieces number
// at most n / PIECE + one a row.
constexpr int64_t LONG_ROW_WORDS = 4;
struct LongRowSpace {
  int64_t most_long, most_slices;
  int64_t words() const { return 1 + LONG_ROW_WORDS * most_long + most_slices; }
  int32_t* counts(int64_t* base) const { return reinterpret_cast<int32_t*>(base); }
  int64_t* rows(int64_t* base) const { return base + 1; }
  int64_t* slices(int64_t* base) const { return base + 1 + LONG_ROW_WORDS * most_long; }
};
inline LongRowSpace long_row_space(int64_t n, int V, int G) {
  const int64_t most_long = n / MIN_LONG_ROW_LOOKUPS;
  // (a row's ceil(lookups / PIECE) pieces, ceil(pieces / slice) slices: a slack word or two each)
  return LongRowSpace{most_long,
                      most_long > 0 ? (n / PIECE + 2 * most_long + 1) / long_slice_pieces(V, G) + most_long + 1 : 0};
}

// piece_update's launch shape (tools/backward_kernel_bench.cu launches the same). Lanes per piece:
// by default enough for the widest row in one float4 a lane (V = 1, up to 128 columns), four
// (V = 4, up to 512) or eight (V = 8, up to 1024: MAX_DIM), as many lanes as the widest row needs
// at V float4 a lane (a 256-wide row takes 16 lanes at V = 4, two pieces a warp: 32 left half of
// them idle, v13). `lanes` > 0 asks for fewer lanes with four float4 each (V = 4, 16 * lanes >=
// max_dim): more pieces per warp (pooled_cuda's "fewest lanes" paths, measured per shape: 500
// tables of rows read about once at dim 64 updated 11% faster, v20); piece_update_for gives it to
// the piece kernel only. The grid is persistent: a few waves of resident blocks (as
// pooled_triton._programs), never more than there are items (pieces, split rows, long rows) for;
// the kernels read the counts on the device.
struct PieceShape {
  int V, G;
  int64_t sms;
  static constexpr int64_t WAVES = 8;
  unsigned grid(int64_t items) const {  // groups of G lanes, one item each
    const int64_t groups_per_block = PIECE_THREADS / G;
    return (unsigned)std::max<int64_t>(1, std::min<int64_t>(sms * WAVES, (items + groups_per_block - 1) / groups_per_block));
  }
  unsigned long_grid(int64_t most_slices) const {  // a block a long row's slice
    return (unsigned)std::max<int64_t>(1, std::min<int64_t>(sms * WAVES, most_slices));
  }
};
inline PieceShape piece_shape(int64_t max_dim, int64_t lanes, int64_t sms) {
  const bool four = lanes > 0 || max_dim > 128, eight = lanes == 0 && max_dim > 512;
  const int V = eight ? 8 : four ? 4 : 1;
  return PieceShape{V, lanes > 0 ? (int)lanes : group_lanes((int)((max_dim + 4 * V - 1) / (4 * V))), sms};
}

// One row's view of the feature it belongs to: lanes, and where its weights start.
struct SplitRow {
  RowLanes L;
  int64_t row_at;
};
template <typename K>
__device__ __forceinline__ SplitRow split_row_of(const Payload& pay, const PieceArgs& a, const int32_t* order,
                                                 int64_t start, K key, bool active, int sl, int G) {
  const int32_t f = active ? pay.feature_of(order[start]) : 0;
  const int64_t* m = a.meta + (int64_t)f * META_W;
  // (partials are stored by column, so a split row takes any layout: the 4-wide one where its
  // addresses are aligned, as before v57)
  const int64_t dim = active ? m[0] : 1;
  const RowLanes L = row_lanes(dim, m[1], dim % 4 == 0 && m[1] % 4 == 0, sl, G);
  return SplitRow{L, m[1] + ((int64_t)key - m[5]) * L.dim};
}

// Split rows of short chains (see LONG_ROW_LOADS): one group of G lanes per row adds the row's
// pieces' partial sums in piece order (deterministic) and finishes the row. Longer rows are
// appended to the long-row list, their slices to the slice list (long_row_space), for
// long_row_kernel. The Triton backend's pooled_triton._split_row_kernel adds the same partials in
// tiles of BLOCK_K.
template <typename W, typename K, int OPT, int V>
__global__ void __launch_bounds__(256) split_row_kernel(const K* __restrict__ row_key,
                                                        const int32_t* __restrict__ order, Payload pay, PieceArgs a,
                                                        W* __restrict__ out) {
  const int64_t num = a.counts[1];
  const LaneGroups lg(a.G);
  float t;
  const Hyper h = read_hyper<OPT>(a, t);
  for (int64_t r0 = lg.first; r0 < num; r0 += lg.stride) {
    const int64_t r = r0 + lg.sub;
    const bool listed = r < num;
    const int64_t start = listed ? a.split_rows[r] : 0;
    const K key = row_key[start];
    // The row's end: the upper bound of key in (start + PIECE, n].
    int64_t lo = start + PIECE + 1, hi = a.n;
    while (listed && lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (row_key[mid] <= key) lo = mid + 1; else hi = mid;
    }
    const int64_t count = listed ? (lo - start + PIECE - 1) / PIECE : 0;
    const bool active = listed && one_group_loads<V>(count) <= LONG_ROW_LOADS;
    const bool long_row = listed && !active;
    const int64_t per_slice = long_slice_pieces<V>(lg.G);
    const int64_t slices = long_row ? (count + per_slice - 1) / per_slice : 0;
    int64_t at = 0, first_slice = 0;
    if (long_row && lg.sl == 0) {
      at = atomicAdd(a.long_counts, 1);  // list order is arbitrary; each row's sum is not
      first_slice = atomicAdd(a.long_counts + 1, (int)slices);
      int64_t* entry = a.long_rows + LONG_ROW_WORDS * at;
      entry[0] = start;
      entry[1] = count;
      entry[2] = first_slice;
      entry[3] = 0;  // slices done (long_row_kernel)
    }
    // the group's lanes list the row's slices (the loop is warp-uniform: every lane shuffles)
    const int leader = (threadIdx.x & 31) - lg.sl;
    at = __shfl_sync(0xffffffffu, at, leader);
    first_slice = __shfl_sync(0xffffffffu, first_slice, leader);
    for (int64_t k = lg.sl; k < slices; k += lg.G) a.slice_rows[first_slice + k] = at;
    const SplitRow row = split_row_of(pay, a, order, start, key, active, lg.sl, lg.G);
    const float state = row_state<OPT>(a.s1, (int64_t)key, active);
    float4 acc[V], w[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      w[k] = (OPT >= 0 && active) ? row.L.load_rw(out + row.row_at, k) : acc[k];
    }
    add_partials<V, false>(acc, row.L, a, start, 0, active ? count : 0);
    finish_row<W, OPT, V, false>(acc, w, state, row.L, active, out, row.row_at, (int64_t)key, a.s1, a.s2, h, t);
  }
}

// Group 0's lanes (warp 0) add the block's groups' sums `acc` in group order (through `sums`).
template <int V>
__device__ __forceinline__ void block_sum(float4 (&acc)[V], float4 (&sums)[V][PIECE_THREADS], int G, int groups,
                                          int sl) {
#pragma unroll
  for (int k = 0; k < V; ++k) sums[k][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.x < G) {
    for (int g = 1; g < groups; ++g) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float4 v = sums[k][g * G + sl];
        acc[k].x += v.x; acc[k].y += v.y; acc[k].z += v.z; acc[k].w += v.w;
      }
    }
  }
}

// Split rows of long chains (split_row_kernel's long-row list and its slices, their counts on the
// device), a block a slice (long_slice_pieces pieces of the row): group g of the block's
// blockDim / G groups adds the g-th contiguous range of the slice's pieces in piece order and the
// groups' sums meet in group order. A row of one slice is finished there. A row of several leaves
// each slice's sum in the slot of the slice's first piece (which only this block reads, and has
// read); the block that ends the row's last slice (a count a row) adds the slices' sums in slice
// order, its groups again contiguous ranges, and finishes the row. Every grouping depends only on
// the row's piece count and the group width, so the bits are the same from run to run (not those
// of one group adding every piece in order: the Triton backend and split_row_kernel group the
// sums differently).
template <typename W, typename K, int OPT, int V>
__global__ void __launch_bounds__(256) long_row_kernel(const K* __restrict__ row_key,
                                                       const int32_t* __restrict__ order, Payload pay, PieceArgs a,
                                                       W* __restrict__ out) {
  __shared__ float4 sums[V][PIECE_THREADS];  // chunk k of every thread's sum
  __shared__ bool last;
  const int64_t num = a.long_counts[1];
  const int G = a.G, groups = blockDim.x / G, grp = threadIdx.x / G, sl = threadIdx.x % G;
  const int64_t per_slice = long_slice_pieces<V>(G);
  float t;
  const Hyper h = read_hyper<OPT>(a, t);
  for (int64_t s = blockIdx.x; s < num; s += gridDim.x) {  // block-uniform: __syncthreads below
    int64_t* entry = a.long_rows + LONG_ROW_WORDS * a.slice_rows[s];
    const int64_t start = entry[0], count = entry[1], slice = s - entry[2];
    const int64_t slices = (count + per_slice - 1) / per_slice;
    const K key = row_key[start];
    const SplitRow row = split_row_of(pay, a, order, start, key, true, sl, G);
    const bool first = grp == 0;  // the group that finishes the row
    const bool whole = slices == 1;
    float state = row_state<OPT>(a.s1, (int64_t)key, first && whole);
    float4 acc[V], w[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      w[k] = (OPT >= 0 && first && whole) ? row.L.load_rw(out + row.row_at, k) : acc[k];
    }
    const int64_t lo = slice * per_slice, hi = min(count, lo + per_slice);
    const int64_t per = (hi - lo + groups - 1) / groups;
    const int64_t j0 = min(hi, lo + (int64_t)grp * per), j1 = min(hi, j0 + per);
    add_partials<V, true>(acc, row.L, a, start, j0, j1);
    block_sum<V>(acc, sums, G, groups, sl);
    if (!whole) {
      float* mine = const_cast<float*>(partial_of(a, start, lo));
      if (first) {
#pragma unroll
        for (int k = 0; k < V; ++k) row.L.store(mine, k, acc[k]);
        __threadfence();  // the sum is out before the count says so
      }
      __syncthreads();  // (also: group 0 has read `sums`)
      if (threadIdx.x == 0)
        last = atomicAdd(reinterpret_cast<unsigned long long*>(entry + 3), 1ull) == (unsigned long long)slices - 1;
      __syncthreads();
      if (!last) continue;
      __threadfence();  // every slice's sum is visible to this block (read from L2: load_l2)
      state = row_state<OPT>(a.s1, (int64_t)key, first);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        w[k] = (OPT >= 0 && first) ? row.L.load_rw(out + row.row_at, k) : acc[k];
      }
      const int64_t per_group = (slices + groups - 1) / groups;
      const int64_t k0 = min(slices, (int64_t)grp * per_group), k1 = min(slices, k0 + per_group);
      for (int64_t k = k0; k < k1; ++k) {
        const float* theirs = partial_of(a, start, k * per_slice);
#pragma unroll
        for (int c = 0; c < V; ++c) {
          const float4 v = row.L.load_l2(theirs, c);
          acc[c].x += v.x; acc[c].y += v.y; acc[c].z += v.z; acc[c].w += v.w;
        }
      }
      block_sum<V>(acc, sums, G, groups, sl);
    }
    if (threadIdx.x < 32)  // warp 0: finish_row's shuffles want the whole warp
      finish_row<W, OPT, V, false>(acc, w, state, row.L, first, out, row.row_at, (int64_t)key, a.s1, a.s2, h, t);
    __syncthreads();  // the next slice's sums overwrite these
  }
}

// ---- backward planning: expand, sort, plan (the Triton backend's _expand/_plan kernels) -------
constexpr int EXPAND_BAGS = 1024;  // most bags an expand block takes (their offsets sit in shared memory)
constexpr int64_t EXPAND_LOOKUPS = 4096;  // lookups an expand block aims at: 4 a thread
// 1,024 threads: a block's bags come from the mean bag, so a feature whose bags are 12x the mean
// (DLRM-DCNv2's 100-id feature among 1-8-id ones) had 100 lookups a thread at 256, one dependent
// load after another, and its 64 blocks took 175 of the step's 1,800 us (v51).
constexpr int EXPAND_THREADS = 1024;
constexpr int PLAN_THREADS = 256;  // plan block: PLAN_ITEMS consecutive sorted positions a thread
constexpr int PLAN_ITEMS = 4;
constexpr int PLAN_BLOCK = PLAN_THREADS * PLAN_ITEMS;

// One entry per lookup at `at` = its position in values (+ the feature's shift when features do
// not read each key once): the row key it reads and the payload the sort carries with it. A block
// takes `block_bags` bags of one feature (expand_bags: ~EXPAND_LOOKUPS lookups), a thread a lookup
// at a time; its bag from a binary search of the block's bag offsets. (A fixed 1,024 bags a block
// left ~200-id bags at 64 blocks of 800 lookups a thread: 741 us for 13M lookups, v19.)
// - PACKED: the payload is feature * batch_size + bag (see Payload); a mean-pooled bag's 1/L goes
//   to bag_scale[payload]. Nothing else is written: 8 bytes a lookup.
// - else: the payload is the entry's own index, and the entry's gradient source (where its row
//   starts in grad_output), scale (sample weight x 1/L for mean pooling) and feature are written
//   for the backward to gather through the sorted payload.
template <typename I, typename K, bool PACKED>
__global__ void __launch_bounds__(EXPAND_THREADS) expand_kernel(
    const I* __restrict__ values, const I* __restrict__ offsets, const float* __restrict__ weights,
    const int64_t* __restrict__ meta, const int64_t* __restrict__ key_index, const int64_t* __restrict__ feature_base,
    K* __restrict__ row_key, int64_t* __restrict__ src, float* __restrict__ scale, int32_t* __restrict__ feature,
    int32_t* __restrict__ index, float* __restrict__ bag_scale, int64_t batch_size, int64_t total_dim,
    int block_bags, int64_t num_values, int64_t last_offset, int64_t n) {
  __shared__ int64_t offs[EXPAND_BAGS + 1];
  const int f = blockIdx.x;
  const int64_t b0 = (int64_t)blockIdx.y * block_bags;
  const int64_t* m = meta + (int64_t)f * META_W;
  const int64_t col = m[2], pooling = m[3], rows = m[4], row_base = m[5];
  const int64_t key = key_index[f];
  const int bags = (int)(batch_size - b0 < block_bags ? batch_size - b0 : block_bags);
  for (int i = threadIdx.x; i <= bags; i += blockDim.x) offs[i] = (int64_t)offsets[key * batch_size + b0 + i];
  __syncthreads();
  // Entries stay in [0, n) whatever the offsets (the forward reports bad ones): positions within
  // the values and, with per-feature bases, within the feature's key, clamped into the values as
  // pooled_triton.lookup_bases counts them.
  auto clamped = [num_values](int64_t v) { return v < 0 ? 0 : v < num_values ? v : num_values; };
  const int64_t key_first = clamped((int64_t)offsets[key * batch_size]);
  const int64_t shift = feature_base ? feature_base[f] - key_first : 0;
  int64_t v0 = offs[0] > 0 ? offs[0] : 0, v1 = offs[bags] < num_values ? offs[bags] : num_values;
  if (feature_base) {
    const int64_t key_last = clamped((int64_t)offsets[(key + 1) * batch_size]);
    v0 = v0 > key_first ? v0 : key_first;
    v1 = v1 < key_last ? v1 : key_last;
  }
  if (!feature_base && f == 0 && blockIdx.y == 0) {
    // Positions no bag covers (lengths not adding up to the values) get a harmless entry: row 0
    // of feature 0's table, from its first bag, scale 0.
    const int64_t first = (int64_t)offsets[0], last = (int64_t)offsets[last_offset];
    const int64_t head = first < 0 ? 0 : first < n ? first : n, tail = last < head ? head : last < n ? last : n;
    for (int part = 0; part < 2; ++part) {
      for (int64_t at = (part ? tail : 0) + threadIdx.x; at < (part ? n : head); at += blockDim.x) {
        row_key[at] = (K)row_base;
        index[at] = PACKED ? 0 : (int32_t)at;
        if (!PACKED) { src[at] = col; scale[at] = 0.f; feature[at] = 0; }
      }
    }
  }
  for (int64_t pos = v0 + threadIdx.x; pos < v1; pos += blockDim.x) {
    int lo = 1, hi = bags;  // the first j in [1, bags] with offs[j] > pos; its bag is j - 1
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (offs[mid] > pos) hi = mid; else lo = mid + 1;
    }
    const int j = lo - 1;
    float s = 1.f;
    if (pooling == 1) {
      const int64_t len = offs[j + 1] - offs[j];
      s = 1.f / (float)(len > 1 ? len : 1);
    }
    const int64_t at = pos + shift;
    row_key[at] = (K)(row_base + clamp_id((int64_t)values[pos], rows));
    if (PACKED) {
      const int64_t payload = (int64_t)f * batch_size + b0 + j;
      index[at] = (int32_t)payload;
      if (pooling == 1 && pos == offs[j]) bag_scale[payload] = s;  // the bag's first lookup
    } else {
      if (weights) s *= weights[pos];
      src[at] = (b0 + j) * total_dim + col;
      scale[at] = s;
      feature[at] = f;
      index[at] = (int32_t)at;
    }
  }
}

// Bags an expand block takes: a power of two near EXPAND_LOOKUPS / (the mean bag's lookups), at
// least 32, at most EXPAND_BAGS, and enough that a feature's blocks fit the grid's y (65,535).
inline int expand_bags(int64_t n, int64_t features, int64_t batch_size) {
  const int64_t mean = std::max<int64_t>(1, n / std::max<int64_t>(1, features * batch_size));
  int64_t bags = 32;
  while (bags < EXPAND_BAGS && bags * 2 * mean <= EXPAND_LOOKUPS) bags *= 2;
  while (bags < EXPAND_BAGS && (batch_size + bags - 1) / bags > 65535) bags *= 2;
  return (int)bags;
}

struct MaxOp {
  __device__ __forceinline__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};

// Where the row holding sorted position p (> 0, with key[p - 1] == key[p]) starts, by one warp
// (every lane calls it): the 32 positions before p in one round (most rows are short), then a
// 32-way search, one round of loads per factor 32. A binary search by one thread cost a dependent
// load per halving in every block that opens inside a row (zipf's hot rows: most blocks).
template <typename K>
__device__ int64_t row_start_before(const K* __restrict__ key, int64_t p, int lane) {
  const K k0 = key[p];
  const int64_t q = p - 1 - lane;
  const unsigned less = __ballot_sync(0xffffffffu, q < 0 || key[q] < k0);
  if (less) return p - (__ffs(less) - 1);  // lane j saw the previous row: the row starts at p - j
  int64_t lo = 0, hi = p - 32;             // key[hi] == k0; the start is in [lo, hi]
  while (lo < hi) {
    const int64_t step = (hi - lo + 30) / 31;  // lane 31 reaches hi (clamped): some lane sees key >= k0
    const int64_t probe = lo + lane * step < hi ? lo + lane * step : hi;
    const unsigned ge = __ballot_sync(0xffffffffu, key[probe] >= k0);
    const int j = __ffs(ge) - 1;
    if (j == 0) return lo;
    const int64_t prev = lo + (int64_t)(j - 1) * step;
    hi = lo + (int64_t)j * step < hi ? lo + (int64_t)j * step : hi;
    lo = prev + 1;
  }
  return lo;
}

// Cuts the sorted keys into pieces exactly as pooled_triton._plan_kernel: a piece starts where a
// row starts and every PIECE lookups into it; pieces (start << 2 | split << 1 | first) and the
// starts of rows longer than PIECE are appended to two lists (counts[0], counts[1], bumped by one
// 64-bit atomic a block). A thread holds PLAN_ITEMS consecutive positions. With `multi`, rows of a
// single lookup get no piece (singleton_kernel finishes them) and the others are marked in it.
// With `touched`, every row a lookup reads is marked in it (the dense backward's zeros skip them).
template <typename K>
__global__ void __launch_bounds__(PLAN_THREADS) plan_kernel(const K* __restrict__ key, int64_t n,
                                                            int64_t* __restrict__ pieces,
                                                            int64_t* __restrict__ split_rows,
                                                            int32_t* __restrict__ counts,
                                                            uint32_t* __restrict__ multi,
                                                            uint32_t* __restrict__ touched = nullptr) {
  using Scan32 = cub::BlockScan<int32_t, PLAN_THREADS>;
  __shared__ typename Scan32::TempStorage tmp;
  __shared__ int64_t opens_at;  // start of the row the block opens in, when it began earlier
  __shared__ unsigned long long base;
  const int64_t block0 = (int64_t)blockIdx.x * PLAN_BLOCK;
  const int64_t p0 = block0 + (int64_t)threadIdx.x * PLAN_ITEMS;
  if (threadIdx.x < 32) {
    int64_t lo = -1;
    if (block0 > 0 && block0 < n && key[block0 - 1] == key[block0])
      lo = row_start_before(key, block0, threadIdx.x);
    if (threadIdx.x == 0) opens_at = lo;
  }
  bool live[PLAN_ITEMS], first[PLAN_ITEMS], longer[PLAN_ITEMS], single[PLAN_ITEMS];
  int32_t last_first[PLAN_ITEMS];
#pragma unroll
  for (int i = 0; i < PLAN_ITEMS; ++i) {
    const int64_t p = p0 + i;
    live[i] = p < n;
    const K k = live[i] ? key[p] : K(0);
    first[i] = live[i] && (p == 0 || key[p - 1] != k);
    longer[i] = live[i] && p + PIECE < n && key[p + PIECE] == k;
    single[i] = first[i] && !(p + 1 < n && key[p + 1] == k);
    if (multi && first[i] && !single[i]) atomicOr(multi + ((int64_t)k >> 5), 1u << ((int64_t)k & 31));
    if (touched && first[i]) atomicOr(touched + ((int64_t)k >> 5), 1u << ((int64_t)k & 31));
    last_first[i] = first[i] ? (int32_t)(p - block0) : -1;
  }
  // The last row start at or before each position within the block (offsets in the block).
  Scan32(tmp).InclusiveScan(last_first, last_first, MaxOp());
  __syncthreads();
  int32_t flags[PLAN_ITEMS];  // piece start in the low 16 bits, split-row start in the high
  int64_t packed[PLAN_ITEMS];
  bool is_start[PLAN_ITEMS], is_row[PLAN_ITEMS];
#pragma unroll
  for (int i = 0; i < PLAN_ITEMS; ++i) {
    const int64_t p = p0 + i;
    const int64_t run_start = last_first[i] >= 0 ? block0 + last_first[i] : opens_at;
    const int64_t depth = p - run_start;
    const bool start = live[i] && depth % PIECE == 0 && !(multi && single[i]);
    const bool split = start && (depth >= PIECE || longer[i]);
    const bool row = first[i] && longer[i];
    is_start[i] = start;
    is_row[i] = row;
    flags[i] = (start ? 1 : 0) | (row ? 1 << 16 : 0);
    packed[i] = p * 4 + (split ? 2 : 0) + (first[i] ? 1 : 0);
  }
  int32_t total;
  Scan32(tmp).ExclusiveSum(flags, flags, total);
  if (threadIdx.x == 0)
    base = atomicAdd(reinterpret_cast<unsigned long long*>(counts),
                     (unsigned long long)(total & 0xffff) | ((unsigned long long)(total >> 16) << 32));
  __syncthreads();
  const int64_t piece_base = (int64_t)(base & 0xffffffffull), row_base = (int64_t)(base >> 32);
#pragma unroll
  for (int i = 0; i < PLAN_ITEMS; ++i) {
    if (is_start[i]) pieces[piece_base + (flags[i] & 0xffff)] = packed[i];
    if (is_row[i]) split_rows[row_base + (flags[i] >> 16)] = p0 + i;
  }
}

// ---- the dense backward's zeros ---------------------------------------------------------------
// With no optimizer the backward writes every row a lookup touched whole (the piece, split-row,
// long-row and singleton kernels store the row's sum), so the rest of the gradient needs zeros,
// not all of it. zero_untouched_kernel writes them, skipping the rows plan_kernel marked in
// `touched` (zeroing the whole buffer first wrote the touched rows twice: at the mixed workload
// 2.0 of its 11.3 GB). It skips only the 64-byte blocks that lie inside a touched row and zeroes
// every other block, the row's edges included, which the pieces then write again: a block left
// partly written costs the memory a read to merge it, and with every touched row's edges left so,
// the kernel ran the mixed workload no faster than zeroing everything (perf-notes v31); skipping
// only whole 128- or 256-byte lines inside a touched row wrote more and ran 3-7% slower (v34). It
// runs before the piece kernels, so an element it cannot place in a table gets a zero that they
// overwrite: the result never depends on how `meta` is ordered, only the bytes saved do.
// A warp takes a tile of ZERO_ITEMS runs of 32 blocks; a lane classifies one block of each run,
// the runs' bitmap words are loaded together, and each run is stored as four coalesced 512-byte
// rows of chunks, a chunk a lane, its block's verdict from a ballot. The stores are streaming
// (evict-first): the zero kernel ran 1% faster at the mixed workload (v34). A module's features
// come table by table, so their element bases ascend: a warp finds the table of its tile's first
// block by a search and each lane walks on from there.
constexpr int ZERO_THREADS = 256;
constexpr int ZERO_ITEMS = 8;  // runs of 32 blocks a warp's tile: 16 KB, a CTA's 128 KB
constexpr int32_t ZERO_BLOCK = -2, SKIP_BLOCK = -1;  // a block's verdict where no row's bit is left to check

// How many of meta's first `n` features have an element base at most x (where the bases ascend),
// by one warp (every lane calls it): a 32-way search, a round of loads per factor 32.
__device__ __forceinline__ int features_at_or_before(const int64_t* __restrict__ meta, int n, int64_t x, int lane) {
  int lo = 0, hi = n;  // the count is in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + 31) / 32;
    const int p = lo + lane * step;
    const unsigned le = __ballot_sync(0xffffffffu, p < hi && __ldg(meta + (int64_t)p * META_W + 1) <= x);
    if (!le) return lo;
    const int last = lo + (31 - __clz(le)) * step;  // a probe at or before x; the next one is past it
    lo = last + 1;
    hi = min(hi, last + step);
  }
  return lo;
}

// A feature's table as the zeros see it: elements [base, end), rows of `dim` numbered from
// `row_base` (the zeros run where the group's rows fit a bitmap: below 2^31, as the dims).
struct ZeroTable {
  int64_t base = 0, end = 0;
  int32_t dim = 1, row_base = 0;
  __device__ __forceinline__ void load(const int64_t* __restrict__ meta, int f) {
    const int64_t* m = meta + (int64_t)f * META_W;
    dim = (int32_t)__ldg(m + 0);
    base = __ldg(m + 1);
    end = base + __ldg(m + 4) * dim;
    row_base = (int32_t)__ldg(m + 5);
  }
  __device__ __forceinline__ int64_t row_of(int64_t x) const {  // x in [base, end)
    const uint64_t off = (uint64_t)(x - base);
    return off < (1ull << 32) ? (int64_t)((uint32_t)off / (uint32_t)dim) : (int64_t)(off / (uint64_t)dim);
  }
};

// Zeroes chunk `e` (16 bytes from element e) of the gradient, element by element where it passes the end.
template <typename W>
__device__ __forceinline__ void zero_chunk(W* __restrict__ out, int64_t e, int64_t numel) {
  constexpr int VEC = 16 / sizeof(W);
  if (e + VEC <= numel) {
    __stcs(reinterpret_cast<float4*>(out + e), make_float4(0.f, 0.f, 0.f, 0.f));
    return;
  }
  for (int64_t x = e; x < numel; ++x) out[x] = from_f<W>(0.f);
}

template <typename W>
__global__ void __launch_bounds__(ZERO_THREADS) zero_untouched_kernel(W* __restrict__ out, int64_t numel,
                                                                      const uint32_t* __restrict__ touched,
                                                                      const int64_t* __restrict__ meta,
                                                                      int num_features) {
  constexpr int VEC = 16 / sizeof(W);
  constexpr int64_t BLK = 4 * VEC;  // elements in a 64-byte block
  const int lane = threadIdx.x & 31;
  const int64_t b0 = ((int64_t)blockIdx.x * (ZERO_THREADS / 32) + (threadIdx.x >> 5)) * 32 * ZERO_ITEMS;
  int f = features_at_or_before(meta, num_features, b0 * BLK, lane) - 1;
  ZeroTable t;  // end 0 until a table is loaded
  if (f >= 0) t.load(meta, f);
  // The row (bitmap key) inside which the lane's block of each run lies, its bit still to load;
  // below 0: the verdict (ZERO_BLOCK, or SKIP_BLOCK past the end).
  int32_t key[ZERO_ITEMS];
#pragma unroll
  for (int i = 0; i < ZERO_ITEMS; ++i) {
    const int64_t b = (b0 + i * 32 + lane) * BLK;
    key[i] = b < numel ? ZERO_BLOCK : SKIP_BLOCK;
    if (b >= numel) continue;
    // on to the last feature (in meta's order) whose table starts at or before b
    while (b >= t.end && f + 1 < num_features && __ldg(meta + (int64_t)(f + 1) * META_W + 1) <= b) t.load(meta, ++f);
    if (f >= 0 && b >= t.base && b + BLK <= t.end) {
      const int64_t r = t.row_of(b);
      if (b + BLK <= t.base + (r + 1) * t.dim) key[i] = (int32_t)(t.row_base + r);  // inside row r
    }
  }
  uint32_t word[ZERO_ITEMS];
#pragma unroll
  for (int i = 0; i < ZERO_ITEMS; ++i) word[i] = key[i] >= 0 ? __ldg(touched + (key[i] >> 5)) : 0u;
#pragma unroll
  for (int i = 0; i < ZERO_ITEMS; ++i) {
    const bool zero = key[i] == ZERO_BLOCK || (key[i] >= 0 && !((word[i] >> (key[i] & 31)) & 1u));
    const unsigned z = __ballot_sync(0xffffffffu, zero);
    const int64_t run = (b0 + i * 32) * BLK;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = j * 32 + lane;  // chunk c of the run lies in its block c / 4
      if ((z >> (c >> 2)) & 1u) zero_chunk(out, run + (int64_t)c * VEC, numel);
    }
  }
}

#ifndef RECOM_REC_KERNELS_ONLY
template <typename F>
void dispatch_weight(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "recom_rec cuda backend: unsupported weight dtype ", t);
  }
}

template <typename W>
W* wptr(const at::Tensor& t) { return reinterpret_cast<W*>(t.data_ptr()); }

#endif
}  // namespace
