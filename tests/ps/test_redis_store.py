"""Redis-specific behaviour: prefixes, ACL auth, unix sockets, outages, persistence, cluster."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis
import torch

from recom_rec.ps import StoreError, StoreUnavailable, open_store
from recom_rec.ps.stores.redis_store import RedisStore
from tests.redis_server import free_port


def _prefix() -> str:
    return f"t{uuid.uuid4().hex}"


def test_prefixes_isolate_stores_on_one_server(redis_server):
    pa, pb = _prefix(), _prefix()
    with open_store(redis_server.url(prefix=pa)) as a, open_store(redis_server.url(prefix=pb)) as b:
        a.put("emb", torch.tensor([1, 2]), torch.ones(2, 2))
        b.put("emb", torch.tensor([2, 3]), torch.full((2, 2), 7.0))
        assert a.scan_ids("emb").tolist() == [1, 2]
        assert b.scan_ids("emb").tolist() == [2, 3]
        got, _ = a.get("emb", torch.tensor([2]), 2, torch.float32)
        assert got.eq(1.0).all()
        b.clear("emb")
        assert a.scan_ids("emb").tolist() == [1, 2]


def test_key_layout_is_prefix_table_and_little_endian_id(redis_server):
    prefix = _prefix()
    with open_store(redis_server.url(prefix=prefix)) as store:
        store.put("emb", torch.tensor([258]), torch.tensor([[1.5, -2.0]]))
    client = redis_server.client()
    try:
        key = f"{prefix}:emb:".encode() + (258).to_bytes(8, "little", signed=True)
        assert client.get(key) == torch.tensor([1.5, -2.0]).numpy().tobytes()
    finally:
        client.close()


def test_stored_value_of_wrong_size_is_a_clear_error(redis_server):
    prefix = _prefix()
    client = redis_server.client()
    try:
        client.set(f"{prefix}:emb:".encode() + (5).to_bytes(8, "little"), b"\x00" * 7)
    finally:
        client.close()
    with open_store(redis_server.url(prefix=prefix)) as store:
        with pytest.raises(StoreError, match=r"id 5 has 7 bytes, expected 16"):
            store.get("emb", torch.tensor([5]), 4, torch.float32)


def test_acl_user_password(start_redis):
    server = start_redis()
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">secret", "~*", "+@all")
    admin.close()

    url = server.url(userinfo="alice:secret", prefix="acl")
    with open_store(url) as store:
        store.put("t", torch.tensor([1]), torch.ones(1, 3))
        assert store.scan_ids("t").tolist() == [1]
        for text in (repr(store), str(store), store.url):
            assert "secret" not in text and "alice:***@" in text

    with pytest.raises(StoreError) as info:
        open_store(server.url(userinfo="alice:wrongsecret", prefix="acl"))
    assert not isinstance(info.value, StoreUnavailable)  # bad credentials are not an outage
    for text in (str(info.value), repr(info.value)):
        assert "authentication failed" in text
        assert "secret" not in text
        assert "alice:***@127.0.0.1" in text


def test_unix_socket_url(start_redis):
    server = start_redis(unixsocket=True)
    with open_store(server.unix_url(db=3, prefix="sock")) as store:
        store.put("t", torch.tensor([9]), torch.ones(1, 2, dtype=torch.bfloat16))
        got, found = store.get("t", torch.tensor([9]), 2, torch.bfloat16)
        assert found.all() and got.eq(1).all()
    for db, expected in ((0, 0), (3, 1)):  # the row went to db 3 only
        client = redis.Redis(host="127.0.0.1", port=server.port, db=db)
        try:
            assert client.dbsize() == expected
        finally:
            client.close()


def test_unreachable_at_open_fails_fast_naming_redacted_url():
    port = free_port()  # nothing listens here
    url = f"redis://bob:hunter2@127.0.0.1:{port}/0?prefix=x"
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        open_store(url)
    assert time.monotonic() - start < 5
    assert f"redis://bob:***@127.0.0.1:{port}/0" in str(info.value)
    assert "hunter2" not in str(info.value) and "hunter2" not in repr(info.value)


def test_server_restarted_within_retry_timeout(start_redis):
    server = start_redis()
    store = open_store(server.url(prefix="r", retry_timeout=15))
    ids = torch.arange(100)
    rows = torch.randn(100, 8)
    store.put("t", ids, rows)

    server.stop()  # SIGKILL; no persistence, so the old rows are gone
    restarter = threading.Timer(1.0, server.start)
    restarter.start()
    try:
        store.put("t", ids, rows)  # blocks, retrying, until the server is back
        got, found = store.get("t", ids, 8, torch.float32)
    finally:
        restarter.join()
        store.close()
    assert found.all() and torch.equal(got, rows)


def test_server_down_past_retry_timeout(start_redis):
    server = start_redis()
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">secret", "~*", "+@all")
    admin.close()
    store = open_store(server.url(userinfo="alice:secret", prefix="r", retry_timeout=1))
    store.put("t", torch.tensor([1]), torch.ones(1, 1))
    server.stop()
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        store.get("t", torch.tensor([1]), 1, torch.float32)
    elapsed = time.monotonic() - start
    assert 0.9 < elapsed < 5
    for text in (str(info.value), repr(info.value)):
        assert f"redis://alice:***@127.0.0.1:{server.port}/0" in text
        assert "unreachable for 1s" in text and "secret" not in text
    store.close()


def test_aof_persistence_survives_kill_9(start_redis):
    server = start_redis(appendonly=True)
    ids = torch.arange(2000) * 3
    rows = torch.randn(2000, 16).to(torch.float16)
    with open_store(server.url(prefix="aof")) as store:
        store.put("t", ids, rows)  # acknowledged => fsynced (appendfsync always)
    server.stop()  # SIGKILL: no chance to flush anything else
    server.start()  # same dir and port: replays the AOF
    with open_store(server.url(prefix="aof")) as store:
        got, found = store.get("t", ids, 16, torch.float16)
        assert found.all() and torch.equal(got, rows)


def test_rediss_url_options_reach_the_tls_connection():
    # No TLS server here: check the URL is parsed into a TLS connection with our options, and
    # that failure to connect is reported as an outage with the redacted URL.
    port = free_port()
    url = f"rediss://u:tlspass@127.0.0.1:{port}/0?ssl_cert_reqs=none&ssl_ca_certs=/nonexistent.pem"
    with pytest.raises(StoreUnavailable) as info:
        open_store(url)
    assert "tlspass" not in str(info.value) and "u:***@" in str(info.value)

    from recom_rec.ps.stores.redis_store import _single_client
    from urllib.parse import parse_qsl, urlsplit

    parts = urlsplit(url)
    client = _single_client(parts, parse_qsl(parts.query))
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert kwargs["ssl_cert_reqs"] == "none" and kwargs["ssl_ca_certs"] == "/nonexistent.pem"
    client.close()


def test_bad_urls_are_value_errors(redis_server):
    with pytest.raises(ValueError, match="prefix"):
        open_store(redis_server.url(prefix="a:b"))
    with pytest.raises(ValueError, match="retry_timeout"):
        open_store(redis_server.url(retry_timeout="soon"))
    with pytest.raises(ValueError, match="host:port"):
        open_store("redis+cluster://127.0.0.1?prefix=x")


def test_cluster_round_trip(redis_cluster):
    url = redis_cluster.url(prefix="cl", retry_timeout=5)
    with open_store(url) as store:
        assert isinstance(store, RedisStore)
        n = 20_000
        ids = torch.randperm(10 * n)[:n]
        rows = torch.randn(n, 12)
        store.put("t", ids, rows)
        got, found = store.get("t", torch.cat([ids, torch.tensor([-1])]), 12, torch.float32)
        assert found[:-1].all() and not found[-1]
        assert torch.equal(got[:-1], rows)
        assert torch.equal(store.scan_ids("t"), torch.sort(ids).values)
        # Rows spread over every shard (no hash tag pins a table to one node).
        for server in redis_cluster.servers:
            c = server.client()
            try:
                assert c.execute_command("DBSIZE") > 0
            finally:
                c.close()
        store.delete("t", ids[:100])
        assert store.scan_ids("t").numel() == n - 100
        store.clear("t")
        assert store.scan_ids("t").numel() == 0


def test_missing_redis_server_binary_is_reported_not_skipped(monkeypatch):
    from tests.redis_server import RedisServerMissing, redis_binary

    monkeypatch.setenv("PATH", "")
    with pytest.raises(RedisServerMissing, match="redis-server.*not on PATH.*make redis"):
        redis_binary()


def test_server_ports_stay_out_of_the_ephemeral_range_and_are_never_handed_out_twice():
    """A client's outgoing connection takes its local port from the ephemeral range: a server's
    port (or a cluster node's bus port, port + 10000) inside it can be taken between the check and
    the bind, as CI once saw ('Failed listening on port ... (cluster)')."""
    from recom_rec.bench.redis_servers import _ephemeral_range

    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    nodes = [free_port(cluster_bus=True) for _ in range(50)]
    taken = ports + nodes + [p + 10000 for p in nodes]
    assert len(set(taken)) == len(taken)
    assert not [p for p in taken if lo <= p <= hi]
