"""``memory://`` store: rows held in this process, for tests and single-process runs.

``memory://`` is private to the handle; ``memory://NAME`` names a namespace shared by every
handle opened with the same name in this process (like a tiny in-process server), and its
data outlives the handles until :func:`drop_memory_namespace` is called.

Each table keeps an id -> slot :class:`~recom_rec.ps.id_index.IdIndex` and one growing
``[capacity, width]`` tensor, so lookups, gathers and scatters of a batch are each a few
vectorised torch ops.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlsplit

import torch

from ..id_index import IdIndex
from .base import RowStore, StoreError

_INITIAL_CAPACITY = 1024


class _Table:
    """Rows of one table: an id -> slot index plus a row tensor that doubles when full."""
    # slots of deleted ids are kept in free_slots and handed out again before the tensor grows

    def __init__(self, width: int, dtype: torch.dtype):
        self.width = width
        self.dtype = dtype
        self.slot_of = IdIndex()
        self.rows = torch.zeros(_INITIAL_CAPACITY, width, dtype=dtype)
        self.used = 0  # slots [0, used) have been handed out at least once
        self.free_slots: List[int] = []  # slots of deleted ids, reused before growing

    def check_layout(self, table: str, width: int, dtype: torch.dtype) -> None:
        if width != self.width or dtype != self.dtype:
            raise StoreError(
                f"table {table!r} stores rows of width {self.width} and dtype {self.dtype}, "
                f"but width {width} and dtype {dtype} were used"
            )

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slot_of.lookup(ids)  # -1 where the id is not stored

    def allocate(self, count: int) -> torch.Tensor:
        reused = self.free_slots[-count:] if count else []
        del self.free_slots[len(self.free_slots) - len(reused):]
        fresh = count - len(reused)
        if self.used + fresh > self.rows.shape[0]:
            capacity = max(self.rows.shape[0] * 2, self.used + fresh)
            grown = torch.zeros(capacity, self.width, dtype=self.dtype)
            grown[: self.used] = self.rows[: self.used]
            self.rows = grown
        new = torch.arange(self.used, self.used + fresh, dtype=torch.int64)
        self.used += fresh
        return torch.cat([torch.tensor(reused, dtype=torch.int64), new]) if reused else new


class _Namespace:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: Dict[str, _Table] = {}


_SHARED: Dict[str, _Namespace] = {}
_SHARED_LOCK = threading.Lock()


def drop_memory_namespace(name: str) -> None:
    """Forget the shared namespace ``memory://name`` (handles still open keep their reference)."""
    with _SHARED_LOCK:
        _SHARED.pop(name, None)


class MemoryStore(RowStore):
    """In-process :class:`RowStore`; see the module docstring for URL forms."""

    def __init__(self, name: Optional[str] = None):
        super().__init__(f"memory://{name}" if name else "memory://")
        if name:
            with _SHARED_LOCK:
                self._ns = _SHARED.setdefault(name, _Namespace())
        else:
            self._ns = _Namespace()

    def _get(self, table, ids, width, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        with self._ns.lock:
            t = self._ns.tables.get(table)
            if t is None:
                return torch.zeros(ids.numel(), width, dtype=dtype), torch.zeros(
                    ids.numel(), dtype=torch.bool
                )
            t.check_layout(table, width, dtype)
            slots = t.lookup(ids)
            found = slots >= 0
            # Missing ids read slot 0 and are zeroed afterwards: one gather for the whole batch.
            rows = t.rows.index_select(0, slots.clamp(min=0))
            rows[~found] = 0
            return rows, found

    def _put(self, table, ids, rows) -> None:
        width, dtype = rows.shape[1], rows.dtype
        with self._ns.lock:
            t = self._ns.tables.get(table)
            if t is None:
                t = self._ns.tables[table] = _Table(width, dtype)
            t.check_layout(table, width, dtype)
            slots = t.lookup(ids)
            missing = (slots < 0).nonzero().flatten()
            if missing.numel():
                slots[missing] = t.allocate(missing.numel())
                t.slot_of.insert(ids[missing], slots[missing])
            t.rows[slots] = rows  # ids are unique here, so the scatter is well defined

    def _delete(self, table, ids) -> None:
        with self._ns.lock:
            t = self._ns.tables.get(table)
            if t is None:
                return
            ids = torch.unique(ids.to(torch.int64))
            slots = t.slot_of.lookup(ids)
            t.slot_of.delete(ids)
            t.free_slots.extend(slots[slots >= 0].tolist())

    def _scan_ids(self, table) -> torch.Tensor:
        with self._ns.lock:
            t = self._ns.tables.get(table)
            return t.slot_of.items()[0] if t is not None else torch.empty(0, dtype=torch.int64)

    def _clear(self, table) -> None:
        with self._ns.lock:
            self._ns.tables.pop(table, None)

    def _close(self) -> None:
        self._ns = _Namespace()  # drop our reference; a shared namespace lives on in _SHARED


def open_memory_store(url: str) -> MemoryStore:
    """Factory for ``memory://`` and ``memory://NAME``."""
    parts = urlsplit(url)
    if parts.scheme != "memory":
        raise ValueError(f"not a memory:// URL: {url!r}")
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"memory:// URL takes only a name, e.g. 'memory://shared', got {url!r}")
    return MemoryStore(parts.netloc or None)
