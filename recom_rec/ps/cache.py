"""Slot map of one PS-backed table's cache: which id sits in which slot, and which slot to evict.

The id -> slot map is a Python dict (one lookup per *unique* id of a batch, about 0.1 us each);
everything else (free/dirty/pinned masks, recency and frequency counters, victim choice) is a
vectorised torch op over the ``cache_rows`` slots. Cost per batch: O(unique ids) dict work plus
O(cache_rows) tensor work when the batch misses.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

FREE = -1


class CacheFull(RuntimeError):
    """Not enough unpinned slots for a batch's misses."""


class SlotCache:
    def __init__(self, table: str, cache_rows: int, eviction: str) -> None:
        self.table = table
        self.cache_rows = cache_rows
        self.eviction = eviction
        self.slot_of: Dict[int, int] = {}
        self.id_of = torch.full((cache_rows,), FREE, dtype=torch.int64)
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool)
        self.pins = torch.zeros(cache_rows, dtype=torch.int32)  # batches in flight using the slot
        self.last_used = torch.zeros(cache_rows, dtype=torch.int64)
        self.uses = torch.zeros(cache_rows, dtype=torch.int64)
        self.clock = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "pushed": 0}

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        get = self.slot_of.get
        return torch.tensor([get(i, FREE) for i in ids.tolist()], dtype=torch.int64)

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
        for i in self.id_of[slots].tolist():
            del self.slot_of[i]
        self.id_of[slots] = FREE
        self.dirty[slots] = False
        self.uses[slots] = 0

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        for i, s in zip(ids.tolist(), slots.tolist()):
            self.slot_of[i] = s
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
