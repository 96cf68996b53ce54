"""Host-side investigation (not a benchmark): one PS batch's store I/O alone, against a local
redis-server and a local 3-master cluster started here.

A batch's store work as the staging job does it: ``rows`` dirty rows pushed and ``rows`` other rows
pulled (ids drawn from a pre-filled table of 200,000 ids), ``width`` float32 each. Timed per batch,
median of ``--reps``: ``store.put`` then ``store.get`` through the public API (whatever client the
installed recom_rec has: run it with another checkout on PYTHONPATH to compare), and, where the
store has the native client, the staging job's one-exchange put+get (``ps_redis_put_get``). The
server's own time is INFO commandstats' usec, all masters summed.
Where the native client's time goes: encoding the commands (its CPU), and in the exchange its CPU
(writing, reading, parsing) against the wall time (the rest is waiting for the server).
Usage: python tools/ps_store_probe.py [--rows 1850] [--width 64] [--reps 50]
"""
import argparse
import statistics
import tempfile
import time

import torch

from recom_rec.ps import host_lib, open_store

try:
    from recom_rec.bench.redis_servers import RedisClusterProcesses, RedisServer
except ImportError:  # a checkout from before they moved there
    from tests.redis_server import RedisClusterProcesses, RedisServer

PREFILL = 200_000


def server_usec(store) -> float:
    fn = getattr(store, "server_command_usec", None)
    if fn is not None:
        return fn()
    client = store._client  # an older checkout: its redis-py client
    infos = (list(client.info("commandstats", target_nodes=client.PRIMARIES).values())
             if hasattr(client, "get_primaries") else [client.info("commandstats")])
    return float(sum(v["usec"] for i in infos for k, v in i.items() if k.startswith("cmdstat_") and k != "cmdstat_info"))


def probe(label, url, rows, width, reps):
    g = torch.Generator().manual_seed(0)
    with open_store(url) as store:
        for a in range(0, PREFILL, 50_000):
            ids = torch.arange(a, a + 50_000)
            store.put("t", ids, torch.randn(ids.numel(), width, generator=g))
        batches = [(torch.randperm(PREFILL, generator=g)[:2 * rows]) for _ in range(reps + 3)]
        values = torch.randn(rows, width, generator=g)
        ways = [("put, then get", lambda ids: (store.put("t", ids[:rows], values, unique_ids=True),
                                               store.get("t", ids[rows:], width, torch.float32)))]
        if hasattr(store, "native_table"):
            table = store.native_table("t", width)
            got, found = torch.empty(rows, width), torch.empty(rows, dtype=torch.bool)

            def put_get(ids):
                assert host_lib.lib().ps_redis_put_get(table._t, ids.data_ptr(), rows, values.data_ptr(),
                                                       ids[rows:].data_ptr(), rows, got.data_ptr(),
                                                       found.data_ptr()) == 0
            ways.append(("put+get, one exchange", put_get))
        for name, fn in ways:
            for ids in batches[:3]:
                fn(ids)
            times = []
            before_u = server_usec(store)
            before = store.native_stats() if hasattr(store, "native_stats") else None
            for ids in batches[3:]:
                start = time.perf_counter()
                fn(ids)
                times.append((time.perf_counter() - start) * 1e3)
            server = (server_usec(store) - before_u) / reps / 1e3
            line = f"{label:<28}{name:<24}{statistics.median(times):>9.3f}{server:>10.3f}"
            if before is not None:
                after = store.native_stats()
                line += (f"{(after['bytes_out'] - before['bytes_out']) / reps / 1e3:>10.1f}"
                         f"{(after['bytes_in'] - before['bytes_in']) / reps / 1e3:>9.1f}"
                         f"{(after['commands'] - before['commands']) / reps:>9.0f}")
                if "cpu_seconds" in after:  # where the client's time goes: its CPU, the rest waiting
                    line += (f"{(after['encode_seconds'] - before['encode_seconds']) / reps * 1e3:>10.3f}"
                             f"{(after['cpu_seconds'] - before['cpu_seconds']) / reps * 1e3:>10.3f}"
                             f"{(after['seconds'] - before['seconds']) / reps * 1e3:>10.3f}")
            print(line, flush=True)
        store.clear("t")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1850)
    p.add_argument("--width", type=int, default=64, help="float32 per row (dim 32 + rowwise state: 33)")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    print(f"{args.rows} rows pushed + {args.rows} pulled per batch, {args.width * 4} bytes a row; ms per batch "
          f"(median of {args.reps}); server ms: INFO commandstats; RESP kB and commands per batch")
    print(f"{'store':<28}{'how':<24}{'client ms':>9}{'server ms':>10}{'out kB':>10}{'in kB':>9}{'commands':>9}"
          f"{'encode ms':>10}{'I/O cpu':>10}{'I/O wall':>10}")
    print("encode ms: the client's CPU building the commands; I/O cpu / wall: its CPU and wall time sending them "
          "and reading the replies (mean per batch; wall - cpu is waiting for the server)")
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(f"{tmp}/one").start()
        cluster = RedisClusterProcesses(f"{tmp}/cluster", n=3)
        try:
            probe("redis:// (1 server)", server.url(prefix="probe"), args.rows, args.width, args.reps)
            cluster.start()
            probe("redis+cluster:// (3 shards)", cluster.url(prefix="probe"), args.rows, args.width, args.reps)
        finally:
            server.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
