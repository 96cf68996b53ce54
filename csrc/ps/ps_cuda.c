/* The row ops (RowOps, ps_host.h) for a cache on a CUDA GPU, through the CUDA driver API.
 *
 * Why the driver API: a staging job runs on the tier's worker thread, without Python and without
 * torch, so it cannot launch torch ops; the driver API can be loaded here from libcuda.so.1 (every
 * machine with an NVIDIA driver has it, no toolkit needed), with the kernels of ps_rows.cu shipped
 * as PTX text (ps_rows.ptx, compiled by the driver on first use). Everything runs on the tier's
 * CUDA stream (torch's stream handle) in the primary context, the one torch uses.
 *
 * Host buffers are page-locked, so copies from them are asynchronous; a buffer is reused only
 * after a stream sync (fetch_ids, sync, read_rows), and grown only after one. write_rows,
 * init_rows and put_ids stage their arguments in one pinned buffer each: the caller syncs before
 * calling the same op again (RowOps, ps_host.h; ps_stage.c's sync_before).
 */
#include "ps_host.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;
#define CU_EVENT_DISABLE_TIMING 0x2

static struct {
    int loaded;
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*PrimaryCtxRelease)(CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*ModuleLoadData)(CUmodule *, const void *);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned);
    CUresult (*MemFreeHost)(void *);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
} cu;

static void *sym(void *lib, const char *a, const char *b) {
    void *f = dlsym(lib, a);
    return f ? f : (b ? dlsym(lib, b) : NULL);
}

/* 0, or -1 with the reason in err. */
static int load_driver(char *err, size_t len) {
    if (cu.loaded) return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(err, len, "cannot load libcuda.so.1: %s", dlerror());
        return -1;
    }
#define LOAD(field, a, b)                                                   \
    if (!(*(void **)&cu.field = sym(lib, a, b))) {                          \
        snprintf(err, len, "libcuda.so.1 has no %s", a);                    \
        return -1;                                                          \
    }
    LOAD(Init, "cuInit", NULL)
    LOAD(DeviceGet, "cuDeviceGet", NULL)
    LOAD(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL)
    LOAD(PrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")
    LOAD(CtxSetCurrent, "cuCtxSetCurrent", NULL)
    LOAD(ModuleLoadData, "cuModuleLoadData", NULL)
    LOAD(ModuleUnload, "cuModuleUnload", NULL)
    LOAD(ModuleGetFunction, "cuModuleGetFunction", NULL)
    LOAD(LaunchKernel, "cuLaunchKernel", NULL)
    LOAD(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync")
    LOAD(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync")
    LOAD(StreamSynchronize, "cuStreamSynchronize", NULL)
    LOAD(MemAlloc, "cuMemAlloc_v2", "cuMemAlloc")
    LOAD(MemFree, "cuMemFree_v2", "cuMemFree")
    LOAD(MemHostAlloc, "cuMemHostAlloc", NULL)
    LOAD(MemFreeHost, "cuMemFreeHost", NULL)
    LOAD(GetErrorString, "cuGetErrorString", NULL)
    LOAD(EventCreate, "cuEventCreate", NULL)
    LOAD(EventDestroy, "cuEventDestroy_v2", "cuEventDestroy")
    LOAD(EventRecord, "cuEventRecord", NULL)
    LOAD(StreamWaitEvent, "cuStreamWaitEvent", NULL)
#undef LOAD
    cu.loaded = 1;
    return 0;
}

/* Pinned buffers: HOST_BUFFERS for the pipeline (host_buffer), then the ops' own. */
enum { PIN_FETCH = HOST_BUFFERS, PIN_READ, PIN_WRITE, PIN_INIT, PIN_OUT, PINNED };
enum { DEV_SLOTS, DEV_IDS, DEV_ROWS, DEVICE_BUFFERS };

typedef struct {
    CUdevice device;
    CUcontext context;
    CUstream stream;
    CUmodule module;
    CUfunction gather, scatter, init;
    CUevent order_event; /* ps_cuda_order's, under order_mutex */
    pthread_mutex_t order_mutex;
    void *pin[PINNED];
    i64 pin_cap[PINNED];
    CUdeviceptr dev[DEVICE_BUFFERS];
    i64 dev_cap[DEVICE_BUFFERS];
    char error[256];
} CudaOps;

static int check(CudaOps *o, CUresult r, const char *what) {
    if (r == 0) return 0;
    const char *msg = NULL;
    if (cu.GetErrorString(r, &msg) != 0 || !msg) msg = "unknown error";
    snprintf(o->error, sizeof(o->error), "%s failed: %s (CUDA error %d)", what, msg, r);
    return -1;
}

#define CHECK(call, what) \
    if (check(o, (call), (what))) return -1

static int enter(CudaOps *o) { return check(o, cu.CtxSetCurrent(o->context), "cuCtxSetCurrent"); }

static void *pinned(CudaOps *o, int which, i64 bytes) {
    if (bytes <= o->pin_cap[which]) return o->pin[which];
    i64 cap = o->pin_cap[which] ? o->pin_cap[which] : 4096;
    while (cap < bytes) cap *= 2;
    /* an asynchronous copy may still read the old buffer */
    if (check(o, cu.StreamSynchronize(o->stream), "cuStreamSynchronize")) return NULL;
    if (o->pin[which]) cu.MemFreeHost(o->pin[which]);
    o->pin[which] = NULL;
    o->pin_cap[which] = 0;
    if (check(o, cu.MemHostAlloc(&o->pin[which], (size_t)cap, 0), "cuMemHostAlloc")) return NULL;
    o->pin_cap[which] = cap;
    return o->pin[which];
}

static CUdeviceptr device_buffer(CudaOps *o, int which, i64 bytes) {
    if (bytes <= o->dev_cap[which]) return o->dev[which];
    i64 cap = o->dev_cap[which] ? o->dev_cap[which] : 4096;
    while (cap < bytes) cap *= 2;
    if (check(o, cu.StreamSynchronize(o->stream), "cuStreamSynchronize")) return 0;
    if (o->dev[which]) cu.MemFree(o->dev[which]);
    o->dev[which] = 0;
    o->dev_cap[which] = 0;
    if (check(o, cu.MemAlloc(&o->dev[which], (size_t)cap), "cuMemAlloc")) return 0;
    o->dev_cap[which] = cap;
    return o->dev[which];
}

static int launch(CudaOps *o, CUfunction f, i64 items, void **params, const char *what) {
    if (items <= 0) return 0;
    const unsigned threads = 256;
    i64 blocks = (items + threads - 1) / threads;
    if (blocks > 4096) blocks = 4096; /* the kernels loop over the rest */
    CHECK(cu.LaunchKernel(f, (unsigned)blocks, 1, 1, threads, 1, 1, 0, o->stream, params, NULL), what);
    return 0;
}

/* Copies `bytes` from host `src` into pinned buffer `which`, then to a device buffer. */
static CUdeviceptr upload(CudaOps *o, int pin, int dev, const void *src, i64 bytes) {
    void *p = pinned(o, pin, bytes);
    CUdeviceptr d = p ? device_buffer(o, dev, bytes) : 0;
    if (!d) return 0;
    memcpy(p, src, (size_t)bytes);
    if (check(o, cu.MemcpyHtoDAsync(d, p, (size_t)bytes, o->stream), "cuMemcpyHtoDAsync")) return 0;
    return d;
}

static int cuda_fetch_ids(void *ctx, const void *src, int id_bytes, i64 n, i64 *dst) {
    CudaOps *o = (CudaOps *)ctx;
    if (enter(o)) return -1;
    void *p = pinned(o, PIN_FETCH, n * id_bytes);
    if (!p) return -1;
    CHECK(cu.MemcpyDtoHAsync(p, (CUdeviceptr)(uintptr_t)src, (size_t)(n * id_bytes), o->stream), "cuMemcpyDtoHAsync");
    CHECK(cu.StreamSynchronize(o->stream), "cuStreamSynchronize");
    ps_ids_to_int64(p, id_bytes, n, dst);
    return 0;
}

static int cuda_sync(void *ctx) {
    CudaOps *o = (CudaOps *)ctx;
    if (enter(o)) return -1;
    CHECK(cu.StreamSynchronize(o->stream), "cuStreamSynchronize");
    return 0;
}

/* The kernels' layout arguments, in their order (see ps_rows.cu). */
typedef struct {
    CUdeviceptr weight;
    long long wdtype, wstride, dim;
    CUdeviceptr s0;
    long long w0;
    CUdeviceptr s1;
    long long w1, width;
} LayoutArgs;

static LayoutArgs layout_args(const RowLayout *L) {
    LayoutArgs a;
    a.weight = (CUdeviceptr)(uintptr_t)L->weight;
    a.wdtype = L->weight_dtype;
    a.wstride = L->weight_stride;
    a.dim = L->dim;
    a.s0 = L->n_states > 0 ? (CUdeviceptr)(uintptr_t)L->state[0] : 0;
    a.w0 = L->n_states > 0 ? L->state_width[0] : 0;
    a.s1 = L->n_states > 1 ? (CUdeviceptr)(uintptr_t)L->state[1] : 0;
    a.w1 = L->n_states > 1 ? L->state_width[1] : 0;
    a.width = L->width;
    return a;
}

/* Gather (read) or scatter (write) the rows of `slots` between the cache and the device buffer
 * d_rows: the slots go up first; a scatter's rows come up from `host` (pinned) before the kernel. */
static int move_rows(CudaOps *o, const RowLayout *L, const i64 *slots, i64 k, int write, const float *host,
                     CUdeviceptr *d_rows) {
    const i64 bytes = k * L->width * (i64)sizeof(float);
    CUdeviceptr d_slots = upload(o, write ? PIN_WRITE : PIN_READ, DEV_SLOTS, slots, k * (i64)sizeof(i64));
    *d_rows = d_slots ? device_buffer(o, DEV_ROWS, bytes) : 0;
    if (!*d_rows) return -1;
    if (write) CHECK(cu.MemcpyHtoDAsync(*d_rows, host, (size_t)bytes, o->stream), "cuMemcpyHtoDAsync");
    LayoutArgs a = layout_args(L);
    long long kk = k;
    void *params[] = {&a.weight, &a.wdtype, &a.wstride, &a.dim, &a.s0, &a.w0, &a.s1, &a.w1, &a.width,
                      &d_slots, &kk, d_rows};
    return launch(o, write ? o->scatter : o->gather, k * L->width, params,
                  write ? "ps_scatter_rows" : "ps_gather_rows");
}

static int cuda_read_rows(void *ctx, const RowLayout *L, const i64 *slots, i64 k, float *dst) {
    CudaOps *o = (CudaOps *)ctx;
    CUdeviceptr d_rows;
    if (k == 0) return 0;
    if (enter(o) || move_rows(o, L, slots, k, 0, NULL, &d_rows)) return -1;
    CHECK(cu.MemcpyDtoHAsync(dst, d_rows, (size_t)(k * L->width) * sizeof(float), o->stream), "cuMemcpyDtoHAsync");
    CHECK(cu.StreamSynchronize(o->stream), "cuStreamSynchronize");
    return 0;
}

static int cuda_write_rows(void *ctx, const RowLayout *L, const i64 *slots, i64 k, const float *src) {
    CudaOps *o = (CudaOps *)ctx;
    CUdeviceptr d_rows;
    if (k == 0) return 0;
    return enter(o) || move_rows(o, L, slots, k, 1, src, &d_rows) ? -1 : 0; /* src is pinned */
}

static int cuda_init_rows(void *ctx, const RowLayout *L, const i64 *slots, const i64 *ids, i64 k) {
    CudaOps *o = (CudaOps *)ctx;
    if (k == 0) return 0;
    if (L->weight_dtype != DTYPE_F32) {
        snprintf(o->error, sizeof(o->error), "init_rows: float32 rows only");
        return -1;
    }
    if (enter(o)) return -1;
    /* slots then ids, one copy */
    void *p = pinned(o, PIN_INIT, 2 * k * (i64)sizeof(i64));
    CUdeviceptr d = p ? device_buffer(o, DEV_IDS, 2 * k * (i64)sizeof(i64)) : 0;
    if (!d) return -1;
    memcpy(p, slots, sizeof(i64) * (size_t)k);
    memcpy((i64 *)p + k, ids, sizeof(i64) * (size_t)k);
    CHECK(cu.MemcpyHtoDAsync(d, p, sizeof(i64) * 2 * (size_t)k, o->stream), "cuMemcpyHtoDAsync");
    LayoutArgs a = layout_args(L);
    CUdeviceptr d_slots = d, d_ids = d + sizeof(i64) * (size_t)k;
    long long kk = k, base = L->init_base;
    double lo = L->init_a, span = L->init_b - L->init_a;
    float v0 = L->n_states > 0 ? (float)L->state_init[0] : 0.f, v1 = L->n_states > 1 ? (float)L->state_init[1] : 0.f;
    void *params[] = {&a.weight, &a.wstride, &a.dim, &a.s0, &a.w0, &v0, &a.s1, &a.w1, &v1, &a.width,
                      &d_slots, &d_ids, &kk, &base, &lo, &span};
    return launch(o, o->init, k * L->width, params, "ps_init_rows");
}

static int cuda_put_ids(void *ctx, const i64 *values, i64 n, void *dst, int id_bytes) {
    CudaOps *o = (CudaOps *)ctx;
    if (n == 0) return 0;
    if (enter(o)) return -1;
    void *p = pinned(o, PIN_OUT, n * id_bytes);
    if (!p) return -1;
    ps_ids_from_int64(values, n, p, id_bytes);
    CHECK(cu.MemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, p, (size_t)(n * id_bytes), o->stream), "cuMemcpyHtoDAsync");
    return 0;
}

static void *cuda_host_buffer(void *ctx, int which, i64 bytes) {
    CudaOps *o = (CudaOps *)ctx;
    if (enter(o)) return NULL;
    return pinned(o, which, bytes);
}

static const char *cuda_error(void *ctx) { return ((CudaOps *)ctx)->error; }

/* Work queued on `waiter` from now on runs after the work queued on `signal` so far (streams of
 * the ops' device: the tier's and the training stream). What torch's Stream.wait_stream does,
 * without building Python stream objects on the training thread (tens of microseconds each). */
int ps_cuda_order(RowOps *ops, void *signal, void *waiter) {
    CudaOps *o = (CudaOps *)ops->ctx;
    pthread_mutex_lock(&o->order_mutex);
    int rc = enter(o) || check(o, cu.EventRecord(o->order_event, (CUstream)signal), "cuEventRecord") ||
             check(o, cu.StreamWaitEvent((CUstream)waiter, o->order_event, 0), "cuStreamWaitEvent");
    pthread_mutex_unlock(&o->order_mutex);
    return rc ? -1 : 0;
}

void ps_cuda_ops_free(RowOps *ops) {
    CudaOps *o = (CudaOps *)ops->ctx;
    if (!o) return;
    if (o->context && cu.CtxSetCurrent(o->context) == 0) {
        cu.StreamSynchronize(o->stream);
        for (int k = 0; k < PINNED; k++)
            if (o->pin[k]) cu.MemFreeHost(o->pin[k]);
        for (int k = 0; k < DEVICE_BUFFERS; k++)
            if (o->dev[k]) cu.MemFree(o->dev[k]);
        if (o->module) cu.ModuleUnload(o->module);
        if (o->order_event) cu.EventDestroy(o->order_event);
        cu.PrimaryCtxRelease(o->device);
    }
    pthread_mutex_destroy(&o->order_mutex);
    free(o);
    ops->ctx = NULL;
}

/* Fills `out` with the CUDA row ops on device `ordinal` and `stream` (a cudaStream_t), the kernels
 * loaded from the PTX text `ptx`. 0, or -1 with the reason in err. */
int ps_cuda_ops_new(RowOps *out, int ordinal, void *stream, const char *ptx, char *err, i64 err_len) {
    memset(out, 0, sizeof(*out));
    if (load_driver(err, (size_t)err_len)) return -1;
    CudaOps *o = (CudaOps *)calloc(1, sizeof(CudaOps));
    if (!o) {
        snprintf(err, (size_t)err_len, "out of host memory");
        return -1;
    }
    out->ctx = o;
    pthread_mutex_init(&o->order_mutex, NULL);
    o->stream = (CUstream)stream;
    int failed = check(o, cu.Init(0), "cuInit") || check(o, cu.DeviceGet(&o->device, ordinal), "cuDeviceGet") ||
                 check(o, cu.PrimaryCtxRetain(&o->context, o->device), "cuDevicePrimaryCtxRetain") ||
                 enter(o) || check(o, cu.ModuleLoadData(&o->module, ptx), "cuModuleLoadData (ps_rows.ptx)") ||
                 check(o, cu.ModuleGetFunction(&o->gather, o->module, "ps_gather_rows"), "cuModuleGetFunction") ||
                 check(o, cu.ModuleGetFunction(&o->scatter, o->module, "ps_scatter_rows"), "cuModuleGetFunction") ||
                 check(o, cu.ModuleGetFunction(&o->init, o->module, "ps_init_rows"), "cuModuleGetFunction") ||
                 check(o, cu.EventCreate(&o->order_event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    if (failed) {
        snprintf(err, (size_t)err_len, "%s", o->error);
        ps_cuda_ops_free(out);
        return -1;
    }
    out->fetch_ids = cuda_fetch_ids;
    out->sync = cuda_sync;
    out->read_rows = cuda_read_rows;
    out->write_rows = cuda_write_rows;
    out->init_rows = cuda_init_rows;
    out->put_ids = cuda_put_ids;
    out->host_buffer = cuda_host_buffer;
    out->error = cuda_error;
    return 0;
}
