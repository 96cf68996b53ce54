"""Configuration of a parameter-server-backed table."""
from __future__ import annotations

from dataclasses import dataclass

EVICTION_POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class PSConfig:
    """A table whose rows live in the store at ``url`` and are cached in ``cache_rows`` slots
    of the fused module's flat buffer.

    ``eviction``: ``"lru"`` (least recently used batch first) or ``"lfu"`` (fewest batches that
    used the row since it entered the cache first, ties by recency). ``seed`` picks the
    deterministic initial value of rows the store has never seen: row ``id`` of table ``t`` is
    ``init_fn`` drawn under a seed derived from ``(t, id, seed)``.
    """

    url: str
    cache_rows: int
    eviction: str = "lru"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ValueError(f"PSConfig.url must be a store URL like 'redis://host:port/0', got {self.url!r}")
        if int(self.cache_rows) < 1:
            raise ValueError(f"PSConfig.cache_rows must be >= 1, got {self.cache_rows}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"PSConfig.eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
