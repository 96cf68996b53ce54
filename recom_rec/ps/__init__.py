"""Parameter-server tier: row stores, the per-table row cache inside the fused module, and
``wrap``/``flush``/``export_table``."""
from .config import PSConfig
from .stores import RowStore, StoreError, StoreUnavailable, open_store, redact_url, register_store
from .tier import export_table, flush, init_rows, tiers_of
from .wrap import wrap

__all__ = [
    "PSConfig", "RowStore", "StoreError", "StoreUnavailable", "export_table", "flush", "init_rows",
    "open_store", "redact_url", "register_store", "tiers_of", "wrap",
]
