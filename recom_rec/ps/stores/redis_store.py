"""Redis-backed row store: ``redis://``, ``rediss://``, ``unix://`` and ``redis+cluster://``.

URL forms (query arguments ``prefix`` and ``retry_timeout`` are ours, the rest go to redis-py)::

    redis://[user:password@]host:port/db?prefix=NAME&retry_timeout=30
    rediss://[user:password@]host:port/db?prefix=NAME&ssl_cert_reqs=required&ssl_ca_certs=/ca.pem
    unix:///path/to/redis.sock?db=N&prefix=NAME
    redis+cluster://[user:password@]host:port[,host:port...]?prefix=NAME

Layout: the row of (table, id) is the value of key ``{prefix}:{table}:`` + the id as 8 bytes
little-endian, holding the row's raw bytes (``width * itemsize``). On a cluster the key starts
with a hash tag, ``{tag}``, one of 64 (the id's bucket: the top 6 bits of id * 0x9E3779B97F4A7C15
mod 2^64; the tags spread evenly over the slots, see csrc/ps/ps_redis.c), so that one MGET/MSET
moves all of a batch's keys of a bucket; the key ``{prefix}:layout`` marks that layout, and a
cluster prefix holding keys of the layout before (no tags) is refused at open. Otherwise no
other keys are written:
``scan_ids``/``clear`` use SCAN with MATCH on the key head, so a put is a single MSET and needs
no id-set bookkeeping (SCAN is O(keys in the db), acceptable for checkpoints/cold starts, which
is when the PS tier scans).

Rows: a batch's get and put are run by the C client of csrc/ps/ps_redis.c (:mod:`.redis_native`),
which the tier's staging job also calls without the GIL: one server gets pipelined MGET/MSET
commands of 512 keys; a cluster gets an MGET/MSET per hash tag, pipelined per master, every
master's pipeline in flight at once, -MOVED and -ASK followed. redis-py keeps the control path: PING at open, SCAN, DEL.

Failures: connection errors and timeouts are retried with exponential backoff until
``retry_timeout`` seconds have passed since the operation started, then
:class:`StoreUnavailable` is raised. Operations are idempotent (MSET/MGET/DEL of fixed
values), so re-sending a whole batch after a partial failure is safe. Opening does not retry:
an unreachable server fails fast (small connect timeout + PING).
"""
from __future__ import annotations

import ctypes
import functools
import ssl
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import numpy as np
import torch

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from .. import host_lib
from .base import RowStore, StoreError, StoreUnavailable, scrub_secrets
from .redis_native import NativeClient, NativeTable
from .urls import join_url, redact_url

#: Keys per DEL command.
CHUNK = 4096
DEFAULT_PREFIX = "recom_rec"
DEFAULT_RETRY_TIMEOUT = 30.0
# Small connect timeout so an unreachable server is reported quickly; reads get longer since
# a chunk can be several MB.
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_SOCKET_TIMEOUT = 10.0
_BACKOFF_START = 0.05
_BACKOFF_CAP = 1.0

# Errors worth retrying: the server is down, restarting, loading its AOF, or a cluster is
# failing over. redis' ConnectionError covers BusyLoadingError but also the auth errors,
# which are excluded explicitly before this tuple is consulted.
_TRANSIENT = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    ClusterDownError,
    TryAgainError,
    RedisClusterException,
    OSError,
)
_AUTH = (AuthenticationError, AuthorizationError)

T = TypeVar("T")


class RedisStore(RowStore):
    """:class:`RowStore` on a Redis server or cluster; open it with :func:`open_redis_store`."""

    def __init__(
        self,
        client,
        *,
        cluster: bool,
        prefix: str,
        retry_timeout: float,
        redacted_url: str,
        native: NativeClient,
        secrets: Sequence[str] = (),
        new_lane: Optional[Callable[[], NativeClient]] = None,
    ):
        super().__init__(redacted_url)
        self._client = client
        self._native = native
        # Store lanes: a client (connections) of its own per staging I/O thread, so that several
        # batches' I/O is in flight at once (lane 0 also serves the store's own get/put).
        self._lanes: List[NativeClient] = [native]
        self._new_lane = new_lane
        self._lanes_lock = threading.Lock()
        self._cluster = cluster
        self._prefix = prefix
        self._retry_timeout = retry_timeout
        self._secrets = tuple(s for s in secrets if s)

    @property
    def prefix(self) -> str:
        """Key prefix isolating this store's rows from other users of the same server."""
        return self._prefix

    @property
    def retry_timeout(self) -> float:
        return self._retry_timeout

    # ------------------------------------------------------------------ RowStore hooks

    def _get(self, table, ids, width, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._table(table, width * _itemsize(dtype)).get(ids, width, dtype)

    def _put(self, table, ids, rows) -> None:
        self._table(table, rows.shape[1] * rows.element_size()).put(ids, rows)

    def native_table(self, table: str, width: int, lane: int = 0) -> NativeTable:
        """The C table of ``table``'s float32 rows of ``width``, which the tier's staging job reads
        and writes itself (csrc/ps/ps_redis.c), on store lane ``lane`` (connections of its own:
        the staging's I/O thread ``lane`` uses them)."""
        self._check_open()
        return self._lane(lane).table(table, self._head(table), width * 4)

    def _lane(self, lane: int) -> NativeClient:
        with self._lanes_lock:
            while len(self._lanes) <= lane:
                if self._new_lane is None:
                    return self._lanes[lane % len(self._lanes)]
                self._lanes.append(self._new_lane())
            return self._lanes[lane]

    def native_stats(self) -> dict:
        """The C client's counters since the store was opened (every lane summed): commands, RESP
        bytes out and in, rows got and put, exchanges and the seconds spent in them, MOVED / ASK
        redirections, retried attempts."""
        with self._lanes_lock:
            lanes = list(self._lanes)
        total: dict = {}
        for lane in lanes:
            for name, value in lane.stats().items():
                total[name] = total.get(name, 0.0) + value
        return total

    def server_command_usec(self) -> float:
        """Microseconds the server (every master of a cluster) has spent running commands since it
        started (INFO commandstats, INFO itself excluded): the store's own time, as it counts it."""
        if self._cluster:
            from redis.cluster import RedisCluster

            infos = list(self._client.info("commandstats", target_nodes=RedisCluster.PRIMARIES).values())
        else:
            infos = [self._client.info("commandstats")]
        return float(sum(v["usec"] for info in infos for k, v in info.items()
                         if k.startswith("cmdstat_") and k != "cmdstat_info"))

    def _table(self, table: str, row_bytes: int) -> NativeTable:
        return self._native.table(table, self._head(table), row_bytes)

    def _delete(self, table, ids) -> None:
        keys = self._keys(table, ids)
        self._retrying("delete", lambda: self._del(keys))

    def _scan_ids(self, table) -> torch.Tensor:
        head = self._head(table)

        def scan() -> torch.Tensor:
            suffixes = [k[-8:] for k in self._scan_keys(head)]
            if not suffixes:
                return torch.zeros(0, dtype=torch.int64)
            ids = np.frombuffer(b"".join(suffixes), dtype="<i8").astype(np.int64)
            return torch.from_numpy(ids)

        return self._retrying("scan_ids", scan)

    def _clear(self, table) -> None:
        head = self._head(table)

        def clear() -> None:
            batch: List[bytes] = []
            for key in self._scan_keys(head):
                batch.append(key)
                if len(batch) == CHUNK:
                    self._del(batch)
                    batch = []
            if batch:
                self._del(batch)

        self._retrying("clear", clear)

    def _close(self) -> None:
        with self._lanes_lock:
            lanes = list(self._lanes)
        for lane in lanes:
            lane.close()
        try:
            self._client.close()
        except RedisError:
            pass  # closing sockets of a dead server is not an error worth reporting

    # ------------------------------------------------------------------ keys

    def _head(self, table: str) -> bytes:
        return f"{self._prefix}:{table}:".encode()

    def _keys(self, table: str, ids: torch.Tensor) -> List[bytes]:
        keys = [key.tobytes() for key in _key_array(self._head(table), ids)]
        if self._cluster:  # the hash tag of each id's bucket in front (see the module docstring)
            tags = _bucket_tags()
            keys = [tags[b] + key for b, key in zip(_buckets(ids).tolist(), keys)]
        return keys

    def _scan_keys(self, head: bytes):
        """Keys of exactly ``head`` + 8 id bytes, on a cluster behind one of the bucket tags (the
        checks reject foreign keys that happen to match the glob)."""
        want = len(head) + 8
        if not self._cluster:
            for key in self._client.scan_iter(match=_escape_glob(head) + b"*", count=1000):
                if len(key) == want and key.startswith(head):
                    yield key
            return
        tags = set(_bucket_tags())
        for key in self._client.scan_iter(match=b"{*}" + _escape_glob(head) + b"*", count=1000):
            tag = key[:key.find(b"}") + 1]
            if tag in tags and len(key) == len(tag) + want and key.startswith(head, len(tag)):
                yield key

    # ------------------------------------------------------------------ batched commands

    def _del(self, keys: List[bytes]) -> None:
        if self._cluster:
            for chunk in _chunks(keys):
                self._client.delete(*chunk)  # the cluster client splits it by slot
            return
        pipe = self._client.pipeline(transaction=False)
        for chunk in _chunks(keys):
            pipe.delete(*chunk)
        pipe.execute()

    # ------------------------------------------------------------------ error handling

    def _retrying(self, op: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient failures with exponential backoff until
        ``retry_timeout`` has passed; map redis errors to StoreError/StoreUnavailable."""
        deadline = time.monotonic() + self._retry_timeout
        delay = _BACKOFF_START
        attempts = 0
        while True:
            attempts += 1
            try:
                return fn()
            except _AUTH as exc:
                raise StoreError(
                    f"{op} on {self.url}: authentication failed: {self._scrub(exc)}"
                ) from None
            except _TRANSIENT as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreUnavailable(
                        f"{op} on {self.url}: store unreachable for {self._retry_timeout:g}s "
                        f"({attempts} attempts), last error: {self._scrub(exc)}"
                    ) from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, _BACKOFF_CAP)
            except ResponseError as exc:
                raise StoreError(f"{op} on {self.url} failed: {self._scrub(exc)}") from None

    def _scrub(self, exc: BaseException) -> str:
        return scrub_secrets(f"{type(exc).__name__}: {exc}", self._secrets)


# ---------------------------------------------------------------------- opening


def open_redis_store(url: str) -> RedisStore:
    """Open a :class:`RedisStore` from one of the URL forms in the module docstring.

    Raises :class:`StoreUnavailable` if the server does not answer PING (no retry, so this is
    quick), :class:`StoreError` if it rejects the credentials, ``ValueError`` for a bad URL.
    """
    redacted = redact_url(url)
    parts = urlsplit(url)
    secrets = [unquote(parts.password)] if parts.password else []
    query = parse_qsl(parts.query, keep_blank_values=True)
    secrets += [v for k, v in query if k == "password"]
    ours = {k: v for k, v in query if k in ("prefix", "retry_timeout")}
    rest = [(k, v) for k, v in query if k not in ("prefix", "retry_timeout")]

    prefix = ours.get("prefix", DEFAULT_PREFIX)
    if not prefix or ":" in prefix:
        raise ValueError(f"prefix must be non-empty and contain no ':' in {redacted!r}")
    try:
        retry_timeout = float(ours.get("retry_timeout", DEFAULT_RETRY_TIMEOUT))
    except ValueError:
        raise ValueError(f"retry_timeout must be a number of seconds in {redacted!r}") from None
    if retry_timeout < 0:
        raise ValueError(f"retry_timeout must be >= 0 in {redacted!r}")

    cluster = parts.scheme == "redis+cluster"
    try:
        if cluster:
            client = _cluster_client(parts, rest, redacted)
        else:
            client = _single_client(parts, rest)
        client.ping()
        if cluster:
            check_cluster_layout(client, prefix, redacted)
    except _AUTH as exc:
        raise StoreError(
            f"cannot open {redacted}: authentication failed: "
            f"{scrub_secrets(f'{type(exc).__name__}: {exc}', secrets)}"
        ) from None
    except (*_TRANSIENT, ResponseError) as exc:
        raise StoreUnavailable(
            f"cannot open {redacted}: store unreachable: "
            f"{scrub_secrets(f'{type(exc).__name__}: {exc}', secrets)}"
        ) from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad store URL {redacted!r}: {scrub_secrets(str(exc), secrets)}") from None
    native = _native_client(client, cluster, parts, redacted, retry_timeout, secrets)
    return RedisStore(
        client,
        new_lane=lambda: _native_client(client, cluster, parts, redacted, retry_timeout, secrets),
        cluster=cluster,
        prefix=prefix,
        retry_timeout=retry_timeout,
        redacted_url=redacted,
        native=native,
        secrets=secrets,
    )


def _native_client(client, cluster: bool, parts, redacted: str, retry_timeout: float, secrets) -> NativeClient:
    """The C client with redis-py's view of the URL: the same servers, credentials, db, timeouts
    and TLS options."""
    if cluster:
        nodes = _cluster_nodes(parts, redacted)
        kw = client.nodes_manager.connection_kwargs
        return NativeClient(redacted_url=redacted, nodes=nodes, cluster=True, username=unquote(parts.username or ""),
                            password=unquote(parts.password or ""), connect_timeout=kw["socket_connect_timeout"],
                            socket_timeout=kw["socket_timeout"], retry_timeout=retry_timeout, secrets=secrets)
    pool = client.connection_pool
    kw = pool.connection_kwargs
    tls = None
    if issubclass(pool.connection_class, redis.SSLConnection):
        reqs = kw.get("ssl_cert_reqs", "required")
        verify = reqs not in ("none", ssl.CERT_NONE, None)
        tls = dict(verify=verify, check_hostname=bool(kw.get("ssl_check_hostname", verify)),
                   ca_certs=kw.get("ssl_ca_certs"), certfile=kw.get("ssl_certfile"), keyfile=kw.get("ssl_keyfile"))
    path = kw.get("path") or ""
    nodes = [("", 0)] if path else [(kw.get("host", "localhost"), int(kw.get("port", 6379)))]
    return NativeClient(redacted_url=redacted, nodes=nodes, cluster=False, unix_path=path,
                        username=kw.get("username") or "", password=kw.get("password") or "", db=int(kw.get("db") or 0),
                        connect_timeout=float(kw.get("socket_connect_timeout") or DEFAULT_CONNECT_TIMEOUT),
                        socket_timeout=float(kw.get("socket_timeout") or DEFAULT_SOCKET_TIMEOUT),
                        retry_timeout=retry_timeout, tls=tls, secrets=secrets)


def _common_options() -> dict:
    # redis-py's own retry is disabled: RedisStore retries whole batches against its own
    # deadline, and a second retry layer would make "unreachable at open" slow.
    return dict(
        socket_connect_timeout=DEFAULT_CONNECT_TIMEOUT,
        socket_timeout=DEFAULT_SOCKET_TIMEOUT,
        retry=Retry(NoBackoff(), 0),
        decode_responses=False,
    )


def _single_client(parts, rest_query) -> redis.Redis:
    """redis://, rediss://, unix://: redis-py parses these itself once our arguments are
    removed; options given in the URL override our defaults."""
    clean = join_url(parts.scheme, parts.netloc, parts.path, urlencode(rest_query))
    return redis.Redis.from_url(clean, **_common_options())


_CLUSTER_FLOAT_ARGS = ("socket_timeout", "socket_connect_timeout")


def _cluster_client(parts, rest_query, redacted: str):
    from redis.cluster import ClusterNode, RedisCluster

    nodes = [ClusterNode(host, port) for host, port in _cluster_nodes(parts, redacted)]
    options = _common_options()
    for key, value in rest_query:
        if key not in _CLUSTER_FLOAT_ARGS:
            raise ValueError(
                f"unsupported query argument {key!r} for redis+cluster:// in {redacted!r}; "
                f"supported: prefix, retry_timeout, " + ", ".join(_CLUSTER_FLOAT_ARGS)
            )
        options[key] = float(value)
    return RedisCluster(
        startup_nodes=nodes,
        username=unquote(parts.username or "") or None,
        password=unquote(parts.password or "") or None,
        **options,
    )


# ---------------------------------------------------------------------- helpers


def _cluster_nodes(parts, redacted: str) -> List[Tuple[str, int]]:
    """The seeds of a redis+cluster:// URL: host:port[,host:port...]."""
    nodes = []
    for hostport in parts.netloc.rpartition("@")[2].split(","):
        host, sep, port = hostport.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"cluster nodes must be host:port[,host:port...] in {redacted!r}")
        nodes.append((host.strip("[]"), int(port)))
    return nodes





def _escape_glob(raw: bytes) -> bytes:
    """Escape Redis glob metacharacters so SCAN MATCH treats the key head literally."""
    out = bytearray()
    for byte in raw:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _key_array(head: bytes, ids: torch.Tensor) -> np.ndarray:
    """Keys of ``ids`` as a ``[n, len(head) + 8]`` uint8 array (see the module docstring)."""
    packed = ids.numpy().astype("<i8", copy=False)
    keys = np.empty((len(packed), len(head) + 8), dtype=np.uint8)
    keys[:, :len(head)] = np.frombuffer(head, dtype=np.uint8)
    keys[:, len(head):] = packed.view(np.uint8).reshape(-1, 8)
    return keys


@functools.lru_cache(maxsize=None)
def _bucket_tags() -> Tuple[bytes, ...]:
    """The cluster layout's hash tags, ``{tag}`` of each bucket (csrc/ps/ps_redis.c computes them)."""
    lib = host_lib.lib()
    out = ctypes.create_string_buffer(16)
    tags = []
    for b in range(lib.ps_redis_buckets()):
        n = lib.ps_redis_bucket_tag(b, out, len(out))
        tags.append(b"{" + out.raw[:n] + b"}")
    return tuple(tags)


def _buckets(ids: torch.Tensor) -> np.ndarray:
    """The bucket of each id: the top 6 bits of id * 0x9E3779B97F4A7C15 mod 2^64."""
    with np.errstate(over="ignore"):
        return (ids.numpy().astype(np.int64).view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(58)


#: The cluster layout's marker key, ``{prefix}:layout``: its value names the layout.
CLUSTER_LAYOUT = b"hash-tags-64"


def check_cluster_layout(client, prefix: str, redacted: str) -> None:
    """Refuse a cluster store written with the layout before hash tags (keys ``{prefix}:...``
    without a tag: this version would not find their rows), and mark a new one. The first open
    of a prefix scans the cluster once for such keys."""
    marker = f"{prefix}:layout".encode()
    value = client.get(marker)
    if value == CLUSTER_LAYOUT:
        return
    if value is not None:
        raise StoreError(f"{redacted}: prefix {prefix!r} holds rows of an unknown layout {value!r} (key {marker!r}); "
                         f"this recom_rec writes {CLUSTER_LAYOUT!r}")
    old = _escape_glob(f"{prefix}:".encode()) + b"*"
    for key in client.scan_iter(match=old, count=1000):
        if key != marker:
            raise StoreError(
                f"{redacted}: prefix {prefix!r} holds rows in the cluster layout without hash tags (keys "
                f"{prefix}:<table>:<id> without a hash tag, e.g. {key[:60]!r}); this version keys a cluster's rows "
                "by hash tag ({tag}{prefix}:<table>:<id>) and would not find them. Export the tables with the "
                "recom_rec that wrote them and load them with this one (docs/parameter-server.md), or use another "
                "prefix")
    client.set(marker, CLUSTER_LAYOUT, nx=True)


def _chunks(items: list) -> List[list]:
    return [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]
