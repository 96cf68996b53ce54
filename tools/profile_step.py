"""Device-side investigation (not a benchmark): where a fused training step's time goes.

For each workload and backend: the step time (CUDA events), the host time to issue one step (no
sync: is the step host-bound?), and the CUDA kernels of one step from torch.profiler, longest first.
Usage: python tools/profile_step.py [--workloads ...] [--backends cuda triton] [--optimizer sgd|none]
       python tools/profile_step.py --points dim=1024,ids=50 dim=256,ids=50,zipf=1 --fbgemm
       python tools/profile_step.py --sequence 1024 --fbgemm --timeline
       python tools/profile_step.py --dcnv2-shards 0/2 1/2 --fbgemm
       python tools/profile_step.py --vbe --fbgemm --host
(--points: sweep points, recom_rec.bench.sweep.Point fields over its base point; --optimizer none:
dense gradients, no optimizer; --sequence BATCH: the sequence workload's EmbeddingCollection at that
batch, recom_rec.bench.sequence's, its step with SGD fused and gradients of ones as the bench's;
--vbe: recom_rec.bench.vbe's workload, ours against fbgemm's raw VBE TBE, SGD fused;
--dcnv2-shards RANK/WORLD: the tables that rank holds in the sharded-dlrm benchmark's table-wise plan
of MLPerf DLRM-DCNv2, at the batch it pools there, world x 16384.)
"""
import argparse
import json
import os
import tempfile
import time

import torch

from recom_rec.bench.peers import make_peer
from recom_rec.bench.timing import time_ms
from recom_rec.bench.random_layouts import dcnv2, random_workloads
from recom_rec.bench.sharded_dlrm import table_wise_ranks
from recom_rec.bench.workloads import Workload, get_workload
from recom_rec.kernels.pooled_cuda import BACKWARD_PATH_TUNER, FORWARD_ORDER_TUNER
from recom_rec.kernels.selection import force_forward


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
    return ", ".join(f"{s.num_features} features x {s.batch_bucket} (batch bucket) dim {s.max_dim}: {o}" for s, o in new.items())


def kernel_times(fn, steps: int = 5) -> dict:
    """{kernel: (us a step, calls a step)} over ``steps`` runs of ``fn`` under torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            times[e.key] = (us / steps, e.count // steps)
    return times


def kernel_table(fn, steps: int = 5, top: int = 14) -> str:
    rows = sorted(((us, calls, name) for name, (us, calls) in kernel_times(fn, steps).items()), reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"    {'us/step':>9} {'calls':>5}  kernel (sum {total:.0f} us)"]
    lines += [f"    {us:9.1f} {calls:5d}  {name[:90]}" for us, calls, name in rows[:top]]
    return "\n".join(lines)


def kernel_timeline(fn, top: int = 40) -> str:
    """One step's kernels in the order they started: start and end (us from the first kernel's
    start) and stream, so kernels on two streams show whether they ran beside each other."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = sorted((e["ts"], e.get("dur", 0), e.get("args", {}).get("stream", "?"), e["name"])
                     for e in events if e.get("cat") == "kernel")
    if not kernels:
        return "    (no kernels in the trace)"
    t0 = kernels[0][0]
    lines = [f"    {'start':>9} {'end':>9} {'stream':>6}  kernel (one step, us)"]
    lines += [f"    {ts - t0:9.1f} {ts - t0 + dur:9.1f} {stream!s:>6}  {name[:90]}"
              for ts, dur, stream, name in kernels[:top]]
    return "\n".join(lines)


def runtime_calls(fn, steps: int = 5) -> str:
    """The CUDA runtime calls of one step that can stall the host or the stream (syncs, blocking
    copies, allocations): a step whose kernels sum to less than its time has a bubble."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    watched = ("Synchronize", "Memcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc", "item", "nonzero")
    rows = [(e.cpu_time_total / steps, e.count / steps, e.key) for e in prof.key_averages()
            if any(w in e.key for w in watched)]
    rows.sort(reverse=True)
    return "\n".join(f"    {us:9.1f} us {calls:5.1f}x  {name[:90]}" for us, calls, name in rows[:12])


def host_ops(fn, steps: int = 10, top: int = 25) -> str:
    """The host's own time per step by operator and CUDA runtime call (torch.profiler's CPU events:
    aten ops, custom ops, cudaLaunchKernel, cudaFuncSetAttribute, ...), largest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.self_cpu_time_total / steps, e.count / steps, e.key) for e in prof.key_averages()]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"    {'self us':>9} {'calls':>6}  host op (sum {total:.0f} us a step)"]
    lines += [f"    {us:9.1f} {calls:6.1f}  {name[:90]}" for us, calls, name in rows[:top]]
    return "\n".join(lines)


def host_profile(fn, steps: int = 10, top: int = 30) -> str:
    """cProfile of the host side of ``steps`` steps, by own time."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    rows = sorted(((tt, ct, nc, f"{k[0].split('site-packages/')[-1].split('/work/main/')[-1]}:{k[1]}({k[2]})")
                   for k, (nc, _, tt, ct, _) in stats.items()), reverse=True)
    lines = [f"    {'own us':>8} {'cum us':>8} {'calls':>6}  function (a step, under cProfile)"]
    lines += [f"    {tt * 1e6 / steps:8.1f} {ct * 1e6 / steps:8.1f} {nc / steps:6.1f}  {name[:100]}"
              for tt, ct, nc, name in rows[:top]]
    return "\n".join(lines)


def sweep_point_peers(spec: str, dev, optimizer: str, fbgemm: bool):
    """(label, kjt, grad, [(name, peer)]) for a sweep point given as ``field=value,...``."""
    from dataclasses import fields, replace

    from recom_rec.bench import sweep

    kinds = {f.name: f.type for f in fields(sweep.Point)}
    changes = {}
    for item in spec.split(","):
        key, value = item.split("=")
        kind = kinds[key]
        changes[key] = (value if kind in (str, "str") else bool(int(value)) if kind in (bool, "bool")
                        else int(value))
    p = replace(sweep.Point("probe"), **changes).fitted()
    kjt = sweep.make_kjt(p, dev)
    dtype = sweep._DATA_TYPES[p.dtype][1]
    gen = torch.Generator(device=dev).manual_seed(1)
    weights = [(torch.rand(p.rows, p.dim, generator=gen, device=dev) - 0.5).to(dtype) for _ in range(p.tables)]
    grad = torch.ones(p.batch, p.tables * p.dim, device=dev)
    opt = None if optimizer == "none" else optimizer
    peers = [("recom_rec", sweep._Ours(p, dev, opt, weights, "auto"))]
    if fbgemm and p.fbgemm:
        peers.append(("fbgemm", sweep._Fbgemm(p, dev, opt or "sgd", weights)))
    return p.label(), kjt, grad, peers


class _OwnGradientPeer:
    """A peer of recom_rec.bench.sequence or .vbe (its step takes its own upstream gradient) as
    report() calls it."""

    def __init__(self, peer):
        self.peer = peer

    def forward(self, kjt):
        return self.peer.forward(kjt)

    def train_step(self, kjt, grad):
        self.peer.train_step(kjt)


def sequence_peers(w, dev, fbgemm: bool):
    """(label, kjt, [(name, peer)]) of a sequence workload (bench.sequence.SequenceWorkload), on one
    set of weights."""
    from recom_rec.bench import sequence

    kjt = w.make_input(dev)
    torch.manual_seed(0)
    weights = [torch.empty(t.num_embeddings, w.dim, device=dev).uniform_(-0.01, 0.01) for t in w.tables()]
    peers = [("recom_rec", sequence._Ours(w, dev, train=True))]
    if fbgemm:
        peers.append(("fbgemm", sequence._Fbgemm(w, dev, True, kjt.keys())))
    for _, peer in peers:
        peer.load(weights)
    return f"{w.label()} ({kjt.values().numel():,} ids)", kjt, [(n, _OwnGradientPeer(peer)) for n, peer in peers]


def vbe_peers(dev, fbgemm: bool):
    """(label, kjt, [(name, peer)]) of the vbe workload (recom_rec.bench.vbe's, fused SGD), on one set
    of weights: ours, and fbgemm's raw VBE TBE (its output not expanded to the batch)."""
    from recom_rec.bench import vbe

    w = vbe.workloads(False)[0]
    kjt = w.make_input(dev)
    torch.manual_seed(0)
    weights = [torch.empty(w.rows, w.dim, device=dev).uniform_(-0.01, 0.01) for _ in w.tables()]
    peers = [(n, vbe._make_peer(n, w, dev, "sgd")) for n in ["recom_rec"] + (["fbgemm"] if fbgemm else [])]
    for _, peer in peers:
        peer.load(weights)
    return f"vbe-b{w.batch_size} ({kjt.values().numel():,} ids)", kjt, [(n, _OwnGradientPeer(p)) for n, p in peers]


def report(label, name, optimizer, peer, kjt, grad, dev, seen_orders, seen_paths, host_prof, timeline=False):
    step = lambda: peer.train_step(kjt, grad)  # noqa: E731
    fwd = lambda: peer.forward(kjt)  # noqa: E731
    ms = time_ms(step, dev, warmup=5, iters=20)
    with torch.no_grad():
        fms = time_ms(fwd, dev, warmup=3, iters=20)
        fhost = host_issue_ms(fwd)
    host = host_issue_ms(step)
    print(f"== {label} {name} {optimizer}: step {ms:.3f} ms (host issue {host:.3f} ms); "
          f"forward {fms:.3f} ms (host {fhost:.3f} ms)", flush=True)
    orders = new_launch_orders(seen_orders)
    if orders:
        print(f"    forward launch order: {orders}", flush=True)
    paths = new_launch_orders(seen_paths, BACKWARD_PATH_TUNER)
    if paths:
        print(f"    backward path: {paths}", flush=True)
    print(kernel_table(step), flush=True)
    if timeline:
        print(kernel_timeline(step), flush=True)
    print("    runtime calls per step that can stall:\n" + runtime_calls(step), flush=True)
    if host_prof:
        print(host_ops(step), flush=True)
        print(host_profile(step), flush=True)


def report_paths(args, label, name, peer, kjt, grad, dev, seen_orders, seen_paths):
    """report() for a peer, once for each forward choice --forward-choices and each backward path
    --backward-paths force on ours."""
    ours = name.startswith("recom_rec")
    try:
        for choice in (args.forward_choices if ours else [None]):
            if choice == "triton" and name != "recom_rec:auto":
                raise SystemExit("--forward-choices triton needs --backends auto (the cuda backend's forward is CUDA)")
            force_forward(choice)  # the auto backend's choice; the cuda backend's launch order below
            FORWARD_ORDER_TUNER.force(choice[len("cuda:"):] if choice and choice.startswith("cuda:") else None)
            for path in (args.backward_paths if ours else [None]):
                BACKWARD_PATH_TUNER.force(path)
                forced = ", ".join(x for x in (choice, path) if x)
                fallbacks = (FORWARD_ORDER_TUNER.forced_fallbacks, BACKWARD_PATH_TUNER.forced_fallbacks)
                report(label + (f" [{forced}]" if forced else ""), name, args.optimizer, peer, kjt, grad, dev,
                       seen_orders, seen_paths, args.host, args.timeline)
                if (FORWARD_ORDER_TUNER.forced_fallbacks, BACKWARD_PATH_TUNER.forced_fallbacks) != fallbacks:
                    print(f"    ({forced}: not offered for this shape; the rows above ran the default)", flush=True)
    finally:
        force_forward(None)
        FORWARD_ORDER_TUNER.force(None)
        BACKWARD_PATH_TUNER.force(None)


def dcnv2_shard(spec: str) -> Workload:
    """``RANK/WORLD``: the tables that rank holds in sharded_dlrm's table-wise plan of MLPerf
    DLRM-DCNv2, pooled over the world's batch (table-wise: a table's owner pools every rank's bags)."""
    rank, world = (int(x) for x in spec.split("/"))
    full = dcnv2(False)
    ranks = table_wise_ranks(full.rows, world)
    mine = [t for t in range(full.num_tables) if ranks[t] == rank]
    if not mine:
        raise SystemExit(f"--dcnv2-shards {spec}: rank {rank} holds no table at world {world}")
    return Workload(f"dlrm-dcnv2 rank {rank} of {world} ({len(mine)} tables)", [full.rows[t] for t in mine],
                    [full.dims[t] for t in mine], full.batch_size * world, [full.pooling_factors[t] for t in mine],
                    full.zipf_a)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workloads", nargs="+", default=["many-1000", "dlrm-kaggle", "many-500"])
    p.add_argument("--backends", nargs="+", default=["cuda"])
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--fbgemm", action="store_true", help="profile fbgemm's TBE step too")
    p.add_argument("--host", action="store_true", help="print a cProfile of the step's host side")
    p.add_argument("--points", nargs="*", default=[], help="sweep points instead of workloads")
    p.add_argument("--sequence", type=int, nargs="*", default=[],
                   help="batch sizes of the sequence workload (EmbeddingCollection) instead of workloads")
    p.add_argument("--vbe", action="store_true",
                   help="the vbe workload (a batch size per feature, fused SGD) instead of workloads")
    p.add_argument("--random", nargs="*", default=[], metavar="SEED:INDEX",
                   help="the pooled layout random-INDEX that `bench --workloads random --seed SEED` draws, "
                   "instead of workloads")
    p.add_argument("--random-sequence", nargs="*", default=[], metavar="SEED:INDEX",
                   help="the sequence layout random-seq-INDEX that `bench --workloads random --seed SEED` draws "
                   "(EmbeddingCollection, fused SGD), instead of workloads")
    p.add_argument("--dcnv2-shards", nargs="*", default=[],
                   help="RANK/WORLD: one rank's tables of the sharded-dlrm plan instead of workloads")
    p.add_argument("--timeline", action="store_true",
                   help="print one step's kernels in start order, with their streams")
    p.add_argument("--forward-choices", nargs="*", default=[None],
                   help="force each of these forward choices in turn (kernels.selection.CHOICES: the CUDA "
                   "launch orders and Triton) for recom_rec")
    p.add_argument("--backward-paths", nargs="*", default=[None],
                   help="force each of these backward paths in turn (pooled_cuda.BACKWARD_PATHS names) for "
                   "recom_rec")
    args = p.parse_args()
    dev = torch.device("cuda")
    seen_orders, seen_paths = set(), set()
    for spec in args.points:
        label, kjt, grad, peers = sweep_point_peers(spec, dev, args.optimizer, args.fbgemm)
        for name, peer in peers:
            report_paths(args, label, name, peer, kjt, grad, dev, seen_orders, seen_paths)
        del peers
        torch.cuda.empty_cache()
    sgd_args = argparse.Namespace(**{**vars(args), "optimizer": "sgd"})  # (the sequence and vbe steps fuse SGD)
    from recom_rec.bench.random_layouts import random_unpooled_workloads
    from recom_rec.bench.sequence import SequenceWorkload

    sequences = [SequenceWorkload(batch, 10_000_000, [100_000, 16], (50, 2000)) for batch in args.sequence]
    sequences += [random_unpooled_workloads(int(seed), 8, False)[0][int(index)]
                  for seed, index in (spec.split(":") for spec in args.random_sequence)]
    for w in sequences:
        label, kjt, peers = sequence_peers(w, dev, args.fbgemm)
        for name, peer in peers:
            report_paths(sgd_args, label, name, peer, kjt, None, dev, seen_orders, seen_paths)
        del peers
        torch.cuda.empty_cache()
    if args.vbe:
        label, kjt, peers = vbe_peers(dev, args.fbgemm)
        for name, peer in peers:
            report_paths(sgd_args, label, name, peer, kjt, None, dev, seen_orders, seen_paths)
        del peers
        torch.cuda.empty_cache()
    shards = [dcnv2_shard(spec) for spec in args.dcnv2_shards]
    drawn = [random_workloads(int(seed), int(index) + 1, False)[int(index)]
             for seed, index in (spec.split(":") for spec in args.random)]
    named = [] if args.points or sequences or args.vbe or args.random else args.workloads
    for w in shards or drawn or [get_workload(n, False) for n in named]:
        wname = w.name
        kjt = w.make_input(dev)
        peers = [f"recom_rec:{b}" for b in args.backends] + (["fbgemm"] if args.fbgemm else [])
        for name in peers:
            peer = make_peer(name, w, dev, args.optimizer)
            grad = torch.ones(w.batch_size, peer.output_width, device=dev)
            report_paths(args, wname, name, peer, kjt, grad, dev, seen_orders, seen_paths)
            del peer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
