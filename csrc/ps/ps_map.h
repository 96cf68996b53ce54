/* The id -> i64 hash map of the tier's host library (the slot cache's id map, the memory://
 * tables' indexes) and its allocator of large arrays. Included by ps_host.c and ps_mem.c. */
#ifndef RECOM_REC_PS_MAP_H
#define RECOM_REC_PS_MAP_H

#include "ps_host.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Large arrays (hash maps past a few MB, row chunks) on 2 MiB pages where the kernel offers
 * transparent huge pages: their accesses are random, and on a virtual machine each TLB miss walks
 * two page tables. Freed with free(). */
#define HUGE_PAGE ((size_t)2 << 20)
static __attribute__((unused)) void *big_alloc(size_t bytes) {
    if (bytes < HUGE_PAGE) return malloc(bytes);
    void *p = NULL;
    size_t rounded = (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    if (posix_memalign(&p, HUGE_PAGE, rounded) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
}

/* ------------------------------------------------------------------ id -> i64 hash map
 * Open addressing, linear probing, load factor <= 1/2, deletion by backward shift (no
 * tombstones, so lookups stay short however many ids come and go). Key and value side by side:
 * a probe of a map larger than the caches costs one memory access, not one per array. The key
 * EMPTY marks a free entry; the id EMPTY itself (INT64_MIN, only a store can be given it) is
 * kept beside the table. */
#define EMPTY INT64_MIN
/* Batch operations look ids up in tables far larger than the CPU caches: prefetching the home
 * entry of the id LOOKAHEAD positions ahead overlaps those memory accesses. */
#define LOOKAHEAD 16

typedef struct {
    i64 key;
    i64 val;
} Pair;

typedef struct {
    Pair *at;
    i64 cap; /* a power of two */
    i64 size;
    int has_empty_key;
    i64 empty_key_val;
} Map;

static inline u64 mix(i64 key) {
    u64 h = (u64)key * 0x9E3779B97F4A7C15ULL;
    return h ^ (h >> 29);
}

static __attribute__((unused)) int map_init(Map *m, i64 want) {
    i64 cap = 16;
    while (cap < 2 * want) cap <<= 1;
    memset(m, 0, sizeof(*m));
    m->at = (Pair *)big_alloc(sizeof(Pair) * (size_t)cap);
    if (!m->at) return 0;
    for (i64 i = 0; i < cap; i++) m->at[i].key = EMPTY;
    m->cap = cap;
    return 1;
}

static __attribute__((unused)) void map_release(Map *m) {
    free(m->at);
    memset(m, 0, sizeof(*m));
}

static inline const Pair *map_home(const Map *m, i64 key) { return m->at + (mix(key) & (u64)(m->cap - 1)); }

/* The value of key, or -1 (values are >= 0). */
static inline i64 map_get(const Map *m, i64 key) {
    if (key == EMPTY) return m->has_empty_key ? m->empty_key_val : -1;
    i64 mask = m->cap - 1, i = (i64)(mix(key) & (u64)mask);
    for (;;) {
        i64 k = m->at[i].key;
        if (k == key) return m->at[i].val;
        if (k == EMPTY) return -1;
        i = (i + 1) & mask;
    }
}

static int map_grow(Map *m);
static inline void map_prefetch(const Map *m, i64 key) { __builtin_prefetch(map_home(m, key)); }

/* Inserts key (absent, not EMPTY) -> val into a map with room (2 * (size + 1) <= cap); returns the
 * entry's index. */
static __attribute__((unused)) i64 map_insert_roomy(Map *m, i64 key, i64 val) {
    i64 mask = m->cap - 1, i = (i64)(mix(key) & (u64)mask);
    while (m->at[i].key != EMPTY) i = (i + 1) & mask;
    m->at[i].key = key;
    m->at[i].val = val;
    m->size++;
    return i;
}

/* Inserts key (absent) -> val. Returns 0 when out of memory. */
static __attribute__((unused)) int map_insert(Map *m, i64 key, i64 val) {
    if (key == EMPTY) {
        m->has_empty_key = 1;
        m->empty_key_val = val;
        return 1;
    }
    if (2 * (m->size + 1) > m->cap && !map_grow(m)) return 0;
    i64 mask = m->cap - 1, i = (i64)(mix(key) & (u64)mask);
    while (m->at[i].key != EMPTY) i = (i + 1) & mask;
    m->at[i].key = key;
    m->at[i].val = val;
    m->size++;
    return 1;
}

static __attribute__((unused)) int map_grow(Map *m) {
    Map bigger;
    if (!map_init(&bigger, m->cap)) return 0; /* cap = 2 * size bound, so this doubles it */
    for (i64 i = 0; i < m->cap; i++) {
        if (i + LOOKAHEAD < m->cap && m->at[i + LOOKAHEAD].key != EMPTY)
            __builtin_prefetch(map_home(&bigger, m->at[i + LOOKAHEAD].key), 1);
        if (m->at[i].key != EMPTY) map_insert(&bigger, m->at[i].key, m->at[i].val);
    }
    bigger.has_empty_key = m->has_empty_key;
    bigger.empty_key_val = m->empty_key_val;
    map_release(m);
    *m = bigger;
    return 1;
}

/* Removes key if present. */
static __attribute__((unused)) void map_erase(Map *m, i64 key) {
    if (key == EMPTY) {
        m->has_empty_key = 0;
        return;
    }
    i64 mask = m->cap - 1, i = (i64)(mix(key) & (u64)mask);
    for (;;) {
        if (m->at[i].key == key) break;
        if (m->at[i].key == EMPTY) return;
        i = (i + 1) & mask;
    }
    m->at[i].key = EMPTY;
    m->size--;
    for (i64 j = i;;) { /* shift back later entries of the probe run that may not sit past the hole */
        j = (j + 1) & mask;
        if (m->at[j].key == EMPTY) return;
        i64 home = (i64)(mix(m->at[j].key) & (u64)mask);
        /* entry j may move to the hole i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        m->at[i] = m->at[j];
        m->at[j].key = EMPTY;
        i = j;
    }
}


#endif
