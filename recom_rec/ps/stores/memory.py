"""``memory://`` store: rows held in this process, for tests and single-process runs.

``memory://`` is private to the handle; ``memory://NAME`` names a namespace shared by every
handle opened with the same name in this process (like a tiny in-process server), and its
data outlives the handles until :func:`drop_memory_namespace` is called.

Each table is a C table (csrc/ps/ps_mem.c): id -> row hash maps and growing row chunks,
sharded where a pool of threads runs a batch's shards at once, rows kept as their raw bytes; a
batch's get or put is one call that releases the GIL. The
parameter-server tier's staging calls a table's C functions directly (:meth:`MemoryStore.native_table`).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Dict, Optional, Tuple
from urllib.parse import urlsplit

import numpy as np
import torch

from .. import host_lib
from .base import RowStore, StoreError


class _Table:
    """Rows of one table (a fixed width and dtype), held by the C library."""

    def __init__(self, width: int, dtype: torch.dtype):
        self.width = width
        self.dtype = dtype
        self.row_bytes = width * torch.empty((), dtype=dtype).element_size()
        self._lib = host_lib.lib()
        self._t = self._lib.ps_mem_new(self.row_bytes)
        if not self._t:
            raise MemoryError("cannot allocate a memory:// table")

    def __del__(self) -> None:
        t, self._t = getattr(self, "_t", None), None
        if t:
            self._lib.ps_mem_free(t)

    def check_layout(self, table: str, width: int, dtype: torch.dtype) -> None:
        if width != self.width or dtype != self.dtype:
            raise StoreError(
                f"table {table!r} stores rows of width {self.width} and dtype {self.dtype}, "
                f"but width {width} and dtype {dtype} were used"
            )

    def get(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = torch.empty(ids.numel(), self.width, dtype=self.dtype)
        found = torch.empty(ids.numel(), dtype=torch.bool)
        if not self._lib.ps_mem_get(self._t, ids.data_ptr(), ids.numel(), rows.data_ptr(), found.data_ptr()):
            raise MemoryError("memory:// store: out of host memory reading rows")
        return rows, found

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if not self._lib.ps_mem_put(self._t, ids.data_ptr(), ids.numel(), rows.data_ptr()):
            raise StoreError(f"memory:// table {table!r}: out of memory storing {ids.numel()} rows")

    def delete(self, table: str, ids: torch.Tensor) -> None:
        if not self._lib.ps_mem_delete(self._t, ids.data_ptr(), ids.numel()):
            raise StoreError(f"memory:// table {table!r}: out of memory deleting rows")

    def fill_store_ops(self, ops) -> None:
        """Points a staging job's store ops (csrc/ps/ps_host.h's StoreOps) at this table."""
        self._lib.ps_mem_store_ops(ctypes.byref(ops), self._t)

    def error(self):
        """A failed native get or put here ran out of memory (the tier says so itself)."""
        return None

    def ids(self) -> torch.Tensor:
        out = np.empty(0, dtype=np.int64)
        while True:  # the count can grow between two calls while a staging thread puts rows
            count = self._lib.ps_mem_scan(self._t, host_lib.ptr(out) if out.size else None, out.size)
            if count <= out.size:
                return torch.from_numpy(out[:count])
            out = np.empty(count + 1024, dtype=np.int64)


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
            return t.get(ids)

    def _put(self, table, ids, rows) -> None:
        width, dtype = rows.shape[1], rows.dtype
        with self._ns.lock:
            t = self._ns.tables.get(table)
            if t is None:
                t = self._ns.tables[table] = _Table(width, dtype)
            t.check_layout(table, width, dtype)
            t.put(table, ids, rows)

    def native_table(self, table: str, width: int) -> _Table:
        """The C table of ``table`` for float32 rows of ``width`` (made when absent), whose
        store ops (:meth:`_Table.fill_store_ops`) the tier's staging calls without Python. Fetch it per batch: a
        :meth:`clear` replaces it."""
        with self._ns.lock:
            t = self._ns.tables.get(table)
            if t is None:
                t = self._ns.tables[table] = _Table(width, torch.float32)
            t.check_layout(table, width, torch.float32)
            return t

    def _delete(self, table, ids) -> None:
        with self._ns.lock:
            t = self._ns.tables.get(table)
            if t is not None:
                t.delete(table, ids)

    def _scan_ids(self, table) -> torch.Tensor:
        with self._ns.lock:
            t = self._ns.tables.get(table)
            return t.ids() if t is not None else torch.empty(0, dtype=torch.int64)

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
