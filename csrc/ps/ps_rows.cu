// Kernels of the parameter-server tier's CUDA row ops (ps_cuda.c): rows of a PS table's cache
// slots to and from float32 store rows [embedding | state 0 | state 1], and never-seen rows
// written by torchrec's uniform rule. Shipped as PTX (ps_rows.ptx, `python tools/gen_ps_ptx.py`)
// and loaded through the driver API, so they need no toolkit at run time. A few thousand rows a
// batch: one thread per element, 64-bit index arithmetic, nothing tuned.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef long long ll;

__device__ __forceinline__ float load_elem(const void* base, ll dtype, ll at) {
  if (dtype == 0) return static_cast<const float*>(base)[at];
  if (dtype == 1) return __half2float(static_cast<const __half*>(base)[at]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[at]);
}

__device__ __forceinline__ void store_elem(void* base, ll dtype, ll at, float v) {
  if (dtype == 0) static_cast<float*>(base)[at] = v;
  else if (dtype == 1) static_cast<__half*>(base)[at] = __float2half_rn(v);
  else static_cast<__nv_bfloat16*>(base)[at] = __float2bfloat16_rn(v);
}

// Element j of a store row of slot s: where it lives in the cache.
struct Where {
  void* base;
  ll dtype, at;
};

__device__ __forceinline__ Where locate(void* weight, ll wdtype, ll wstride, ll dim, float* s0, ll w0, float* s1,
                                        ll w1, ll s, ll j) {
  if (j < dim) return Where{weight, wdtype, s * wstride + j};
  if (j < dim + w0) return Where{s0, 0, s * w0 + (j - dim)};
  return Where{s1, 0, s * w1 + (j - dim - w0)};
}

extern "C" __global__ void ps_gather_rows(const void* weight, ll wdtype, ll wstride, ll dim, const float* s0, ll w0,
                                          const float* s1, ll w1, ll width, const ll* slots, ll k, float* rows) {
  for (ll i = blockIdx.x * (ll)blockDim.x + threadIdx.x; i < k * width; i += (ll)gridDim.x * blockDim.x) {
    const ll r = i / width, j = i - r * width;
    const Where w = locate(const_cast<void*>(weight), wdtype, wstride, dim, const_cast<float*>(s0), w0,
                           const_cast<float*>(s1), w1, slots[r], j);
    rows[i] = load_elem(w.base, w.dtype, w.at);
  }
}

extern "C" __global__ void ps_scatter_rows(void* weight, ll wdtype, ll wstride, ll dim, float* s0, ll w0, float* s1,
                                           ll w1, ll width, const ll* slots, ll k, const float* rows) {
  for (ll i = blockIdx.x * (ll)blockDim.x + threadIdx.x; i < k * width; i += (ll)gridDim.x * blockDim.x) {
    const ll r = i / width, j = i - r * width;
    const Where w = locate(weight, wdtype, wstride, dim, s0, w0, s1, w1, slots[r], j);
    store_elem(w.base, w.dtype, w.at, rows[i]);
  }
}

__device__ __forceinline__ unsigned long long splitmix(unsigned long long x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// float32 rows: value = float(lo + span * u), u = (h >> 11) * 2^-53, in float64 rounded at each
// step (no fused multiply-add), as recom_rec.ps.init_rows and ps_init_uniform_row compute it.
extern "C" __global__ void ps_init_rows(float* weight, ll wstride, ll dim, float* s0, ll w0, float v0, float* s1,
                                        ll w1, float v1, ll width, const ll* slots, const ll* ids, ll k, ll base,
                                        double lo, double span) {
  for (ll i = blockIdx.x * (ll)blockDim.x + threadIdx.x; i < k * width; i += (ll)gridDim.x * blockDim.x) {
    const ll r = i / width, j = i - r * width, s = slots[r];
    if (j < dim) {
      const unsigned long long h1 = splitmix((unsigned long long)ids[r] * 0x94D049BB133111EBULL + (unsigned long long)base);
      const unsigned long long h = splitmix(h1 + (unsigned long long)j * 0x9E3779B97F4A7C15ULL);
      const double u = __dmul_rn(__ull2double_rn(h >> 11), 1.0 / 9007199254740992.0);
      weight[s * wstride + j] = __double2float_rn(__dadd_rn(lo, __dmul_rn(span, u)));
    } else if (j < dim + w0) {
      s0[s * w0 + (j - dim)] = v0;
    } else {
      s1[s * w1 + (j - dim - w0)] = v1;
    }
  }
}
