"""python -m recom_rec.bench: recom_rec against its peers, one process, same inputs.

Prints a table (median ms, our speed-up over each peer, our forward bandwidth as a share of the
measured device-copy ceiling) and writes JSON and a PNG bar chart. Each peer is timed beside ours
in alternating rounds, and its ratio is to ours' median of the same rounds (_run_peers)."""
import argparse
import gc
import json
import os
import statistics
import sys

import torch
from tqdm import tqdm

from .peers import GROUP_PARAMETERS, PEERS, PINNED_BACKENDS, fbgemm_available, make_peer
from .report import format_table, plot_results
from .batch_sizes import DISTRIBUTIONS
from .timing import copy_bandwidth_gbs, graph_replay, time_beside, time_ms, time_second_half_ms
from .workloads import DEFAULT_WORKLOADS, DRAWN, WORKLOADS, get_workload

# forward: inference under no_grad. backward: forward + backward to dense gradients (fbgemm has
# no such mode and applies its fused SGD); ours also on the backward alone, against the byte
# floor. sgd / rowwise_adagrad: a whole training step of the embeddings - fused into the backward
# for recom_rec and fbgemm, dense gradients + torch.optim (torchrec's RowWiseAdagrad) for
# torchrec's module.
# forward-graph: the forward captured once in a CUDA graph and replayed (small-batch inference
# latency without launch overhead; needs a forward with no host syncs: validation off).
# inference: quantized tables (recom_rec/bench/inference.py), INT8 / INT4 / FP16 rows (--row-types),
# ours vs fbgemm's IntN TBE vs torchrec's quantized EBC, at the workload's batch and at batches
# 1, 16, 64 replayed from CUDA graphs; its own default workloads (dlrm-kaggle, many-500, many-4000).
PHASES = ("forward", "forward-graph", "backward", "sgd", "rowwise_adagrad", "inference", "cold")
FORWARD_PHASES = ("forward", "forward-graph", "backward")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m recom_rec.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=None,
                   choices=list(WORKLOADS) + ["ps", "random", "sequence", "serving", "sharded-dlrm", "sweep", "vbe"],
                   help="not in the default set: 'sweep', ours against fbgemm over a grid of table layouts "
                   "(recom_rec/bench/sweep.py; --warmup/--iters/--out apply); 'ps', a 1e8-row table in the parameter-server tier (see "
                   "--ps-urls); 'sharded-dlrm', a DLRM training step under DistributedModelParallel, ours vs "
                   "torchrec's sharder (see --worlds); 'sequence', a sequence model's unpooled lookups (recom_rec.EmbeddingCollection) "
                   "against fbgemm's TBE in PoolingMode.NONE and torchrec's EmbeddingCollection; 'vbe', a batch size per feature "
                   "against fbgemm's VBE TBE and torchrec's module; 'serving', a stream of inference requests of batch sizes 1-1024 "
                   "drawn with --seed, answered one at a time (latency p50/p99/p999, throughput, the first 100 requests), "
                   "float and INT8 (recom_rec/bench/serving.py; see --requests, --distributions); 'random', --random-count layouts drawn with --seed "
                   "(recom_rec/bench/random_layouts.py) and MLPerf DLRM-DCNv2's, then a quarter as many sequence and variable-batch layouts. Default: " + " ".join(DEFAULT_WORKLOADS) +
                   "; with --phases inference alone: dlrm-kaggle many-500 many-4000")
    p.add_argument("--row-types", nargs="+", default=["int8", "int4", "fp16"],
                   choices=["int8", "int4", "int2", "fp16"], help="row types of --phases inference")
    p.add_argument("--worlds", nargs="+", type=int, default=None,
                   help="process counts for 'sharded-dlrm' (one per GPU; default 1 and every GPU)")
    p.add_argument("--ps-urls", nargs="+", default=["memory://bench"],
                   help="stores for the 'ps' workload, e.g. memory://bench redis://127.0.0.1:6379/0; redis://local and "
                   "redis+cluster://local start a server / a 3-shard cluster on loopback for the run")
    p.add_argument("--peers", nargs="+", default=["recom_rec", "torchrec", "fbgemm", "fbgemm_unchecked"],
                   choices=list(PEERS) + list(PINNED_BACKENDS) + [GROUP_PARAMETERS],
                   help="fbgemm: its TBE with its default bounds check (as sharded torchrec trains; ours checks ids "
                   "inside its kernels); fbgemm_unchecked: without it; recom_rec:triton / recom_rec:cuda: ours "
                   "with that backend pinned, beside 'recom_rec' (--backend); recom_rec:group-params: ours with "
                   "group_parameters=True (one trainable Parameter a dtype group, for dense gradients)")
    p.add_argument("--batch-size", type=int, default=None, help="override every workload's batch size")
    p.add_argument("--phases", nargs="+", default=[p for p in PHASES if p not in ("forward-graph", "inference", "cold")],
                   choices=PHASES,
                   help="forward: inference under no_grad; backward: forward+backward to dense gradients "
                   "(fbgemm applies its fused SGD); sgd, rowwise_adagrad: forward+backward+optimizer "
                   "(fused for recom_rec and fbgemm); inference: quantized tables (see --row-types); cold: the "
                   "summed time of each peer's first 1, 10, 100 and --cold-calls calls (forward and fused SGD), "
                   "each peer in a fresh process")
    p.add_argument("--seed", type=int, default=None,
                   help="the 'random' workloads' and 'serving''s draws (default: a fresh one, printed)")
    p.add_argument("--random-count", type=int, default=8, help="layouts the 'random' workloads draw")
    p.add_argument("--random-kinds", nargs="+", default=["pooled", "sequence", "vbe"],
                   choices=["pooled", "sequence", "vbe"],
                   help="what 'random' draws: pooled layouts (--random-count and DLRM-DCNv2), sequence and "
                   "variable-batch layouts (a quarter as many each)")
    p.add_argument("--requests", type=int, default=3000, help="requests a batch-size distribution of 'serving' sends")
    p.add_argument("--distributions", nargs="+", default=None, choices=list(DISTRIBUTIONS),
                   help="the batch-size distributions of 'serving' (recom_rec/bench/batch_sizes.py; default: all)")
    p.add_argument("--cold-calls", type=int, default=1000, help="calls a peer makes in --phases cold")
    p.add_argument("--backend", default="auto", help="recom_rec backend: auto, triton, cuda or torch")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="scaled-down workloads (default on the CPU)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=12,
                   help="untimed runs first; on a GPU more follow while the product's tuners still measure a choice")
    p.add_argument("--min-ms", type=float, default=100.0,
                   help="sweep: time each peer at least this long (and --iters runs) per point and phase, ours and "
                   "fbgemm interleaved")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print how two sweep JSONs differ (choices, ratios) and exit: the run-to-run stability check")
    p.add_argument("--out", default="bench-results", help="file stem for the .json and .png outputs")
    return p.parse_args(argv)


def _tuners():
    """The measured choices: auto's forward kernels, the CUDA forward's launch order (a pinned
    backend), the CUDA backward's path."""
    from ..kernels.pooled_cuda import BACKWARD_PATH_TUNER, FORWARD_ORDER_TUNER
    from ..kernels.selection import FORWARD

    return {"forward_choice": FORWARD, "launch_order": FORWARD_ORDER_TUNER, "backward_path": BACKWARD_PATH_TUNER}


def _new_decisions(which: str) -> str:
    """What a tuner decided since the last call (one per group shape; measured during the warm-up
    and the first timed runs)."""
    return "+".join(_tuners()[which].decisions_since(_REPORTED_SHAPES.setdefault(which, set())).values())


_REPORTED_SHAPES: dict = {}


def _forget_launch_orders() -> None:
    from ..kernels.selection import forget_all

    forget_all()
    _REPORTED_SHAPES.clear()


class _Built:
    """A peer built for one optimizer's phases: its step per phase, and its rows (an error where it
    could not be built or a phase could not be made)."""

    def __init__(self, pname, w, kjt, device, optimizer, phases, args):
        self.name, self.peer, self.steps, self.out_of_memory = pname, None, {}, False
        self.rows = {p: {"workload": w.name, "peer": pname, "phase": p} for p in phases}
        fbgemm_opt = "sgd" if optimizer == "none" else optimizer  # fbgemm always fuses an optimizer
        try:
            self.peer = make_peer(pname, w, device, fbgemm_opt if pname.startswith("fbgemm") else optimizer,
                                  args.backend)
        # e.g. a peer that does not fit on the device
        except (AssertionError, RuntimeError, ValueError, torch.OutOfMemoryError) as e:
            for row in self.rows.values():
                row["error"] = str(e)[:200]
            self.out_of_memory = isinstance(e, torch.OutOfMemoryError)
            return
        peer, grad = self.peer, torch.ones(w.batch_size, self.peer.output_width, device=device)
        for phase in phases:
            if getattr(peer, "padded", False):
                self.rows[phase]["padded"] = True
            if phase == "forward":
                def step():
                    with torch.no_grad():
                        peer.forward(kjt)
            elif phase == "forward-graph":
                try:
                    step = graph_replay(peer, kjt, device)
                except Exception as e:  # noqa: BLE001 - a peer whose forward cannot be captured
                    self.rows[phase]["error"] = f"capture failed: {str(e)[:160]}"
                    continue
            else:
                def step(grad=grad):
                    peer.train_step(kjt, grad)
            self.steps[phase] = step
        self.grad = grad

    def free(self, device) -> None:
        self.peer = self.steps = self.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _run_peers(pnames, w, kjt, device, optimizer, phases, args, ceiling):
    """One optimizer's phases for every peer. Ours ("recom_rec") is built once and each other peer,
    built in turn, is timed beside it in alternating rounds (timing.time_interleaved): that peer's
    row keeps ours' median of the same rounds (``recom_rec_ms``), which its ratio divides by, so a
    drift of the host or device between the peers' timings does not enter a ratio. Two peers' tables
    are resident at a time; where they do not fit together, the other peer is timed alone
    (``timed_apart``: its ratio is to ours' median over its other rounds, or ours timed alone). Ours'
    own ``ms`` is its median over all those rounds."""
    def ours():
        return _Built("recom_rec", w, kjt, device, optimizer, phases, args)

    anchor = ours() if "recom_rec" in pnames else None
    ours_samples = {p: [] for p in phases}
    for pname in [p for p in pnames if p != "recom_rec"]:
        other = _Built(pname, w, kjt, device, optimizer, phases, args)
        beside = anchor
        if other.out_of_memory and anchor is not None:  # the two peers' tables do not fit together
            kept_rows = anchor.rows
            anchor.free(device)
            beside = None
            other = _Built(pname, w, kjt, device, optimizer, phases, args)
        for phase, step in other.steps.items():
            row = other.rows[phase]
            try:
                if beside is not None and phase in beside.steps:
                    samples = time_beside(row, beside.steps[phase], step, device, args.warmup, args.iters)
                    if not ours_samples[phase]:
                        _record_decisions(beside.rows[phase], phase, device)
                    ours_samples[phase] += samples
                else:
                    row["ms"] = time_ms(step, device, warmup=args.warmup, iters=args.iters)
                    row["timed_apart"] = anchor is not None
                if pname.startswith("recom_rec"):
                    _record_decisions(row, phase, device)
                _finish_row(row, other, w, kjt, phase, args, ceiling, device)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                row["error"] = str(e)[:200]
        rows = list(other.rows.values())
        step = None  # (the loop's last step holds its peer)
        other.free(device)
        if anchor is not None and beside is None:  # ours again, for the next peers and its own rows
            anchor = ours()
            if anchor.steps:
                anchor.rows = kept_rows
        yield from rows
    if anchor is None:
        return
    for phase, step in anchor.steps.items():
        row = anchor.rows[phase]
        try:
            if ours_samples[phase]:
                row["ms"] = statistics.median(ours_samples[phase])
            else:  # no other peer ran this phase
                row["ms"] = time_ms(step, device, warmup=args.warmup, iters=args.iters)
                _record_decisions(row, phase, device)
            _finish_row(row, anchor, w, kjt, phase, args, ceiling, device)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            row["error"] = str(e)[:200]
    rows = list(anchor.rows.values())
    anchor.free(device)
    yield from rows


def _record_decisions(row, phase, device) -> None:
    """The launches ours' tuners chose for this phase's shapes (measured while it settled)."""
    if device.type != "cuda":
        return
    if phase.startswith("forward"):
        row["launch_order"] = "+".join(filter(None, (_new_decisions("forward_choice"), _new_decisions("launch_order"))))
    else:
        row["backward_path"] = _new_decisions("backward_path")


def _finish_row(row, built, w, kjt, phase, args, ceiling, device) -> None:
    """What a row adds to its ms: the forward's bandwidth; for ours' dense backward, its floor and
    the backward alone beside it."""
    if phase in ("forward", "forward-graph"):
        row["gbs"] = w.lookup_bytes() / (row["ms"] * 1e-3) / 1e9
        row["ceiling_share"] = row["gbs"] / ceiling
    elif phase == "backward" and built.name.startswith("recom_rec"):  # dense gradients (fbgemm fuses SGD)
        peer, grad = built.peer, built.grad
        row["floor_ms"] = w.dense_gradient_bytes() / (ceiling * 1e9) * 1e3
        row["floor_x"] = row["ms"] / row["floor_ms"]
        # the floor counts the backward's bytes: the backward alone beside it, its forward untimed
        row["backward_only_ms"] = time_second_half_ms(lambda: peer.forward(kjt),
                                                      lambda out: peer.step_from(out, grad), device,
                                                      iters=args.iters)
        row["backward_only_floor_x"] = row["backward_only_ms"] / row["floor_ms"]


def run(args):
    device = torch.device(args.device)
    small = args.small or device.type == "cpu"
    ceiling = copy_bandwidth_gbs(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 26))
    results = []
    peers = [p for p in args.peers if not p.startswith("fbgemm") or fbgemm_available(device)]
    for wname in tqdm([w for w in args.workloads if w in WORKLOADS or w in DRAWN], desc="workloads", file=sys.stderr):
        if device.type == "cuda":
            _forget_launch_orders()  # zipf's model may be built where many-500's was: tune it afresh
        w = get_workload(wname, small)
        if args.batch_size:
            w.batch_size = args.batch_size
        kjt = w.make_input(device)
        # forward and backward share a peer without optimizer; each optimizer phase builds its own.
        plan = [("none", [p for p in args.phases if p in FORWARD_PHASES])]
        plan += [(p, [p]) for p in args.phases if p not in FORWARD_PHASES]
        for optimizer, phases in plan:
            if phases:
                results.extend(_run_peers(peers, w, kjt, device, optimizer, phases, args, ceiling))
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "copy_gbs": ceiling, "small": small, "backend": args.backend,
        "workloads": {n: get_workload(n, small).description for n in args.workloads if n in WORKLOADS or n in DRAWN},
    }
    return meta, results


def _run_inference(args):
    from .inference import INFERENCE_WORKLOADS, run_inference

    device = torch.device(args.device)
    small = args.small or device.type == "cpu"
    ceiling = copy_bandwidth_gbs(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 26))
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "copy_gbs": ceiling, "small": small, "backend": "quantized",
            "workloads": {n: get_workload(n, small).description for n in INFERENCE_WORKLOADS}}
    return meta, run_inference(args, device, ceiling, small)


def _draw_random(args) -> list:
    """Draws the 'random' workloads (``args.seed``; registered for this run under their names) in
    their place in ``args.workloads``; returns their names."""
    from .random_layouts import random_workloads

    small = args.small or args.device == "cpu"
    names = []
    for w in random_workloads(args.seed, args.random_count, small) if "pooled" in args.random_kinds else []:
        DRAWN[w.name] = w
        names.append(w.name)
    i = args.workloads.index("random")
    args.workloads[i:i + 1] = names
    return names


def _run_drawn_unpooled(args, meta: dict) -> list:
    """The sequence and variable-batch layouts drawn beside the pooled ones (issue 53): each against
    its peers (bench/sequence.py's, bench/vbe.py's), their tables and summaries."""
    from .random_layouts import random_unpooled_workloads, summarize
    from .sequence import format_sequence, run_sequence
    from .vbe import format_vbe, run_vbe

    device = torch.device(args.device)
    small = args.small or device.type == "cpu"
    sequences, vbes = random_unpooled_workloads(args.seed, args.random_count, small)
    sequences = sequences if "sequence" in args.random_kinds else []
    vbes = vbes if "vbe" in args.random_kinds else []
    for w in sequences + vbes:
        meta["workloads"][w.label()] = w.describe()
        print(f"{w.label()}: {w.describe()}", flush=True)
    narrow = dict(iters=args.iters, warmup=args.warmup, peers=args.peers, phases=args.phases)
    sequence_rows = run_sequence(device, small, drawn=sequences, **narrow) if sequences else []
    if sequence_rows:
        print(format_sequence(sequence_rows))
    vbe_rows = run_vbe(device, small, drawn=vbes, **narrow) if vbes else []
    if vbe_rows:
        print(format_vbe(vbe_rows))
    print(f"sequence and variable-batch layouts drawn with --seed {args.seed}")
    print(summarize(sequence_rows, [w.label() for w in sequences], ["fbgemm", "torchrec"], "random sequence layouts"))
    print(summarize(vbe_rows, [w.label() for w in vbes], ["fbgemm", "fbgemm+expand", "torchrec"],
                    "random variable-batch layouts"))
    return sequence_rows + vbe_rows


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        from .stability import compare_files

        print(compare_files(*args.compare))
        return
    if "inference" in args.phases:
        from .inference import INFERENCE_PEERS

        args.phases = [p for p in args.phases if p != "inference"]
        meta, results = _run_inference(args)
        print(format_table(meta, results, [p for p in args.peers if p in INFERENCE_PEERS]))
        agree = sorted({f"{r['workload']} {r['phase'].split()[0]}: {r['agree']}" for r in results if "agree" in r})
        print("ours vs torchrec's quantized EBC, largest difference (bits = identical): " + ", ".join(agree))
        stem = args.out + ("-inference" if args.phases else "")
        os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        plot_results(results, stem + ".png", meta)
        print(f"wrote {stem}.json and {stem}.png")
        if not args.phases:
            return
    if args.workloads is None:
        args.workloads = list(DEFAULT_WORKLOADS)
    drawn = []
    if args.seed is None and ("random" in args.workloads or "serving" in args.workloads):
        args.seed = int.from_bytes(os.urandom(4), "little")
    if "serving" in args.workloads:
        print(f"serving: batch sizes drawn with --seed {args.seed}", flush=True)  # before a run that may fail
    random_unpooled = "random" in args.workloads and bool({"sequence", "vbe"} & set(args.random_kinds))
    if "random" in args.workloads:
        drawn = _draw_random(args)
    if "cold" in args.phases:
        from .cold import format_cold, run_cold, summarize_cold

        device = torch.device(args.device)
        cold_rows = run_cold([w for w in args.workloads if w in WORKLOADS or w in DRAWN], args.peers,
                             ["forward", "sgd"], device, args.small or device.type == "cpu", args.cold_calls,
                             args.backend, draw=(args.seed, args.random_count) if drawn else None)
        print(format_cold(cold_rows))
        if drawn:
            print(f"random layouts drawn with --seed {args.seed}")
            print(summarize_cold(cold_rows, drawn, [p for p in args.peers if p != "recom_rec"]))
        stem = args.out + "-cold"
        os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump({"results": cold_rows}, f, indent=1)
        args.phases = [p for p in args.phases if p != "cold"]
        if not args.phases:
            return
    if "sweep" in args.workloads:
        from .sweep import main_sweep

        device = torch.device(args.device)
        ceiling = copy_bandwidth_gbs(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 26))
        main_sweep(args, device, ceiling)
        args.workloads = [w for w in args.workloads if w != "sweep"]
        if not args.workloads:
            return
        args.out += "-workloads"
    meta, results = run(args)
    if results:
        print(format_table(meta, results, args.peers))
    if drawn:
        from .random_layouts import summarize

        meta["seed"] = args.seed
        print(f"random layouts drawn with --seed {args.seed}")
        print(summarize(results, drawn, [p for p in args.peers if p != "recom_rec"]))
    if random_unpooled:
        meta["seed"] = args.seed
        results = results + _run_drawn_unpooled(args, meta)
    if "ps" in args.workloads:
        from .ps_workload import format_ps, run_ps_workload

        ps_results = run_ps_workload(torch.device(args.device), args.ps_urls, args.small or args.device == "cpu")
        print(format_ps(ps_results))
        results = results + ps_results
    if "sequence" in args.workloads:
        from .sequence import format_sequence, run_sequence

        sequence_rows = run_sequence(torch.device(args.device), args.small or args.device == "cpu",
                                     iters=args.iters, warmup=args.warmup)
        print(format_sequence(sequence_rows))
        results = results + sequence_rows
    if "vbe" in args.workloads:
        from .vbe import format_vbe, run_vbe

        vbe_rows = run_vbe(torch.device(args.device), args.small or args.device == "cpu", iters=args.iters,
                           warmup=args.warmup)
        print(format_vbe(vbe_rows))
        results = results + vbe_rows
    if "serving" in args.workloads:
        from .serving import format_serving, run_serving

        device = torch.device(args.device)
        serving_rows = run_serving(device, args.small or device.type == "cpu", args.seed, args.requests,
                                   args.distributions, args.peers, args.backend)
        print(format_serving(serving_rows))
        meta["seed"] = args.seed
        results = results + serving_rows
    if "sharded-dlrm" in args.workloads:
        from .sharded_dlrm import default_worlds, format_sharded, run_sharded_dlrm

        small = args.small or args.device == "cpu"
        dlrm_rows = run_sharded_dlrm(args.worlds or default_worlds(small), small, iters=args.iters,
                                     warmup=args.warmup)
        print(format_sharded(dlrm_rows))
        results = results + dlrm_rows
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    plot_results(results, args.out + ".png", meta)
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
