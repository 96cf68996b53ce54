"""The abstract row store that the parameter-server tier pulls rows from and pushes rows to.

A store keeps, per (table name, int64 id), one fixed-width float row. The row is whatever the
caller wants persisted for that id: usually the embedding followed by its optimizer state,
concatenated by the caller. The store never interprets the row; it only checks that its width
and dtype match what the caller asks for.

All operations are batched and take/return torch CPU tensors.
"""
from __future__ import annotations

import abc
from typing import Tuple

import torch

#: Row dtypes a store accepts. Rows are stored as their raw bytes, so any of these round-trips
#: exactly.
ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class StoreError(RuntimeError):
    """A store operation failed for a reason that retrying will not fix (bad data, bad auth...)."""


class StoreUnavailable(StoreError):
    """The store could not be reached (at open time, or for longer than its retry timeout)."""


class RowStore(abc.ABC):
    """Batched, binary-safe key-value store of fixed-width float rows keyed by (table, id).

    Subclasses implement the ``_get``/``_put``/... hooks; the public methods here validate and
    normalise arguments once, so every backend sees contiguous CPU int64 ids and rows of a
    supported dtype.

    ``put`` is acknowledged only when it returns without raising: after that the rows are held
    by the store (for a server, the server has replied), so a cache may drop its dirty copies.
    """

    def __init__(self, redacted_url: str):
        self._redacted_url = redacted_url
        self._closed = False

    # ------------------------------------------------------------------ public API

    @property
    def url(self) -> str:
        """The URL this store was opened with, with any password replaced by ``***``."""
        return self._redacted_url

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    def get(
        self, table: str, ids: torch.Tensor, width: int, dtype: torch.dtype
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Fetch rows for ``ids`` of ``table``.

        Returns ``(rows, found)``: ``rows`` is a new ``[n, width]`` tensor of ``dtype``, with
        zeros where the id is not stored; ``found`` is a ``[n]`` bool tensor. Duplicate ids are
        allowed and each gets its row. A stored row of a different width or dtype size raises
        :class:`StoreError`.
        """
        self._check_open()
        check_table(table)
        ids = normalize_ids(ids)
        width = int(width)
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        check_dtype(dtype)
        if ids.numel() == 0:
            return torch.zeros(0, width, dtype=dtype), torch.zeros(0, dtype=torch.bool)
        return self._get(table, ids, width, dtype)

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor, unique_ids: bool = False) -> None:
        """Store ``rows[i]`` under ``ids[i]`` of ``table``, replacing earlier rows.

        If an id occurs more than once in ``ids``, the last occurrence wins. ``unique_ids=True``
        promises that no id repeats (the cache's pushes), which skips the check. Returns only
        after the store has acknowledged the write.
        """
        self._check_open()
        check_table(table)
        ids = normalize_ids(ids)
        rows = normalize_rows(rows, ids.numel())
        if ids.numel() == 0:
            return
        if not unique_ids:
            ids, rows = last_write_wins(ids, rows)
        self._put(table, ids, rows)

    def delete(self, table: str, ids: torch.Tensor) -> None:
        """Remove the rows of ``ids`` from ``table``; ids not stored are ignored."""
        self._check_open()
        check_table(table)
        ids = normalize_ids(ids)
        if ids.numel() == 0:
            return
        self._delete(table, torch.unique(ids))

    def scan_ids(self, table: str) -> torch.Tensor:
        """All ids stored for ``table``, as a sorted 1-D int64 tensor (each id once)."""
        self._check_open()
        check_table(table)
        ids = self._scan_ids(table)
        return torch.unique(ids)  # sorts and drops the duplicates a SCAN may return

    def clear(self, table: str) -> None:
        """Remove every row of ``table``."""
        self._check_open()
        check_table(table)
        self._clear(table)

    def close(self) -> None:
        """Release connections/resources. Idempotent; later operations raise :class:`StoreError`."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> "RowStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return f"{type(self).__name__}({self._redacted_url!r}{state})"

    __str__ = __repr__

    # ------------------------------------------------------------------ backend hooks

    @abc.abstractmethod
    def _get(
        self, table: str, ids: torch.Tensor, width: int, dtype: torch.dtype
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``ids`` is non-empty, contiguous CPU int64 (may hold duplicates)."""

    @abc.abstractmethod
    def _put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """``ids`` is non-empty and unique; ``rows`` is contiguous CPU ``[len(ids), width]``."""

    @abc.abstractmethod
    def _delete(self, table: str, ids: torch.Tensor) -> None:
        """``ids`` is non-empty and unique."""

    @abc.abstractmethod
    def _scan_ids(self, table: str) -> torch.Tensor:
        """Stored ids of ``table`` as 1-D int64, any order, duplicates allowed."""

    @abc.abstractmethod
    def _clear(self, table: str) -> None:
        ...

    @abc.abstractmethod
    def _close(self) -> None:
        ...

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed")


# ---------------------------------------------------------------------- argument helpers


def scrub_secrets(text: str, secrets) -> str:
    """Remove secrets (passwords) from error text we did not write (client messages, parse errors)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def check_table(table: str) -> None:
    """Table names are non-empty strings without ':' (backends use ':' as a key separator)."""
    if not isinstance(table, str) or not table:
        raise ValueError(f"table name must be a non-empty str, got {table!r}")
    if ":" in table:
        raise ValueError(f"table name must not contain ':', got {table!r}")


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in ROW_DTYPES:
        raise ValueError(f"row dtype must be one of {ROW_DTYPES}, got {dtype}")


def normalize_ids(ids) -> torch.Tensor:
    """Return ``ids`` as a contiguous 1-D CPU int64 tensor (accepts tensors, arrays, lists)."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be integers, got {ids.dtype}")
    return ids.to(device="cpu", dtype=torch.int64).contiguous()


def normalize_rows(rows, n: int) -> torch.Tensor:
    """Return ``rows`` as a contiguous CPU ``[n, width]`` tensor of a supported dtype."""
    rows = torch.as_tensor(rows)
    if rows.dim() != 2 or rows.shape[0] != n:
        raise ValueError(f"rows must have shape [{n}, width], got {tuple(rows.shape)}")
    if rows.shape[1] < 1:
        raise ValueError("rows must have width >= 1")
    check_dtype(rows.dtype)
    return rows.detach().to("cpu").contiguous()


def last_write_wins(ids: torch.Tensor, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Drop all but the last occurrence of each id, so a put has one well-defined row per id."""
    unique_ids, inverse = torch.unique(ids, return_inverse=True)
    if unique_ids.numel() == ids.numel():
        return ids, rows
    positions = torch.arange(ids.numel())
    last = torch.full((unique_ids.numel(),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, positions, reduce="amax")
    return unique_ids, rows.index_select(0, last)
