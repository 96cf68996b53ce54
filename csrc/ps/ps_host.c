/* Host-side bookkeeping of the parameter-server tier, in C so that a batch's id lookup, slot
 * choice and store I/O cost microseconds instead of the ~100 small torch ops (30-40 us of host
 * time each) they took in Python. Loaded with ctypes (recom_rec/ps/host_lib.py), which releases
 * the GIL during each call; a batch's whole staging runs in ps_stage.c.
 *
 * Two parts (the memory:// store's tables are in ps_mem.c):
 *  - slot cache: id -> slot map of one PS table's cache, pins of batches in flight, the eviction
 *    choice (free slots lowest first, then the smallest (score, slot) among unpinned occupied
 *    slots; LRU score = last batch used, LFU score = uses << 40 | last batch used);
 *  - init: torchrec's default uniform init, as recom_rec.ps.tier.init_rows computes it in torch.
 *
 * The per-slot arrays of the cache (id_of, dirty, pins, last_used, uses) are numpy arrays owned
 * by Python; the struct keeps their pointers. A cache holds a mutex: a staging thread and the
 * training thread call it at once. The training thread's calls never
 * wait for a staging: an unpin only queues the slots (applied by the next call that holds the
 * mutex), and marking rows dirty touches only the running batch's pinned slots, which no staging
 * reads or writes.
 */
#include "ps_host.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "ps_map.h"

/* ------------------------------------------------------------------ slot cache */
typedef struct {
    i64 score;
    i64 slot;
} Entry;

/* A sorted run of eviction candidates: the slots one unpin made evictable, by (score, slot). */
typedef struct {
    Entry *e;
    i64 n, cur;
} Run;

struct Cache {
    pthread_mutex_t mutex;    /* held by the calls that read or change the state below */
    pthread_mutex_t queue;    /* guards the unpins queued and not applied yet: */
    pthread_cond_t released;  /* signalled by an unpin (a staging waiting for slots) */
    i64 releases;             /* unpins so far */
    i64 *queued, *applying;   /* slots to unpin, and the buffer they are applied from (swapped) */
    i64 n_queued, queued_cap, applying_cap;
    i64 rows;
    int lfu;
    i64 *id_of;
    uint8_t *dirty;
    int32_t *pins;
    i64 *last_used;
    i64 *uses;
    Map map;        /* id -> slot of every occupied slot */
    i64 *free_heap; /* min-heap of free slots */
    i64 n_free;
    /* Eviction candidates: sorted runs, merged through a min-heap of runs keyed by their next
     * entry. An entry is current while its slot is occupied, unpinned and still has that score;
     * every occupied unpinned slot has a current entry, stale ones are skipped when they come up.
     * (A binary heap of single entries cost ~15 scattered memory accesses per victim: the
     * largest cost of a batch. A victim from a run is the next entry of an array.) */
    Run *runs;
    i64 n_runs, runs_cap;
    i64 run_entries; /* entries not yet consumed, current or stale */
    Entry *scratch, *scratch2; /* rows entries each: an unpin's new run before it is copied */
    i64 n_unpinned; /* slots with pins == 0, free or occupied */
    i64 clock;      /* batches touched so far */
    i64 *stamp;     /* the stage call that last met the slot (distinct slots per batch) */
    i64 serial;
    /* Slots unpinned since the last stage, not yet in a run: the training thread's unpin only
     * lists them, and the next stage (a staging thread) scores, sorts and adds them. */
    i64 *pending;
    i64 n_pending;
    Map batch;       /* a stage's distinct misses (id -> index in new_ids), kept between calls */
    i64 *batch_pos;  /* where each went in it, to empty those entries afterwards */
    i64 batch_room;  /* ids a stage may have without regrowing batch */
    /* Ids pushed by staging jobs in flight whose store has not acknowledged them yet -> the push's
     * serial number (a job's pushed rows of this cache get consecutive serials from push_serial),
     * which tells a later job where the row lies in that job's push buffer (ps_stage.c forwards
     * it from there). Only the stager's worker thread touches these. */
    Map pushing;
    int pushing_ready;
    i64 push_serial;
};

static inline i64 score_of(const Cache *c, i64 s) {
    return c->lfu ? (c->uses[s] << 40) + c->last_used[s] : c->last_used[s];
}

static inline int entry_less(Entry a, Entry b) {
    return a.score < b.score || (a.score == b.score && a.slot < b.slot);
}

static inline int entry_current(const Cache *c, Entry e) {
    return c->id_of[e.slot] != FREE_SLOT && c->pins[e.slot] == 0 && score_of(c, e.slot) == e.score;
}

static int entry_cmp(const void *a, const void *b) {
    Entry x = *(const Entry *)a, y = *(const Entry *)b;
    return entry_less(x, y) ? -1 : entry_less(y, x) ? 1 : 0;
}

/* Sorts e[0..n) by (score, slot): an LSD radix sort of the slots when all scores are equal (an
 * unpin's slots were last used by the same batch, the usual case), else qsort. */
static void sort_entries(Cache *c, Entry *e, i64 n) {
    int same = 1;
    for (i64 i = 1; i < n && same; i++) same = e[i].score == e[0].score;
    if (!same) {
        qsort(e, (size_t)n, sizeof(Entry), entry_cmp);
        return;
    }
    Entry *src = e, *dst = c->scratch2;
    for (int shift = 0; ((c->rows - 1) >> shift) > 0; shift += 8) {
        i64 count[257] = {0};
        for (i64 i = 0; i < n; i++) count[((src[i].slot >> shift) & 255) + 1]++;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (i64 i = 0; i < n; i++) dst[count[(src[i].slot >> shift) & 255]++] = src[i];
        Entry *t = src;
        src = dst;
        dst = t;
    }
    if (src != e) memcpy(e, src, sizeof(Entry) * (size_t)n);
}

static inline int run_less(const Run *a, const Run *b) { return entry_less(a->e[a->cur], b->e[b->cur]); }

static void runs_sift_down(Cache *c, i64 i) {
    Run *h = c->runs;
    for (;;) {
        i64 l = 2 * i + 1, best = i;
        if (l < c->n_runs && run_less(&h[l], &h[best])) best = l;
        if (l + 1 < c->n_runs && run_less(&h[l + 1], &h[best])) best = l + 1;
        if (best == i) return;
        Run t = h[i];
        h[i] = h[best];
        h[best] = t;
        i = best;
    }
}

static void runs_clear(Cache *c) {
    for (i64 i = 0; i < c->n_runs; i++) free(c->runs[i].e);
    c->n_runs = 0;
    c->run_entries = 0;
}

/* Adds the sorted e[0..n) as a run (copied). Returns 0 when out of memory. */
static int runs_add(Cache *c, const Entry *e, i64 n) {
    if (n == 0) return 1;
    Run *runs = (Run *)ps_room_for_one(c->runs, &c->runs_cap, c->n_runs, sizeof(Run), 64);
    if (!runs) return 0;
    c->runs = runs;
    Entry *copy = (Entry *)malloc(sizeof(Entry) * (size_t)n);
    if (!copy) return 0;
    memcpy(copy, e, sizeof(Entry) * (size_t)n);
    i64 i = c->n_runs++;
    c->runs[i] = (Run){copy, n, 0};
    c->run_entries += n;
    while (i > 0) {
        i64 p = (i - 1) / 2;
        if (!run_less(&c->runs[i], &c->runs[p])) break;
        Run t = c->runs[i];
        c->runs[i] = c->runs[p];
        c->runs[p] = t;
        i = p;
    }
    return 1;
}

/* One run of the current entries of every evictable slot (drops the stale ones). */
static int runs_rebuild(Cache *c) {
    runs_clear(c);
    i64 n = 0;
    for (i64 s = 0; s < c->rows; s++)
        if (c->id_of[s] != FREE_SLOT && c->pins[s] == 0) c->scratch[n++] = (Entry){score_of(c, s), s};
    qsort(c->scratch, (size_t)n, sizeof(Entry), entry_cmp);
    return runs_add(c, c->scratch, n);
}

/* The slots e[0..n) (distinct) became evictable: add them as a run, or rebuild when the runs
 * hold more stale entries than current ones. */
static void runs_push(Cache *c, Entry *e, i64 n) {
    if (n == 0) return;
    if (c->run_entries + n > 2 * c->rows + 1024) {
        runs_rebuild(c); /* includes these slots: they are unpinned now */
        return;
    }
    sort_entries(c, e, n);
    if (!runs_add(c, e, n)) runs_rebuild(c); /* out of memory: one run of at most rows entries */
}

static i64 pop_victim(Cache *c) { /* the smallest current entry's slot, or -1 */
    while (c->n_runs > 0) {
        Run *top = &c->runs[0];
        Entry e = top->e[top->cur++];
        c->run_entries--;
        if (top->cur == top->n) {
            free(top->e);
            c->runs[0] = c->runs[--c->n_runs];
        }
        if (c->n_runs > 1) runs_sift_down(c, 0);
        if (entry_current(c, e)) return e.slot;
    }
    return -1;
}

static void free_push(Cache *c, i64 s) {
    i64 i = c->n_free++;
    while (i > 0) {
        i64 p = (i - 1) / 2;
        if (c->free_heap[p] <= s) break;
        c->free_heap[i] = c->free_heap[p];
        i = p;
    }
    c->free_heap[i] = s;
}

static i64 free_pop(Cache *c) {
    i64 top = c->free_heap[0], last = c->free_heap[--c->n_free], n = c->n_free, i = 0;
    for (;;) {
        i64 l = 2 * i + 1, best = -1;
        if (l < n) best = l;
        if (l + 1 < n && c->free_heap[l + 1] < c->free_heap[l]) best = l + 1;
        if (best < 0 || c->free_heap[best] >= last) break;
        c->free_heap[i] = c->free_heap[best];
        i = best;
    }
    if (n > 0) c->free_heap[i] = last;
    return top;
}

void ps_cache_free(Cache *c) {
    if (!c) return;
    pthread_mutex_destroy(&c->mutex);
    pthread_mutex_destroy(&c->queue);
    pthread_cond_destroy(&c->released);
    free(c->queued);
    free(c->applying);
    map_release(&c->map);
    free(c->free_heap);
    runs_clear(c);
    free(c->runs);
    free(c->scratch);
    free(c->scratch2);
    free(c->stamp);
    free(c->pending);
    map_release(&c->batch);
    free(c->batch_pos);
    if (c->pushing_ready) map_release(&c->pushing);
    free(c);
}

/* The arrays must hold `rows` entries and stay alive as long as the cache; id_of starts all
 * FREE_SLOT (an empty cache), the others zero. */
Cache *ps_cache_new(i64 rows, int lfu, i64 *id_of, uint8_t *dirty, int32_t *pins, i64 *last_used, i64 *uses) {
    Cache *c = (Cache *)calloc(1, sizeof(Cache));
    if (!c) return NULL;
    pthread_mutex_init(&c->mutex, NULL);
    pthread_mutex_init(&c->queue, NULL);
    pthread_cond_init(&c->released, NULL);
    c->rows = rows;
    c->lfu = lfu;
    c->id_of = id_of;
    c->dirty = dirty;
    c->pins = pins;
    c->last_used = last_used;
    c->uses = uses;
    c->free_heap = (i64 *)malloc(sizeof(i64) * (rows + 1));
    c->scratch = (Entry *)malloc(sizeof(Entry) * (rows + 1));
    c->scratch2 = (Entry *)malloc(sizeof(Entry) * (rows + 1));
    c->stamp = (i64 *)calloc(rows + 1, sizeof(i64));
    c->pending = (i64 *)malloc(sizeof(i64) * (rows + 1));
    if (!c->free_heap || !c->scratch || !c->scratch2 || !c->stamp || !c->pending || !map_init(&c->map, rows)) {
        ps_cache_free(c);
        return NULL;
    }
    for (i64 s = 0; s < rows; s++) c->free_heap[s] = s; /* ascending: already a min-heap */
    c->n_free = rows;
    c->n_unpinned = rows;
    return c;
}

/* Stage one batch's ids (any order, duplicates allowed):
 *  pos_slot[n]    the slot of each position (misses: the slot reserved for the id);
 *  uniq_slots[]   the batch's distinct slots, hits first, then take[] (all now pinned);
 *  take[m]        the slots reserved for the m distinct misses new_ids[m] (first-seen order);
 *  evicted[m]     the id each take slot holds now (FREE_SLOT if none), push[m] = it is dirty.
 * Nothing in the id map changes until ps_cache_commit (after the store has the pushed rows and
 * the pulled rows are written), so a failed store leaves every row where it was
 * (ps_cache_abort). counts = [distinct slots u, misses m, distinct hits]. On STAGE_FULL and
 * STAGE_WOULD_BLOCK nothing changed and counts[2] holds the number of slots the batch could get. */
/* The pending unpinned slots become eviction candidates (one sorted run). */
static void add_pending(Cache *c) {
    i64 g = 0;
    for (i64 k = 0; k < c->n_pending; k++) {
        i64 s = c->pending[k];
        if (c->id_of[s] != FREE_SLOT && c->pins[s] == 0) c->scratch[g++] = (Entry){score_of(c, s), s};
    }
    c->n_pending = 0;
    runs_push(c, c->scratch, g);
}

static i64 cache_stage(Cache *c, const i64 *ids, i64 n, i64 *pos_slot, i64 *uniq_slots, i64 *take, i64 *new_ids,
                       i64 *evicted, uint8_t *push, i64 *counts) {
    i64 serial = ++c->serial, hits = 0, m = 0, hits_unpinned = 0;
    add_pending(c);
    if (n > c->batch_room) { /* the misses' map, kept empty between calls */
        map_release(&c->batch);
        free(c->batch_pos);
        c->batch_pos = (i64 *)malloc(sizeof(i64) * (size_t)(n > 8 ? n : 8));
        if (!c->batch_pos || !map_init(&c->batch, n > 8 ? n : 8)) {
            c->batch_room = 0;
            return STAGE_NO_MEMORY;
        }
        c->batch_room = n > 8 ? n : 8;
    }
    Map *batch = &c->batch;
    for (i64 i = 0; i < n; i++) {
        i64 id = ids[i];
        if (id < 0) {
            for (i64 k = 0; k < m; k++) batch->at[c->batch_pos[k]].key = EMPTY;
            batch->size = 0;
            counts[0] = i;
            return STAGE_NEGATIVE_ID;
        }
        if (i + LOOKAHEAD < n) map_prefetch(&c->map, ids[i + LOOKAHEAD]);
        i64 s = map_get(&c->map, id);
        if (s >= 0) {
            pos_slot[i] = s;
            if (c->stamp[s] != serial) {
                c->stamp[s] = serial;
                uniq_slots[hits++] = s;
                hits_unpinned += c->pins[s] == 0;
            }
        } else {
            i64 k = map_get(batch, id);
            if (k < 0) {
                k = m++;
                new_ids[k] = id;
                c->batch_pos[k] = map_insert_roomy(batch, id, k);
            }
            pos_slot[i] = -(k + 1); /* resolved once the slots are chosen */
        }
    }
    for (i64 k = 0; k < m; k++) batch->at[c->batch_pos[k]].key = EMPTY;
    batch->size = 0;
    i64 available = c->n_unpinned - hits_unpinned;
    counts[0] = hits + m;
    counts[1] = m;
    counts[2] = available;
    if (m > available) return c->n_unpinned < c->rows ? STAGE_WOULD_BLOCK : STAGE_FULL;
    for (i64 k = 0; k < hits; k++) {
        i64 s = uniq_slots[k];
        if (c->pins[s]++ == 0) c->n_unpinned--;
    }
    for (i64 k = 0; k < m; k++) {
        i64 s = c->n_free > 0 ? free_pop(c) : pop_victim(c);
        /* s >= 0: every occupied unpinned slot has a current entry, and m <= available */
        take[k] = s;
        evicted[k] = c->id_of[s];
        push[k] = c->id_of[s] != FREE_SLOT && c->dirty[s];
        c->pins[s] = 1;
        c->n_unpinned--;
        uniq_slots[hits + k] = s;
    }
    for (i64 i = 0; i < n; i++)
        if (pos_slot[i] < 0) pos_slot[i] = take[-pos_slot[i] - 1];
    counts[2] = hits;
    return STAGE_OK;
}

/* Unpins slots[0..n); the caller holds the mutex. A slot no batch holds any more becomes free, or
 * an eviction candidate from the next stage on (add_pending). */
static void unpin_now(Cache *c, const i64 *slots, i64 n) {
    for (i64 k = 0; k < n; k++) {
        i64 s = slots[k];
        if (c->pins[s] <= 0 || --c->pins[s] > 0) continue;
        c->n_unpinned++;
        if (c->id_of[s] != FREE_SLOT)
            c->pending[c->n_pending++] = s;
        else
            free_push(c, s);
    }
}

/* Applies the queued unpins; the caller holds the mutex. */
static void apply_unpins(Cache *c) {
    pthread_mutex_lock(&c->queue);
    i64 n = c->n_queued, *slots = c->queued, cap = c->queued_cap;
    c->queued = c->applying; /* the queue takes the other buffer, so it is held only for a swap */
    c->queued_cap = c->applying_cap;
    c->n_queued = 0;
    c->applying = slots;
    c->applying_cap = cap;
    pthread_mutex_unlock(&c->queue);
    unpin_now(c, slots, n);
}

static void count_release(Cache *c) {
    pthread_mutex_lock(&c->queue);
    c->releases++;
    pthread_cond_broadcast(&c->released);
    pthread_mutex_unlock(&c->queue);
}

i64 ps_cache_stage(Cache *c, const i64 *ids, i64 n, i64 *pos_slot, i64 *uniq_slots, i64 *take, i64 *new_ids,
                   i64 *evicted, uint8_t *push, i64 *counts) {
    pthread_mutex_lock(&c->mutex);
    apply_unpins(c);
    i64 status = cache_stage(c, ids, n, pos_slot, uniq_slots, take, new_ids, evicted, push, counts);
    pthread_mutex_unlock(&c->mutex);
    return status;
}

/* Applies the queued unpins now (before Python reads the pins). */
void ps_cache_sync(Cache *c) {
    pthread_mutex_lock(&c->mutex);
    apply_unpins(c);
    pthread_mutex_unlock(&c->mutex);
}

/* The staged rows are in place: take[k] now holds new_ids[k] (clean), every slot of the batch
 * counts one more use at a new clock tick. Returns the number of evicted ids. */
i64 ps_cache_commit(Cache *c, const i64 *uniq_slots, i64 u, const i64 *take, const i64 *new_ids, i64 m) {
    i64 evictions = 0;
    pthread_mutex_lock(&c->mutex);
    for (i64 k = 0; k < m; k++) {
        i64 s = take[k], old = c->id_of[s];
        if (old != FREE_SLOT) {
            map_erase(&c->map, old);
            evictions++;
        }
        c->id_of[s] = new_ids[k];
        map_insert(&c->map, new_ids[k], s); /* cannot fail: sized for rows at creation */
        c->dirty[s] = 0;
        c->uses[s] = 0;
    }
    c->clock++;
    for (i64 k = 0; k < u; k++) {
        i64 s = uniq_slots[k];
        c->last_used[s] = c->clock;
        c->uses[s]++;
    }
    pthread_mutex_unlock(&c->mutex);
    return evictions;
}

/* Undo a stage that will not be committed: its slots are unpinned, every id stays where it was. */
void ps_cache_abort(Cache *c, const i64 *uniq_slots, i64 u) {
    pthread_mutex_lock(&c->mutex);
    apply_unpins(c);
    unpin_now(c, uniq_slots, u);
    pthread_mutex_unlock(&c->mutex);
    count_release(c);
}

/* Takes back a stage and its commit made ahead of the store I/O (ps_stage.c commits a job's
 * cache plan at once, so that the next batch's plan sees it): every take slot holds its old id
 * again, dirty as before (the rows were never overwritten: a slot is written only after the
 * store acknowledged its push), the recency of the batch's slots is restored, its slots are
 * unpinned. Later commits must have been taken back first (reverse order). old_last / old_uses:
 * last_used and uses of uniq_slots before the commit. */
void ps_cache_undo(Cache *c, const i64 *uniq_slots, i64 u, const i64 *take, const i64 *new_ids, const i64 *evicted,
                   const uint8_t *push, i64 m, const i64 *old_last, const i64 *old_uses) {
    pthread_mutex_lock(&c->mutex);
    apply_unpins(c);
    for (i64 k = 0; k < m; k++) {
        i64 s = take[k];
        map_erase(&c->map, new_ids[k]);
        c->id_of[s] = evicted[k];
        if (evicted[k] != FREE_SLOT) map_insert(&c->map, evicted[k], s); /* sized for rows: cannot fail */
        c->dirty[s] = push[k];
    }
    for (i64 k = 0; k < u; k++) {
        c->last_used[uniq_slots[k]] = old_last[k];
        c->uses[uniq_slots[k]] = old_uses[k];
    }
    c->clock--;
    unpin_now(c, uniq_slots, u);
    pthread_mutex_unlock(&c->mutex);
    count_release(c);
}

/* last_used and uses of slots[0..n) (what ps_cache_undo restores). */
void ps_cache_recency(Cache *c, const i64 *slots, i64 n, i64 *last, i64 *uses) {
    pthread_mutex_lock(&c->mutex);
    for (i64 k = 0; k < n; k++) {
        last[k] = c->last_used[slots[k]];
        uses[k] = c->uses[slots[k]];
    }
    pthread_mutex_unlock(&c->mutex);
}

/* serial[i]: the serial of the push in flight of ids[i] (ps_cache_pushing_add), or -1. */
void ps_cache_pushing_find(Cache *c, const i64 *ids, i64 n, i64 *serial) {
    if (!c->pushing_ready || c->pushing.size == 0) {
        for (i64 i = 0; i < n; i++) serial[i] = -1;
        return;
    }
    for (i64 i = 0; i < n; i++) serial[i] = map_get(&c->pushing, ids[i]);
}

/* ids[0..n) are pushed by a job in flight, the newest push of each: they get the serials *first,
 * *first + 1, ... (set before any is added), replacing an older push's. 0 when out of memory (some
 * may have been added: ps_cache_pushing_remove takes them out). */
int ps_cache_pushing_add(Cache *c, const i64 *ids, i64 n, i64 *first) {
    *first = c->push_serial;
    c->push_serial += n;
    if (!c->pushing_ready) {
        if (!map_init(&c->pushing, 4096)) return 0;
        c->pushing_ready = 1;
    }
    for (i64 i = 0; i < n; i++) {
        map_erase(&c->pushing, ids[i]);
        if (!map_insert(&c->pushing, ids[i], *first + i)) return 0;
    }
    return 1;
}

/* The pushes first.. of ids[0..n) are no longer in flight (acknowledged, or their job taken
 * back); a newer push of the same id stays. */
void ps_cache_pushing_remove(Cache *c, const i64 *ids, i64 n, i64 first) {
    if (!c->pushing_ready || first < 0) return;
    for (i64 i = 0; i < n; i++)
        if (map_get(&c->pushing, ids[i]) == first + i) map_erase(&c->pushing, ids[i]);
}

/* A batch is done with its slots (its backward has been issued): queued, never waiting for a
 * staging that holds the mutex. Returns 0, or -1 when out of memory (nothing queued). */
int ps_cache_unpin(Cache *c, const i64 *slots, i64 n) {
    pthread_mutex_lock(&c->queue);
    if (c->n_queued + n > c->queued_cap) {
        i64 cap = c->queued_cap ? c->queued_cap : 1024;
        while (cap < c->n_queued + n) cap *= 2;
        i64 *grown = (i64 *)realloc(c->queued, sizeof(i64) * (size_t)cap);
        if (!grown) {
            pthread_mutex_unlock(&c->queue);
            return -1;
        }
        c->queued = grown;
        c->queued_cap = cap;
    }
    memcpy(c->queued + c->n_queued, slots, sizeof(i64) * (size_t)n);
    c->n_queued += n;
    c->releases++;
    pthread_cond_broadcast(&c->released);
    pthread_mutex_unlock(&c->queue);
    return 0;
}

/* Without the mutex: the slots are the running batch's, pinned, so no staging reads or writes
 * their dirty bytes now; a staging sees the bytes after the batch's unpin (which orders them). */
void ps_cache_mark_dirty(Cache *c, const i64 *slots, i64 n) {
    for (i64 k = 0; k < n; k++) c->dirty[slots[k]] = 1;
}

i64 ps_cache_releases(Cache *c) {
    pthread_mutex_lock(&c->queue);
    i64 r = c->releases;
    pthread_mutex_unlock(&c->queue);
    return r;
}

i64 ps_cache_wait_release(Cache *c, i64 seen, i64 timeout_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&c->queue);
    while (c->releases == seen) {
        if (timeout_ms < 0)
            pthread_cond_wait(&c->released, &c->queue);
        else if (pthread_cond_timedwait(&c->released, &c->queue, &until) == ETIMEDOUT)
            break;
    }
    i64 r = c->releases;
    pthread_mutex_unlock(&c->queue);
    return r;
}

/* The ids of unpinned occupied slots leave the cache (their dirty rows were pushed). */
void ps_cache_drop(Cache *c, const i64 *slots, i64 n) {
    pthread_mutex_lock(&c->mutex);
    apply_unpins(c);
    for (i64 k = 0; k < n; k++) {
        i64 s = slots[k];
        if (c->id_of[s] == FREE_SLOT || c->pins[s] != 0) continue;
        map_erase(&c->map, c->id_of[s]);
        c->id_of[s] = FREE_SLOT;
        c->dirty[s] = 0;
        c->uses[s] = 0;
        free_push(c, s);
    }
    pthread_mutex_unlock(&c->mutex);
}

/* ------------------------------------------------------------------ init
 * torchrec's default init (uniform in [a, b]) exactly as init_rows computes it in torch:
 * h = splitmix(splitmix(id * M2 + base) + col * GOLDEN), u = (h >> 11) * 2^-53,
 * value = float32(a + (b - a) * u) (double arithmetic, no fused multiply-add), written into the
 * rows at given positions (a store's reply, where the ids it lacked are). */
static inline u64 splitmix(u64 x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

void ps_init_uniform_row(i64 id, i64 dim, i64 base, double a, double b, float *row) {
    const double span = b - a, scale = 1.0 / (double)(1ULL << 53);
    u64 h1 = splitmix((u64)id * 0x94D049BB133111EBULL + (u64)base);
    for (i64 j = 0; j < dim; j++) {
        u64 h = splitmix(h1 + (u64)j * 0x9E3779B97F4A7C15ULL);
        double u = (double)(h >> 11) * scale;
        double prod = span * u;
        row[j] = (float)(a + prod);
    }
}

/* Row i = at[k] of out (row_stride floats apart) gets the init of ids[i] for k < n; at NULL: i = k. */
void ps_init_uniform(const i64 *ids, const i64 *at, i64 n, i64 dim, i64 base, double a, double b, float *out,
                     i64 row_stride) {
    for (i64 k = 0; k < n; k++) {
        i64 i = at ? at[k] : k;
        ps_init_uniform_row(ids[i], dim, base, a, b, out + i * row_stride);
    }
}
