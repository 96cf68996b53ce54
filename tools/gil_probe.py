"""Device-side investigation (not a benchmark): how much a busy background Python thread slows
the training thread's step, by the kind of work it does. Evidence for where wrap()'s prefetch
loses time: the staging thread and the training thread share one GIL.

The training step is the `ps` workload's in-device step (one 1e8 x 32 table, batch 4096, fused
SGD). The background thread loops over one of:
- idle: no thread;
- sleep: time.sleep(0.002) (no GIL held);
- c_calls: 60 tiny ctypes calls (each releases and retakes the GIL) with ~10 us of Python between;
- torch_ops: 60 small CPU torch ops with ~10 us of Python between;
- python: pure Python for 2 ms at a time (the GIL is taken from it every switch interval).
Usage: python tools/gil_probe.py [--steps 200] [--switch-interval SECONDS]
"""
import argparse
import ctypes
import sys
import threading
import time

import torch

from recom_rec.bench import ps_workload as w


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def background(kind: str, stop: threading.Event) -> None:
    libc = ctypes.CDLL(None)
    x = torch.zeros(16)
    while not stop.is_set():
        if kind == "sleep":
            time.sleep(0.002)
        elif kind == "c_calls":
            for _ in range(60):
                libc.getpid()
                spin(10)
        elif kind == "torch_ops":
            for _ in range(60):
                x.add_(1)
                spin(10)
        elif kind == "python":
            spin(2000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run (default: the interpreter's, 0.005)")
    args = p.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = device.type == "cpu"
    batches = w._batches(device, small)
    model = w._model(device, 10**6 if small else w.ROWS)
    print(f"switch interval {sys.getswitchinterval() * 1e3:g} ms")
    for kind in ("idle", "sleep", "c_calls", "torch_ops", "python", "idle"):
        stop = threading.Event()
        thread = None if kind == "idle" else threading.Thread(target=background, args=(kind, stop), daemon=True)
        if thread:
            thread.start()
        for kjt in batches[:5]:
            w._train_step(model, kjt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(args.steps):
            w._train_step(model, batches[i % len(batches)])
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / args.steps * 1e3
        stop.set()
        if thread:
            thread.join()
        print(f"{kind:>10}: {ms:.3f} ms per step")


if __name__ == "__main__":
    main()
