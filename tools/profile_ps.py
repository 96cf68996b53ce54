"""Host-side investigation (not a benchmark): where the PS tier's staging of one batch goes.

Builds the ``ps`` benchmark's model and batches (full size on the GPU, small on the CPU), replays
the warm-up batches, then stages each timed batch alone (the same loop as the benchmark's
``staging ms`` column), three times: once to warm up (first-use kernel loads, Triton compiles),
once under cProfile (functions by own and cumulative time), and once reading the native job's
own timers (``--sections``: ms per batch of each phase of recom_rec/csrc/ps_stage.c).
Usage: python tools/profile_ps.py [--url memory://prof] [--top 30] [--sections]
"""
import argparse
import cProfile
import io
import pstats

import torch

from recom_rec import ps as ps_tier
from recom_rec.bench import ps_workload as w


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
        phases = {}
        ms = w._staging_ms(model, batches, device, phases)
        print(f"staging {ms:.2f} ms/batch; the native job's phases, ms per batch:")
        for name, per_batch in phases.items():
            print(f"  {name:<28}{per_batch:8.3f}")

if __name__ == "__main__":
    main()
