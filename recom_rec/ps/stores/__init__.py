"""Row store backends of the parameter-server tier; open them with ``open_store(url)``."""
from .base import ROW_DTYPES, RowStore, StoreError, StoreUnavailable
from .memory import MemoryStore
from .registry import known_schemes, open_store, register_store
from .urls import redact_url

__all__ = [
    "ROW_DTYPES",
    "MemoryStore",
    "RowStore",
    "StoreError",
    "StoreUnavailable",
    "known_schemes",
    "open_store",
    "redact_url",
    "register_store",
]
