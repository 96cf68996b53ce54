"""Host-side investigation (not a benchmark): where the PS tier's staging of one batch goes.

Builds the ``ps`` benchmark's model and batches (full size on the GPU, small on the CPU), replays
the warm-up batches, then stages each timed batch alone (the same loop as the benchmark's
``staging ms`` column), three times: once to warm up (first-use kernel loads, Triton compiles),
once under cProfile (functions by own and cumulative time), and once with the tier's steps timed
between device syncs (``--sections``: ms per batch of each step; the syncs add their own cost).
Usage: python tools/profile_ps.py [--url memory://prof] [--top 30] [--sections]
"""
import argparse
import cProfile
import io
import pstats
import contextlib
import functools
import time
from collections import defaultdict

import torch

from recom_rec import ps as ps_tier
from recom_rec.bench import ps_workload as w


@contextlib.contextmanager
def section_timers(tier, device):
    """Wrap the tier's steps with timers that sync the device before and after each call."""
    totals = defaultdict(float)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                totals[name] += time.perf_counter() - start
        return run

    patched = []

    def patch(obj, attr, name):
        patched.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, timed(name, getattr(obj, attr)))

    patch(tier, "_stage", "stage (all)")
    patch(tier, "_assign", "  assign (all)")
    patch(tier, "_move_rows", "    move rows (all)")
    patch(tier, "_read_rows", "      read evicted rows")
    patch(tier, "_write_rows", "      write pulled rows")
    patch(tier, "_init_rows_into", "      init new rows")  # on the CPU
    patch(tier, "_init_rows_on_device", "      init new rows")  # on a GPU
    for t in tier.tables.values():
        patch(t.cache, "stage", "    cache stage")
        patch(t.cache, "commit", "    cache commit")
        patch(t.store, "get", "      store get")
        patch(t.store, "put", "      store put")
    try:
        yield totals
    finally:
        for obj, attr, original in reversed(patched):
            if attr in obj.__dict__ and not isinstance(obj, type):
                delattr(obj, attr)
            else:
                setattr(obj, attr, original)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", default="memory://prof")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--sections", action="store_true", help="also time the tier's steps between syncs")
    p.add_argument("--full-size", action="store_true",
                   help="on the CPU too, the GPU run's batches (4096 ids of a 1e8-row table; the CPU default is small)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = device.type == "cpu" and not args.full_size
    batches = w._batches(device, small)
    rows = 10**6 if small else w.ROWS
    touched = torch.unique(torch.cat([b.values() for b in batches])).numel()
    per_batch = max(torch.unique(b.values()).numel() for b in batches)
    cache_rows = max(int(w.CACHE_FRACTION * touched), int(1.2 * per_batch))
    ms = w._staging_ms(w._ps_model(device, rows, args.url, cache_rows), batches, device)
    print(f"staging {ms:.2f} ms/batch (first pass: first-use costs included)")
    model = w._ps_model(device, rows, args.url, cache_rows)
    prof = cProfile.Profile()
    prof.enable()
    ms = w._staging_ms(model, batches, device)
    prof.disable()
    print(f"staging {ms:.2f} ms/batch under cProfile")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        print(buf.getvalue())
    ps_tier.flush(model)
    if args.sections:
        model = w._ps_model(device, rows, args.url, cache_rows)
        (tier,) = ps_tier.tiers_of(model)
        with section_timers(tier, device) as totals:
            ms = w._staging_ms(model, batches, device)
        steps = len(batches)  # the warm-up batches' staging is timed too
        print(f"staging {ms:.2f} ms/batch with the steps timed between syncs; ms per batch (all {steps}):")
        for name, seconds in totals.items():
            print(f"  {name:<28}{seconds / steps * 1e3:8.3f}")


if __name__ == "__main__":
    main()
