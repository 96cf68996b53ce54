"""Opening stores by URL: a scheme -> factory registry, and password redaction for URLs."""
from __future__ import annotations

import threading
from typing import Callable, Dict
from urllib.parse import parse_qsl, urlencode, urlsplit

from .base import RowStore

StoreFactory = Callable[[str], RowStore]

_FACTORIES: Dict[str, StoreFactory] = {}
_LOCK = threading.Lock()

# Query arguments that carry secrets (redis-py accepts ?password=... in URLs).
_SECRET_QUERY_KEYS = {"password", "pass", "passwd", "pwd", "token", "secret"}


def redact_url(url: str) -> str:
    """``url`` with the password of its user-info, and secret query values, replaced by ``***``.

    Works for multi-host netlocs (``redis+cluster://u:p@h1:1,h2:2``) too, since it edits the
    netloc as text instead of relying on host/port parsing.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hosts}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode(
                [(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs],
                safe="*/,",
            )
    return join_url(parts.scheme, netloc, parts.path, query, parts.fragment)


def join_url(scheme: str, netloc: str, path: str, query: str = "", fragment: str = "") -> str:
    """Inverse of ``urlsplit`` that keeps ``//`` for an empty netloc (``unix:///path``), which
    ``urlunsplit`` drops for schemes it does not know."""
    url = f"{scheme}://{netloc}{path}"
    if query:
        url += f"?{query}"
    if fragment:
        url += f"#{fragment}"
    return url


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
