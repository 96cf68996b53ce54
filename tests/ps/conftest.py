"""Fixtures that run real redis-server processes for the store tests.

They fail (never skip) when redis-server is missing: the store layer must be tested against
the real thing.
"""
from __future__ import annotations

import pytest

from tests.redis_server import RedisClusterProcesses, RedisServer, RedisServerMissing, redis_binary


def _require(binary: str = "redis-server") -> None:
    try:
        redis_binary(binary)
    except RedisServerMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One shared server without persistence; tests isolate themselves by key prefix."""
    _require()
    server = RedisServer(tmp_path_factory.mktemp("redis-shared")).start()
    yield server
    server.stop()


@pytest.fixture
def start_redis(tmp_path):
    """Factory for private servers: ``start_redis(appendonly=True, unixsocket=True, ...)``.

    Every server started through it is killed at the end of the test.
    """
    _require()
    started = []

    def start(**kwargs) -> RedisServer:
        name = f"redis-{len(started)}"
        server = RedisServer(tmp_path / name, **kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A 3-master cluster built with redis-cli --cluster create."""
    _require()
    _require("redis-cli")
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
