/* A batch's staging in one native call: from the batch's ids where they are (host or GPU) to its
 * remapped ids there, every PS table's misses pulled and dirty victims pushed on the way.
 *
 * Why native: the tier's work per batch is a few C calls, row copies and store I/O; driven from
 * Python it took tens of calls, each taking the GIL back, and a staging thread that takes the GIL
 * many times a batch slows the training thread several-fold (tools/gil_probe.py, perf-notes
 * "PS v4"). Here a Stager runs a job either in the calling thread (ps_stager_run; ctypes releases
 * the GIL) or submitted (ps_stager_submit / ps_stager_wait) on threads of its own, which take the
 * GIL only for a store or an init written in Python.
 *
 * A job, per PS table, in the order that keeps every row safe (the stages and why several jobs
 * may be in flight: "a job in flight" below):
 *  1. plan: the cache reserves slots for the misses, pins the batch's slots, and the plan is
 *     committed to the id map (undone if the job fails); the dirty victims' rows are read;
 *  2. store I/O: the victims are put to the store, which acknowledges them, and the misses are got
 *     (in one exchange where the store can); ids it lacks get their initial rows;
 *  3. finish: the rows are written into their slots, the remapped ids out.
 * A failure in 2 takes the job back: the slots are unpinned and every id is where it was (a dirty
 * row the store did not acknowledge stays cached and dirty, its slot never overwritten).
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

/* Seconds spent in each phase, summed over a stager's jobs (tools/profile_ps.py prints them);
 * the last two are counts: rows taken from an earlier job's push in flight instead of the store,
 * and jobs given back. */
enum { T_FETCH, T_STAGE, T_WAIT, T_READ, T_PUT, T_GET, T_WRITE, T_INIT, T_COMMIT, T_PUT_IDS, T_JOB, T_PUT_GET,
       N_FORWARDED, N_GIVEN_BACK, N_TIMES };

/* Adds the time since *t to times[k] and restarts *t. */
static inline void lap(double *times, int k, double *t) {
    double x = ps_now();
    times[k] += x - *t;
    *t = x;
}

/* ------------------------------------------------------------------ a job in flight
 *
 * Several batches' jobs in flight (ps_stager_set_depth): a job is cut in three stages.
 *  plan   (the worker thread, in job order): fetch the ids, stage every table's cache and commit
 *         its plan at once (new ids mapped to their reserved slots, evicted ids out of the map),
 *         read the dirty victims' rows into the job's host buffer;
 *  I/O    (I/O threads, several jobs at once, each thread on its own store lane): push the
 *         victims, pull the misses;
 *  finish (the worker thread, in job order): write the pulled rows into their slots, the
 *         remapped ids out.
 * So the next job's plan sees this job's plan, as it saw its commit when jobs ran one by one, and
 * the results are the same. What keeps every row safe:
 *  - a slot's row is overwritten only in finish, after the store acknowledged the push of the
 *    row it held; until then the row is in the slot (and a copy in the job's buffer);
 *  - a job missing an id that an earlier job in flight pushes (Cache.pushing: the newest push of
 *    each id) takes the row from that job's push buffer, in its plan, and does not pull it: the
 *    store may not have it yet, and so no job's store I/O waits for another's. The copy is what
 *    the store would return once it acknowledged the push (rows are stored as their bytes); the
 *    buffer is valid, as every push in flight is an earlier flight's, unfinished, and the plans
 *    and finishes run on one thread. The earlier job still pushes the row;
 *  - a failed job is taken back with every later job in flight (ps_cache_undo, newest first):
 *    every evicted id is cached and dirty again in its slot, every new id is gone; the later
 *    jobs end with STAGE_ABORTED;
 *  - flush, load and ps_stager_run wait until no job is in flight (ps_stager_lock).
 * A slot reserved by a job in flight is pinned until its batch is released, which happens after
 * the job finished, so no later job evicts it or reads it before it is written. */
#define MAX_FLIGHTS 4 /* jobs planned and not finished; host buffer p for ring position p */
enum { IO_WAITING, IO_RUNNING, IO_DONE };

typedef struct {
    i64 n, distinct, m, np, kept, fresh;
    i64 forwarded, got; /* of the m misses: rows taken from earlier jobs' pushes, ids pulled */
    i64 push_first;     /* the serial of pids[0] in the cache's pushing map, or -1 */
    i64 *ids, *pos_slot, *take, *new_ids, *evicted, *pids, *pslots, *old_last, *old_uses, *kslots, *fslots, *fids;
    i64 *serial, *gids, *gslots; /* per miss: its push in flight or -1; the pulled ids, their slots */
    uint8_t *push, *found;
    float *pushed, *rows; /* in the flight's host buffer */
} TablePlan;

#define PLAN_ARRAYS 15

typedef struct {
    Job *job;
    int buffer;      /* the row ops' host buffer of this flight */
    int wrote;       /* a finish queued row writes from the buffer (a device may still read it) */
    int io;          /* IO_* */
    i64 io_status;   /* STAGE_OK, or the store's failure at table io_table */
    i64 io_table;
    double start;
    double times[N_TIMES];
    i64 cap, tcap;
    char *arena;     /* span, remap, then the tables' arrays */
    i64 *span, *remap;
    TablePlan *tp;
} Flight;

static int flight_reserve(Flight *F, i64 n, i64 tables) {
    if (tables > F->tcap) {
        TablePlan *tp = (TablePlan *)realloc(F->tp, sizeof(TablePlan) * (size_t)tables);
        if (!tp) return 0;
        F->tp = tp;
        F->tcap = tables;
    }
    if (n <= F->cap) return 1;
    i64 cap = F->cap ? F->cap : 1024;
    while (cap < n) cap *= 2;
    char *a = (char *)malloc((size_t)cap * ((PLAN_ARRAYS + 2) * sizeof(i64) + 2));
    if (!a) return 0;
    free(F->arena);
    F->arena = a;
    F->cap = cap;
    F->span = (i64 *)a;
    F->remap = F->span + cap;
    return 1;
}

/* Table plan arrays for the table whose ids start at `at` of the job's span order (n of them). */
static void plan_arrays(Flight *F, TablePlan *P, i64 at, i64 n) {
    i64 *base = F->remap + F->cap;
    i64 **arrays[PLAN_ARRAYS] = {&P->ids, &P->pos_slot, &P->take, &P->new_ids, &P->evicted, &P->pids,
                                 &P->pslots, &P->old_last, &P->old_uses, &P->kslots, &P->fslots, &P->fids,
                                 &P->serial, &P->gids, &P->gslots};
    for (int k = 0; k < PLAN_ARRAYS; k++) *arrays[k] = base + (i64)k * F->cap + at;
    uint8_t *bytes = (uint8_t *)(base + (i64)PLAN_ARRAYS * F->cap);
    P->push = bytes + at;
    P->found = bytes + F->cap + at;
    P->n = n;
    P->distinct = P->m = P->np = P->kept = P->fresh = P->forwarded = P->got = 0;
    P->push_first = -1;
}

/* Takes back the plans of tables [0, upto) of a flight, newest first. */
static void undo_tables(Flight *F, i64 upto) {
    Job *job = F->job;
    for (i64 k = upto - 1; k >= 0; k--) {
        TableJob *tj = &job->tables[k];
        TablePlan *P = &F->tp[k];
        if (P->distinct == 0) continue;
        ps_cache_pushing_remove(tj->cache, P->pids, P->np, P->push_first);
        P->push_first = -1;
        ps_cache_undo(tj->cache, tj->slots, P->distinct, P->take, P->new_ids, P->evicted, P->push, P->m, P->old_last,
                      P->old_uses);
        P->distinct = 0;
    }
}

/* The row of push `serial` of cache c (id `id`) in the push buffer of an earlier flight, or NULL
 * where none has it (every push in flight is an earlier flight's: none is not expected). */
static const float *pushed_row(const Cache *c, i64 serial, i64 id, Flight *const *earlier, int n_earlier) {
    for (int e = n_earlier - 1; e >= 0; e--) {
        const Flight *E = earlier[e];
        for (i64 k = 0; k < E->job->n_tables; k++) {
            const TablePlan *Q = &E->tp[k];
            if (E->job->tables[k].cache != c || Q->push_first < 0 || serial < Q->push_first ||
                serial >= Q->push_first + Q->np)
                continue;
            const i64 i = serial - Q->push_first;
            return Q->pids[i] == id ? Q->pushed + i * E->job->tables[k].layout->width : NULL;
        }
    }
    return NULL;
}

/* Splits table k's misses: those an earlier job in flight pushes get that push's row, copied to
 * the front of the rows buffer (their slots first in kslots); the others are pulled (gids,
 * gslots), their rows after those. */
static void forward_rows(Flight *F, i64 k, Flight *const *earlier, int n_earlier) {
    TablePlan *P = &F->tp[k];
    const Cache *c = F->job->tables[k].cache;
    const i64 width = F->job->tables[k].layout->width;
    i64 f = 0, g = 0;
    for (i64 q = 0; q < P->m; q++) {
        const float *row = P->serial[q] >= 0 ? pushed_row(c, P->serial[q], P->new_ids[q], earlier, n_earlier) : NULL;
        if (row) {
            memcpy(P->rows + f * width, row, sizeof(float) * (size_t)width);
            P->kslots[f++] = P->take[q];
        } else {
            P->gids[g] = P->new_ids[q];
            P->gslots[g++] = P->take[q];
        }
    }
    P->forwarded = f;
    P->got = g;
    F->times[N_FORWARDED] += (double)f;
}

/* 1: planned; 0: failed (job->status, job->done set; nothing held); -1: a table lacks unpinned
 * slots now (nothing held; *blocked = that table's cache, *seen = its releases before the try). */
static int plan_job(const RowOps *ops, Flight *F, Flight *const *earlier, int n_earlier, int *queued, Cache **blocked,
                    i64 *seen) {
    Job *job = F->job;
    void *ctx = ops->ctx;
    double t = ps_now();
    F->start = t;
    F->io_status = STAGE_OK;
    F->io_table = 0;
    job->done = 0;
    job->error_at = -1;
    if (!flight_reserve(F, job->n, job->n_tables)) {
        job->status = STAGE_NO_MEMORY;
        return 0;
    }
    for (i64 k = 0; k < job->n_tables; k++) F->tp[k].distinct = 0;
    if (ops->fetch_ids(ctx, job->span, (int)job->id_bytes, job->n, F->span)) {
        job->status = STAGE_DEVICE_ERROR;
        return 0;
    }
    *queued = 0; /* fetch_ids waited for everything queued */
    memcpy(F->remap, F->span, sizeof(i64) * (size_t)job->n);
    lap(F->times, T_FETCH, &t);
    i64 at = 0, bytes = 0, status = STAGE_OK;
    for (i64 k = 0; k < job->n_tables; k++) {
        TableJob *tj = &job->tables[k];
        TablePlan *P = &F->tp[k];
        i64 n = 0;
        for (i64 g = 0; g < tj->n_segs; g++) n += tj->segs[2 * g + 1] - tj->segs[2 * g];
        plan_arrays(F, P, at, n);
        at += n;
        memset(tj->counts, 0, sizeof(tj->counts));
        if (n == 0) continue;
        for (i64 g = 0, w = 0; g < tj->n_segs; g++) {
            i64 a = tj->segs[2 * g], b = tj->segs[2 * g + 1];
            memcpy(P->ids + w, F->span + a, sizeof(i64) * (size_t)(b - a));
            w += b - a;
        }
        i64 counts[3];
        *seen = ps_cache_releases(tj->cache);
        status = ps_cache_stage(tj->cache, P->ids, n, P->pos_slot, tj->slots, P->take, P->new_ids, P->evicted,
                                P->push, counts);
        lap(F->times, T_STAGE, &t);
        tj->counts[0] = counts[0];
        tj->counts[1] = counts[1];
        tj->counts[2] = counts[2];
        if (status != STAGE_OK) {
            undo_tables(F, k);
            if (status == STAGE_WOULD_BLOCK) {
                *blocked = tj->cache;
                return -1;
            }
            if (status == STAGE_NEGATIVE_ID) job->error_at = P->ids[counts[0]]; /* the id itself */
            job->status = status;
            job->done = k;
            return 0;
        }
        P->distinct = counts[0];
        P->m = counts[1];
        ps_cache_recency(tj->cache, tj->slots, P->distinct, P->old_last, P->old_uses);
        tj->counts[4] = ps_cache_commit(tj->cache, tj->slots, P->distinct, P->take, P->new_ids, P->m);
        for (i64 q = 0; q < P->m; q++)
            if (P->push[q]) {
                P->pslots[P->np] = P->take[q];
                P->pids[P->np++] = P->evicted[q];
            }
        tj->counts[3] = P->np;
        bytes += (P->np + P->m) * tj->layout->width * (i64)sizeof(float);
        lap(F->times, T_COMMIT, &t);
    }
    /* misses that earlier jobs in flight push (their rows forwarded below); then this job's pushes
     * are in flight */
    for (i64 k = 0; k < job->n_tables; k++)
        if (F->tp[k].m > 0) ps_cache_pushing_find(job->tables[k].cache, F->tp[k].new_ids, F->tp[k].m, F->tp[k].serial);
    for (i64 k = 0; k < job->n_tables && status == STAGE_OK; k++) {
        TablePlan *P = &F->tp[k];
        if (P->np > 0 && !ps_cache_pushing_add(job->tables[k].cache, P->pids, P->np, &P->push_first))
            status = STAGE_NO_MEMORY;
    }
    char *buf = NULL;
    if (status == STAGE_OK && bytes > 0 && !(buf = (char *)ops->host_buffer(ctx, F->buffer, bytes)))
        status = STAGE_NO_MEMORY;
    int read_any = 0;
    for (i64 k = 0; k < job->n_tables && status == STAGE_OK; k++) {
        TablePlan *P = &F->tp[k];
        const RowLayout *L = job->tables[k].layout;
        P->pushed = (float *)buf;
        buf += P->np * L->width * (i64)sizeof(float);
        P->rows = (float *)buf;
        buf += P->m * L->width * (i64)sizeof(float);
        if (P->np > 0) {
            /* the victims' rows as they are now: their slots are overwritten only after the store
             * acknowledged these copies */
            if (ops->read_rows(ctx, L, P->pslots, P->np, P->pushed)) {
                status = STAGE_DEVICE_ERROR;
                job->done = k;
            }
            read_any = 1;
        }
    }
    /* the buffer's last writes into the device (an earlier finish) must be done before the I/O
     * fills it; a read above waited for them */
    if (status == STAGE_OK && F->wrote && !read_any && ops->sync(ctx)) status = STAGE_DEVICE_ERROR;
    F->wrote = 0;
    for (i64 k = 0; k < job->n_tables && status == STAGE_OK; k++) forward_rows(F, k, earlier, n_earlier);
    lap(F->times, T_READ, &t);
    if (status != STAGE_OK) {
        undo_tables(F, job->n_tables);
        job->status = status;
        return 0;
    }
    return 1;
}

/* The store I/O of a planned job, on store lane `lane` of every table. */
static void io_job(Flight *F, int lane) {
    Job *job = F->job;
    double t = ps_now();
    for (i64 k = 0; k < job->n_tables; k++) {
        TableJob *tj = &job->tables[k];
        TablePlan *P = &F->tp[k];
        const i64 m = P->m, np = P->np, g = P->got, f = P->forwarded;
        if (m == 0) continue;
        const StoreOps *store = &tj->store[tj->store_lanes > 1 ? lane % tj->store_lanes : 0];
        const RowLayout *L = tj->layout;
        const i64 width = L->width;
        float *rows = P->rows, *got = rows + f * width; /* the forwarded rows first (plan) */
        int failed;
        if (np > 0 && g > 0 && store->put_get) {
            failed = store->put_get(store->ctx, P->pids, np, P->pushed, P->gids, g, got, P->found);
            lap(F->times, T_PUT_GET, &t);
        } else {
            failed = np > 0 && store->put(store->ctx, P->pids, np, P->pushed);
            lap(F->times, T_PUT, &t);
            if (!failed && g > 0) failed = store->get(store->ctx, P->gids, g, got, P->found);
            lap(F->times, T_GET, &t);
        }
        if (failed) {
            F->io_status = STAGE_STORE_ERROR;
            F->io_table = k;
            return;
        }
        i64 kept = f, fresh = 0;
        for (i64 q = 0; q < g; q++) {
            if (P->found[q]) {
                if (kept != f + q) memcpy(rows + kept * width, got + q * width, sizeof(float) * (size_t)width);
                P->kslots[kept++] = P->gslots[q];
            } else {
                P->fslots[fresh] = P->gslots[q];
                P->fids[fresh++] = P->gids[q];
            }
        }
        if (fresh > 0 && !L->init_uniform) { /* initial rows made on the host, written with the kept ones */
            if (store->init(store->ctx, P->fids, fresh, rows + kept * width)) {
                F->io_status = STAGE_STORE_ERROR;
                F->io_table = k;
                return;
            }
            lap(F->times, T_INIT, &t);
            memcpy(P->kslots + kept, P->fslots, sizeof(i64) * (size_t)fresh);
            kept += fresh;
            fresh = 0;
        }
        P->kept = kept;
        P->fresh = fresh;
    }
}

/* The row ops may read their own copy of a write_rows, init_rows or put_ids call's arguments
 * until their next sync (ps_cuda.c stages them in one pinned buffer per op, copied to the device
 * asynchronously): a second call of the same op waits for a sync first. *queued: the ops called
 * since the last sync (Q_*), kept by the stager across its jobs. */
enum { Q_WRITE = 1, Q_INIT = 2, Q_IDS = 4 };

static int sync_before(const RowOps *ops, int *queued, int op) {
    if (!(*queued & op)) return 0;
    if (ops->sync(ops->ctx)) return -1;
    *queued = 0;
    return 0;
}

/* Writes a job's pulled rows and remapped ids (its store I/O succeeded). 0 on a device error. */
static int finish_job(const RowOps *ops, Flight *F, int *queued, double *times) {
    Job *job = F->job;
    void *ctx = ops->ctx;
    double t = ps_now();
    for (i64 k = 0; k < job->n_tables; k++) {
        TableJob *tj = &job->tables[k];
        TablePlan *P = &F->tp[k];
        if (P->kept > 0 && (sync_before(ops, queued, Q_WRITE) ||
                            ops->write_rows(ctx, tj->layout, P->kslots, P->kept, P->rows))) {
            job->done = k;
            return 0;
        }
        if (P->kept > 0) *queued |= Q_WRITE;
        F->wrote |= P->kept > 0;
        lap(F->times, T_WRITE, &t);
        if (P->fresh > 0 && (sync_before(ops, queued, Q_INIT) ||
                             ops->init_rows(ctx, tj->layout, P->fslots, P->fids, P->fresh))) {
            job->done = k;
            return 0;
        }
        if (P->fresh > 0) *queued |= Q_INIT;
        lap(F->times, T_INIT, &t);
    }
    for (i64 k = 0; k < job->n_tables; k++) {
        TableJob *tj = &job->tables[k];
        TablePlan *P = &F->tp[k];
        for (i64 g = 0, at = 0; g < tj->n_segs; g++)
            for (i64 p = tj->segs[2 * g]; p < tj->segs[2 * g + 1]; p++) F->remap[p] = P->pos_slot[at++];
    }
    if (sync_before(ops, queued, Q_IDS) || ops->put_ids(ctx, F->remap, job->n, job->out, (int)job->id_bytes)) {
        job->done = 0;
        return 0;
    }
    *queued |= Q_IDS;
    lap(F->times, T_PUT_IDS, &t);
    for (i64 k = 0; k < job->n_tables; k++) { /* acknowledged: later jobs pull these ids from the store */
        ps_cache_pushing_remove(job->tables[k].cache, F->tp[k].pids, F->tp[k].np, F->tp[k].push_first);
        F->tp[k].push_first = -1;
    }
    F->times[T_JOB] += t - F->start;
    for (int k = 0; k < N_TIMES; k++) times[k] += F->times[k];
    memset(F->times, 0, sizeof(F->times));
    job->status = STAGE_OK;
    job->done = job->n_tables;
    return 1;
}

/* ------------------------------------------------------------------ the stager and its threads */
typedef struct {
    const RowOps *ops;
    pthread_mutex_t run;    /* held while a job is planned or finished, and by ps_stager_lock */
    pthread_mutex_t queue;  /* guards the fields below */
    pthread_cond_t changed; /* a job queued, planned, its I/O done, finished; a lock let go; stop */
    Job *head, *tail;       /* submitted, not planned */
    int stop, started, depth, io_threads;
    int planning;           /* the worker is planning a job (between the queue and the ring) */
    int lockers;            /* ps_stager_lock / ps_stager_run callers: nothing new is planned */
    int blocked;            /* the head lacks slots: plan it again once a flight finished */
    int aborting;           /* a failed job and those after it are being taken back */
    int queued;             /* row ops called since their last sync (Q_*; under `run`) */
    pthread_t thread, io[MAX_FLIGHTS];
    Flight flights[MAX_FLIGHTS + 1]; /* the ring, then ps_stager_run's */
    i64 first, count;
    double times[N_TIMES];
} Stager;

static inline Flight *ring(Stager *st, i64 i) { return &st->flights[(st->first + i) % MAX_FLIGHTS]; }

Stager *ps_stager_new(const RowOps *ops) {
    Stager *st = (Stager *)calloc(1, sizeof(Stager));
    if (!st) return NULL;
    st->ops = ops;
    st->depth = 1;
    for (int p = 0; p <= MAX_FLIGHTS; p++) st->flights[p].buffer = p;
    pthread_mutex_init(&st->run, NULL);
    pthread_mutex_init(&st->queue, NULL);
    pthread_cond_init(&st->changed, NULL);
    return st;
}

/* Jobs in flight at most (1 = one after another); 1..MAX_FLIGHTS. */
void ps_stager_set_depth(Stager *st, i64 depth) {
    pthread_mutex_lock(&st->queue);
    st->depth = depth < 1 ? 1 : depth > MAX_FLIGHTS ? MAX_FLIGHTS : (int)depth;
    pthread_cond_broadcast(&st->changed);
    pthread_mutex_unlock(&st->queue);
}

/* The failed oldest flight (status, at table `table`) and every flight after it are taken back,
 * newest first, once none has store I/O running. Called by the worker holding `run`. */
static void take_back(Stager *st, i64 status, i64 table) {
    pthread_mutex_lock(&st->queue);
    st->aborting = 1;
    pthread_cond_broadcast(&st->changed);
    for (;;) {
        int running = 0;
        for (i64 i = 0; i < st->count; i++) running |= ring(st, i)->io != IO_DONE;
        if (!running) break;
        pthread_cond_wait(&st->changed, &st->queue);
    }
    i64 n = st->count;
    pthread_mutex_unlock(&st->queue);
    for (i64 i = n - 1; i >= 0; i--) {
        Flight *F = ring(st, i);
        undo_tables(F, F->job->n_tables);
        memset(F->times, 0, sizeof(F->times));
        st->times[N_GIVEN_BACK] += 1;
        F->job->status = i == 0 ? status : STAGE_ABORTED;
        F->job->done = i == 0 ? table : 0;
    }
    pthread_mutex_lock(&st->queue);
    for (i64 i = 0; i < n; i++) ring(st, i)->job->state = 2;
    st->first = (st->first + n) % MAX_FLIGHTS;
    st->count = 0;
    st->aborting = 0;
    st->blocked = 0;
    pthread_cond_broadcast(&st->changed);
    pthread_mutex_unlock(&st->queue);
}

static void *worker_main(void *arg) {
    Stager *st = (Stager *)arg;
    pthread_mutex_lock(&st->queue);
    for (;;) {
        Flight *old = st->count ? ring(st, 0) : NULL;
        if (old && old->io == IO_DONE) { /* finish in job order */
            pthread_mutex_unlock(&st->queue);
            pthread_mutex_lock(&st->run);
            i64 status = old->io_status, table = old->io_table;
            int ok = status == STAGE_OK && finish_job(st->ops, old, &st->queued, st->times);
            if (!ok) {
                if (status == STAGE_OK) {
                    status = STAGE_DEVICE_ERROR;
                    table = old->job->done;
                }
                take_back(st, status, table);
            }
            pthread_mutex_unlock(&st->run);
            pthread_mutex_lock(&st->queue);
            if (ok) {
                old->job->state = 2;
                st->first = (st->first + 1) % MAX_FLIGHTS;
                st->count--;
            }
            st->blocked = 0;
            pthread_cond_broadcast(&st->changed);
            continue;
        }
        if (st->stop && st->head) {
            /* ps_stager_free: the jobs not planned yet are given back (nothing moved); their
             * batches will not be trained, and one may wait for slots that nothing releases now */
            for (Job *j = st->head; j;) {
                Job *next = j->next; /* read first: a waiter may free the job once state is 2 */
                j->status = STAGE_ABORTED;
                j->done = 0;
                j->state = 2;
                j = next;
            }
            st->head = st->tail = NULL;
            pthread_cond_broadcast(&st->changed);
            continue;
        }
        if (st->head && st->count < st->depth && !st->lockers && !st->blocked) {
            Job *job = st->head;
            st->head = job->next;
            if (!st->head) st->tail = NULL;
            st->planning = 1;
            Flight *F = ring(st, st->count);
            F->job = job;
            Flight *earlier[MAX_FLIGHTS]; /* in flight before it (only this thread changes the ring) */
            int n_earlier = 0;
            for (i64 i = 0; i < st->count; i++) earlier[n_earlier++] = ring(st, i);
            pthread_mutex_unlock(&st->queue);
            pthread_mutex_lock(&st->run);
            Cache *blocked = NULL;
            i64 seen = 0;
            double t = ps_now();
            int r = plan_job(st->ops, F, earlier, n_earlier, &st->queued, &blocked, &seen);
            if (r == 0) {
                st->times[T_JOB] += ps_now() - t;
                memset(F->times, 0, sizeof(F->times));
            }
            pthread_mutex_unlock(&st->run);
            pthread_mutex_lock(&st->queue);
            st->planning = 0;
            if (r == 1 && st->depth == 1) {
                /* one job at a time: its I/O here, without handing it to an I/O thread and back */
                F->io = IO_RUNNING;
                st->count++;
                pthread_mutex_unlock(&st->queue);
                io_job(F, 0);
                pthread_mutex_lock(&st->queue);
                F->io = IO_DONE;
            } else if (r == 1) {
                F->io = IO_WAITING;
                st->count++;
            } else if (r == 0) {
                job->state = 2;
            } else { /* no slots now: batches in flight hold them; plan it again later */
                job->next = st->head;
                st->head = job;
                if (!st->tail) st->tail = job;
                if (st->count > 0) {
                    st->blocked = 1; /* until a flight finishes */
                } else {
                    /* wait for a batch to release slots (`seen` was read before the stage, so a
                     * release in between is not missed); a flush may run meanwhile */
                    pthread_cond_broadcast(&st->changed);
                    pthread_mutex_unlock(&st->queue);
                    while (ps_cache_wait_release(blocked, seen, 100) == seen &&
                           !__atomic_load_n(&st->stop, __ATOMIC_ACQUIRE)) {
                    } /* a release, or ps_stager_free */
                    pthread_mutex_lock(&st->queue);
                    st->times[T_WAIT] += ps_now() - t;
                }
            }
            pthread_cond_broadcast(&st->changed);
            continue;
        }
        if (st->stop && !st->head && !st->count) break;
        pthread_cond_wait(&st->changed, &st->queue);
    }
    pthread_mutex_unlock(&st->queue);
    return NULL;
}

typedef struct {
    Stager *st;
    int lane;
} IoThread;

static void *io_main(void *arg) {
    IoThread *me = (IoThread *)arg;
    Stager *st = me->st;
    const int lane = me->lane;
    free(me);
    pthread_mutex_lock(&st->queue);
    for (;;) {
        Flight *F = NULL;
        for (i64 i = 0; i < st->count && !F; i++)
            if (ring(st, i)->io == IO_WAITING) F = ring(st, i); /* the oldest waiting */
        if (!F) {
            if (st->stop && !st->head && !st->count) break;
            pthread_cond_wait(&st->changed, &st->queue);
            continue;
        }
        F->io = IO_RUNNING;
        int skip = st->aborting;
        pthread_mutex_unlock(&st->queue);
        if (skip)
            F->io_status = STAGE_ABORTED;
        else
            io_job(F, lane);
        pthread_mutex_lock(&st->queue);
        F->io = IO_DONE;
        pthread_cond_broadcast(&st->changed);
    }
    pthread_mutex_unlock(&st->queue);
    return NULL;
}

/* Waits until no job is in flight and keeps new ones from being planned (until unlock_flights). */
static void lock_flights(Stager *st) {
    pthread_mutex_lock(&st->queue);
    st->lockers++;
    while (st->count > 0 || st->planning) pthread_cond_wait(&st->changed, &st->queue);
    pthread_mutex_unlock(&st->queue);
}

static void unlock_flights(Stager *st) {
    pthread_mutex_lock(&st->queue);
    st->lockers--;
    pthread_cond_broadcast(&st->changed);
    pthread_mutex_unlock(&st->queue);
}

/* Runs `job` now, in the calling thread, once no job is in flight; returns its status. */
i64 ps_stager_run(Stager *st, Job *job) {
    lock_flights(st);
    pthread_mutex_lock(&st->run);
    Flight *F = &st->flights[MAX_FLIGHTS];
    F->job = job;
    for (;;) {
        Cache *blocked = NULL;
        i64 seen = 0;
        double t = ps_now();
        int r = plan_job(st->ops, F, NULL, 0, &st->queued, &blocked, &seen); /* nothing else in flight */
        if (r == 1) {
            io_job(F, 0);
            i64 status = F->io_status, table = F->io_table;
            if (status == STAGE_OK && !finish_job(st->ops, F, &st->queued, st->times)) {
                status = STAGE_DEVICE_ERROR;
                table = job->done;
            }
            if (status != STAGE_OK) {
                undo_tables(F, job->n_tables);
                job->status = status;
                job->done = table;
            }
            break;
        }
        if (r == 0) break;
        /* other batches hold the slots: wait for one to be released; a flush may run meanwhile */
        pthread_mutex_unlock(&st->run);
        ps_cache_wait_release(blocked, seen, -1);
        pthread_mutex_lock(&st->run);
        st->times[T_WAIT] += ps_now() - t;
    }
    memset(F->times, 0, sizeof(F->times));
    pthread_mutex_unlock(&st->run);
    unlock_flights(st);
    job->state = 2;
    return job->status;
}

/* Queues `job` (the worker and the I/O threads start on first use); 0, or -1 when no thread can
 * be started. */
int ps_stager_submit(Stager *st, Job *job) {
    pthread_mutex_lock(&st->queue);
    if (!st->started) {
        if (pthread_create(&st->thread, NULL, worker_main, st) != 0) {
            pthread_mutex_unlock(&st->queue);
            return -1;
        }
        st->started = 1;
    }
    while (st->io_threads < st->depth) {
        IoThread *arg = (IoThread *)malloc(sizeof(IoThread));
        if (!arg) break;
        arg->st = st;
        arg->lane = st->io_threads;
        if (pthread_create(&st->io[st->io_threads], NULL, io_main, arg) != 0) {
            free(arg);
            break;
        }
        st->io_threads++;
    }
    if (st->io_threads == 0) {
        pthread_mutex_unlock(&st->queue);
        return -1;
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

/* Excludes staging (flush, load): waits until no job is in flight, and plans none until unlock. */
void ps_stager_lock(Stager *st) {
    lock_flights(st);
    pthread_mutex_lock(&st->run);
}

void ps_stager_unlock(Stager *st) {
    pthread_mutex_unlock(&st->run);
    unlock_flights(st);
}

/* The phase times so far (N_TIMES seconds, in the enum's order), then zeroes them. */
i64 ps_stager_times(Stager *st, double *out) {
    pthread_mutex_lock(&st->run);
    memcpy(out, st->times, sizeof(st->times));
    memset(st->times, 0, sizeof(st->times));
    pthread_mutex_unlock(&st->run);
    return N_TIMES;
}

/* Stops the threads: the jobs in flight finish, those queued and not planned are given back. */
void ps_stager_free(Stager *st) {
    if (!st) return;
    pthread_mutex_lock(&st->queue);
    __atomic_store_n(&st->stop, 1, __ATOMIC_RELEASE); /* read unlocked by a worker waiting for slots */
    pthread_cond_broadcast(&st->changed);
    pthread_mutex_unlock(&st->queue);
    if (st->started) pthread_join(st->thread, NULL);
    for (int k = 0; k < st->io_threads; k++) pthread_join(st->io[k], NULL);
    pthread_mutex_destroy(&st->run);
    pthread_mutex_destroy(&st->queue);
    pthread_cond_destroy(&st->changed);
    for (int p = 0; p <= MAX_FLIGHTS; p++) {
        free(st->flights[p].arena);
        free(st->flights[p].tp);
    }
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
