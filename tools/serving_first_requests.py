"""Device-side investigation (not a benchmark): where the float serving stream's first requests go.

`--workloads serving` timed ours' first 100 float requests at 0.51-0.77x fbgemm's while its p50 was
ahead (perf-notes v60, v67). This answers a stream as the benchmark does (bench/serving.py: its
layout, its draws, a warmed process, ours' choices forgotten before its stream), and splits ours'
first N requests' summed latency by what the tuners did in each: a shape class's first request, a
request behind a trial's hold (and the holds' own ms), another request of a shape on trial (untimed:
its default, or a candidate's first launch), a decided shape's request.
Then both peers' requests split by the stream alone: those that open a shape class (the first of
their batch bucket and lookup bucket, as the tuners round them) and the rest, within the first
EARLY requests and after, so that a class's opening cost is told from the stream's start's (both
peers' first requests are slower). ``--force CHOICE`` runs ours' forward on one choice, unmeasured
(no prior, no trials): what opening a class costs without the tuners.
Then ours' slowest requests with the tuners' launches in them (the choice, whether timed, whether
its first launch for the shape). Then the same first N requests again, from forgotten choices, under cProfile.

    python3 tools/serving_first_requests.py [--distribution log-uniform] [--seed S] [--requests 100]
        [--force cuda:features]
"""
import argparse
import cProfile
import pstats

import torch

from recom_rec.bench.batch_sizes import DISTRIBUTIONS
from recom_rec.bench.serving import answer_stream, draw_stream, float_peers, warm_process
from recom_rec.bench.workloads import serving_layout
from recom_rec.kernels import selection
from recom_rec.kernels.launch_tuner import _power_of_two_at_least


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--distribution", default="log-uniform", choices=list(DISTRIBUTIONS))
    p.add_argument("--seed", type=int, default=4232939074)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--force", choices=list(selection.CHOICES), help="ours' forward on this choice alone")
    args = p.parse_args()
    device = torch.device("cuda")
    layout = serving_layout(False)
    sizes, stream = draw_stream(layout, args.distribution, args.seed, args.requests)
    warm_process(layout, device, ["recom_rec", "fbgemm"], "auto")
    peers = float_peers(layout, device, ["recom_rec", "fbgemm"], "auto")
    if args.force:
        selection.force_forward(args.force)

    tuners = selection._tuners()
    holds = {"ms": 0.0, "count": 0}
    for t in tuners:  # count the holds ahead of timed trials
        def hold(dev, ms, _orig=t._hold):
            holds["ms"] += ms
            holds["count"] += 1
            _orig(dev, ms)
        t._hold = hold

    launches = []  # the tuners' launches in the current request: (choice, timed, a first launch for its shape)
    for t in tuners:
        def next_launch(shape, candidates, default, _orig=t._next_launch, _t=t):
            trials = _t._trials.get(shape)
            choice, timed = _orig(shape, candidates, default)
            first = trials is None or choice not in trials.launched
            launches.append((_t.names[choice], timed, first))
            return choice, timed
        t._next_launch = next_launch
    request_launches = []

    def after_request(i):
        log.append(state())
        request_launches.append(list(launches))
        launches.clear()

    def state():
        return (sum(len(set(t._starts) | set(t._decided)) for t in tuners), holds["count"], holds["ms"],
                sum(t.trial_launches for t in tuners))

    selection.forget_all()
    log = [state()]
    ours = answer_stream(peers["recom_rec"], stream, device, after_request)
    theirs = answer_stream(peers["fbgemm"], stream, device)
    kinds = {"new shape class": 0.0, "behind a hold": 0.0, "on trial, untimed": 0.0, "decided": 0.0}
    counts = dict.fromkeys(kinds, 0)
    for i, ms in enumerate(ours):
        before, after = log[i], log[i + 1]
        kind = ("new shape class" if after[0] > before[0] else "behind a hold" if after[1] > before[1]
                else "on trial, untimed" if after[3] > before[3] else "decided")
        kinds[kind] += ms
        counts[kind] += 1
    print(f"{args.distribution}, seed {args.seed}, first {args.requests} requests, batch sizes "
          f"{min(sizes)}-{max(sizes)}: ours {sum(ours):.1f} ms, fbgemm {sum(theirs):.1f} ms")
    for kind, ms in kinds.items():
        print(f"  {kind:20s} {counts[kind]:4d} requests {ms:8.2f} ms")
    print(f"  holds: {holds['count']} totalling {holds['ms']:.2f} ms; shape classes {log[-1][0]}")
    print("  request ms (ours / fbgemm, batch):",
          " ".join(f"{a:.2f}/{b:.2f}({s})" for a, b, s in zip(ours[:40], theirs, sizes)))
    split_by_class_opening(stream, ours, theirs)
    slow = sorted(range(len(ours)), key=lambda i: -ours[i])[:SLOWEST]
    print(f"  ours' {SLOWEST} slowest requests and the tuners' launches in them (choice, timed, first launch):")
    for i in slow:
        print(f"    #{i} batch {sizes[i]}: {ours[i]:.2f} ms (fbgemm {theirs[i]:.2f})", request_launches[i])

    selection.forget_all()
    prof = cProfile.Profile()
    prof.enable()
    answer_stream(peers["recom_rec"], stream, device)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


SLOWEST = 12
EARLY = 10  # the stream's first requests, slower for every peer


def opens_a_class(stream) -> list:
    """Per request, whether it is the first of its shape class (batch and lookup buckets, rounded
    as the tuners' ForwardLaunchShape rounds them)."""
    seen, opens = set(), []
    for kjt in stream:
        key = (_power_of_two_at_least(kjt.stride()), _power_of_two_at_least(kjt.values().numel()))
        opens.append(key not in seen)
        seen.add(key)
    return opens


def split_by_class_opening(stream, ours, theirs) -> None:
    opens = opens_a_class(stream)
    print(f"  by the stream alone (ms summed / requests / mean), first {EARLY} requests and after:")
    for early in (True, False):
        for opening in (True, False):
            picked = [i for i in range(len(ours)) if (i < EARLY) == early and opens[i] == opening]
            if not picked:
                continue
            a, b = sum(ours[i] for i in picked), sum(theirs[i] for i in picked)
            print(f"    {'first' if early else 'after'} {EARLY:3d}, {'opening a class' if opening else 'the rest':15s} "
                  f"{len(picked):4d} requests: ours {a:7.2f} ms ({a / len(picked):.3f}), "
                  f"fbgemm {b:7.2f} ms ({b / len(picked):.3f})")


if __name__ == "__main__":
    main()
