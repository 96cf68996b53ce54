"""The tests' real ``redis-server`` processes: recom_rec/bench/redis_servers.py (the ``ps``
benchmark starts its local servers and cluster with the same code)."""
from recom_rec.bench.redis_servers import (  # noqa: F401
    RedisClusterProcesses,
    RedisServer,
    RedisServerMissing,
    free_port,
    redis_binary,
)
