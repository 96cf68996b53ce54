"""Slot map of one PS-backed table's cache: which id sits in which slot, and which slot to evict.

The id -> slot map is an :class:`~recom_rec.ps.id_index.IdIndex` (sorted arrays, one
``searchsorted`` per batch); everything else (free/dirty/pinned masks, recency and frequency
counters, victim choice) is a vectorised torch op over the ``cache_rows`` slots. Cost per batch:
a few torch ops over the batch's unique ids plus O(cache_rows) tensor work when the batch misses.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .id_index import IdIndex

FREE = -1


class CacheFull(RuntimeError):
    """Not enough unpinned slots for a batch's misses."""


class SlotCache:
    def __init__(self, table: str, cache_rows: int, eviction: str) -> None:
        self.table = table
        self.cache_rows = cache_rows
        self.eviction = eviction
        self.slot_of = IdIndex()
        self.id_of = torch.full((cache_rows,), FREE, dtype=torch.int64)
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool)
        self.pins = torch.zeros(cache_rows, dtype=torch.int32)  # batches in flight using the slot
        self.last_used = torch.zeros(cache_rows, dtype=torch.int64)
        self.uses = torch.zeros(cache_rows, dtype=torch.int64)
        self.clock = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "pushed": 0}

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slot_of.lookup(ids)  # FREE (-1) where the id is not cached

    def free_slots(self) -> torch.Tensor:
        return (self.id_of == FREE).nonzero().flatten()

    def choose_victims(self, count: int, exclude: torch.Tensor) -> torch.Tensor:
        """``count`` occupied, unpinned slots not in ``exclude``, by the eviction policy."""
        candidates = (self.id_of != FREE) & (self.pins == 0)
        candidates[exclude] = False
        idx = candidates.nonzero().flatten()
        if idx.numel() < count:
            raise CacheFull(
                f"table {self.table!r}: a batch needs {count} more slots but only {idx.numel()} of "
                f"cache_rows={self.cache_rows} can be evicted (the rest hold rows of batches in flight); "
                "raise cache_rows"
            )
        if self.eviction == "lru":
            score = self.last_used[idx]
        else:  # lfu, ties by recency (last_used < 2**40 batches)
            score = self.uses[idx] * (1 << 40) + self.last_used[idx]
        # stable sort: equal scores evict the lower slot first, so the choice is deterministic
        order = torch.sort(score, stable=True).indices[:count]
        return idx[order]

    def drop(self, slots: torch.Tensor) -> None:
        self.stats["evictions"] += slots.numel()
        self.slot_of.delete(self.id_of[slots])
        self.id_of[slots] = FREE
        self.dirty[slots] = False
        self.uses[slots] = 0

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self.slot_of.insert(ids, slots)
        self.id_of[slots] = ids
        self.dirty[slots] = False
        self.uses[slots] = 0

    def touch(self, slots: torch.Tensor) -> None:
        self.clock += 1
        self.last_used[slots] = self.clock
        self.uses[slots] += 1

    def occupied(self) -> Tuple[torch.Tensor, torch.Tensor]:
        slots = (self.id_of != FREE).nonzero().flatten()
        return self.id_of[slots], slots
