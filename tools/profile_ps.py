"""Host-side investigation (not a benchmark): where the PS tier's staging of one batch goes.

Builds the ``ps`` benchmark's model and batches (full size on the GPU, small on the CPU), replays
the warm-up batches, then stages each timed batch alone (the same loop as the benchmark's
``staging ms`` column), three times: once to warm up (first-use kernel loads, Triton compiles),
once under cProfile (functions by own and cumulative time), and once reading the native job's
own timers (``--sections``: ms per batch of each phase of csrc/ps/ps_stage.c).
With ``--prefetch N`` it profiles the training loop under ``wrap(prefetch=N)`` instead.
Usage: python tools/profile_ps.py [--url memory://prof] [--top 30] [--sections | --prefetch N]
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
    p.add_argument("--prefetch", type=int, default=0,
                   help="profile the training loop under wrap(prefetch=N) instead (the training thread's "
                   "functions, then the staging jobs' phases on the tier's worker)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = device.type == "cpu" and not args.full_size
    batches = w._batches(device, small)
    rows = 10**6 if small else w.ROWS
    touched = torch.unique(torch.cat([b.values() for b in batches])).numel()
    per_batch = max(torch.unique(b.values()).numel() for b in batches)
    cache_rows = max(int(w.CACHE_FRACTION * touched), int(1.2 * per_batch))
    if args.prefetch:
        return profile_training(args, device, batches, rows, cache_rows)
    ms = w._staging_ms(w._ps_model(device, rows, args.url, cache_rows), batches, device)
    print(f"staging {ms:.2f} ms/batch (first pass: first-use costs included)")
    model = w._ps_model(device, rows, args.url, cache_rows)
    prof = cProfile.Profile()
    prof.enable()
    ms = w._staging_ms(model, batches, device)
    prof.disable()
    print(f"staging {ms:.2f} ms/batch under cProfile")
    print_stats(prof, args.top)
    ps_tier.flush(model)
    if args.sections:
        model = w._ps_model(device, rows, args.url, cache_rows)
        phases = {}
        ms = w._staging_ms(model, batches, device, phases)
        print(f"staging {ms:.2f} ms/batch; the native job's phases, ms per batch:")
        for name, per_batch in phases.items():
            print(f"  {name:<28}{per_batch:8.3f}")

def print_stats(prof, top):
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        print(buf.getvalue())


def profile_training(args, device, batches, rows, cache_rows):
    """The ps workload's training loop under wrap(): step time, then the training thread under
    cProfile, then the jobs' phases (the worker's time per batch)."""
    base = w._time_steps(w._model(device, rows), batches, device)
    model = w._ps_model(device, rows, args.url, cache_rows)
    ms = w._time_steps(model, batches, device, args.prefetch)
    (tier,) = ps_tier.tiers_of(model)
    phases = {k: v / (w.STEPS + w.WARMUP) * 1e3 for k, v in tier.stager_times().items()
              if not k.startswith(("jobs ", "rows "))}  # those are counts
    print(f"in-device step {base:.3f} ms; PS step with prefetch {args.prefetch}: {ms:.3f} ms ({base / ms:.2f}x)")
    print("staging jobs, ms per batch: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items() if v >= 0.0005))
    model = w._ps_model(device, rows, args.url, cache_rows)
    prof = cProfile.Profile()
    prof.enable()
    ms = w._time_steps(model, batches, device, args.prefetch)
    prof.disable()
    print(f"PS step under cProfile {ms:.3f} ms")
    print_stats(prof, args.top)


if __name__ == "__main__":
    main()
