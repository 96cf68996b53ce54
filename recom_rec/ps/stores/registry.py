"""Opening stores by URL: a scheme -> factory registry."""
from __future__ import annotations

import threading
from typing import Callable, Dict

from .base import RowStore
from .urls import redact_url

StoreFactory = Callable[[str], RowStore]

_FACTORIES: Dict[str, StoreFactory] = {}
_LOCK = threading.Lock()


def register_store(scheme: str, factory: StoreFactory, *, replace: bool = False) -> None:
    """Make ``open_store`` call ``factory(url)`` for URLs of ``scheme`` (e.g. ``"rocksdb"``).

    Registering a scheme twice raises ``ValueError`` unless ``replace=True``.
    """
    if not isinstance(scheme, str) or not scheme or "://" in scheme:
        raise ValueError(f"scheme must be a bare name like 'redis', got {scheme!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {factory!r}")
    scheme = scheme.lower()
    with _LOCK:
        if scheme in _FACTORIES and not replace:
            raise ValueError(f"store scheme {scheme!r} is already registered")
        _FACTORIES[scheme] = factory


def known_schemes() -> list:
    """Sorted list of the schemes ``open_store`` can open."""
    with _LOCK:
        return sorted(_FACTORIES)


def open_store(url: str) -> RowStore:
    """Open the row store named by ``url``; the scheme picks the backend.

    Built in: ``memory://[NAME]``, ``redis://``, ``rediss://``, ``unix://``,
    ``redis+cluster://``. Unknown schemes raise ``ValueError`` listing the known ones.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"store URL must look like 'scheme://...', got {redact_url(str(url))!r}")
    scheme = url.split("://", 1)[0].lower()
    with _LOCK:
        factory = _FACTORIES.get(scheme)
        known = sorted(_FACTORIES)
    if factory is None:
        raise ValueError(
            f"unknown store scheme {scheme!r} in {redact_url(url)!r}; known schemes: "
            + ", ".join(known)
        )
    return factory(url)


def _open_redis(url: str) -> RowStore:
    # Imported on use: redis-py is an optional dependency (extras_require["redis"]).
    from .redis_store import open_redis_store

    return open_redis_store(url)


def _register_builtins() -> None:
    """The built-in schemes, registered at import time."""
    from .memory import open_memory_store

    _FACTORIES["memory"] = open_memory_store
    for scheme in ("redis", "rediss", "unix", "redis+cluster"):
        _FACTORIES[scheme] = _open_redis


_register_builtins()
