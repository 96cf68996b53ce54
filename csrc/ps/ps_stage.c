/* A batch's staging in one native call: from the batch's ids where they are (host or GPU) to its
 * remapped ids there, every PS table's misses pulled and dirty victims pushed on the way.
 *
 * Why native: the tier's work per batch is a few C calls, row copies and store I/O; driven from
 * Python it took tens of calls, each taking the GIL back, and a staging thread that takes the GIL
 * many times a batch slows the training thread several-fold (tools/gil_probe.py, perf-notes
 * "PS v4"). Here a Stager runs jobs either in the calling thread (ps_stager_run; ctypes releases
 * the GIL) or on a worker thread of its own (ps_stager_submit / ps_stager_wait), which takes the
 * GIL only for a store or an init written in Python.
 *
 * One table's staging (stage_table), the order that keeps every row safe:
 *  1. the cache reserves slots for the misses and pins the batch's slots (nothing moves yet);
 *  2. the dirty victims' rows are read and put to the store, which acknowledges them;
 *  3. the misses are got from the store (with 2 in one exchange where the store can); ids it lacks
 *     get their initial rows;
 *  4. the rows are written into their slots, and only then the cache commits the new ids.
 * A failure in 2-3 aborts: the slots are unpinned and every id stays where it was (a dirty row the
 * store did not acknowledge stays cached and dirty).
 *
 * The row ops (RowOps) move rows between the cache's memory and the host: the CPU ops below, or
 * the CUDA ops of ps_cuda.c, or Python's (recom_rec/ps/native.py).
 */
#include "ps_host.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Seconds spent in each phase, summed over a stager's jobs (tools/profile_ps.py prints them). */
enum { T_FETCH, T_STAGE, T_WAIT, T_READ, T_PUT, T_GET, T_WRITE, T_INIT, T_COMMIT, T_PUT_IDS, T_JOB, T_PUT_GET, N_TIMES };

/* Adds the time since *t to times[k] and restarts *t. */
static inline void lap(double *times, int k, double *t) {
    double x = ps_now();
    times[k] += x - *t;
    *t = x;
}

/* ------------------------------------------------------------------ scratch arrays */
typedef struct {
    i64 cap;
    i64 *span, *remap;                                  /* the job's span: ids, remapped */
    i64 *ids, *pos_slot, *take, *new_ids, *evicted;     /* one table's */
    i64 *pslots, *pids, *kslots, *fslots, *fids;       /* pushes, kept pulls, fresh ids */
    uint8_t *push, *found;
    void *block;
} Scratch;

static int scratch_reserve(Scratch *s, i64 n) {
    if (n <= s->cap) return 1;
    i64 cap = s->cap ? s->cap : 1024;
    while (cap < n) cap *= 2;
    char *b = (char *)malloc((size_t)cap * (12 * sizeof(i64) + 2));
    if (!b) return 0;
    free(s->block);
    s->block = b;
    i64 **arrays[] = {&s->span, &s->remap, &s->ids, &s->pos_slot, &s->take, &s->new_ids, &s->evicted,
                      &s->pslots, &s->pids, &s->kslots, &s->fslots, &s->fids};
    for (int k = 0; k < 12; k++) *arrays[k] = (i64 *)(b + (size_t)k * cap * sizeof(i64));
    s->push = (uint8_t *)(b + (size_t)12 * cap * sizeof(i64));
    s->found = s->push + cap;
    s->cap = cap;
    return 1;
}

/* ------------------------------------------------------------------ one table */
static i64 fail(TableJob *tj, i64 status, const i64 *slots, i64 distinct) {
    ps_cache_abort(tj->cache, slots, distinct);
    return status;
}

/* `run`: the stager's mutex, held by the caller and let go while the table waits for slots (a
 * flush may then run; the training thread may need one to make progress). */
static i64 stage_table(const RowOps *ops, Scratch *s, Job *job, TableJob *tj, pthread_mutex_t *run, double *times) {
    const RowLayout *L = tj->layout;
    const StoreOps *store = tj->store;
    void *ctx = ops->ctx;
    i64 n = 0;
    for (i64 k = 0; k < tj->n_segs; k++) n += tj->segs[2 * k + 1] - tj->segs[2 * k];
    memset(tj->counts, 0, sizeof(tj->counts));
    if (n == 0) return STAGE_OK;
    for (i64 k = 0, at = 0; k < tj->n_segs; k++) {
        i64 a = tj->segs[2 * k], b = tj->segs[2 * k + 1];
        memcpy(s->ids + at, s->span + a, sizeof(i64) * (size_t)(b - a));
        at += b - a;
    }
    i64 counts[3], status;
    double t = ps_now();
    for (;;) {
        i64 seen = ps_cache_releases(tj->cache);
        status = ps_cache_stage(tj->cache, s->ids, n, s->pos_slot, tj->slots, s->take, s->new_ids, s->evicted,
                                s->push, counts);
        lap(times, T_STAGE, &t);
        if (status != STAGE_WOULD_BLOCK) break;
        /* other batches in flight hold the slots: wait for one to be released (`seen` was read
         * before the stage, so a release in between is not missed) */
        pthread_mutex_unlock(run);
        ps_cache_wait_release(tj->cache, seen, -1);
        pthread_mutex_lock(run);
        lap(times, T_WAIT, &t);
    }
    tj->counts[0] = counts[0];
    tj->counts[1] = counts[1];
    tj->counts[2] = counts[2];
    if (status == STAGE_NEGATIVE_ID) job->error_at = s->ids[counts[0]]; /* the id itself */
    if (status != STAGE_OK) return status;
    const i64 distinct = counts[0], m = counts[1], width = L->width;
    if (m > 0) {
        /* 2. pushes: the dirty victims' rows, acknowledged before their slots are reused */
        i64 np = 0;
        for (i64 k = 0; k < m; k++)
            if (s->push[k]) {
                s->pslots[np] = s->take[k];
                s->pids[np++] = s->evicted[k];
            }
        float *pushed = NULL;
        if (np > 0) {
            pushed = (float *)ops->host_buffer(ctx, 0, np * width * (i64)sizeof(float));
            if (!pushed) return fail(tj, STAGE_NO_MEMORY, tj->slots, distinct);
            if (ops->read_rows(ctx, L, s->pslots, np, pushed)) return fail(tj, STAGE_DEVICE_ERROR, tj->slots, distinct);
            lap(times, T_READ, &t);
        }
        tj->counts[3] = np;
        /* 3. pulls (the misses are not the pushed ids, so a store may take both at once); rows the
         * store lacks start from the init rule */
        float *rows = (float *)ops->host_buffer(ctx, 1, m * width * (i64)sizeof(float));
        if (!rows) return fail(tj, STAGE_NO_MEMORY, tj->slots, distinct);
        if (np > 0 && store->put_get) {
            if (store->put_get(store->ctx, s->pids, np, pushed, s->new_ids, m, rows, s->found))
                return fail(tj, STAGE_STORE_ERROR, tj->slots, distinct);
            lap(times, T_PUT_GET, &t);
        } else {
            if (np > 0 && store->put(store->ctx, s->pids, np, pushed))
                return fail(tj, STAGE_STORE_ERROR, tj->slots, distinct);
            lap(times, T_PUT, &t);
            if (store->get(store->ctx, s->new_ids, m, rows, s->found))
                return fail(tj, STAGE_STORE_ERROR, tj->slots, distinct);
            lap(times, T_GET, &t);
        }
        i64 kept = 0, fresh = 0;
        for (i64 k = 0; k < m; k++) {
            if (s->found[k]) {
                if (kept != k) memcpy(rows + kept * width, rows + k * width, sizeof(float) * (size_t)width);
                s->kslots[kept++] = s->take[k];
            } else {
                s->fslots[fresh] = s->take[k];
                s->fids[fresh++] = s->new_ids[k];
            }
        }
        if (fresh > 0 && !L->init_uniform) { /* initial rows made on the host, written with the kept ones */
            if (store->init(store->ctx, s->fids, fresh, rows + kept * width))
                return fail(tj, STAGE_STORE_ERROR, tj->slots, distinct);
            lap(times, T_INIT, &t);
            memcpy(s->kslots + kept, s->fslots, sizeof(i64) * (size_t)fresh);
            kept += fresh;
            fresh = 0;
        }
        /* 4. the rows into their slots */
        if (kept > 0 && ops->write_rows(ctx, L, s->kslots, kept, rows))
            return fail(tj, STAGE_DEVICE_ERROR, tj->slots, distinct);
        lap(times, T_WRITE, &t);
        if (fresh > 0 && ops->init_rows(ctx, L, s->fslots, s->fids, fresh))
            return fail(tj, STAGE_DEVICE_ERROR, tj->slots, distinct);
        lap(times, T_INIT, &t);
    }
    tj->counts[4] = ps_cache_commit(tj->cache, tj->slots, distinct, s->take, s->new_ids, m);
    lap(times, T_COMMIT, &t);
    for (i64 k = 0, at = 0; k < tj->n_segs; k++)
        for (i64 p = tj->segs[2 * k]; p < tj->segs[2 * k + 1]; p++) s->remap[p] = s->pos_slot[at++];
    return STAGE_OK;
}

static void run_job(const RowOps *ops, Scratch *s, Job *job, pthread_mutex_t *run, double *times) {
    const double start = ps_now();
    double t = start;
    job->done = 0;
    job->error_at = -1;
    if (!scratch_reserve(s, job->n)) {
        job->status = STAGE_NO_MEMORY;
        return;
    }
    if (ops->fetch_ids(ops->ctx, job->span, (int)job->id_bytes, job->n, s->span)) {
        job->status = STAGE_DEVICE_ERROR;
        return;
    }
    memcpy(s->remap, s->span, sizeof(i64) * (size_t)job->n);
    lap(times, T_FETCH, &t);
    for (i64 k = 0; k < job->n_tables; k++) {
        /* the previous table's row writes may still read their host buffers */
        if (k > 0 && ops->sync(ops->ctx)) {
            job->status = STAGE_DEVICE_ERROR;
            return;
        }
        i64 status = stage_table(ops, s, job, &job->tables[k], run, times);
        if (status != STAGE_OK) {
            job->status = status;
            return;
        }
        job->done = k + 1;
    }
    t = ps_now();
    job->status = ops->put_ids(ops->ctx, s->remap, job->n, job->out, (int)job->id_bytes) ? STAGE_DEVICE_ERROR
                                                                                        : STAGE_OK;
    lap(times, T_PUT_IDS, &t);
    times[T_JOB] += t - start;
}

/* ------------------------------------------------------------------ the stager and its worker */
typedef struct {
    const RowOps *ops;
    pthread_mutex_t run; /* held while a job runs, and by ps_stager_lock (flush, load) */
    pthread_mutex_t queue;
    pthread_cond_t changed; /* a job queued or finished, or stop */
    Job *head, *tail;
    int stop, started;
    pthread_t thread;
    Scratch scratch;
    double times[N_TIMES];
} Stager;

Stager *ps_stager_new(const RowOps *ops) {
    Stager *st = (Stager *)calloc(1, sizeof(Stager));
    if (!st) return NULL;
    st->ops = ops;
    pthread_mutex_init(&st->run, NULL);
    pthread_mutex_init(&st->queue, NULL);
    pthread_cond_init(&st->changed, NULL);
    return st;
}

/* Runs `job` now, in the calling thread; returns its status. */
i64 ps_stager_run(Stager *st, Job *job) {
    pthread_mutex_lock(&st->run);
    run_job(st->ops, &st->scratch, job, &st->run, st->times);
    pthread_mutex_unlock(&st->run);
    job->state = 2;
    return job->status;
}

static void *worker_main(void *arg) {
    Stager *st = (Stager *)arg;
    pthread_mutex_lock(&st->queue);
    for (;;) {
        while (!st->stop && !st->head) pthread_cond_wait(&st->changed, &st->queue);
        if (!st->head) break; /* stopping, nothing left */
        Job *job = st->head;
        st->head = job->next;
        if (!st->head) st->tail = NULL;
        pthread_mutex_unlock(&st->queue);
        pthread_mutex_lock(&st->run);
        run_job(st->ops, &st->scratch, job, &st->run, st->times);
        pthread_mutex_unlock(&st->run);
        pthread_mutex_lock(&st->queue);
        job->state = 2;
        pthread_cond_broadcast(&st->changed);
    }
    pthread_mutex_unlock(&st->queue);
    return NULL;
}

/* Queues `job` for the worker (started on first use); 0, or -1 when no thread can be started. */
int ps_stager_submit(Stager *st, Job *job) {
    pthread_mutex_lock(&st->queue);
    if (!st->started) {
        if (pthread_create(&st->thread, NULL, worker_main, st) != 0) {
            pthread_mutex_unlock(&st->queue);
            return -1;
        }
        st->started = 1;
    }
    job->state = 1;
    job->next = NULL;
    if (st->tail)
        st->tail->next = job;
    else
        st->head = job;
    st->tail = job;
    pthread_cond_broadcast(&st->changed);
    pthread_mutex_unlock(&st->queue);
    return 0;
}

/* Waits for a submitted job; returns its status. */
i64 ps_stager_wait(Stager *st, Job *job) {
    pthread_mutex_lock(&st->queue);
    while (job->state != 2) pthread_cond_wait(&st->changed, &st->queue);
    pthread_mutex_unlock(&st->queue);
    return job->status;
}

void ps_stager_lock(Stager *st) { pthread_mutex_lock(&st->run); }

/* The phase times so far (N_TIMES seconds, in the enum's order), then zeroes them. */
i64 ps_stager_times(Stager *st, double *out) {
    pthread_mutex_lock(&st->run);
    memcpy(out, st->times, sizeof(st->times));
    memset(st->times, 0, sizeof(st->times));
    pthread_mutex_unlock(&st->run);
    return N_TIMES;
}
void ps_stager_unlock(Stager *st) { pthread_mutex_unlock(&st->run); }

/* Stops the worker after the jobs queued so far. */
void ps_stager_free(Stager *st) {
    if (!st) return;
    pthread_mutex_lock(&st->queue);
    st->stop = 1;
    pthread_cond_broadcast(&st->changed);
    pthread_mutex_unlock(&st->queue);
    if (st->started) pthread_join(st->thread, NULL);
    pthread_mutex_destroy(&st->run);
    pthread_mutex_destroy(&st->queue);
    pthread_cond_destroy(&st->changed);
    free(st->scratch.block);
    free(st);
}

/* ------------------------------------------------------------------ the memory:// store's ops */
static int mem_store_get(void *ctx, const i64 *ids, i64 n, float *rows, uint8_t *found) {
    return ps_mem_get((MemTable *)ctx, ids, n, (char *)rows, found) ? 0 : -1;
}

static int mem_store_put(void *ctx, const i64 *ids, i64 n, const float *rows) {
    return ps_mem_put((MemTable *)ctx, ids, n, (const char *)rows) ? 0 : -1;
}

/* A memory:// table as a StoreOps (float32 rows; `init` left as the caller set it). */
void ps_mem_store_ops(StoreOps *out, MemTable *t) {
    out->ctx = t;
    out->get = mem_store_get;
    out->put = mem_store_put;
}

/* ------------------------------------------------------------------ half-precision conversions
 * Round to nearest even, as torch's .to(float16 / bfloat16) on the CPU. */
static inline float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t bits_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

float ps_bf16_to_f32(uint16_t h) { return f32_of_bits((uint32_t)h << 16); }

uint16_t ps_f32_to_bf16(float f) {
    uint32_t u = bits_of_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN (quiet) */
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

float ps_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return f32_of_bits(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp == 0) {
        float v = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24, exact */
        return sign ? -v : v;
    }
    return f32_of_bits(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t ps_f32_to_f16(float f) {
    uint32_t u = bits_of_f32(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff)); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to or past 65520: inf */
    if (a < 0x38800000u) {                                  /* below 2^-14: a subnormal half or zero */
        if (a < 0x33000000u) return (uint16_t)sign;         /* below 2^-25: rounds to zero */
        /* v = man * 2^(e - 150) with e = a >> 23 in 102..112; in the subnormal's units of 2^-24
         * that is man >> s, s = 126 - e in 14..24, rounded to nearest even (a carry into
         * 0x400 is the smallest normal, encoded the same way) */
        uint32_t man = (a & 0x7fffffu) | 0x800000u, s = 126 - (a >> 23);
        uint32_t q = man >> s, rem = man & ((1u << s) - 1), half = 1u << (s - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias the exponent, round the 13 dropped bits to nearest even */
    uint32_t r = a - 0x38000000u; /* exponent - 112 */
    r += 0xfffu + ((r >> 13) & 1);
    return (uint16_t)(sign | (r >> 13));
}

/* ------------------------------------------------------------------ CPU row ops
 * The cache's rows are in host memory: the "device" pointers are host pointers. */
typedef struct {
    void *buf[HOST_BUFFERS];
    i64 cap[HOST_BUFFERS];
    char error[128];
} CpuOps;

static inline float load_elem(const void *base, i64 dtype, i64 at) {
    if (dtype == DTYPE_F32) return ((const float *)base)[at];
    if (dtype == DTYPE_F16) return ps_f16_to_f32(((const uint16_t *)base)[at]);
    return ps_bf16_to_f32(((const uint16_t *)base)[at]);
}

static inline void store_elem(void *base, i64 dtype, i64 at, float v) {
    if (dtype == DTYPE_F32)
        ((float *)base)[at] = v;
    else if (dtype == DTYPE_F16)
        ((uint16_t *)base)[at] = ps_f32_to_f16(v);
    else
        ((uint16_t *)base)[at] = ps_f32_to_bf16(v);
}

void ps_ids_to_int64(const void *src, int id_bytes, i64 n, i64 *dst) {
    if (id_bytes == 8)
        memcpy(dst, src, sizeof(i64) * (size_t)n);
    else
        for (i64 i = 0; i < n; i++) dst[i] = ((const int32_t *)src)[i];
}

void ps_ids_from_int64(const i64 *src, i64 n, void *dst, int id_bytes) {
    if (id_bytes == 8)
        memcpy(dst, src, sizeof(i64) * (size_t)n);
    else
        for (i64 i = 0; i < n; i++) ((int32_t *)dst)[i] = (int32_t)src[i];
}

static int cpu_fetch_ids(void *ctx, const void *src, int id_bytes, i64 n, i64 *dst) {
    (void)ctx;
    ps_ids_to_int64(src, id_bytes, n, dst);
    return 0;
}

static int cpu_sync(void *ctx) {
    (void)ctx;
    return 0;
}

static int cpu_read_rows(void *ctx, const RowLayout *L, const i64 *slots, i64 k, float *dst) {
    (void)ctx;
    for (i64 r = 0; r < k; r++) {
        float *row = dst + r * L->width;
        const i64 s = slots[r];
        for (i64 j = 0; j < L->dim; j++) row[j] = load_elem(L->weight, L->weight_dtype, s * L->weight_stride + j);
        i64 col = L->dim;
        for (i64 q = 0; q < L->n_states; q++) {
            const i64 w = L->state_width[q];
            memcpy(row + col, L->state[q] + s * w, sizeof(float) * (size_t)w);
            col += w;
        }
    }
    return 0;
}

static int cpu_write_rows(void *ctx, const RowLayout *L, const i64 *slots, i64 k, const float *src) {
    (void)ctx;
    for (i64 r = 0; r < k; r++) {
        const float *row = src + r * L->width;
        const i64 s = slots[r];
        for (i64 j = 0; j < L->dim; j++) store_elem(L->weight, L->weight_dtype, s * L->weight_stride + j, row[j]);
        i64 col = L->dim;
        for (i64 q = 0; q < L->n_states; q++) {
            const i64 w = L->state_width[q];
            memcpy(L->state[q] + s * w, row + col, sizeof(float) * (size_t)w);
            col += w;
        }
    }
    return 0;
}

static int cpu_init_rows(void *ctx, const RowLayout *L, const i64 *slots, const i64 *ids, i64 k) {
    CpuOps *o = (CpuOps *)ctx;
    if (L->weight_dtype != DTYPE_F32) { /* the tier asks for the uniform rule on float32 rows only */
        snprintf(o->error, sizeof(o->error), "init_rows: float32 rows only");
        return -1;
    }
    for (i64 r = 0; r < k; r++) {
        const i64 s = slots[r];
        ps_init_uniform_row(ids[r], L->dim, L->init_base, L->init_a, L->init_b,
                            (float *)L->weight + s * L->weight_stride);
        for (i64 q = 0; q < L->n_states; q++) {
            const i64 w = L->state_width[q];
            for (i64 j = 0; j < w; j++) L->state[q][s * w + j] = (float)L->state_init[q];
        }
    }
    return 0;
}

static int cpu_put_ids(void *ctx, const i64 *values, i64 n, void *dst, int id_bytes) {
    (void)ctx;
    ps_ids_from_int64(values, n, dst, id_bytes);
    return 0;
}

static void *cpu_host_buffer(void *ctx, int which, i64 bytes) {
    CpuOps *o = (CpuOps *)ctx;
    if (bytes > o->cap[which]) {
        void *b = realloc(o->buf[which], (size_t)bytes);
        if (!b) return NULL;
        o->buf[which] = b;
        o->cap[which] = bytes;
    }
    return o->buf[which];
}

static const char *cpu_error(void *ctx) { return ((CpuOps *)ctx)->error; }

/* Fills `out` with the CPU row ops and a new context (free it with ps_cpu_ops_free). */
int ps_cpu_ops_new(RowOps *out) {
    CpuOps *o = (CpuOps *)calloc(1, sizeof(CpuOps));
    if (!o) return -1;
    out->ctx = o;
    out->fetch_ids = cpu_fetch_ids;
    out->sync = cpu_sync;
    out->read_rows = cpu_read_rows;
    out->write_rows = cpu_write_rows;
    out->init_rows = cpu_init_rows;
    out->put_ids = cpu_put_ids;
    out->host_buffer = cpu_host_buffer;
    out->error = cpu_error;
    return 0;
}

void ps_cpu_ops_free(RowOps *ops) {
    CpuOps *o = (CpuOps *)ops->ctx;
    if (!o) return;
    for (int k = 0; k < HOST_BUFFERS; k++) free(o->buf[k]);
    free(o);
    ops->ctx = NULL;
}
