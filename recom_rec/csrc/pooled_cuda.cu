// Fused pooled embedding lookups in CUDA C++ (backend="cuda"): the forward, and the backward's
// piece kernel with the optimizer fused in. Same contract as recom_rec/kernels/pooled_triton.py:
// one flat weight buffer per group, `feature_meta` rows of META_W int64 (dim, element base, output
// column, pooling, rows, row base, table), a KJT's values/offsets. The backward's plan (sorted row
// keys, pieces, split rows) is the Triton backend's, in one host call here: the expand and plan
// kernels ported, and a CUB radix sort of only the key bits the group's rows need, carrying 32-bit
// lookup indices (torch.sort sorts all 32 or 64 bits and carries 64-bit ones).
//
// Why a second implementation: Triton runs the lanes of a program in lock-step over a fixed
// [bags x BLOCK_D] tile, so a dim-8 table in a launch whose widest table is 128 wastes 15/16 of its
// lanes, and the backward's dependent loads (piece -> key -> order -> source -> gradient row) are
// serialised per program. Here each bag (forward) or piece (backward) gets a group of G lanes sized
// by its own table's dim at run time, 16-byte accesses, and four lookups' loads in flight at once.
#ifndef RECOM_REC_KERNELS_ONLY  // defined by tests that compile the kernels without torch's headers
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif
#include <cstdint>
#include <type_traits>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
__device__ __forceinline__ float4 fma4(float4 g, float s, float4 acc) {
  return make_float4(acc.x + g.x * s, acc.y + g.y * s, acc.z + g.z * s, acc.w + g.w * s);
}

// Lanes per bag or piece: enough chunks for the dim, a power of two, at most a warp.
__host__ __device__ __forceinline__ int group_lanes(int chunks) {
  int g = 1;
  while (g < chunks && g < 32) g <<= 1;
  return g;
}

// A feature's rows can be read 4 wide when every address it touches is 16-byte aligned
// (8-byte for two-byte types): dim, table base and output column multiples of 4.
__device__ __forceinline__ bool vec_ok(int64_t dim, int64_t base, int64_t col, int64_t total_dim) {
  return (dim % 4 == 0) && (base % 4 == 0) && (col % 4 == 0) && (total_dim % 4 == 0);
}

// ---- forward ---------------------------------------------------------------------------------
// Grid (features, blocks of bags). Every group of G lanes pools one bag: G = lanes for the
// feature's dim, so narrow tables pack several bags per warp. A bag's ids are summed in input
// order in fp32 (the same order as the Triton kernel: equal results in fp32).
template <typename W, typename I>
__global__ void __launch_bounds__(256) pooled_forward_kernel(
    const W* __restrict__ flat, const I* __restrict__ values, const I* __restrict__ offsets,
    const float* __restrict__ psw, const int64_t* __restrict__ meta, const int64_t* __restrict__ key_index,
    float* __restrict__ out, int64_t batch_size, int64_t total_dim) {
  const int64_t* m = meta + (int64_t)blockIdx.x * META_W;
  const int64_t dim = m[0], base = m[1], col = m[2];
  const bool mean = m[3] == 1;
  const int64_t key = key_index[blockIdx.x];
  const bool vec = vec_ok(dim, base, col, total_dim);
  const int chunks = vec ? (int)(dim / 4) : (int)dim;
  const int G = group_lanes(chunks);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane / G, sl = lane % G;
  const int bags_per_warp = 32 / G;
  const int bags_per_block = bags_per_warp * (blockDim.x >> 5);
  for (int64_t b = (int64_t)blockIdx.y * bags_per_block + warp * bags_per_warp + sub; b < batch_size;
       b += (int64_t)gridDim.y * bags_per_block) {
    const int64_t bag = key * batch_size + b;
    const int64_t start = offsets[bag], end = offsets[bag + 1];
    const float inv = (mean && end > start) ? 1.0f / (float)(end - start) : 1.0f;
    float* o = out + b * total_dim + col;
    if (vec) {
      for (int c = sl; c < chunks; c += G) {
        const W* w = flat + base + 4 * c;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        int64_t i = start;
        for (; i + 4 <= end; i += 4) {  // four rows in flight
          const int64_t i0 = values[i], i1 = values[i + 1], i2 = values[i + 2], i3 = values[i + 3];
          const float4 r0 = load4(w + i0 * dim), r1 = load4(w + i1 * dim);
          const float4 r2 = load4(w + i2 * dim), r3 = load4(w + i3 * dim);
          if (psw) {
            acc = fma4(r0, psw[i], acc); acc = fma4(r1, psw[i + 1], acc);
            acc = fma4(r2, psw[i + 2], acc); acc = fma4(r3, psw[i + 3], acc);
          } else {
            acc = fma4(r0, 1.f, acc); acc = fma4(r1, 1.f, acc); acc = fma4(r2, 1.f, acc); acc = fma4(r3, 1.f, acc);
          }
        }
        for (; i < end; ++i) acc = fma4(load4(w + (int64_t)values[i] * dim), psw ? psw[i] : 1.f, acc);
        acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
        store4(o + 4 * c, acc);
      }
    } else {
      for (int c = sl; c < chunks; c += G) {
        const W* w = flat + base + c;
        float acc = 0.f;
        for (int64_t i = start; i < end; ++i) acc += to_f(w[(int64_t)values[i] * dim]) * (psw ? psw[i] : 1.f);
        o[c] = acc * inv;
      }
    }
  }
}

// ---- backward: the piece kernel -------------------------------------------------------------
struct Hyper {
  float lr, eps, beta1, beta2, wd, decoupled;
};

// The fused optimizer on one 4-wide (or scalar) chunk of a row; `g` already includes the
// coupled weight decay. Same formulas as optim/rows.py and pooled_triton._apply_rows.
template <int OPT>
__device__ __forceinline__ float apply1(float w, float g, float* s1, float* s2, int64_t at, float row_acc,
                                        const Hyper& h, float t) {
  if (OPT == 0) return w - h.lr * g;
  if (OPT == 1) {
    const float a = s1[at] + g * g;
    s1[at] = a;
    return w - h.lr * g / (sqrtf(a) + h.eps);
  }
  if (OPT == 2) return w - h.lr * g / (sqrtf(row_acc) + h.eps);
  const float mm = h.beta1 * s1[at] + (1.f - h.beta1) * g;
  const float vv = h.beta2 * s2[at] + (1.f - h.beta2) * g * g;
  s1[at] = mm;
  s2[at] = vv;
  const float m_hat = mm / (1.f - expf(t * logf(h.beta1)));
  const float v_hat = vv / (1.f - expf(t * logf(h.beta2)));
  return w - h.lr * (m_hat / (sqrtf(v_hat) + h.eps)) - h.lr * h.wd * h.decoupled * w;
}

__device__ __forceinline__ float& comp(float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// One group of G lanes per piece (a run of at most PIECE sorted lookups of one row), groups
// looping over the piece list, whose length is on the device. A group sums its piece's scaled
// gradient rows in sorted order (the row's input order: deterministic) with four lookups' loads in
// flight; a piece that is a whole row applies the optimizer (OPT >= 0) or writes the row's
// gradient (OPT < 0); a piece of a split row leaves its sum in its partial slot for the split-row
// kernel. Control flow stays warp-uniform around the shuffles (row-wise Adagrad's row sum).
//
// A lane holds V float4 accumulators: chunk k is columns 4 * (sl + k * G) .. + 3 of a row whose
// addresses are 16-byte aligned ("vec"), else element e of chunk k is column sl + (4 * k + e) * G.
// V = 1 covers dims up to 128 (G = 32) with few registers; V = 4 covers 512.
template <typename W, typename K, int OPT, int V>
__global__ void __launch_bounds__(256) piece_kernel(
    const K* __restrict__ row_key, const int32_t* __restrict__ order, const int64_t* __restrict__ src,
    const float* __restrict__ scale, const int32_t* __restrict__ feature, const float* __restrict__ grad,
    int64_t total_dim, const int64_t* __restrict__ meta, const int64_t* __restrict__ pieces,
    const int32_t* __restrict__ counts, int64_t n, float* __restrict__ partials, int64_t partial_stride,
    W* __restrict__ out, float* __restrict__ s1, float* __restrict__ s2, const float* __restrict__ hyper,
    const int64_t* __restrict__ step, int G) {
  const int64_t num = counts[0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane / G, sl = lane % G;
  const int groups_per_warp = 32 / G;
  const unsigned gmask = G == 32 ? 0xffffffffu : (((1u << G) - 1u) << (sub * G));
  Hyper h{0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float t = 0.f;
  if (OPT >= 0) {
    h = Hyper{hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], hyper[5]};
    if (OPT == 3) t = (float)step[0];
  }
  const int64_t warps_total = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t r0 = ((int64_t)blockIdx.x * (blockDim.x >> 5) + warp) * groups_per_warp; r0 < num;
       r0 += warps_total * groups_per_warp) {
    const int64_t r = r0 + sub;
    const bool active = r < num;
    const int64_t packed = active ? pieces[r] : 0;
    const int64_t start = packed >> 2;
    const bool split = (packed & 2) != 0;
    const K key = row_key[start];
    // The piece's length: the run of `key` from start, at most PIECE (the keys are sorted).
    int len = 0;
    for (int j0 = 0; j0 < PIECE; j0 += G) {
      const int64_t p = start + j0 + sl;
      const bool eq = active && p < n && row_key[p] == key;
      const unsigned bal = __ballot_sync(0xffffffffu, eq) & gmask;
      len += __popc(bal);
      if (__all_sync(0xffffffffu, bal != gmask)) break;
    }
    const int32_t f = active ? feature[order[start]] : 0;
    const int64_t* m = meta + (int64_t)f * META_W;
    const int64_t dim = active ? m[0] : 1, base = m[1], col = m[2], row_base = m[5];
    const bool vec = vec_ok(dim, base, col, total_dim);
    // Offset of element e of chunk k within a row, or -1 past the row's end.
    auto at = [&](int k, int e) -> int {
      const int c = vec ? 4 * (sl + k * G) + e : sl + (4 * k + e) * G;
      return c < dim ? c : -1;
    };
    float4 acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add_row = [&](const float* g, float s) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (vec) {
          if (at(k, 0) >= 0) acc[k] = fma4(load4(g + at(k, 0)), s, acc[k]);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (at(k, e) >= 0) comp(acc[k], e) += __ldg(g + at(k, e)) * s;
        }
      }
    };
    // Sum the piece: lookups in sorted order, four sources resolved before the rows are read.
    int j = 0;
    for (; j + 4 <= len; j += 4) {
      const int64_t o0 = order[start + j], o1 = order[start + j + 1], o2 = order[start + j + 2],
                    o3 = order[start + j + 3];
      const int64_t q0 = src[o0], q1 = src[o1], q2 = src[o2], q3 = src[o3];
      const float c0 = scale[o0], c1 = scale[o1], c2 = scale[o2], c3 = scale[o3];
      if (vec && V == 1) {  // the common case, with all four rows' loads issued first
        if (at(0, 0) >= 0) {
          const int c = at(0, 0);
          const float4 g0 = load4(grad + q0 + c), g1 = load4(grad + q1 + c);
          const float4 g2 = load4(grad + q2 + c), g3 = load4(grad + q3 + c);
          acc[0] = fma4(g0, c0, acc[0]); acc[0] = fma4(g1, c1, acc[0]);
          acc[0] = fma4(g2, c2, acc[0]); acc[0] = fma4(g3, c3, acc[0]);
        }
      } else {
        add_row(grad + q0, c0); add_row(grad + q1, c1); add_row(grad + q2, c2); add_row(grad + q3, c3);
      }
    }
    for (; j < len; ++j) {
      const int64_t o = order[start + j];
      add_row(grad + src[o], scale[o]);
    }
    // Writes chunk k's four values into a row laid out like the table's (a partial or a table row).
    auto store_chunk = [&](auto* dst, int k, float4 v) {
      using T = typename std::remove_pointer<decltype(dst)>::type;
      if (vec) {
        if (at(k, 0) >= 0) store4(dst + at(k, 0), v);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (at(k, e) >= 0) dst[at(k, e)] = from_f<T>(comp(v, e));
      }
    };
    if (split) {  // a piece of a long row: leave its sum for the split-row kernel
      float* dst = partials + (2 * (start / PIECE) + (packed & 1)) * partial_stride;
#pragma unroll
      for (int k = 0; k < V; ++k) store_chunk(dst, k, acc[k]);
    }
    const bool finish = active && !split;
    const int64_t row_at = base + ((int64_t)key - row_base) * dim;
    W* row = out + row_at;
    if (OPT < 0) {  // the row's gradient
      if (finish) {
#pragma unroll
        for (int k = 0; k < V; ++k) store_chunk(row, k, acc[k]);
      }
      continue;
    }
    // Weights (and coupled weight decay) first; row-wise Adagrad needs the row's sum of g^2.
    const float wd = h.wd * (1.f - h.decoupled);
    float4 w[V];
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      w[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (finish) {
        if (vec) {
          if (at(k, 0) >= 0) w[k] = load4_rw(row + at(k, 0));
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (at(k, e) >= 0) comp(w[k], e) = to_f(row[at(k, e)]);
        }
      }
      acc[k] = fma4(w[k], wd, acc[k]);
      sq += acc[k].x * acc[k].x + acc[k].y * acc[k].y + acc[k].z * acc[k].z + acc[k].w * acc[k].w;
    }
    float row_acc = 0.f;
    if (OPT == 2) {
      for (int off = G / 2; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
      if (finish) {
        row_acc = s1[key] + sq / (float)dim;
        if (sl == 0) s1[key] = row_acc;  // every lane of the group has read it above
      }
    }
    if (!finish) continue;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float4 nw;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = at(k, vec ? 0 : e);
        const int64_t a = row_at + c + (vec ? e : 0);
        comp(nw, e) = c >= 0 ? apply1<OPT>(comp(w[k], e), comp(acc[k], e), s1, s2, a, row_acc, h, t) : 0.f;
      }
      store_chunk(row, k, nw);
    }
  }
}


// ---- backward planning: expand, sort, plan (the Triton backend's _expand/_plan kernels) -------
constexpr int EXPAND_BAGS = 1024;  // bags per expand block (their offsets sit in shared memory)
constexpr int PLAN_BLOCK = 1024;   // sorted positions per plan block, a thread each

// One entry per lookup at `at` = its position in values (+ the feature's shift when features do
// not read each key once): the row key it reads, where its gradient row starts in grad_output,
// its scale (sample weight x 1/L for mean pooling), its feature, and its own index (the payload the
// sort carries). A thread per lookup; its bag from a binary search of the block's bag offsets.
template <typename I, typename K>
__global__ void __launch_bounds__(256) expand_kernel(
    const I* __restrict__ values, const I* __restrict__ offsets, const float* __restrict__ weights,
    const int64_t* __restrict__ meta, const int64_t* __restrict__ key_index, const int64_t* __restrict__ feature_base,
    K* __restrict__ row_key, int64_t* __restrict__ src, float* __restrict__ scale, int32_t* __restrict__ feature,
    int32_t* __restrict__ index, int64_t batch_size, int64_t total_dim) {
  __shared__ int64_t offs[EXPAND_BAGS + 1];
  const int f = blockIdx.x;
  const int64_t b0 = (int64_t)blockIdx.y * EXPAND_BAGS;
  const int64_t* m = meta + (int64_t)f * META_W;
  const int64_t col = m[2], pooling = m[3], row_base = m[5];
  const int64_t key = key_index[f];
  const int bags = (int)(batch_size - b0 < EXPAND_BAGS ? batch_size - b0 : EXPAND_BAGS);
  for (int i = threadIdx.x; i <= bags; i += blockDim.x) offs[i] = (int64_t)offsets[key * batch_size + b0 + i];
  __syncthreads();
  const int64_t shift = feature_base ? feature_base[f] - (int64_t)offsets[key * batch_size] : 0;
  const int64_t v1 = offs[bags];
  for (int64_t pos = offs[0] + threadIdx.x; pos < v1; pos += blockDim.x) {
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
    if (weights) s *= weights[pos];
    const int64_t at = pos + shift;
    row_key[at] = (K)(row_base + (int64_t)values[pos]);
    src[at] = (b0 + j) * total_dim + col;
    scale[at] = s;
    feature[at] = f;
    index[at] = (int32_t)at;
  }
}

struct MaxOp {
  __device__ __forceinline__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};

// Cuts the sorted keys into pieces exactly as pooled_triton._plan_kernel: a piece starts where a
// row starts and every PIECE lookups into it; pieces (start << 2 | split << 1 | first) and the
// starts of rows longer than PIECE are appended to two lists (counts[0], counts[1]).
template <typename K>
__global__ void __launch_bounds__(PLAN_BLOCK) plan_kernel(const K* __restrict__ key, int64_t n,
                                                          int64_t* __restrict__ pieces, int64_t* __restrict__ split_rows,
                                                          int32_t* __restrict__ counts) {
  using Scan32 = cub::BlockScan<int32_t, PLAN_BLOCK>;
  __shared__ typename Scan32::TempStorage tmp;
  __shared__ int64_t opens_at;  // start of the row the block opens in, when it began earlier
  __shared__ int32_t base;
  const int64_t block0 = (int64_t)blockIdx.x * PLAN_BLOCK;
  const int64_t p = block0 + threadIdx.x;
  const bool live = p < n;
  const K k = live ? key[p] : K(0);
  const bool first = live && (p == 0 || key[p - 1] != k);
  const bool long_from_here = live && p + PIECE < n && key[p + PIECE] == k;
  if (threadIdx.x == 0) {
    int64_t lo = -1;
    if (block0 > 0 && block0 < n && key[block0 - 1] == key[block0]) {  // one search, shared
      const K k0 = key[block0];
      int64_t l = 0, h = block0;
      while (l < h) {
        const int64_t mid = (l + h) >> 1;
        if (key[mid] < k0) l = mid + 1; else h = mid;
      }
      lo = l;
    }
    opens_at = lo;
  }
  // The last row start at or before p within the block (offsets in the block: a 32-bit scan).
  int32_t last_first;
  Scan32(tmp).InclusiveScan(first ? (int32_t)threadIdx.x : -1, last_first, MaxOp());
  __syncthreads();
  const int64_t run_start = last_first >= 0 ? block0 + last_first : opens_at;
  const int64_t depth = p - run_start;
  const bool start = live && depth % PIECE == 0;
  const bool split = start && (depth >= PIECE || long_from_here);
  const bool row = first && long_from_here;
  int32_t slot, total;
  Scan32(tmp).ExclusiveSum((int32_t)start, slot, total);
  if (threadIdx.x == 0) base = atomicAdd(counts, total);
  __syncthreads();
  if (start) pieces[base + slot] = p * 4 + (split ? 2 : 0) + (first ? 1 : 0);
  __syncthreads();  // base and the scan storage are reused below
  Scan32(tmp).ExclusiveSum((int32_t)row, slot, total);
  if (threadIdx.x == 0) base = atomicAdd(counts + 1, total);
  __syncthreads();
  if (row) split_rows[base + slot] = p;
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

#ifndef RECOM_REC_KERNELS_ONLY
// Pooled forward of a group: out [batch_size, total_dim] fp32. The caller has checked dims
// <= 512 and converted offsets to values' dtype and per-sample weights to fp32.
at::Tensor pooled_forward(const at::Tensor& flat, const at::Tensor& values, const at::Tensor& offsets,
                          const c10::optional<at::Tensor>& psw, const at::Tensor& meta, const at::Tensor& key_index,
                          int64_t batch_size, int64_t total_dim, int64_t max_dim) {
  c10::cuda::CUDAGuard guard(flat.device());
  auto out = at::empty({batch_size, total_dim}, flat.options().dtype(at::kFloat));
  const int64_t F = meta.size(0);
  if (F == 0 || batch_size == 0) return out.zero_();
  TORCH_CHECK(values.scalar_type() == offsets.scalar_type(), "values and offsets must share a dtype");
  const int threads = 256;
  // Bags per block for the widest table; narrower features stride over more bags per block.
  const int g = group_lanes((int)((max_dim + 3) / 4));
  const int64_t bags_per_block = (32 / g) * (threads / 32);
  const int64_t blocks_y = std::min<int64_t>((batch_size + bags_per_block - 1) / bags_per_block, 65535);
  dim3 grid((unsigned)F, (unsigned)blocks_y);
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = psw.has_value() ? psw->data_ptr<float>() : nullptr;
  dispatch_weight(flat.scalar_type(), [&](auto wt) {
    using W = decltype(wt);
    if (values.scalar_type() == at::kLong) {
      pooled_forward_kernel<W, int64_t><<<grid, threads, 0, stream>>>(
          wptr<W>(flat), values.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), w, meta.data_ptr<int64_t>(),
          key_index.data_ptr<int64_t>(), out.data_ptr<float>(), batch_size, total_dim);
    } else {
      TORCH_CHECK(values.scalar_type() == at::kInt, "values must be int32 or int64");
      pooled_forward_kernel<W, int32_t><<<grid, threads, 0, stream>>>(
          wptr<W>(flat), values.data_ptr<int32_t>(), offsets.data_ptr<int32_t>(), w, meta.data_ptr<int64_t>(),
          key_index.data_ptr<int64_t>(), out.data_ptr<float>(), batch_size, total_dim);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// The backward's plan of a group (see the kernels above): returns sorted row keys, the sort's
// order (int32 lookup indices), each lookup's gradient source, scale and feature (in expand
// order), the piece list, the split-row list and their two counts (on the device: no sync).
// `feature_base` is absent when every key is read by one feature (a lookup's index is then its
// position in values); `key_bits` bounds the row keys (the group's rows), `key64` their width.
std::vector<at::Tensor> plan_backward(const at::Tensor& values, const at::Tensor& offsets,
                                      const c10::optional<at::Tensor>& psw, const at::Tensor& meta,
                                      const at::Tensor& key_index, const c10::optional<at::Tensor>& feature_base,
                                      int64_t batch_size, int64_t total_dim, int64_t n, int64_t key_bits, bool key64) {
  c10::cuda::CUDAGuard guard(values.device());
  TORCH_CHECK(n < (int64_t)INT32_MAX, "recom_rec cuda backend: a group's backward takes at most 2^31 - 1 lookups");
  TORCH_CHECK(values.scalar_type() == offsets.scalar_type(), "values and offsets must share a dtype");
  const auto dev = values.options();
  const auto key_dtype = key64 ? at::kLong : at::kInt;
  auto row_key = at::empty({n}, dev.dtype(key_dtype));
  auto src = at::empty({n}, dev.dtype(at::kLong));
  auto scale = at::empty({n}, dev.dtype(at::kFloat));
  auto feature = at::empty({n}, dev.dtype(at::kInt));
  auto index = at::empty({n}, dev.dtype(at::kInt));
  auto sorted_key = at::empty({n}, dev.dtype(key_dtype));
  auto order = at::empty({n}, dev.dtype(at::kInt));
  auto pieces = at::empty({n}, dev.dtype(at::kLong));
  auto split_rows = at::empty({n / (PIECE + 1) + 1}, dev.dtype(at::kLong));
  auto counts = at::zeros({2}, dev.dtype(at::kInt));
  const int64_t F = meta.size(0);
  if (n == 0 || F == 0 || batch_size == 0) return {sorted_key, order, src, scale, feature, pieces, split_rows, counts};
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = psw.has_value() ? psw->data_ptr<float>() : nullptr;
  const int64_t* fb = feature_base.has_value() ? feature_base->data_ptr<int64_t>() : nullptr;
  const dim3 grid((unsigned)F, (unsigned)((batch_size + EXPAND_BAGS - 1) / EXPAND_BAGS));
  const int bits = (int)key_bits;
  auto run = [&](auto kt, auto it) {
    using K = decltype(kt);
    using I = decltype(it);
    using U = typename std::make_unsigned<K>::type;  // keys are non-negative: sort them unsigned
    expand_kernel<I, K><<<grid, 256, 0, stream>>>(
        values.data_ptr<I>(), offsets.data_ptr<I>(), w, meta.data_ptr<int64_t>(), key_index.data_ptr<int64_t>(), fb,
        reinterpret_cast<K*>(row_key.data_ptr()), src.data_ptr<int64_t>(), scale.data_ptr<float>(),
        feature.data_ptr<int32_t>(), index.data_ptr<int32_t>(), batch_size, total_dim);
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
    plan_kernel<K><<<(unsigned)((n + PLAN_BLOCK - 1) / PLAN_BLOCK), PLAN_BLOCK, 0, stream>>>(
        reinterpret_cast<const K*>(sorted_key.data_ptr()), n, pieces.data_ptr<int64_t>(),
        split_rows.data_ptr<int64_t>(), counts.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const bool v64 = values.scalar_type() == at::kLong;
  TORCH_CHECK(v64 || values.scalar_type() == at::kInt, "values must be int32 or int64");
  if (key64) {
    if (v64) run(int64_t{}, int64_t{}); else run(int64_t{}, int32_t{});
  } else {
    if (v64) run(int32_t{}, int64_t{}); else run(int32_t{}, int32_t{});
  }
  return {sorted_key, order, src, scale, feature, pieces, split_rows, counts};
}

// The backward's piece kernel (see piece_kernel). `opt` < 0 writes row gradients into `out`.
void piece_update(const at::Tensor& row_key, const at::Tensor& order, const at::Tensor& src, const at::Tensor& scale,
                  const at::Tensor& feature, const at::Tensor& grad, const at::Tensor& meta, const at::Tensor& pieces,
                  const at::Tensor& counts, int64_t n, const at::Tensor& partials, int64_t partial_stride,
                  const at::Tensor& out, const at::Tensor& state1, const at::Tensor& state2, const at::Tensor& hyper,
                  const at::Tensor& step, int64_t opt, int64_t max_dim) {
  c10::cuda::CUDAGuard guard(out.device());
  const int G = group_lanes((int)((max_dim + 3) / 4));
  // A persistent grid: a few waves of resident blocks (as pooled_triton._programs), never more
  // than there are pieces for; the kernel reads the piece count on the device.
  constexpr int threads = 256, waves = 8;
  const int64_t groups_per_block = threads / G;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(sms * waves, (n + groups_per_block - 1) / groups_per_block));
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_weight(out.scalar_type(), [&](auto wt) {
    using W = decltype(wt);
    auto launch = [&](auto kt, auto opt_c) {
      using K = decltype(kt);
      constexpr int OPT = decltype(opt_c)::value;
      auto kernel = max_dim <= 128 ? piece_kernel<W, K, OPT, 1> : piece_kernel<W, K, OPT, 4>;
      kernel<<<(unsigned)blocks, threads, 0, stream>>>(
          reinterpret_cast<const K*>(row_key.data_ptr()), order.data_ptr<int32_t>(), src.data_ptr<int64_t>(),
          scale.data_ptr<float>(), feature.data_ptr<int32_t>(), grad.data_ptr<float>(), grad.size(1),
          meta.data_ptr<int64_t>(), pieces.data_ptr<int64_t>(), counts.data_ptr<int32_t>(), n,
          partials.data_ptr<float>(), partial_stride, wptr<W>(out),
          state1.scalar_type() == at::kFloat ? state1.data_ptr<float>() : nullptr,
          state2.scalar_type() == at::kFloat ? state2.data_ptr<float>() : nullptr,
          hyper.scalar_type() == at::kFloat ? hyper.data_ptr<float>() : nullptr,
          step.scalar_type() == at::kLong ? step.data_ptr<int64_t>() : nullptr, G);
    };
    auto with_key = [&](auto opt_c) {
      if (row_key.scalar_type() == at::kInt) launch(int32_t{}, opt_c);
      else launch(int64_t{}, opt_c);
    };
    switch (opt) {
      case -1: with_key(std::integral_constant<int, -1>{}); break;
      case 0: with_key(std::integral_constant<int, 0>{}); break;
      case 1: with_key(std::integral_constant<int, 1>{}); break;
      case 2: with_key(std::integral_constant<int, 2>{}); break;
      case 3: with_key(std::integral_constant<int, 3>{}); break;
      default: TORCH_CHECK(false, "unknown optimizer kind ", opt);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pooled_forward", &pooled_forward, "fused pooled embedding forward (CUDA)");
  m.def("piece_update", &piece_update, "backward piece kernel with the fused optimizer (CUDA)");
  m.def("plan_backward", &plan_backward, "backward plan: expand, sort, pieces (CUDA)");
}
#endif
