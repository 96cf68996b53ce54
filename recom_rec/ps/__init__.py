"""Parameter-server tier. So far: the key-value row stores it pulls rows from and pushes to."""
from .stores import RowStore, StoreError, StoreUnavailable, open_store, redact_url, register_store

__all__ = ["RowStore", "StoreError", "StoreUnavailable", "open_store", "redact_url", "register_store"]
