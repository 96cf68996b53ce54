"""GPU investigation (not a benchmark): how a tuner's way of timing its trials decides how stable
its choices are (issue 18 item 3; docs/perf-notes.md v27).

Three ways, put in through the tuners' hooks and host paths (kernels/launch_tuner.py):

- ``device`` (the product's): a sleep kernel queued ahead of each timed trial's start event covers
  the host's call, so the interval holds the kernels alone (the product compares Triton against
  the CUDA launches on the longer of device and host time: the tuners' ``host_path``);
- ``wall`` (the product's before v27): no hold. On an idle device the start event fires at once and
  the interval also holds the host's time until the kernels start (10-50 us that jitter on the GPU
  hosts, against kernels of 20-300 us);
- ``max``: as ``device``, and every sample is the longer of that device time and the host's time
  in the call (a stream of such launches runs at the slower of the two).

For each point (the sweep's, by label) and each of ``--instances`` fresh models (weights at new
addresses, an unused allocation of random size ahead of them), every way tunes its own model
(choices forgotten first); in the forward phase, the first way's model then measures what each
candidate takes on it: the launch forced and replayed from a CUDA graph, timed interleaved (device
time). Printed: each instance's choices by way, the forced times, and per way how many distinct
choices the instances made.

Usage (GPU machine): PYTHONPATH=. python tools/choice_stability.py [--instances 5] [--points LABEL ...]
"""
import argparse
import collections
import random
import statistics

import torch

from recom_rec.bench.sweep import _DATA_TYPES, _choices, _forget_choices, _Ours, _step, make_kjt, points
from recom_rec.bench.timing import graph_replay, settle, time_interleaved
from recom_rec.kernels import launch_tuner, pooled_cuda, selection

# Points whose choices differed between the two sweeps of perf-notes v26 (call 10).
DEFAULT_POINTS = (
    ("16x100000 D=4 B=4096 ~50 ids fp32", "forward"),
    ("16x100000 D=16 B=4096 ~10 ids fp32", "forward"),
    ("16x100000 D=64 B=4096 ~10 ids fp32", "forward"),
    ("16x100000 D=512 B=4096 ~10 ids fp32", "forward"),
    ("16x100000 D=64 B=4096 ~10 ids fp16", "forward"),
    ("16x100000 D=17 B=4096 ~10 ids fp32", "forward"),
    ("16x100000 D=100 B=4096 ~10 ids fp32", "forward"),
    ("16x100000 D=32 B=4096 ~50 ids fp32", "sgd"),
    ("16x100000 D=64 B=4096 ~10 ids fp32 mean", "sgd"),
    ("16x100000 D=32 B=4096 ~10 ids fp32", "rowwise_adagrad"),
)
WAYS = ("wall", "device", "max")
TUNERS = (selection.FORWARD, pooled_cuda.FORWARD_ORDER_TUNER, pooled_cuda.BACKWARD_PATH_TUNER)


# The product's host paths (selection.FORWARD: Triton's own), restored after each tuning.
PRODUCT_HOST_PATHS = {tuner: tuner.host_path for tuner in TUNERS}


def _set_way(way):
    """``wall``: no hold, no host time counted (before v27); ``device``: the product's; ``max``: every
    candidate its own host path, so every comparison takes each trial's longer of device and host time."""
    for tuner in TUNERS:
        tuner._hold = (lambda device, ms: None) if way == "wall" else launch_tuner.hold_device
        tuner.host_path = {"wall": None, "max": lambda choice: choice}.get(way, PRODUCT_HOST_PATHS[tuner])


def tune(p, phase, device, tables, kjt, grad, way):
    _forget_choices()
    _set_way(way)
    peer = _Ours(p, device, None if phase == "forward" else phase, tables, "auto")
    step = _step(peer, kjt, grad, phase)
    runs = settle(step, device, warmup=1)
    _set_way("device")
    choices = _choices()
    if phase == "forward":
        choice = choices.get("forward", "?")
    else:
        choice = f"{choices.get('backward_path', '?')} | {choices.get('forward', '?')}"
    return peer, choice, runs


def forced_forward_ms(peer, kjt, device, iters):
    """Each forward candidate of this model, forced, as graph replays timed interleaved (ms)."""
    shape = next(iter(selection.FORWARD.decisions()), None)  # the model's one forward shape
    replays = {}
    for choice in selection._candidates(shape) if shape is not None else ():
        selection.force_forward(choice)
        replays[choice] = graph_replay(peer, kjt, device)
    selection.force_forward(None)
    samples = time_interleaved(replays, device, warmup=2, min_iters=iters, min_ms=20.0)
    return {c: statistics.median(t) for c, t in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--points", nargs="*", help="labels (forward phase), default: v26's differing choices")
    ap.add_argument("--ways", nargs="*", default=list(WAYS), choices=WAYS)
    args = ap.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), flush=True)
    wanted = [(label, "forward") for label in args.points] if args.points else list(DEFAULT_POINTS)
    by_label = {p.label(): p for p in points(False)}
    rng = random.Random(0)
    for label, phase in wanted:
        p = by_label[label]
        kjt = make_kjt(p, device)
        gen = torch.Generator(device=device).manual_seed(1)
        tables = [(torch.rand(p.rows, p.dim, generator=gen, device=device) - 0.5).to(_DATA_TYPES[p.dtype][1])
                  for _ in range(p.tables)]
        grad = torch.ones(p.batch, p.tables * p.dim, device=device)
        made = collections.defaultdict(list)
        print(f"== {label} {phase}", flush=True)
        for instance in range(args.instances):
            pad = torch.empty(rng.randrange(1, 64) << 20, dtype=torch.uint8, device=device)
            ways = args.ways[instance % len(args.ways):] + args.ways[:instance % len(args.ways)]
            line = []
            for way in ways:
                peer, choice, runs = tune(p, phase, device, tables, kjt, grad, way)
                made[way].append(choice)
                line.append(f"{way}: {choice} ({runs} runs)")
                if phase == "forward" and way == ways[0]:
                    forced = forced_forward_ms(peer, kjt, device, args.iters)
                    best = min(forced, key=forced.get)
                    line.append("forced ms: " + ", ".join(f"{c} {ms:.4f}" for c, ms in sorted(forced.items(),
                                                                                          key=lambda x: x[1]))
                                + f" (best {best})")
                del peer
                torch.cuda.synchronize(device)
            print(f"  instance {instance}: " + " | ".join(line), flush=True)
            del pad
        for way in args.ways:
            counts = collections.Counter(made[way])
            print(f"  {way}: {len(counts)} distinct: " + ", ".join(f"{c} x{n}" for c, n in counts.most_common()),
                  flush=True)
        del kjt, tables, grad
        _forget_choices()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
