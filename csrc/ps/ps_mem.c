/* The tables of the memory:// store (recom_rec/ps/stores/memory.py): per (table), id -> row.
 *
 * A table is shards by a hash of the id, each an id -> row index map (ps_map.h) and rows in chunks
 * (no copy when it grows), under its own mutex. A batch's get, put or delete sorts its ids by shard
 * and runs the shards as tasks of ps_parallel: the work is random accesses into maps and rows of
 * hundreds of MB, whose latency several cores hide together. Without pool threads a table is one
 * shard (on two cores, 16 shards run one after another made a batch 2.5x slower).
 */
#include "ps_map.h"

#include <pthread.h>

#define SHARDS 16
#define PARALLEL_MIN 512 /* ids in a batch below which the shards run in the calling thread */

/* A store's rows are allocated in chunks of this size (no copy when a table grows). */
#define CHUNK_BYTES ((i64)8 << 20)

typedef struct {
    pthread_mutex_t mutex;
    Map map;       /* id -> row index */
    char **chunks; /* rows in chunks of chunk_rows */
    i64 n_chunks, chunks_cap, used;
    i64 *freed;    /* row indices of deleted ids, reused before the chunks grow */
    i64 n_freed, freed_cap;
} Shard;

struct MemTable {
    i64 row_bytes, chunk_rows;
    int shards, shift; /* shards = 1 << (64 - shift) (1: shift 64, see shard_of) */
    Shard shard[SHARDS];
};

/* The top bits of the hash (the map's home uses the low bits). */
static inline int shard_of(const MemTable *t, i64 id) { return t->shift >= 64 ? 0 : (int)(mix(id) >> t->shift); }

static inline char *row_at(const MemTable *t, const Shard *s, i64 r) {
    return s->chunks[r / t->chunk_rows] + (r % t->chunk_rows) * t->row_bytes;
}

void ps_mem_free(MemTable *t) {
    if (!t) return;
    for (int k = 0; k < SHARDS; k++) {
        Shard *s = &t->shard[k];
        pthread_mutex_destroy(&s->mutex);
        map_release(&s->map);
        for (i64 i = 0; i < s->n_chunks; i++) free(s->chunks[i]);
        free(s->chunks);
        free(s->freed);
    }
    free(t);
}

MemTable *ps_mem_new(i64 row_bytes) {
    MemTable *t = (MemTable *)calloc(1, sizeof(MemTable));
    if (!t) return NULL;
    t->row_bytes = row_bytes;
    t->chunk_rows = CHUNK_BYTES / row_bytes > 0 ? CHUNK_BYTES / row_bytes : 1;
    t->shards = ps_pool_workers() > 0 ? SHARDS : 1;
    t->shift = t->shards == 1 ? 64 : 64 - 4; /* SHARDS = 16 = 2^4 */
    int ok = 1;
    for (int k = 0; k < SHARDS; k++) {
        pthread_mutex_init(&t->shard[k].mutex, NULL);
        ok &= map_init(&t->shard[k].map, 64);
    }
    if (!ok) {
        ps_mem_free(t);
        return NULL;
    }
    return t;
}

static int new_row(const MemTable *t, Shard *s, i64 *r) {
    if (s->n_freed > 0) {
        *r = s->freed[--s->n_freed];
        return 1;
    }
    if (s->used == s->n_chunks * t->chunk_rows) {
        char **chunks = (char **)ps_room_for_one(s->chunks, &s->chunks_cap, s->n_chunks, sizeof(char *), 16);
        if (!chunks) return 0;
        s->chunks = chunks;
        char *chunk = (char *)big_alloc((size_t)(t->chunk_rows * t->row_bytes));
        if (!chunk) return 0;
        s->chunks[s->n_chunks++] = chunk;
    }
    *r = s->used++;
    return 1;
}

/* One batch operation: the batch's positions grouped by shard (order[starts[k]..starts[k+1])). */
enum { OP_GET, OP_PUT, OP_DELETE };
typedef struct {
    MemTable *t;
    int op;
    const i64 *ids;
    char *rows; /* get: out [n, row_bytes]; put: in */
    uint8_t *found;
    i64 *order, starts[SHARDS + 1]; /* the first t->shards + 1 used */
    int failed; /* out of memory in some shard (atomic) */
} Batch;

static void run_shard(void *ctx, int k) {
    Batch *b = (Batch *)ctx;
    const MemTable *t = b->t;
    Shard *s = &b->t->shard[k];
    const i64 *pos = b->order + b->starts[k], n = b->starts[k + 1] - b->starts[k];
    const size_t width = (size_t)t->row_bytes;
    if (n == 0) return;
    pthread_mutex_lock(&s->mutex);
    for (i64 i = 0; i < n; i++) {
        if (i + LOOKAHEAD < n) map_prefetch(&s->map, b->ids[pos[i + LOOKAHEAD]]);
        const i64 p = pos[i], id = b->ids[p];
        i64 r = map_get(&s->map, id);
        if (b->op == OP_GET) {
            b->found[p] = r >= 0;
            if (r >= 0)
                memcpy(b->rows + p * t->row_bytes, row_at(t, s, r), width);
            else
                memset(b->rows + p * t->row_bytes, 0, width);
        } else if (b->op == OP_PUT) {
            if (r < 0 && (!new_row(t, s, &r) || !map_insert(&s->map, id, r))) {
                __atomic_store_n(&b->failed, 1, __ATOMIC_RELAXED);
                break;
            }
            memcpy(row_at(t, s, r), b->rows + p * t->row_bytes, width);
        } else if (r >= 0) {
            i64 *freed = (i64 *)ps_room_for_one(s->freed, &s->freed_cap, s->n_freed, sizeof(i64), 256);
            if (!freed) {
                __atomic_store_n(&b->failed, 1, __ATOMIC_RELAXED);
                break;
            }
            s->freed = freed;
            s->freed[s->n_freed++] = r;
            map_erase(&s->map, id);
        }
    }
    pthread_mutex_unlock(&s->mutex);
}

/* 1, or 0 when out of memory (a put's rows written before that stay written). */
static int run_batch(MemTable *t, int op, const i64 *ids, i64 n, char *rows, uint8_t *found) {
    if (n <= 0) return 1;
    Batch b = {t, op, ids, rows, found, (i64 *)malloc(sizeof(i64) * (size_t)n), {0}, 0};
    if (!b.order) return 0;
    const int shards = t->shards;
    i64 count[SHARDS] = {0};
    for (i64 i = 0; i < n; i++) count[shard_of(t, ids[i])]++;
    for (int k = 0; k < shards; k++) b.starts[k + 1] = b.starts[k] + count[k];
    i64 at[SHARDS];
    memcpy(at, b.starts, sizeof(at));
    for (i64 i = 0; i < n; i++) b.order[at[shard_of(t, ids[i])]++] = i;
    if (n >= PARALLEL_MIN)
        ps_parallel(shards, run_shard, &b);
    else
        for (int k = 0; k < shards; k++) run_shard(&b, k);
    free(b.order);
    return !b.failed;
}

/* rows of ids (duplicates allowed) into out [n, row_bytes], zeros where absent; found[i]. */
int ps_mem_get(MemTable *t, const i64 *ids, i64 n, char *out, uint8_t *found) {
    return run_batch(t, OP_GET, ids, n, out, found);
}

/* ids unique; returns 0 when out of memory (rows written before that stay written). */
int ps_mem_put(MemTable *t, const i64 *ids, i64 n, const char *rows) {
    return run_batch(t, OP_PUT, ids, n, (char *)rows, NULL);
}

int ps_mem_delete(MemTable *t, const i64 *ids, i64 n) { return run_batch(t, OP_DELETE, ids, n, NULL, NULL); }

/* The stored ids, in no particular order, into out[0..cap) when they fit; returns how many there
 * are (more than cap: nothing written, ask again with more room). */
i64 ps_mem_scan(MemTable *t, i64 *out, i64 cap) {
    for (int k = 0; k < t->shards; k++) pthread_mutex_lock(&t->shard[k].mutex);
    i64 count = 0, at = 0;
    for (int k = 0; k < t->shards; k++) count += t->shard[k].map.size + t->shard[k].map.has_empty_key;
    if (count <= cap) {
        for (int k = 0; k < t->shards; k++) {
            const Map *m = &t->shard[k].map;
            for (i64 i = 0; i < m->cap; i++)
                if (m->at[i].key != EMPTY) out[at++] = m->at[i].key;
            if (m->has_empty_key) out[at++] = EMPTY;
        }
    }
    for (int k = t->shards - 1; k >= 0; k--) pthread_mutex_unlock(&t->shard[k].mutex);
    return count;
}
