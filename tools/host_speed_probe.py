"""How fast the host issues GPU work, window by window (perf-notes v37): the sweep's eager ratios
move between runs where one peer's step is host-bound and the other's device-bound, so this asks
whether the host's own speed moves, and whether pinning the process to one CPU steadies it.

Each window times WINDOW_CALLS small launches (``x.add_(1)``, queued, one sync at the end: the
host's cost of a launch through torch) and a pure-Python loop. Prints each window's us a launch
and ms a loop, then the spread (max / min) over the windows.

    python3 tools/host_speed_probe.py --seconds 60 [--cpu N]
"""
import argparse
import os
import statistics
import time

import torch

WINDOW_CALLS = 2000


def launch_us(x: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(WINDOW_CALLS):
        x.add_(1)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / WINDOW_CALLS * 1e6


def python_ms() -> float:
    t0 = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i & 7
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--cpu", type=int, help="pin this process to one CPU")
    args = p.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    x = torch.zeros(16, device="cuda")
    for _ in range(3):
        launch_us(x)
    launches, loops = [], []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        launches.append(launch_us(x))
        loops.append(python_ms())
        time.sleep(0.2)
    cpus = sorted(os.sched_getaffinity(0))
    print(f"cpus {cpus[0]}-{cpus[-1]} ({len(cpus)})" if len(cpus) > 1 else f"cpu {cpus[0]}")
    print("launch us:", " ".join(f"{v:.1f}" for v in launches))
    print("loop ms:  ", " ".join(f"{v:.1f}" for v in loops))
    for name, v in (("launch", launches), ("loop", loops)):
        print(f"{name}: {len(v)} windows, median {statistics.median(v):.2f}, min {min(v):.2f}, max {max(v):.2f}, "
              f"max/min {max(v) / min(v):.2f}")


if __name__ == "__main__":
    main()
