"""Start and stop real ``redis-server`` processes for the tests and the ``ps`` benchmark (single
nodes and small clusters).

Servers listen on a free loopback port, keep their files in a caller-given directory, and are
killed by :meth:`RedisServer.stop` (SIGKILL by default, as a crash would). Nothing here skips:
if ``redis-server`` is missing, :class:`RedisServerMissing` is raised with install hints.
"""
from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import redis

START_TIMEOUT_S = 10.0


class RedisServerMissing(RuntimeError):
    pass


def redis_binary(name: str = "redis-server") -> str:
    path = shutil.which(name)
    if path is None:
        raise RedisServerMissing(
            f"{name!r} is not on PATH; the parameter-server store tests need a real Redis. "
            "Install it with `make redis` (Debian/Ubuntu: apt-get install redis-server)."
        )
    return path


_HANDED_OUT: set = set()


def _ephemeral_range() -> Tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; IANA's elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port outside the ephemeral range, so that no client's outgoing connection
    takes it between this check and the server's bind (nor while the server restarts). A cluster
    node also listens on port + 10000, which must be free and outside that range too."""
    lo, hi = _ephemeral_range()
    span = 10000 if cluster_bus else 0
    ranges = [(r0, r1) for r0, r1 in ((10000, lo - 1 - span), (hi + 1, 65535 - span)) if r1 > r0]
    ranges = ranges or [(1024, 65535 - span)]
    rng = random.Random()
    for _ in range(500):
        r0, r1 = rng.choice(ranges)
        port = rng.randint(r0, r1)
        taken = {port, port + span}
        # Servers are made before they start: a port handed out once is not handed out again.
        if taken & _HANDED_OUT or not all(_is_free(p) for p in taken):
            continue
        _HANDED_OUT.update(taken)
        return port
    raise RuntimeError(f"no free loopback port outside the ephemeral range {lo}-{hi}")


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisServer:
    """One ``redis-server`` on 127.0.0.1:``port`` with its files in ``workdir``.

    ``appendonly=True`` turns on AOF with fsync on every write, so an acknowledged write
    survives SIGKILL. ``unixsocket=True`` also listens on ``workdir/redis.sock``.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        port: Optional[int] = None,
        appendonly: bool = False,
        unixsocket: bool = False,
        extra_args: Sequence[str] = (),
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.socket_path = str(self.workdir / "redis.sock") if unixsocket else None
        self.extra_args = list(extra_args)
        self.proc: Optional[subprocess.Popen] = None

    @property
    def logfile(self) -> Path:
        return self.workdir / "redis.log"

    def url(self, scheme: str = "redis", db: int = 0, userinfo: str = "", **query) -> str:
        auth = f"{userinfo}@" if userinfo else ""
        q = "&".join(f"{k}={v}" for k, v in query.items())
        return f"{scheme}://{auth}127.0.0.1:{self.port}/{db}" + (f"?{q}" if q else "")

    def unix_url(self, **query) -> str:
        assert self.socket_path, "server was started without unixsocket=True"
        q = "&".join(f"{k}={v}" for k, v in query.items())
        return f"unix://{self.socket_path}" + (f"?{q}" if q else "")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)

    def start(self) -> "RedisServer":
        args: List[str] = [
            redis_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--logfile", str(self.logfile),
            "--daemonize", "no",
            "--save", "",
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.socket_path:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        args += self.extra_args
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.workdir
        )
        self._wait_for_ping()
        return self

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> "RedisServer":
        self.stop()
        return self.start()

    def _wait_for_ping(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = self.client()
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited with {self.proc.returncode}: "
                        f"{self.proc.stderr.read().decode(errors='replace')}\n{self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass  # not listening yet, or still loading its AOF
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not answer PING within "
                        f"{START_TIMEOUT_S}s\n{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            return "log tail:\n" + "\n".join(self.logfile.read_text().splitlines()[-20:])
        except OSError:
            return "(no log)"


class RedisClusterProcesses:
    """``n`` cluster-enabled ``redis-server`` masters joined by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, n: int = 3, appendonly: bool = False):
        self.servers = [
            RedisServer(
                Path(workdir) / f"node{i}",
                appendonly=appendonly,
                # Redis listens for cluster traffic on port + 10000, which must exist and be free.
                port=free_port(cluster_bus=True),
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000",
                ],
            )
            for i in range(n)
        ]

    @property
    def nodes(self) -> List[str]:
        return [f"127.0.0.1:{s.port}" for s in self.servers]

    def url(self, **query) -> str:
        q = "&".join(f"{k}={v}" for k, v in query.items())
        return "redis+cluster://" + ",".join(self.nodes) + (f"?{q}" if q else "")

    def start(self) -> "RedisClusterProcesses":
        for s in self.servers:
            s.start()
        subprocess.run(
            [redis_binary("redis-cli"), "--cluster", "create", *self.nodes,
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60,
        )
        self.wait_until_ok()
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def owners(self) -> dict:
        """slot -> index of the server that serves it (CLUSTER SLOTS as the first server sees it)."""
        c = self.servers[0].client()
        try:
            ranges = c.execute_command("CLUSTER SLOTS")
        finally:
            c.close()
        ports = [s.port for s in self.servers]
        return {slot: ports.index(int(r[2][1])) for r in ranges for slot in range(int(r[0]), int(r[1]) + 1)}

    def migrate_slot(self, slot: int, src: int, dst: int, keys_per_call: int = 100) -> int:
        """Move ``slot`` and its keys from server ``src`` to ``dst`` as ``redis-cli --cluster
        reshard`` does (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE); returns the keys moved."""
        clients = [s.client() for s in self.servers]
        try:
            ids = [c.execute_command("CLUSTER MYID").decode() for c in clients]
            clients[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
            clients[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
            moved = 0
            while True:
                keys = clients[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, keys_per_call)
                if not keys:
                    break
                clients[src].execute_command("MIGRATE", "127.0.0.1", self.servers[dst].port, "", 0, 5000,
                                             "KEYS", *keys)
                moved += len(keys)
            for k in [dst, src] + [i for i in range(len(clients)) if i not in (src, dst)]:
                clients[k].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
            return moved
        finally:
            for c in clients:
                c.close()

    def wait_until_ok(self) -> None:
        """Until every node reports cluster_state:ok (at start, after a node's restart, ...)."""
        deadline = time.monotonic() + 20
        while True:
            states = []
            for s in self.servers:
                c = s.client()
                try:
                    states.append(c.execute_command("CLUSTER", "INFO").decode())
                finally:
                    c.close()
            if all("cluster_state:ok" in st for st in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not reach cluster_state:ok: {states}")
            time.sleep(0.05)
