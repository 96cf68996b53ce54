"""Slot map of one PS-backed table's cache: which id sits in which slot, which slots batches in
flight hold, and which slot to evict. The work is done in C (csrc/ps/ps_host.c, through
:mod:`.host_lib`); the per-slot arrays are numpy arrays here, readable (and, between calls,
writable) from Python.

A batch goes through :meth:`SlotCache.stage` (its ids looked up, the misses' slots reserved,
everything it uses pinned), then the tier moves the rows (pushes the dirty victims, pulls the
misses), then :meth:`SlotCache.commit` (the id map changes) or :meth:`SlotCache.abort` (nothing
changes). Eviction order: free slots first (lowest first), then unpinned occupied slots that the
batch does not use, by the policy's score, ties to the lower slot:
- ``lru``: the last batch that used the slot;
- ``lfu``: the batches that used the row since it entered the cache, ties by the last batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import host_lib
from .host_lib import ptr

FREE = -1


class CacheFull(RuntimeError):
    """Not enough unpinned slots for a batch's misses."""


@dataclass
class Staged:
    """One batch's reservation in a cache, from :meth:`SlotCache.stage`."""

    pos_slot: np.ndarray  # the slot of each id position of the batch
    slots: np.ndarray  # the batch's distinct slots (hits, then take), pinned
    take: np.ndarray  # slots reserved for the misses
    new_ids: np.ndarray  # the misses, distinct, in first-seen order; new_ids[k] goes to take[k]
    evicted: np.ndarray  # the id each take slot holds now (FREE if none)
    push: np.ndarray  # bool: that evicted row is dirty, the store must have it first

    @property
    def misses(self) -> int:
        return int(self.take.size)


class SlotCache:
    def __init__(self, table: str, cache_rows: int, eviction: str) -> None:
        self.table = table
        self.cache_rows = int(cache_rows)
        self.eviction = eviction
        self.id_of = np.full(self.cache_rows, FREE, dtype=np.int64)
        self.dirty = np.zeros(self.cache_rows, dtype=np.uint8)
        self._pins = np.zeros(self.cache_rows, dtype=np.int32)  # batches in flight using the slot
        self.last_used = np.zeros(self.cache_rows, dtype=np.int64)
        self.uses = np.zeros(self.cache_rows, dtype=np.int64)
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "pushed": 0}
        self._lib = host_lib.lib()
        self._c = self._lib.ps_cache_new(self.cache_rows, int(eviction == "lfu"), ptr(self.id_of), ptr(self.dirty),
                                         ptr(self._pins), ptr(self.last_used), ptr(self.uses))
        if not self._c:
            raise MemoryError(f"table {table!r}: cannot allocate a cache of {cache_rows} slots")

    @property
    def handle(self) -> int:
        """The C cache's address (what a staging job reads)."""
        return self._c

    def __del__(self) -> None:
        c, self._c = getattr(self, "_c", None), None
        if c:
            self._lib.ps_cache_free(c)

    def stage(self, ids: np.ndarray) -> Optional[Staged]:
        """Reserve slots for a batch's ids (int64, duplicates allowed). None: other batches in
        flight hold too many slots now (retry after one is released)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        n = ids.size
        # the outputs are views of one block: one address to fetch (tens of us each on slow hosts)
        block = np.empty(5 * n + 3 + (n + 7) // 8, np.int64)
        pos_slot, slots, take, new_ids, evicted = (block[k * n:(k + 1) * n] for k in range(5))
        counts = block[5 * n:5 * n + 3]
        push = block[5 * n + 3:].view(np.uint8)[:n]
        at = ptr(block)
        status = self._lib.ps_cache_stage(self._c, ptr(ids), n, at, at + 8 * n, at + 16 * n, at + 24 * n, at + 32 * n,
                                          at + 8 * (5 * n + 3), at + 40 * n)
        distinct, m, third = (int(x) for x in counts)
        if status == host_lib.STAGE_NEGATIVE_ID:
            raise ValueError(f"table {self.table!r}: PS-backed tables take ids >= 0, got {int(ids[distinct])}")
        if status == host_lib.STAGE_NO_MEMORY:
            raise MemoryError(f"table {self.table!r}: out of host memory staging a batch of {n} ids")
        if status == host_lib.STAGE_WOULD_BLOCK:
            return None
        if status == host_lib.STAGE_FULL:
            if distinct > self.cache_rows:
                raise CacheFull(f"table {self.table!r}: a batch uses {distinct} distinct ids, more than "
                                f"cache_rows={self.cache_rows}")
            raise CacheFull(
                f"table {self.table!r}: a batch needs {m} slots but only {third} of cache_rows={self.cache_rows} "
                "are free or can be evicted (the rest hold rows of this batch or of batches in flight); "
                "raise cache_rows")
        self.stats["hits"] += third
        self.stats["misses"] += m
        return Staged(pos_slot, slots[:distinct], take[:m], new_ids[:m], evicted[:m], push[:m].view(bool))

    def commit(self, staged: Staged) -> None:
        """The staged batch's rows are in place: its misses now own their slots."""
        self.stats["evictions"] += int(self._lib.ps_cache_commit(
            self._c, ptr(staged.slots), staged.slots.size, ptr(staged.take), ptr(staged.new_ids), staged.misses))

    def abort(self, staged: Staged) -> None:
        """Forget a stage that will not be committed: its pins go, every id stays where it was."""
        self._lib.ps_cache_abort(self._c, ptr(staged.slots), staged.slots.size)

    def unpin(self, slots: np.ndarray) -> None:
        """A batch holding ``slots`` (its :attr:`Staged.slots`) is done (queued in C, applied by the
        next call that changes the cache: it never waits for a staging in progress)."""
        if self._lib.ps_cache_unpin(self._c, ptr(slots), slots.size) != 0:
            raise MemoryError(f"table {self.table!r}: out of host memory unpinning {slots.size} slots")

    @property
    def pins(self) -> np.ndarray:
        """Batches in flight holding each slot (the queued unpins applied first)."""
        self._lib.ps_cache_sync(self._c)
        return self._pins

    def mark_dirty(self, slots: np.ndarray) -> None:
        self._lib.ps_cache_mark_dirty(self._c, ptr(slots), slots.size)

    def drop(self, slots: np.ndarray) -> None:
        """Free unpinned occupied ``slots`` (their dirty rows must be in the store already)."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        self.stats["evictions"] += int((self.id_of[slots] != FREE).sum())
        self._lib.ps_cache_drop(self._c, ptr(slots), slots.size)

    def occupied(self) -> Tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of the occupied slots."""
        slots = np.flatnonzero(self.id_of != FREE)
        return self.id_of[slots], slots
