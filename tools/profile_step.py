"""Device-side investigation (not a benchmark): where a fused training step's time goes.

For each workload and backend: the step time (CUDA events), the host time to issue one step (no
sync: is the step host-bound?), and the CUDA kernels of one step from torch.profiler, longest first.
Usage: python tools/profile_step.py [--workloads ...] [--backends cuda triton] [--optimizer sgd]
"""
import argparse
import time

import torch

from recom_rec.bench.peers import make_peer
from recom_rec.bench.timing import time_ms
from recom_rec.bench.workloads import get_workload
from recom_rec.kernels.pooled_cuda import BACKWARD_PATH_TUNER, FORWARD_ORDER_TUNER


def host_issue_ms(fn, steps: int = 20) -> float:
    """Mean host time per step while the GPU queue is kept busy (the queue never drains)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    return host


def new_launch_orders(seen: set, tuner=FORWARD_ORDER_TUNER) -> str:
    """What a tuner (the CUDA forward's launch order, the backward's path) decided since the last
    call (one per group shape)."""
    new = tuner.decisions_since(seen)
    return ", ".join(f"{s.num_features} features x {s.batch_size} dim {s.max_dim}: {o}" for s, o in new.items())


def kernel_table(fn, steps: int = 5, top: int = 14) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append((us / steps, e.count // steps, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"    {'us/step':>9} {'calls':>5}  kernel (sum {total:.0f} us)"]
    lines += [f"    {us:9.1f} {calls:5d}  {name[:90]}" for us, calls, name in rows[:top]]
    return "\n".join(lines)


def host_profile(fn, steps: int = 10, top: int = 30) -> str:
    """cProfile of the host side of ``steps`` steps, by own time."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workloads", nargs="+", default=["many-1000", "dlrm-kaggle", "many-500"])
    p.add_argument("--backends", nargs="+", default=["cuda"])
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--fbgemm", action="store_true", help="profile fbgemm's TBE step too")
    p.add_argument("--host", action="store_true", help="print a cProfile of the step's host side")
    args = p.parse_args()
    dev = torch.device("cuda")
    seen_orders, seen_paths = set(), set()
    for wname in args.workloads:
        w = get_workload(wname, False)
        kjt = w.make_input(dev)
        grad = torch.ones(w.batch_size, sum(w.dims), device=dev)
        peers = [f"recom_rec:{b}" for b in args.backends] + (["fbgemm"] if args.fbgemm else [])
        for name in peers:
            peer = make_peer(name, w, dev, args.optimizer)
            step = lambda: peer.train_step(kjt, grad)  # noqa: E731
            fwd = lambda: peer.forward(kjt)  # noqa: E731
            ms = time_ms(step, dev, warmup=5, iters=20)
            with torch.no_grad():
                fms = time_ms(fwd, dev, warmup=3, iters=20)
                fhost = host_issue_ms(fwd)
            host = host_issue_ms(step)
            print(f"== {wname} {name} {args.optimizer}: step {ms:.3f} ms (host issue {host:.3f} ms); "
                  f"forward {fms:.3f} ms (host {fhost:.3f} ms)", flush=True)
            orders = new_launch_orders(seen_orders)
            if orders:
                print(f"    forward launch order: {orders}", flush=True)
            paths = new_launch_orders(seen_paths, BACKWARD_PATH_TUNER)
            if paths:
                print(f"    backward path: {paths}", flush=True)
            print(kernel_table(step), flush=True)
            if args.host:
                print(host_profile(step), flush=True)
            del peer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
