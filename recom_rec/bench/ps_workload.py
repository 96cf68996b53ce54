"""The ``ps`` benchmark workload: a training step on a table far larger than its cache.

One table of 10^8 declared rows (dim 32) read with Zipf(1.05) ids, trained with fused SGD. The
parameter-server run caches 5% of the ids the whole run touches (at least what one batch needs)
in the module and keeps the rest in the store at each URL; the baseline holds the whole table in
device memory. Reported: step time (wall clock, the PS work is host-side), cache hit rate, rows
pulled and pushed per second, and the tier's staging time per batch measured alone.
"""
import time
from typing import Dict, List, Optional

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


def _time_steps(model, batches, device, prefetch: int = 0) -> float:
    for kjt in batches[:WARMUP]:
        _train_step(model, kjt)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
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
                phases[name] = phases.get(name, 0.0) + seconds / STEPS * 1e3
    return total / STEPS * 1e3


def run_ps_workload(device: torch.device, urls: List[str], small: bool) -> List[Dict]:
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
    for url, prefetch in [(u, p) for u in urls for p in (0, 1, 2)]:
        model = _ps_model(device, rows, url, cache_rows)
        ms = _time_steps(model, batches, device, prefetch)
        stats = [t.cache.stats for tier in ps_tier.tiers_of(model) for t in tier.tables.values()][0]
        seconds = ms * 1e-3 * (STEPS + WARMUP)
        staging, phases = None, {}
        if not prefetch:
            ps_tier.flush(model)
            del model
            model = _ps_model(device, rows, url, cache_rows)
            staging = _staging_ms(model, batches, device, phases)
        results.append({
            "workload": "ps", "peer": f"ps {ps_tier.redact_url(url)}" + (" prefetch" if prefetch else ""),
            "phase": "sgd", "ms": ms,
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
    for r in results:
        if r.get("staging_phases_ms"):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["staging_phases_ms"].items() if v >= 0.0005)
            lines.append(f"  {r['peer']} staging job, ms per batch: {parts}")
    return "\n".join(lines)
