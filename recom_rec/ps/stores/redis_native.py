"""The C Redis client (csrc/ps/ps_redis.c) behind :class:`~recom_rec.ps.stores.redis_store.RedisStore`'s
rows: a batch's MGET/MSET (one server) or per-shard GET/SET pipelines (a cluster) written and read
in C, by the store's own get/put and by the tier's staging job without the GIL.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Dict, Optional, Sequence, Tuple

import torch

from .. import host_lib
from .base import StoreError, StoreUnavailable, scrub_secrets

#: ps_redis.c's counters, in its order (ps_redis_stats).
STATS = ("commands", "bytes_out", "bytes_in", "rows_got", "rows_put", "exchanges", "seconds", "moved", "ask",
         "retries", "cpu_seconds", "encode_seconds")


class NativeTable:
    """One table's rows of ``row_bytes`` bytes on the client; ``fill_store_ops`` points a staging
    job's store ops at it."""

    def __init__(self, client: "NativeClient", table: str, head: bytes, row_bytes: int) -> None:
        self.client = client  # kept alive while the table is
        self.table = table
        self._lib = client._lib
        self._t = self._lib.ps_redis_table_new(client._c, head, len(head), table.encode(), row_bytes)
        if not self._t:
            raise MemoryError("cannot allocate a redis table handle")

    def get(self, ids: torch.Tensor, width: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = torch.empty(ids.numel(), width, dtype=dtype)
        found = torch.empty(ids.numel(), dtype=torch.bool)
        if self._lib.ps_redis_get(self._t, ids.data_ptr(), ids.numel(), rows.data_ptr(), found.data_ptr()) != 0:
            raise self._failure("get")
        return rows, found

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if self._lib.ps_redis_put(self._t, ids.data_ptr(), ids.numel(), rows.data_ptr()) != 0:
            raise self._failure("put")

    def _failure(self, op: str) -> StoreError:
        # None only if another thread took this table's error first (a staging job's own failure)
        return self.error() or StoreError(f"{op} of table {self.table!r} failed")

    def error(self) -> Optional[StoreError]:
        """The last failed get or put as the exception the store raises, once (None when none
        failed since the last call)."""
        text = ctypes.create_string_buffer(1024)
        kind = self._lib.ps_redis_take_error(self._t, text, len(text))
        if kind == 0:
            return None
        message = self.client.scrub(text.value.decode(errors="replace"))
        return StoreUnavailable(message) if kind == 1 else StoreError(message)

    def fill_store_ops(self, ops) -> None:
        self._lib.ps_redis_store_ops(ctypes.byref(ops), self._t)

    def __del__(self) -> None:
        t, self._t = getattr(self, "_t", None), None
        if t:
            self._lib.ps_redis_table_free(t)


class NativeClient:
    """The connections of one store (one server, or a cluster's masters found from its seeds)."""

    def __init__(self, *, redacted_url: str, nodes: Sequence[Tuple[str, int]], cluster: bool,
                 unix_path: str = "", username: str = "", password: str = "", db: int = 0,
                 connect_timeout: float, socket_timeout: float, retry_timeout: float,
                 tls: Optional[dict] = None, secrets: Sequence[str] = ()) -> None:
        self._lib = host_lib.lib()
        self._secrets = tuple(s for s in secrets if s)
        self._c = self._lib.ps_redis_client_new(redacted_url.encode(), int(cluster), unix_path.encode(),
                                                (username or "").encode(), (password or "").encode(), int(db),
                                                connect_timeout, socket_timeout, retry_timeout)
        if not self._c:
            raise MemoryError("cannot allocate a redis client")
        for host, port in nodes:
            if self._lib.ps_redis_client_add_node(self._c, host.encode(), int(port)) < 0:
                raise ValueError(f"too many nodes in {redacted_url!r}")
        if tls is not None:
            self._lib.ps_redis_client_tls(self._c, int(tls["verify"]), int(tls["check_hostname"]),
                                          (tls.get("ca_certs") or "").encode(), (tls.get("certfile") or "").encode(),
                                          (tls.get("keyfile") or "").encode())
        self._tables: Dict[Tuple[str, int], NativeTable] = {}
        self._lock = threading.Lock()

    def table(self, table: str, head: bytes, row_bytes: int) -> NativeTable:
        with self._lock:
            key = (table, row_bytes)
            t = self._tables.get(key)
            if t is None:
                t = self._tables[key] = NativeTable(self, table, head, row_bytes)
            return t

    def stats(self) -> Dict[str, float]:
        """Counters since the client was made (commands, RESP bytes each way, rows, time in I/O...)."""
        out = (ctypes.c_double * len(STATS))()
        self._lib.ps_redis_stats(self._c, out)
        return dict(zip(STATS, out))

    def disconnect(self) -> None:
        self._lib.ps_redis_client_disconnect(self._c)

    def scrub(self, text: str) -> str:
        return scrub_secrets(text, self._secrets)

    def close(self) -> None:
        """Closes the connections; the client is freed with the last table that refers to it (a
        staging job may still hold one)."""
        with self._lock:
            self._tables.clear()
        self.disconnect()

    def __del__(self) -> None:
        c, self._c = getattr(self, "_c", None), None
        if c:
            self._lib.ps_redis_client_free(c)
