/* A process-wide pool of threads for fork-join work of the tier's host library: ps_parallel runs
 * `tasks` calls fn(ctx, k), the calling thread among the workers, and returns when all are done.
 *
 * Why: a batch's store I/O is a few thousand independent hash-map operations whose cost is memory
 * latency (random accesses into tables of hundreds of MB); split over the memory:// table's shards
 * they run on several cores at once. Workers spin briefly after a job before they sleep, since a
 * staging job asks for two in a row (its put, then its get). Workers: the cores but two (the
 * training and staging threads'), at most MAX_WORKERS; RECOM_REC_PS_THREADS sets the number.
 * Without workers the caller runs every task.
 */
#include "ps_host.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_WORKERS 7
#define SPIN_ROUNDS 1000 /* polls of the generation before a worker sleeps (tens of microseconds) */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    sched_yield();
#endif
}

typedef struct {
    void (*fn)(void *ctx, int task);
    void *ctx;
    int tasks;
    int next;  /* the next task to claim (atomic) */
    int done;  /* tasks finished (atomic) */
    int users; /* workers holding this job (atomic): it lives on the caller's stack */
} PoolJob;

static struct {
    pthread_once_t once;
    pthread_mutex_t mutex; /* guards job and generation (with cond) */
    pthread_cond_t cond;
    pthread_mutex_t one_job; /* one job at a time */
    PoolJob *job;
    long generation;
    int workers;
} pool = {PTHREAD_ONCE_INIT, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
          NULL, 0, 0};

static void work_on(PoolJob *job) {
    for (;;) {
        int k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (k >= job->tasks) break;
        job->fn(job->ctx, k);
        __atomic_fetch_add(&job->done, 1, __ATOMIC_RELEASE);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    long seen = 0;
    for (;;) {
        PoolJob *job = NULL;
        /* spin a while on the generation (lock-free read), then sleep on the condition */
        for (int r = 0; r < SPIN_ROUNDS && __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen; r++)
            relax();
        pthread_mutex_lock(&pool.mutex);
        while (pool.generation == seen) pthread_cond_wait(&pool.cond, &pool.mutex);
        seen = pool.generation;
        job = pool.job;
        if (job) __atomic_fetch_add(&job->users, 1, __ATOMIC_ACQUIRE);
        pthread_mutex_unlock(&pool.mutex);
        if (job) {
            work_on(job);
            __atomic_fetch_sub(&job->users, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

static void start_workers(void) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int n = cores > 2 ? (int)(cores - 2) : 0; /* leave the training and staging threads their cores */
    const char *env = getenv("RECOM_REC_PS_THREADS");
    if (env && *env) n = atoi(env);
    if (n > MAX_WORKERS) n = MAX_WORKERS;
    if (n < 0) n = 0;
    for (int i = 0; i < n; i++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, worker_main, NULL) == 0) pool.workers++;
        pthread_attr_destroy(&attr);
    }
}

int ps_pool_workers(void) {
    pthread_once(&pool.once, start_workers);
    return pool.workers;
}

void ps_parallel(int tasks, void (*fn)(void *ctx, int task), void *ctx) {
    if (tasks <= 1 || ps_pool_workers() == 0) {
        for (int k = 0; k < tasks; k++) fn(ctx, k);
        return;
    }
    PoolJob job = {fn, ctx, tasks, 0, 0, 0};
    pthread_mutex_lock(&pool.one_job);
    pthread_mutex_lock(&pool.mutex);
    pool.job = &job;
    __atomic_fetch_add(&pool.generation, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.cond);
    pthread_mutex_unlock(&pool.mutex);
    work_on(&job);
    pthread_mutex_lock(&pool.mutex);
    pool.job = NULL; /* workers waking from now on find nothing to do */
    pthread_mutex_unlock(&pool.mutex);
    while (__atomic_load_n(&job.done, __ATOMIC_ACQUIRE) < tasks || __atomic_load_n(&job.users, __ATOMIC_ACQUIRE) > 0)
        relax();
    pthread_mutex_unlock(&pool.one_job);
}
