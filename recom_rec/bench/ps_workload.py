"""The ``ps`` benchmark workload: a training step on a table far larger than its cache.

One table of 10^8 declared rows (dim 32) read with Zipf(1.05) ids, trained with fused SGD. The
parameter-server run caches 5% of the ids the whole run touches (at least what one batch needs)
in the module and keeps the rest in the store at each URL; the baseline holds the whole table in
device memory. Reported: step time (wall clock, the PS work is host-side), cache hit rate, rows
pulled and pushed per second, and the tier's staging time per batch measured alone; per timed
batch, the staging job's time and its store get + put time, the server's own time (Redis: INFO
commandstats, every master summed) and the RESP bytes each way.

``redis://local`` and ``redis+cluster://local`` in the URLs start a redis-server (no persistence)
or a 3-master cluster on loopback for the run (recom_rec/bench/redis_servers.py, as the tests do).
"""
import contextlib
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import recom_rec
from recom_rec import ps as ps_tier
from .workloads import zipf_ids

ROWS, DIM, BATCH, WARMUP, ZIPF_A, CACHE_FRACTION = 10**8, 32, 4096, 5, 1.05, 0.05
# 200 timed steps touch ~270k distinct ids (~2,500 per batch), so the cache (5% of them) holds
# ~5 batches' ids, as a real run's cache holds many batches. With 40 steps it held 1.45 batches:
# a prefetching thread found no slots to stage the next batch into until the current one ended.
STEPS = 200


def _batches(device, small: bool) -> List[KeyedJaggedTensor]:
    rng = np.random.default_rng(7)
    rows, batch = (10**6, 512) if small else (ROWS, BATCH)
    out = []
    for _ in range(WARMUP + STEPS):
        ids = zipf_ids(rng, ZIPF_A, rows, batch)
        out.append(KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.from_numpy(ids).to(device), lengths=torch.ones(batch, dtype=torch.int64, device=device)))
    return out


def _model(device, rows, ps=None):
    table = EmbeddingBagConfig(name="big", embedding_dim=DIM, num_embeddings=rows, feature_names=["f"])
    m = recom_rec.EmbeddingBagCollection([table], device=device, validate_inputs=False, ps=ps)
    m.enable_fused_optimizer("sgd", lr=0.01)
    return m


def _train_step(model, kjt) -> None:
    model(kjt).values().sum().backward()


def _time_steps(model, batches, device, prefetch: int = 0, on_start: Optional[Callable] = None) -> float:
    for kjt in batches[:WARMUP]:
        _train_step(model, kjt)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if on_start is not None:
        on_start()
    start = time.perf_counter()
    # With prefetch, a background thread stages the next batches' rows while this one trains.
    timed = ps_tier.wrap(batches[WARMUP:], model, prefetch=prefetch) if prefetch else batches[WARMUP:]
    for kjt in timed:
        _train_step(model, kjt)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / STEPS * 1e3


def _ps_model(device, rows, url, cache_rows):
    """A PS-backed model whose table starts empty in its store, so every run pulls, initialises
    and pushes the same rows (a run after another would find the earlier run's rows stored)."""
    model = _model(device, rows, ps={"big": ps_tier.PSConfig(url=url, cache_rows=cache_rows)})
    for tier in ps_tier.tiers_of(model):
        for t in tier.tables.values():
            t.store.clear(t.name)
    return model


def _staging_ms(model, batches, device, phases: Optional[Dict[str, float]] = None) -> float:
    """The tier's own cost per batch in the timed run: a fresh model trains the warm-up batches,
    then each timed batch is prepared alone (rows marked dirty as a training batch's are) between
    device syncs, without training: the same pulls, first-time initialisations, evictions and
    pushes as the timed run. Beside the step times it tells whether the PS step is the in-device
    step plus this (serialised) or less (overlapped). ``phases`` receives the native job's own
    times per phase, ms per batch."""
    for kjt in batches[:WARMUP]:
        _train_step(model, kjt)
    tiers = ps_tier.tiers_of(model)
    for tier in tiers:
        tier.stager_times()  # from here on
    total = 0.0
    with torch.enable_grad():
        for kjt in batches[WARMUP:]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for tier in tiers:
                tier.prepare(kjt)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            total += time.perf_counter() - start
    for tier in tiers:
        tier.release_sync()
        if phases is not None:
            for name, seconds in tier.stager_times().items():
                if not name.startswith(("jobs ", "rows ")):  # counts, not seconds
                    phases[name] = phases.get(name, 0.0) + seconds / STEPS * 1e3
    return total / STEPS * 1e3


LOCAL_SHARDS = 3
PREFETCH = (0, 1, 2, 4)  # wrap()'s prefetch per PS run (0: none)


@contextlib.contextmanager
def local_stores(urls: List[str]):
    """(label, url) per URL, ``redis://local`` and ``redis+cluster://local`` replaced by servers
    started here (stopped on exit)."""
    from .redis_servers import RedisClusterProcesses, RedisServer

    started, out = [], []
    with tempfile.TemporaryDirectory(prefix="recom_rec-bench-redis-") as tmp:
        try:
            for k, url in enumerate(urls):
                if url == "redis://local":
                    server = RedisServer(f"{tmp}/redis{k}").start()
                    started.append(server)
                    out.append(("redis://local (1 server)", server.url(prefix="bench")))
                elif url == "redis+cluster://local":
                    cluster = RedisClusterProcesses(f"{tmp}/cluster{k}", n=LOCAL_SHARDS)
                    started.append(cluster)
                    cluster.start()
                    out.append((f"redis+cluster://local ({LOCAL_SHARDS} shards)", cluster.url(prefix="bench")))
                else:
                    out.append((ps_tier.redact_url(url), url))
            yield out
        finally:
            for s in started:
                s.stop()


class _StoreCounters:
    """The staging job's phase times, the stores' native client counters and server time, from
    :meth:`start` to :meth:`per_batch` (divided by the batches)."""

    def __init__(self, model) -> None:
        self.tiers = ps_tier.tiers_of(model)
        self.stores = list({id(s): s for tier in self.tiers for s in tier.stores}.values())

    def _snapshot(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for store in self.stores:
            for name, value in getattr(store, "native_stats", dict)().items():
                out[name] = out.get(name, 0.0) + value
            if hasattr(store, "server_command_usec"):
                out["server_usec"] = out.get("server_usec", 0.0) + store.server_command_usec()
        return out

    def start(self) -> None:
        for tier in self.tiers:
            tier.stager_times()  # zeroed
        self.before = self._snapshot()

    def per_batch(self, batches: int) -> Dict[str, float]:
        after = self._snapshot()
        phases: Dict[str, float] = {}
        for tier in self.tiers:
            for name, seconds in tier.stager_times().items():
                phases[name] = phases.get(name, 0.0) + seconds
        out = {"job_ms": phases.get("job", 0.0) / batches * 1e3,
               "store_ms": sum(phases.get(k, 0.0) for k in ("store get", "store put", "store put+get")) / batches * 1e3,
               # jobs in flight: rows taken from an earlier job's push in flight, not pulled
               "forwarded": phases.get("rows forwarded", 0.0) / batches}
        if "server_usec" in after:
            out["server_ms"] = (after["server_usec"] - self.before["server_usec"]) / batches * 1e-3
        if "bytes_out" in after:
            for name in ("bytes_out", "bytes_in", "commands", "rows_got", "rows_put"):
                out[f"resp_{name}" if name.startswith("bytes") or name == "commands" else name] = \
                    (after[name] - self.before[name]) / batches
            out["client_io_ms"] = (after["seconds"] - self.before["seconds"]) / batches * 1e3
        return out


def run_ps_workload(device: torch.device, urls: List[str], small: bool) -> List[Dict]:
    with local_stores(urls) as stores:
        return _run(device, stores, small)


def _run(device: torch.device, stores, small: bool) -> List[Dict]:
    batches = _batches(device, small)
    rows = 10**6 if small else ROWS
    touched = torch.unique(torch.cat([b.values() for b in batches])).numel()
    per_batch = max(torch.unique(b.values()).numel() for b in batches)
    cache_rows = max(int(CACHE_FRACTION * touched), int(1.2 * per_batch))
    results = []
    baseline = _model(device, rows)
    results.append({"workload": "ps", "peer": "in-device table", "phase": "sgd", "rows": rows,
                    "batch": batches[0].stride(), "ms": _time_steps(baseline, batches, device)})
    del baseline
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # prefetch N keeps N jobs in flight: their store I/O runs at once (csrc/ps/ps_stage.c)
    for (label, url), prefetch in [(s, p) for s in stores for p in PREFETCH]:
        model = _ps_model(device, rows, url, cache_rows)
        before: Dict[str, int] = {}
        counters = _StoreCounters(model)
        stats = [t.cache.stats for tier in ps_tier.tiers_of(model) for t in tier.tables.values()][0]
        ms = _time_steps(model, batches, device, prefetch, on_start=lambda: (counters.start(), before.update(stats)))
        timed = counters.per_batch(STEPS)
        timed["pulled_per_batch"] = (stats["misses"] - before["misses"]) / STEPS
        timed["pushed_per_batch"] = (stats["pushed"] - before["pushed"]) / STEPS
        seconds = ms * 1e-3 * (STEPS + WARMUP)
        staging, phases = None, {}
        if not prefetch:
            ps_tier.flush(model)
            del model
            model = _ps_model(device, rows, url, cache_rows)
            staging = _staging_ms(model, batches, device, phases)
        results.append({
            "workload": "ps", "peer": f"ps {label}" + (f" prefetch {prefetch}" if prefetch else ""),
            "phase": "sgd", "ms": ms, "timed_per_batch": timed,
            "hit_rate": stats["hits"] / max(1, stats["hits"] + stats["misses"]),
            "pulled_per_s": stats["misses"] / seconds, "pushed_per_s": stats["pushed"] / seconds,
            "cache_rows": cache_rows, "touched_ids": touched, "rows": rows,
            "batch": batches[0].stride(),
            **({"staging_ms": staging, "staging_phases_ms": phases} if staging is not None else {}),
        })
        ps_tier.flush(model)
        del model
    return results


def format_ps(results: List[Dict]) -> str:
    base = next(r["ms"] for r in results if r["peer"] == "in-device table")
    lines = [f"ps workload: one table of {results[0]['rows']:.0e} rows x {DIM}, Zipf({ZIPF_A}) ids, "
             f"batch {results[0]['batch']}, fused SGD; "
             f"cache = 5% of the ids touched (at least 1.2x one batch's)",
             f"{'peer':<50}{'step ms':>10}{'x in-device':>13}{'hit rate':>10}{'pulled/s':>12}{'pushed/s':>12}"
             f"{'staging ms':>12}"]
    for r in results:
        extra = (f"{r['hit_rate']:>10.1%}{r['pulled_per_s']:>12.0f}{r['pushed_per_s']:>12.0f}"
                 if "hit_rate" in r else "")
        if "staging_ms" in r:
            extra += f"{r['staging_ms']:>12.2f}"
        lines.append(f"{r['peer']:<50}{r['ms']:>10.2f}{base / r['ms']:>13.2f}{extra}")
    cache = next((r for r in results if "cache_rows" in r), None)
    if cache:
        lines.append(f"cache rows {cache['cache_rows']} of {cache['touched_ids']} ids touched; staging ms: the "
                     "tier's work per batch alone, between device syncs (no training)")
    lines.append(f"per timed batch: {'peer':<50}{'pulled':>8}{'pushed':>8}{'job ms':>8}{'store ms':>9}"
                 f"{'server ms':>10}{'RESP out kB':>12}{'RESP in kB':>11}{'commands':>9}{'forwarded':>10}")
    for r in results:
        t = r.get("timed_per_batch")
        if t:
            server = f"{t['server_ms']:>10.3f}" if "server_ms" in t else f"{'':>10}"
            wire = (f"{t['resp_bytes_out'] / 1e3:>12.1f}{t['resp_bytes_in'] / 1e3:>11.1f}{t['resp_commands']:>9.0f}"
                    if "resp_bytes_out" in t else f"{'':>32}")
            wire += f"{t.get('forwarded', 0.0):>10.1f}"
            lines.append(f"{'':<17}{r['peer']:<50}{t['pulled_per_batch']:>8.0f}{t['pushed_per_batch']:>8.0f}"
                         f"{t['job_ms']:>8.3f}{t['store_ms']:>9.3f}{server}{wire}")
    lines.append("job ms: the staging job (ps_stage.c) per batch, from its plan to its finish (with prefetch N, up "
                 "to N jobs are in flight at once); store ms: its store get + put; server ms: the store's own "
                 "command time (Redis INFO commandstats, all masters summed); forwarded: rows per batch a job took "
                 "from an earlier job in flight that pushes them, instead of pulling them from the store")
    for r in results:
        if r.get("staging_phases_ms"):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["staging_phases_ms"].items() if v >= 0.0005)
            lines.append(f"  {r['peer']} staging job, ms per batch: {parts}")
    return "\n".join(lines)
