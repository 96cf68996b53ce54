"""Device-side investigation (not a benchmark): one training step of a sweep point, ours and
fbgemm's, inside a CUDA profiler range, for Nsight Compute's hardware counters.

Each peer is warmed up first (ours until its tuners decided), outside the range; then one step of
each runs between ``torch.cuda.profiler.start()`` and ``stop()``. Run it under
``ncu --profile-from-start off --clock-control none --kernel-name regex:... python tools/ncu_point.py
--points dim=256,ids=50,zipf=1`` (the fields as in tools/profile_step.py --points).
"""
import argparse

import torch

from recom_rec.bench.timing import time_ms
from profile_step import sweep_point_peers


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--points", nargs="+", required=True)
    p.add_argument("--optimizer", default="sgd")
    args = p.parse_args()
    dev = torch.device("cuda")
    for spec in args.points:
        label, kjt, grad, peers = sweep_point_peers(spec, dev, args.optimizer, fbgemm=True)
        for name, peer in peers:
            step = lambda: peer.train_step(kjt, grad)  # noqa: E731
            ms = time_ms(step, dev, warmup=5, iters=10)
            print(f"== {label} {name} {args.optimizer}: step {ms:.3f} ms", flush=True)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        del peers


if __name__ == "__main__":
    main()
