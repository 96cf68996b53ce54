/* The parameter-server tier's host library: declarations shared by its parts.
 *
 *  ps_host.c   the slot cache (id -> slot map, pins, eviction) and torchrec's uniform init;
 *  ps_mem.c    the memory:// store's tables (sharded, their batches run on ps_pool.c's threads);
 *  ps_map.h    the id -> i64 hash map both use;
 *  ps_stage.c  a batch's staging from the ids on the device to the remapped ids on the device,
 *              in one native call (or on a worker thread of the tier's own), and the CPU row ops;
 *  ps_cuda.c   the row ops on a CUDA GPU, through the driver API (kernels from ps_rows.ptx);
 *  ps_resp.c, ps_tls.c, ps_redis.c (ps_redis.h)  the Redis store's rows, spoken in RESP by the job;
 *  ps_build_info.c  the hash of the sources the library was built from (the loader's staleness check).
 *
 * Built into one shared library when the package is installed (setup.py; the source list is
 * recom_rec/native_build.py), or with the system C compiler on first use (recom_rec/ps/host_lib.py).
 */
#ifndef RECOM_REC_PS_HOST_H
#define RECOM_REC_PS_HOST_H

#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef int64_t i64;
typedef uint64_t u64;

/* Seconds on the monotonic clock: deadlines and phase timers. */
static inline double ps_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A growable array (`items`, n used of *cap) with room for one more item: `items` itself, or,
 * when full, its copy at twice the capacity (`first` items at first; *cap updated). NULL when
 * out of memory, `items` then left as it was. */
static inline void *ps_room_for_one(void *items, i64 *cap, i64 n, size_t item_size, i64 first) {
    if (n < *cap) return items;
    i64 grown = *cap ? 2 * *cap : first;
    void *p = realloc(items, item_size * (size_t)grown);
    if (p) *cap = grown;
    return p;
}

#define FREE_SLOT (-1)
#define STAGE_OK 0
#define STAGE_WOULD_BLOCK (-1)  /* not enough unpinned slots now; other batches hold pins */
#define STAGE_FULL (-2)         /* not enough slots even with no other batch in flight */
#define STAGE_NEGATIVE_ID (-3)  /* counts[0] = the position of the negative id */
#define STAGE_NO_MEMORY (-4)
#define STAGE_STORE_ERROR (-5)  /* the store's get or put failed (nothing moved, see ps_stage.c) */
#define STAGE_DEVICE_ERROR (-6) /* a row op failed (its message: ps_ops_error) */
#define STAGE_ABORTED (-7)      /* taken back: an earlier job in flight failed (nothing moved) */

/* ------------------------------------------------------------------ slot cache (ps_host.c) */
typedef struct Cache Cache;
Cache *ps_cache_new(i64 rows, int lfu, i64 *id_of, uint8_t *dirty, int32_t *pins, i64 *last_used, i64 *uses);
void ps_cache_free(Cache *c);
i64 ps_cache_stage(Cache *c, const i64 *ids, i64 n, i64 *pos_slot, i64 *uniq_slots, i64 *take, i64 *new_ids,
                   i64 *evicted, uint8_t *push, i64 *counts);
i64 ps_cache_commit(Cache *c, const i64 *uniq_slots, i64 u, const i64 *take, const i64 *new_ids, i64 m);
void ps_cache_abort(Cache *c, const i64 *uniq_slots, i64 u);
void ps_cache_undo(Cache *c, const i64 *uniq_slots, i64 u, const i64 *take, const i64 *new_ids, const i64 *evicted,
                   const uint8_t *push, i64 m, const i64 *old_last, const i64 *old_uses);
void ps_cache_recency(Cache *c, const i64 *slots, i64 n, i64 *last, i64 *uses);
void ps_cache_pushing_find(Cache *c, const i64 *ids, i64 n, i64 *serial);
int ps_cache_pushing_add(Cache *c, const i64 *ids, i64 n, i64 *first);
void ps_cache_pushing_remove(Cache *c, const i64 *ids, i64 n, i64 first);
int ps_cache_unpin(Cache *c, const i64 *slots, i64 n);
/* Waits until a batch unpins slots of this cache after `seen` (a value of ps_cache_releases), or
 * until `timeout_ms` passed; returns the releases so far. */
i64 ps_cache_releases(Cache *c);
i64 ps_cache_wait_release(Cache *c, i64 seen, i64 timeout_ms);

/* ------------------------------------------------------------------ memory:// tables (ps_mem.c) */
typedef struct MemTable MemTable;
int ps_mem_get(MemTable *t, const i64 *ids, i64 n, char *out, uint8_t *found);
int ps_mem_put(MemTable *t, const i64 *ids, i64 n, const char *rows);

/* ------------------------------------------------------------------ threads (ps_pool.c) */
void ps_parallel(int tasks, void (*fn)(void *ctx, int task), void *ctx);
int ps_pool_workers(void);

/* ------------------------------------------------------------------ init (ps_host.c) */
void ps_init_uniform(const i64 *ids, const i64 *at, i64 n, i64 dim, i64 base, double a, double b, float *out,
                     i64 row_stride);
void ps_init_uniform_row(i64 id, i64 dim, i64 base, double a, double b, float *row);

/* ------------------------------------------------------------------ staging (ps_stage.c) */
#define DTYPE_F32 0
#define DTYPE_F16 1
#define DTYPE_BF16 2
#define MAX_STATES 2

/* Where one PS table's cache rows live (host or device memory, as the row ops know it), and the
 * row a store keeps for an id: float32 [embedding | state 0 | state 1], `width` wide. */
typedef struct {
    void *weight;       /* element (slot, j) at weight + (slot * weight_stride + j) elements */
    i64 weight_dtype;   /* DTYPE_* */
    i64 weight_stride;
    i64 dim;
    i64 n_states;       /* the fused optimizer's states: float32, contiguous rows */
    float *state[MAX_STATES];
    i64 state_width[MAX_STATES]; /* 1 (row-wise) or dim */
    double state_init[MAX_STATES];
    i64 width;
    /* Never-seen rows: torchrec's uniform rule (ps_init_uniform) written by the row ops when
     * init_uniform, else the store ops' init (float32 rows on the host). */
    i64 init_uniform;
    i64 init_base;
    double init_a, init_b;
} RowLayout;

/* Moving rows between the cache (host or device memory) and the host. Each returns 0 on success.
 * The host buffers handed to write_rows, init_rows and put_ids stay untouched until the ops' next
 * sync, so a device may copy from them asynchronously; and a second call of write_rows, init_rows
 * or put_ids comes after a sync (the ops may still read their own staging of the previous call's
 * arguments: ps_cuda.c's one pinned buffer per op). */
typedef struct RowOps {
    void *ctx;
    /* `n` ids, `id_bytes` (4 or 8) wide at `src` (where the batch's ids are), into `dst` as
     * int64; waits for the copy (and for everything queued before it). */
    int (*fetch_ids)(void *ctx, const void *src, int id_bytes, i64 n, i64 *dst);
    /* Waits for everything queued so far (host buffers may be reused after it). */
    int (*sync)(void *ctx);
    /* float32 rows [k, L->width] of `slots` into `dst` (a buffer of host_buffer); waits. */
    int (*read_rows)(void *ctx, const RowLayout *L, const i64 *slots, i64 k, float *dst);
    /* float32 rows [k, L->width] at `src` (a buffer of host_buffer) into `slots`. */
    int (*write_rows)(void *ctx, const RowLayout *L, const i64 *slots, i64 k, const float *src);
    /* The initial rows of `ids` (L's uniform rule) into `slots`, their states at their initial values. */
    int (*init_rows)(void *ctx, const RowLayout *L, const i64 *slots, const i64 *ids, i64 k);
    /* `n` int64 `values` to `dst` (where the remapped ids go) as `id_bytes`-wide integers. */
    int (*put_ids)(void *ctx, const i64 *values, i64 n, void *dst, int id_bytes);
    /* A host buffer of at least `bytes` (pinned on a GPU), one per `which` (0..HOST_BUFFERS-1),
     * valid until the next call with the same `which`; NULL when out of memory. */
    void *(*host_buffer)(void *ctx, int which, i64 bytes);
    /* The last failure's message. */
    const char *(*error)(void *ctx);
} RowOps;
#define HOST_BUFFERS 8

/* A table's store. get: rows [n, width] float32 (zeros where absent) and found[n]; put: ids
 * unique, acknowledged when it returns 0. init (optional, used when the layout's rule is not
 * uniform): the initial float32 rows [n, width] of ids, states included. put_get (optional): a put
 * and a get of other ids in one exchange with the store (a server's round trip, not two); 0 when
 * both succeeded. Each returns 0 on success; the tier reads a failure's reason from its own side
 * (a Python exception, or the C store's message). */
typedef struct {
    void *ctx;
    int (*get)(void *ctx, const i64 *ids, i64 n, float *rows, uint8_t *found);
    int (*put)(void *ctx, const i64 *ids, i64 n, const float *rows);
    int (*init)(void *ctx, const i64 *ids, i64 n, float *rows);
    int (*put_get)(void *ctx, const i64 *put_ids, i64 n_put, const float *put_rows, const i64 *get_ids, i64 n_get,
                   float *get_rows, uint8_t *found);
} StoreOps;

/* `n` ids `id_bytes` (4 or 8) wide to int64, and back (the row ops' host side). */
void ps_ids_to_int64(const void *src, int id_bytes, i64 n, i64 *dst);
void ps_ids_from_int64(const i64 *src, i64 n, void *dst, int id_bytes);

/* One table's part of a staging job. */
typedef struct {
    Cache *cache;
    const StoreOps *store; /* store_lanes StoreOps: lane k's connections serve one I/O thread at a time */
    const RowLayout *layout;
    const i64 *segs; /* [start, end) pairs: where the table's ids sit in the job's span */
    i64 n_segs;
    i64 *slots;      /* out: the batch's distinct slots of this table, pinned (room for its ids) */
    i64 counts[5];   /* out: distinct slots, misses, hits, rows pushed, evictions */
    i64 store_lanes; /* >= 1 */
} TableJob;

/* A batch's staging: the span of the KJT's values holding every PS feature's ids, remapped into
 * `out` (ids of other features inside the span pass through). On STAGE_OK every table is staged
 * and its slots pinned; otherwise nothing is (the job gave its slots back) and status is the
 * error of table `done`. */
typedef struct Job {
    const void *span;
    i64 id_bytes;
    i64 n;
    void *out;
    TableJob *tables;
    i64 n_tables;
    /* out */
    i64 status;
    i64 done;
    i64 error_at;      /* STAGE_NEGATIVE_ID: the negative id */
    /* the worker's */
    i64 state;         /* 0 idle, 1 queued or running, 2 finished */
    struct Job *next;
} Job;

#endif
