"""Device-side investigation (not a benchmark): the host's own time for each call of one fused
training step at a sweep point, with the GPU queue kept full (a long sleep kernel ahead of the
calls), so no call waits for the device and what is timed is the host alone.

Prints microseconds a call (median of --reps) for: the whole step, the forward, the Python backward,
the extension's plan_backward and piece_update on the step's own arguments, and the primitives
they are made of (an allocation, a one-element kernel launch, a memset).
Usage: python tools/host_cost.py --points dim=32,ids=50 [--optimizer sgd]
"""
import argparse
import statistics
import time
from unittest import mock

import torch

from profile_step import host_profile, sweep_point_peers
from recom_rec.bench.timing import settle
from recom_rec.kernels import cuda_ext


def host_us(fn, reps: int) -> float:
    """Median host microseconds of ``fn`` while the device is busy with a sleep queued ahead."""
    samples = []
    for _ in range(reps):
        torch.cuda._sleep(2_000_000)  # ~1 ms of device time: launches queue, nothing waits
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def idle_trace(fn, path: str, calls: int, with_stack: bool = False) -> None:
    """A chrome trace of ``calls`` calls of ``fn``, each from an idle device (as the benchmark
    times them), written to ``path``."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=with_stack) as prof:
        for _ in range(calls):
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)


class Captured:
    """The last arguments the step passed to the extension's plan and piece calls."""

    def __init__(self):
        self.plan = self.pieces = None
        ext = cuda_ext.extension()
        self._plan, self._pieces = ext.plan_backward, ext.piece_update
        cap = self

        class Proxy:
            def __getattr__(self, name):
                return getattr(ext, name)

            def plan_backward(self, *a):
                cap.plan = a
                return cap._plan(*a)

            def piece_update(self, *a):
                cap.pieces = a
                return cap._pieces(*a)

        self.proxy = Proxy()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--points", nargs="+", required=True)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--trace", default="", help="also write a chrome trace of 3 steps (each from an idle device) "
                   "of each peer to <this prefix>-<point>-<peer>.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    for spec in args.points:
        label, kjt, grad, peers = sweep_point_peers(spec, dev, args.optimizer, fbgemm=True)
        for name, peer in peers:
            step = lambda: peer.train_step(kjt, grad)  # noqa: E731
            settle(step, dev, warmup=5)  # until the tuners have decided
            step_us = host_us(step, args.reps)
            rows = [("step", step_us)]

            def fwd():
                with torch.no_grad():
                    peer.forward(kjt)
            rows.append(("forward (no grad)", host_us(fwd, args.reps)))
            if name == "recom_rec":
                forward_us = host_us(lambda: peer.module(kjt).values(), args.reps)
                rows.append(("forward with autograd", forward_us))
                cap = Captured()
                with mock.patch.object(cuda_ext, "extension", lambda: cap.proxy):
                    step()
                torch.cuda.synchronize()
                ext = cuda_ext.extension()
                if cap.plan is not None:
                    rows.append(("ext.plan_backward", host_us(lambda: ext.plan_backward(*cap.plan), args.reps)))
                if cap.pieces is not None:
                    rows.append(("ext.piece_update", host_us(lambda: ext.piece_update(*cap.pieces), args.reps)))
                rows.append(("backward (autograd, step minus forward)", step_us - forward_us))
            x = torch.zeros(1, device=dev, dtype=torch.int64)
            rows.append(("torch.empty(1M int32)", host_us(lambda: torch.empty(1 << 20, dtype=torch.int32, device=dev),
                                                          args.reps)))
            rows.append(("x.add_(1) (one kernel)", host_us(lambda: x.add_(1), args.reps)))
            rows.append(("torch.zeros(3) (alloc + memset)", host_us(lambda: torch.zeros(3, device=dev), args.reps)))
            if args.trace:
                idle_trace(step, f"{args.trace}-{spec.replace(',', '_').replace('=', '')}-{name}.json", calls=3,
                           with_stack=True)
            print(f"== {label} {name} {args.optimizer}: host us a call (GPU kept busy)")
            for what, us in rows:
                print(f"    {us:9.1f}  {what}", flush=True)
            if name == "recom_rec":
                print(host_profile(step, steps=50, top=60), flush=True)
        del peers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
