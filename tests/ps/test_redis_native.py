"""The staging job's own Redis client (csrc/ps/ps_redis.c) against real servers: the tier's rows go
through it, TLS, credentials refused on a reconnect, the cluster's slots as Redis computes them,
and a cluster resharded while training loses no row."""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
import uuid

import pytest
import torch

from recom_rec import ps
from recom_rec.ps import StoreError, StoreUnavailable, open_store
from recom_rec.ps import host_lib
from recom_rec.ps.stores.redis_native import NativeTable
from tests.ps.test_tier import assert_same_tables, batches, ps_model, reference_model, step, train
from tests.redis_server import RedisClusterProcesses, RedisServer, free_port


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _slot(key: bytes) -> int:
    return host_lib.lib().ps_redis_key_slot(key, len(key))


@pytest.mark.parametrize("prefetch", [None, 2])
def test_the_tier_stages_redis_rows_natively(redis_server, prefetch):
    url = redis_server.url(prefix=_prefix())
    data = batches(8, seed=12)
    m = ps_model(url, cache_rows=40)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    t = m._ps.tables["big"]
    outs = train(m, data, prefetch)
    assert isinstance(t.native_store, NativeTable)  # no Python callback for the rows
    assert t.py_ops._get is None and t.py_ops._put is None
    stats = t.store.native_stats()
    assert stats["rows_got"] > 0 and stats["rows_put"] == t.cache.stats["pushed"] > 0
    assert stats["bytes_out"] > stats["rows_put"] * t.layout.width * 4
    for a, b in zip(outs, train(ref, data)):
        assert torch.equal(a, b)
    ps.flush(m)
    assert_same_tables(m, ref)


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_put_and_get_in_one_exchange(where, redis_server, redis_cluster):
    # the staging job's evictions and misses: a put and a get of other ids, one exchange
    url = (redis_server if where == "server" else redis_cluster).url(prefix=_prefix())
    with open_store(url) as store:
        old = torch.randn(700, 5)
        store.put("t", torch.arange(700), old)
        table = store.native_table("t", 5)
        put_ids, put_rows = torch.arange(700, 1900), torch.randn(1200, 5)
        get_ids = torch.cat([torch.arange(0, 700, 2), torch.tensor([5000])])
        rows, found = torch.empty(get_ids.numel(), 5), torch.empty(get_ids.numel(), dtype=torch.bool)
        before = store.native_stats()
        assert host_lib.lib().ps_redis_put_get(table._t, put_ids.data_ptr(), 1200, put_rows.data_ptr(),
                                               get_ids.data_ptr(), get_ids.numel(), rows.data_ptr(),
                                               found.data_ptr()) == 0
        after = store.native_stats()
        assert after["exchanges"] - before["exchanges"] == 1
        assert torch.equal(rows[:-1], old[::2]) and found[:-1].all() and not found[-1] and rows[-1].eq(0).all()
        got, hit = store.get("t", put_ids, 5, torch.float32)
        assert hit.all() and torch.equal(got, put_rows)


def test_key_slots_are_the_servers(redis_cluster):
    c = redis_cluster.servers[0].client()
    try:
        g = torch.Generator().manual_seed(0)
        keys = [b"recom_rec:emb:" + int(i).to_bytes(8, "little", signed=True)
                for i in torch.randint(-2**62, 2**62, (200,), generator=g)]
        keys += [b"{user1000}.following", b"foo{}{bar}", b"foo{{bar}}zap", b"foo{bar}{zap}", b"{", b"}{x}",
                 b"a{\x7b\x7d}b", b"p:t:\x7b\x00\x00\x00\x00\x00\x7d\x00"]
        for key in keys:
            assert _slot(key) == c.execute_command("CLUSTER", "KEYSLOT", key), key
    finally:
        c.close()


def test_cluster_rows_move_by_hash_tag_tens_of_keys_a_command(redis_cluster):
    # a multi-key command must stay within one slot: a cluster table's keys carry one of 64 hash
    # tags, whose slots spread over the masters, so one MSET / MGET moves a bucket's keys
    with open_store(redis_cluster.url(prefix=_prefix())) as store:
        ids = torch.arange(1850) * 7919
        keys = store._keys("t", ids)
        c = redis_cluster.servers[0].client()
        try:
            for key in keys[:40]:  # the tagged keys' slots as the server computes them
                assert _slot(key) == c.execute_command("CLUSTER", "KEYSLOT", key), key
        finally:
            c.close()
        slots = {_slot(key) for key in keys}
        assert len(slots) == 64
        owners = redis_cluster.owners()
        per_master = [sum(owners[s] == k for s in slots) for k in range(3)]
        assert min(per_master) >= 18, per_master  # 64 buckets over 3 even slot ranges: 21-22 each
        rows = torch.randn(1850, 8)
        before = store.native_stats()
        store.put("t", ids, rows)
        middle = store.native_stats()
        got, found = store.get("t", ids, 8, torch.float32)
        after = store.native_stats()
        assert found.all() and torch.equal(got, rows)
        assert middle["commands"] - before["commands"] == 64  # an MSET per tag (29 keys each here)
        assert after["commands"] - middle["commands"] == 64
        assert store._client.get(keys[5]) == rows[5].numpy().tobytes()  # the layout, as documented
        assert sorted(store.scan_ids("t").tolist()) == sorted(ids.tolist())
        store.delete("t", ids[:10])
        assert not store.get("t", ids[:10], 8, torch.float32)[1].any()
        store.clear("t")
        assert store.scan_ids("t").numel() == 0


def test_a_cluster_prefix_in_the_layout_without_hash_tags_is_refused(redis_cluster):
    prefix = _prefix()
    c = redis_cluster.servers[0].client()
    old_key = f"{prefix}:emb:".encode() + (12345).to_bytes(8, "little")
    server = redis_cluster.servers[redis_cluster.owners()[_slot(old_key)]]
    c.close()
    c = server.client()
    try:
        c.set(old_key, b"\0" * 16)  # a row as the layout before hash tags wrote it
        with pytest.raises(StoreError, match="without a hash tag"):
            open_store(redis_cluster.url(prefix=prefix))
        c.delete(old_key)
        with open_store(redis_cluster.url(prefix=prefix)) as store:  # an empty prefix is marked
            store.put("emb", torch.tensor([1]), torch.ones(1, 4))
            assert store._client.get(f"{prefix}:layout".encode()) == b"hash-tags-64"
    finally:
        c.close()
    with open_store(redis_cluster.url(prefix=prefix)) as store:  # and opens again
        assert store.get("emb", torch.tensor([1]), 4, torch.float32)[1].all()


def test_refused_credentials_on_a_reconnect_are_not_an_outage(start_redis):
    server = start_redis()
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">secret", "~*", "+@all")
    store = open_store(server.url(userinfo="alice:secret", prefix="a", retry_timeout=5))
    try:
        store.put("t", torch.tensor([1, 2]), torch.ones(2, 3))
        admin.execute_command("ACL", "SETUSER", "alice", "resetpass", ">other")
        admin.execute_command("CLIENT", "KILL", "USER", "alice")  # the store must log in again
        start = time.monotonic()
        with pytest.raises(StoreError) as info:
            store.get("t", torch.tensor([1]), 3, torch.float32)
        assert time.monotonic() - start < 2  # not retried until retry_timeout
        assert not isinstance(info.value, StoreUnavailable)
        text = str(info.value)
        assert "authentication failed" in text and "secret" not in text and "alice:***@" in text
    finally:
        store.close()
        admin.close()


def test_unix_socket_and_db_reach_the_native_client(start_redis):
    server = start_redis(unixsocket=True)
    with open_store(server.unix_url(db=5, prefix="u")) as store:
        rows = torch.randn(1500, 6)
        store.put("t", torch.arange(1500), rows)
        got, found = store.get("t", torch.arange(1501), 6, torch.float32)
        assert found[:1500].all() and not found[1500] and torch.equal(got[:1500], rows)
        assert store.native_stats()["rows_put"] == 1500
    c = server.client()
    try:
        c.execute_command("SELECT", 5)
        assert c.dbsize() == 1500
    finally:
        c.close()


def _certificates(tmp_path):
    """A CA and a server certificate for localhost / 127.0.0.1, made with the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the rediss:// test needs the openssl command (`make redis` installs it)", pytrace=False)

    def run(*args):
        subprocess.run([openssl, *args], check=True, cwd=tmp_path, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=recom_rec test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (tmp_path / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.pem", "-days", "2", "-extfile", "san.ext")
    return tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"


def test_rediss_rows_over_tls(tmp_path):
    ca, cert, key = _certificates(tmp_path)
    tls_port = free_port()
    server = RedisServer(tmp_path / "redis", extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]).start()
    try:
        url = f"rediss://localhost:{tls_port}/0?prefix=tls&ssl_ca_certs={ca}"
        with open_store(url) as store:
            rows = torch.randn(3000, 32)  # a pipeline of several MB through TLS records
            store.put("t", torch.arange(3000), rows)
            got, found = store.get("t", torch.arange(3000), 32, torch.float32)
            assert found.all() and torch.equal(got, rows)
            assert store.native_stats()["bytes_in"] > rows.numel() * 4
        plain = server.client()  # the same rows, read without TLS
        try:
            assert plain.dbsize() == 3000
        finally:
            plain.close()
        # a CA that did not sign the server's certificate: the handshake fails (redis-py's at open)
        with pytest.raises(StoreUnavailable):
            open_store(f"rediss://localhost:{tls_port}/0?prefix=tls&ssl_ca_certs={cert}")
    finally:
        server.stop()


def test_cluster_resharded_while_training_loses_no_row(tmp_path):
    cluster = RedisClusterProcesses(tmp_path, n=3)
    try:
        cluster.start()
        prefix = _prefix()
        url = cluster.url(prefix=prefix, retry_timeout=10)
        data = batches(24, seed=21)
        m = ps_model(url, cache_rows=40)
        ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
        ref_outs = train(ref, data)
        # the slots of the table's keys, moved from node to node for as long as training runs
        keys = m._ps.tables["big"].store._keys("big", torch.arange(1000))
        slots = sorted({_slot(key) for key in keys})
        assert len(slots) == 64  # the cluster layout's hash tags
        owner = cluster.owners()
        done, errors, moved = threading.Event(), [], [0]

        def reshard():
            deadline = time.monotonic() + 60
            try:
                while not done.is_set() and time.monotonic() < deadline:
                    for s in slots[moved[0] % len(slots):][:25]:
                        src = owner[s]
                        cluster.migrate_slot(s, src, (src + 1) % 3)
                        owner[s] = (src + 1) % 3
                    moved[0] += 25
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        mover = threading.Thread(target=reshard)
        mover.start()
        try:
            outs = []
            for i, kjt in enumerate(ps.wrap(data, m, prefetch=2)):
                outs.append(step(m, kjt))
                if i % 6 == 5:
                    time.sleep(0.2)  # let slots move between the batches too
        finally:
            done.set()
            mover.join(timeout=120)
        assert not errors, errors
        assert moved[0] > 0
        stats = m._ps.tables["big"].store.native_stats()
        print("resharding:", moved[0], "slots moved;", stats)
        assert stats["moved"] + stats["ask"] > 0, stats  # the client was redirected, and followed
        for a, b in zip(outs, ref_outs):
            assert torch.equal(a, b)
        ps.flush(m)
        assert_same_tables(m, ref)
    finally:
        cluster.stop()


def test_cluster_shard_killed_mid_run_loses_no_acknowledged_row(tmp_path):
    cluster = RedisClusterProcesses(tmp_path, n=3, appendonly=True)
    try:
        cluster.start()
        url = cluster.url(prefix=_prefix(), retry_timeout=0.5)
        data = batches(8, seed=23)
        m = ps_model(url, cache_rows=40)
        ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
        train(m, data[:3], 2)
        train(ref, data[:3])
        cache = m._ps.tables["big"].cache
        dirty_before = set(cache.id_of[cache.dirty.astype(bool)].tolist())
        cluster.servers[1].stop()  # SIGKILL one master: a third of the slots have no server
        with pytest.raises(StoreUnavailable) as info:
            train(m, data[3:5], 2)
        assert "unreachable" in str(info.value)
        assert dirty_before <= set(cache.id_of[cache.dirty.astype(bool)].tolist())
        assert not cache.pins.any()
        cluster.servers[1].start()  # its AOF replays the acknowledged rows, nodes.conf its slots
        cluster.wait_until_ok()
        assert ps.flush(m) >= len(dirty_before)
        outs = train(m, data[3:], 2)
        for a, b in zip(outs, train(ref, data[3:])):
            assert torch.equal(a, b)
        assert_same_tables(m, ref)
    finally:
        cluster.stop()


def test_a_server_that_stops_answering_times_out_and_is_retried(start_redis):
    import os
    import signal

    server = start_redis()
    store = open_store(server.url(prefix="s", socket_timeout=0.3, retry_timeout=1))
    try:
        store.put("t", torch.arange(10), torch.ones(10, 4))
        os.kill(server.proc.pid, signal.SIGSTOP)  # alive, listening, silent
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailable, match=r"unreachable for 1s.*no reply"):
                store.get("t", torch.arange(10), 4, torch.float32)
            assert time.monotonic() - start < 4
            threading.Timer(0.3, os.kill, (server.proc.pid, signal.SIGCONT)).start()
            got, found = store.get("t", torch.arange(10), 4, torch.float32)  # retried until it answers
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert found.all() and got.eq(1).all()
        assert store.native_stats()["retries"] > 0
    finally:
        store.close()


def test_pipelines_of_tens_of_megabytes(redis_server):
    # a flush's put: larger than the buffers a connection keeps between batches (16 MB)
    with open_store(redis_server.url(prefix=_prefix())) as store:
        rows = torch.randn(40_000, 160)  # 25.6 MB of rows
        store.put("t", torch.arange(40_000), rows)
        for _ in range(2):  # the second time on buffers made again
            got, found = store.get("t", torch.arange(40_000), 160, torch.float32)
            assert found.all() and torch.equal(got, rows)
        store.clear("t")
