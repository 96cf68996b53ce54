"""Slot map of one PS-backed table's cache: which id sits in which slot, and which slot to evict.

The metadata lives on the device of the table's rows (the batch's ids are there already, so a
GPU batch is looked up without copying ids to the host and back). The id -> slot map:

- on a GPU, ``id_of`` sorted once after each change (one device sort of ``cache_rows`` int64,
  tens of microseconds), then one ``searchsorted`` per lookup: a handful of kernel launches per
  batch instead of the dozens of small host ops an incremental index costs;
- on the CPU, an :class:`~recom_rec.ps.id_index.IdIndex` (sorted arrays updated incrementally),
  where re-sorting a large cache every batch would cost more than the updates.

Everything else (free/dirty/pinned masks, recency and frequency counters, the slot choice) is a
vectorised torch op over the ``cache_rows`` slots.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .id_index import IdIndex

FREE = -1
_NEVER = torch.iinfo(torch.int64).max  # the choice key of a slot that may not be taken


class CacheFull(RuntimeError):
    """Not enough unpinned slots for a batch's misses."""


class SlotCache:
    def __init__(self, table: str, cache_rows: int, eviction: str, device=None) -> None:
        self.table = table
        self.cache_rows = cache_rows
        self.eviction = eviction
        device = torch.device(device or "cpu")
        self.id_of = torch.full((cache_rows,), FREE, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool, device=device)
        self.pins = torch.zeros(cache_rows, dtype=torch.int32, device=device)  # batches in flight using the slot
        self.last_used = torch.zeros(cache_rows, dtype=torch.int64, device=device)
        self.uses = torch.zeros(cache_rows, dtype=torch.int64, device=device)
        # Updates by index go through index_fill_/index_put_ with these: one op each, where
        # `x[slots] += 1` is three (a torch op costs tens of microseconds of host time).
        self._one_i32 = torch.ones((), dtype=torch.int32, device=device)
        self._one_i64 = torch.ones((), dtype=torch.int64, device=device)
        self._minus_one_i32 = -self._one_i32
        self.clock = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "pushed": 0}
        self._index: Optional[IdIndex] = None  # CPU: incremental
        self._sorted: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # GPU: id_of sorted, and its slots
        self._rebuild_index()

    @property
    def device(self) -> torch.device:
        return self.id_of.device

    def to(self, device) -> "SlotCache":
        """Move the metadata (the module moved its rows)."""
        device = torch.device(device)
        if device != self.device:
            for name in ("id_of", "dirty", "pins", "last_used", "uses", "_one_i32", "_one_i64", "_minus_one_i32"):
                setattr(self, name, getattr(self, name).to(device))
            self._rebuild_index()
        return self

    def _rebuild_index(self) -> None:
        self._sorted = None
        self._index = None
        if self.device.type == "cpu":
            self._index = IdIndex()
            ids, slots = self.occupied()
            self._index.insert(ids, slots)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, FREE (-1) where the id is not cached."""
        if self._index is not None:
            return self._index.lookup(ids)
        if self._sorted is None:
            keys, slots = torch.sort(self.id_of)
            self._sorted = (keys, slots)
        keys, slots = self._sorted
        pos = torch.searchsorted(keys, ids).clamp_(max=self.cache_rows - 1)
        return torch.where(keys[pos] == ids, slots[pos], FREE)

    def free_slots(self) -> torch.Tensor:
        return (self.id_of == FREE).nonzero().flatten()

    def choose_slots(self, count: int, exclude: torch.Tensor) -> torch.Tensor:
        """``count`` slots for new rows: free slots first (lowest first), then occupied, unpinned
        slots outside the mask ``exclude`` by the eviction policy (ties: the lower slot). One stable sort of a key per slot; raises CacheFull when fewer
        than ``count`` slots qualify."""
        if count == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self.eviction == "lru":
            score = self.last_used.clone()
        else:  # lfu, ties by recency (last_used < 2**40 batches)
            score = self.uses * (1 << 40) + self.last_used
        score.masked_fill_(self.id_of == FREE, -1)
        score.masked_fill_(self.pins > 0, _NEVER)
        score.masked_fill_(exclude, _NEVER)
        keys, order = torch.sort(score, stable=True)
        if count > self.cache_rows or int(keys[count - 1]) == _NEVER:
            able = int((keys != _NEVER).sum())
            raise CacheFull(
                f"table {self.table!r}: a batch needs {count} slots but only {able} of "
                f"cache_rows={self.cache_rows} are free or can be evicted (the rest hold rows of this batch or "
                "of batches in flight); raise cache_rows"
            )
        return order[:count]

    def choose_victims(self, count: int, exclude: torch.Tensor) -> torch.Tensor:
        """``count`` occupied, unpinned slots not in ``exclude``, by the eviction policy."""
        taken = self.id_of == FREE
        taken[exclude.to(self.device)] = True
        return self.choose_slots(count, taken)

    def drop(self, slots: torch.Tensor) -> None:
        self.stats["evictions"] += slots.numel()
        if self._index is not None:
            self._index.delete(self.id_of[slots])
        self._sorted = None
        self.id_of.index_fill_(0, slots, FREE)
        self.dirty.index_fill_(0, slots, False)
        self.uses.index_fill_(0, slots, 0)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        if self._index is not None:
            self._index.insert(ids, slots)
        self._sorted = None
        self.id_of.index_copy_(0, slots, ids)
        self.dirty.index_fill_(0, slots, False)
        self.uses.index_fill_(0, slots, 0)

    def touch(self, slots: torch.Tensor) -> None:
        self.clock += 1
        self.last_used.index_fill_(0, slots, self.clock)
        self.uses.index_put_((slots,), self._one_i64, accumulate=True)

    def pin(self, slots: torch.Tensor, by: int = 1) -> None:
        """Count a batch in flight on ``slots`` (``by=-1``: the batch is done)."""
        self.pins.index_put_((slots,), self._one_i32 if by == 1 else self._minus_one_i32, accumulate=True)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        self.dirty.index_fill_(0, slots, True)

    def occupied(self) -> Tuple[torch.Tensor, torch.Tensor]:
        slots = (self.id_of != FREE).nonzero().flatten()
        return self.id_of[slots], slots
