"""Where a peer's first call goes, in a fresh process (issue 51; docs/perf-notes.md v46).

`--phases cold` measured DLRM-DCNv2's first forward at 219 ms with the shipped sm_90 prior and
65 ms with RECOM_REC_PRIOR=off, against fbgemm's 38 ms. This builds the peer as the cold bench
does (bench/cold.py), then runs its first CALLS calls under torch.profiler (host and CUDA
activity) and prints each call's wall time and the ops and kernels that took the most host time
in call 1 (Triton compiles show as `triton` / `compile` frames, module loads as long first
launches).

    python3 tools/first_call_profile.py dlrm-dcnv2 --phase forward            # with the shipped prior
    RECOM_REC_PRIOR=off python3 tools/first_call_profile.py dlrm-dcnv2        # every candidate measured
    python3 tools/first_call_profile.py random-0 --draw SEED:COUNT --peer fbgemm
    python3 tools/first_call_profile.py dlrm-dcnv2 --python      # call 1's Python frames (cProfile)
    python3 tools/first_call_profile.py random-0 --draw SEED:COUNT --phase sgd --decisions 200
        # calls 1-200 timed (no profiler): ms a call by window, and the tuners' decisions as they stand

torch.profiler shows Python work between ops only as its caller's self time (v47: 68 of call 1's
74 ms were `_EagerLookup`'s own); --python names it: call 1 under cProfile, by cumulative time.
"""
import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", help="a named workload, dlrm-dcnv2, or random-K with --draw")
    p.add_argument("--peer", default="recom_rec")
    p.add_argument("--phase", default="forward", choices=["forward", "sgd"])
    p.add_argument("--draw", default=None, help="SEED:COUNT of the drawn layouts (random-K workloads)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda")
    p.add_argument("--python", action="store_true", help="call 1 under cProfile instead of torch.profiler")
    p.add_argument("--decisions", type=int, default=0, metavar="CALLS",
                   help="time CALLS calls (synchronized, no profiler) and print the decisions after calls 10, "
                   "100 and CALLS instead")
    args = p.parse_args()

    from recom_rec.bench.peers import make_peer
    from recom_rec.bench.workloads import DRAWN, get_workload

    from recom_rec.bench.random_layouts import random_workloads

    device = torch.device(args.device)
    small = device.type == "cpu"
    seed, count = (int(x) for x in args.draw.split(":")) if args.draw else (0, 0)
    DRAWN.update((w.name, w) for w in random_workloads(seed, count, small))  # (DLRM-DCNv2 always)
    w = get_workload(args.workload, small)
    kjt = w.make_input(device)
    optimizer = "none" if args.phase == "forward" else "sgd"
    peer = make_peer(args.peer, w, device, optimizer if not args.peer.startswith("fbgemm") else "sgd", "auto")
    grad = torch.ones(w.batch_size, peer.output_width, device=device)

    def call():
        if args.phase == "forward":
            with torch.no_grad():
                peer.forward(kjt)
        else:
            peer.train_step(kjt, grad)

    if args.decisions:
        timed_decisions(call, device, args.decisions, f"{args.workload} {args.peer} {args.phase}")
        return
    if args.python:
        import cProfile
        import pstats

        if device.type == "cuda":
            torch.cuda.synchronize(device)
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.runcall(call)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        print(f"{args.workload} {args.peer} {args.phase}: call 1 {(time.perf_counter() - t0) * 1e3:.1f} ms "
              "(under cProfile, synchronized)")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    walls = []
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for i in range(args.calls):
            with torch.profiler.record_function(f"call {i + 1}"):
                t0 = time.perf_counter()
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                walls.append((time.perf_counter() - t0) * 1e3)
    print(f"{args.workload} {args.peer} {args.phase}: wall ms a call (synchronized): "
          + ", ".join(f"{ms:.1f}" for ms in walls))
    print(prof.key_averages(group_by_stack_n=4).table(sort_by="self_cpu_time_total", row_limit=args.top,
                                                      max_name_column_width=60))


def timed_decisions(call, device, calls: int, label: str) -> None:
    """Each call's wall time (synchronized), summed by window, and the kernel decisions taken by
    calls 10, 100 and ``calls`` (a shape class still on trial is not among them)."""
    import json

    from recom_rec import kernel_decisions

    marks, ms, shown = {1, 10, 100, calls}, [], None
    for i in range(1, calls + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms.append((time.perf_counter() - t0) * 1e3)
        if i in marks:
            decided = {f"{tuner}: {shape}": choice for classes in kernel_decisions()["entries"].values()
                       for tuner, shapes in classes.items() for shape, choice in shapes.items()}
            start = max([m for m in marks if m < i], default=0)
            print(f"{label}: calls 1-{i} {sum(ms):.1f} ms; calls {start + 1}-{i} {statistics.median(ms[start:]):.3f} "
                  f"ms a call (median); decisions: {len(decided)}", flush=True)
            if decided != shown:
                print("  " + json.dumps(decided, default=str)[:1500], flush=True)
                shown = decided


if __name__ == "__main__":
    main()
