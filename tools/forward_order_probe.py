"""Probe (GPU): does the order in which a bag-major forward runs its features change its speed?
The forward kernel reads each block's feature record (meta row, key index) by block index, so a
permutation of those two arrays reorders the blocks and nothing else (each bag is still summed by
one group, in input order: the same bits). Captures a workload's forward launch (default mixed),
then times its launches on several feature orders and on subsets of the features, interleaved.

    python tools/forward_order_probe.py [workload] [--ncu ORDER]

With --ncu, runs one launch of ORDER inside a CUDA profiler range, for
``ncu --profile-from-start off --kernel-name regex:pooled_forward ...``.
"""
import argparse
import statistics

import numpy as np
import torch

import recom_rec.kernels.pooled_cuda as pooled_cuda
from recom_rec.bench.peers import make_peer
from recom_rec.bench.timing import time_interleaved
from recom_rec.bench.workloads import get_workload

L2_BYTES = 50 << 20  # an H100's L2; tables up to an eighth of it are counted as resident in it


def capture(workload: str, dev):
    w = get_workload(workload, False)
    kjt = w.make_input(dev)
    peer = make_peer("recom_rec", w, dev, "none", backend="cuda")
    seen = {}
    real = pooled_cuda.forward_launch

    def spy(flat, values, offsets, psw, meta, key_index, batch_size, total_dim, max_dim, launch, check=None):
        seen.update(args=(flat, values, offsets, psw, meta, key_index, batch_size, total_dim, max_dim), launch=launch)
        return real(flat, values, offsets, psw, meta, key_index, batch_size, total_dim, max_dim, launch, check)

    pooled_cuda.forward_launch = spy
    for _ in range(8):  # past the tuner's trials
        peer.forward(kjt)
    pooled_cuda.forward_launch = real
    torch.cuda.synchronize()
    return seen["args"], seen["launch"]


def orders(meta, key_index, offsets, batch_size, elem_bytes):
    """Feature orders by name (index tensors into the group's features)."""
    m = meta.cpu().numpy()
    dims, rows = m[:, 0], m[:, 4]
    offs = offsets.cpu().numpy()
    keys = key_index.cpu().numpy()
    lookups = np.array([offs[(k + 1) * batch_size] - offs[k * batch_size] for k in keys])
    table = rows * dims * elem_bytes
    work = lookups * dims * elem_bytes
    n = len(dims)
    resident = np.flatnonzero(table <= L2_BYTES // 8)
    streaming = np.flatnonzero(table > L2_BYTES // 8)

    def interleave(a, b):  # merge two lists so that their work advances at the same rate
        wa, wb = np.cumsum(work[a]) / work[a].sum(), np.cumsum(work[b]) / work[b].sum()
        out, i, j = [], 0, 0
        while i < len(a) or j < len(b):
            if j >= len(b) or (i < len(a) and wa[i] <= wb[j]):
                out.append(a[i]); i += 1
            else:
                out.append(b[j]); j += 1
        return np.array(out)

    rng = np.random.default_rng(0)
    named = {
        "given": np.arange(n),
        "table bytes up": np.argsort(table, kind="stable"),
        "table bytes down": np.argsort(-table, kind="stable"),
        "resident/streaming interleaved": interleave(resident, streaming),
        "random": rng.permutation(n),
        "resident only": resident,
        "streaming only": streaming,
    }
    print(f"{n} features: {len(resident)} tables <= {L2_BYTES // 8 >> 20} MiB ({work[resident].sum() / 1e9:.2f} GB "
          f"of rows looked up), {len(streaming)} larger ({work[streaming].sum() / 1e9:.2f} GB)", flush=True)
    dev = meta.device
    return {k: torch.as_tensor(v, dtype=torch.int64, device=dev) for k, v in named.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload", nargs="?", default="mixed")
    p.add_argument("--ncu", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    (flat, values, offsets, psw, meta, key_index, B, total_dim, max_dim), decided = capture(args.workload, dev)
    named = orders(meta, key_index, offsets, B, flat.element_size())
    launches = pooled_cuda.forward_launches(
        pooled_cuda.ForwardLaunchShape.of(flat, values, psw, meta, B, total_dim, max_dim))
    print(f"the tuner's launch: {decided}; launches: {', '.join(launches)}", flush=True)

    def run(order, launch):
        idx = named[order]
        m, k = meta[idx].contiguous(), key_index[idx].contiguous()
        return lambda: pooled_cuda.forward_launch(flat, values, offsets, psw, m, k, B, total_dim, max_dim, launch)

    if args.ncu:
        fn = run(args.ncu, decided)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    ref = run("given", decided)()
    for order in named:
        if "only" not in order:
            assert torch.equal(run(order, decided)(), ref), order
    print("every whole order gives the given order's bits", flush=True)
    for launch in launches:
        steps = {order: run(order, launch) for order in named}
        samples = time_interleaved(steps, dev, min_iters=30, min_ms=100)
        print(f"-- launch {launch}", flush=True)
        for order, s in samples.items():
            print(f"   {order:32s} {statistics.median(s) * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
