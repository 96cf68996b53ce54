"""GPU investigation (not a benchmark): the random-row gather ceiling by row width, beside ours' and
fbgemm's forward on the same rows.

The sweep judges a forward that reads >= 100 MB of rows against the device-to-device copy rate.
Rows of 16-32 bytes are read at random, a 32-byte sector (or more) at a time, and no kernel may
reach the copy rate there. This measures what a gather can reach on the sweep's own points: a
minimal Triton kernel (recom_rec/bench/gather.py, which the sweep also times at its forwards below
85% of the copy rate) that reads each lookup's row (its flat row index precomputed, 4 bytes) and
sums a block of them (no bags, no ids check, no output to speak of), at several block sizes, the
best taken. Ours (backend auto, checked as it runs by default) and fbgemm (checked and unchecked)
run the point's forward on the same KJT; all are CUDA-graph replays (device time), timed
interleaved. Shares are the rows' bytes over each time, over the copy rate.

Usage (GPU machine): PYTHONPATH=. python tools/gather_ceiling.py [--dims 4 8 16 32 64] [--ids 10 50 200]
"""
import argparse
import statistics

import torch

from recom_rec.bench.gather import gathers
from recom_rec.bench.sweep import Point, _choices, _Fbgemm, _forget_choices, _Ours, make_kjt, rows_read_bytes
from recom_rec.bench.timing import copy_bandwidth_gbs, graph_replay, settle, time_interleaved
from recom_rec.kernels import selection
from recom_rec.kernels.pooled_cuda import FORWARD_LAUNCHES
from recom_rec.kernels.selection import CUDA


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--ids", type=int, nargs="+", default=[10, 50, 200])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--fixed", action="store_true",
                    help="also every bag exactly --ids long (the sweep's grid has them uniform in [0, 2 x ids])")
    ap.add_argument("--launches", nargs="*", default=[], choices=list(FORWARD_LAUNCHES),
                    help="also ours with each of these CUDA forward launches forced")
    ap.add_argument("--ncu", action="store_true",
                    help="no timing: one eager forward of each peer between profiler start and stop, for "
                         "ncu --profile-from-start off")
    args = ap.parse_args()
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name(device)}: copy {copy_gbs:.0f} GB/s")
    print(f"{'point':<40} {'rows MB':>8} | {'gather ms':>9} {'block':>10} {'share':>6} | {'ours ms':>8} {'share':>6}"
          f" {'of gather':>9} | {'fbgemm':>7} {'unchecked':>9}")
    shapes = [(d, i, f) for d in args.dims for i in args.ids for f in ((False, True) if args.fixed else (False,))]
    for dim, ids, fixed in shapes:
        p = Point("grid", dim=dim, ids=ids, fixed=fixed).fitted()
        kjt = make_kjt(p, device)
        weights = torch.randn(p.tables * p.rows, p.dim, device=device)
        tables = list(weights.view(p.tables, p.rows, p.dim))
        peers = {"ours": _Ours(p, device, None, tables, "auto"), "fbgemm": _Fbgemm(p, device, None, tables),
                 "unchecked": _Fbgemm(p, device, None, tables, bounds_checked=False)}
        peers.update(gathers(weights, kjt, p.tables, p.rows))
        with torch.no_grad():
            sums = {name: peer.forward(kjt).double().sum().item() for name, peer in peers.items()}
        reference = sums["fbgemm"]
        bad = {n: s for n, s in sums.items() if abs(s - reference) > 1e-3 * (abs(reference) + 1)}
        assert not bad, f"{p.label()}: sums disagree with fbgemm's {reference}: {bad}"
        if args.ncu:  # ours' choices decided first (settle), then one forward each under the profiler
            settle(lambda: peers["ours"].forward(kjt), device, warmup=2)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            with torch.no_grad():
                for name in ("ours", "unchecked", "gather 512/4"):
                    peers[name].forward(kjt)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"profiled {p.label()}: ours {_choices().get('forward')}", flush=True)
            _forget_choices()
            continue
        replays = {name: graph_replay(peer, kjt, device) for name, peer in peers.items()}
        for launch in args.launches:  # ours forced to each launch (captured forced: the replay keeps it)
            selection.force_forward(CUDA + launch)
            replays[launch] = graph_replay(_Ours(p, device, None, tables, "auto"), kjt, device)
        selection.force_forward(None)
        samples = time_interleaved(replays, device, warmup=2, min_iters=args.iters, min_ms=20.0)
        ms = {name: statistics.median(t) for name, t in samples.items()}
        choice = _choices().get("forward", "?")
        best = min((n for n in ms if n.startswith("gather")), key=ms.get)
        rows_bytes = rows_read_bytes(p, kjt)

        def share(t):
            return rows_bytes / (t * 1e-3) / 1e9 / copy_gbs

        print(f"{p.label():<40} {rows_bytes / 1e6:8.0f} | {ms[best]:9.4f} {best[7:]:>10} {share(ms[best]):6.0%} | "
              f"{ms['ours']:8.4f} {share(ms['ours']):6.0%} {ms[best] / ms['ours']:9.0%} | "
              f"{ms['fbgemm']:7.4f} {ms['unchecked']:9.4f}  ours: {choice}", flush=True)
        if args.launches:
            print("    ours by launch: " + ", ".join(f"{n} {ms[n]:.4f}" for n in args.launches), flush=True)
        del peers, replays, kjt, weights, tables
        _forget_choices()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
