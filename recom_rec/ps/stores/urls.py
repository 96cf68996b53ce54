"""Store URLs as text: password redaction for messages, and joining split URLs back."""
from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

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
