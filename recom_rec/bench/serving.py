"""The ``serving`` workload: a stream of inference requests of varying batch size, answered one at a
time as a server answers them, each peer on the same stream (issue 51).

Requests: batch sizes drawn from the distributions of batch_sizes.py (log-uniform 1-1024, a long
tail of mostly small requests with rare ones up to 1024, a bimodal one), ``--requests`` of them a
distribution, from ``--seed`` (default: a fresh one, printed). Each request is a KJT over the
serving layout (workloads.serving_layout: 40 tables of 1e5-1e7 rows, 15 GiB fp32, dims 16-128,
1-50 uniform ids a bag; ``--small``: the same draw scaled down for the CPU); the same requests,
same ids, go to every peer.

Peers, float (fp32 rows, the same weights, eval, no_grad): ours (recom_rec.EmbeddingBagCollection),
fbgemm's TBE as the other benches build it (peers.py, its default bounds check), torchrec's
EmbeddingBagCollection. INT8 rows (the same rows, built by inference.build_peers): ours
(recom_rec.quant.EmbeddingBagCollection), fbgemm's IntN inference TBE (torchrec's own, called
directly; its request includes casting the ids to int32 on a GPU, as torchrec's module does),
torchrec's quantized EmbeddingBagCollection.

Timing: every peer of a distribution and precision is built fresh, then the peers answer the stream
one request after another, taking turns a block of STREAM_BLOCK requests at a time (``answer_streams``:
a drift of the machine's speed falls on all of them alike): the request is copied to the device
(untimed), then timed on the host's clock from the call to the end of ``torch.cuda.synchronize()``
(a server returns each answer). Ours' measured choices are forgotten before the stream, so it tunes
as a new model does; before the first stream every peer answers a few requests untimed, so that no
peer pays the process's first CUDA calls and compilations for the others (a fresh process's first
calls: ``--phases cold``). Per peer: the summed latency of its first 100 requests (cold start), then,
excluding a warm-up of min(200, a quarter of the stream), the latency's p50 / p99 / p999 and the
throughput over the steady state's summed latencies (requests/s, samples/s). After the stream, each
peer answers a sample of the requests again (the largest among them) and its outputs are checked
against ours (float: allclose at 1e-5; INT8: at 1e-4, the soak's tolerance); a mismatch stops the run.
"""
import contextlib
import gc
import sys
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from tqdm import tqdm

from .batch_sizes import DISTRIBUTIONS, draw_batch_sizes
from .workloads import Workload, serving_layout

SERVING_PEERS = ("recom_rec", "fbgemm", "torchrec")
PRECISIONS = ("float", "int8")
WARMUP_REQUESTS = 200  # the most requests left out of the steady state (and at most a quarter of them)
COLD_REQUESTS = 100  # issue 51's first calls
STREAM_BLOCK = COLD_REQUESTS  # the requests a peer answers before the next peer's turn (answer_streams)
CHECKED_REQUESTS = 8  # requests whose outputs are compared between peers, the largest among them
PROCESS_WARMUP_BATCHES = (1, 3, 64, 1024)  # the untimed first requests of every peer, once a process
TOLERANCE = {"float": 1e-5, "int8": 1e-4}  # rtol and atol against ours (tools/soak.py's)


class OutputMismatch(RuntimeError):
    """A peer's output differs from ours on a request of the stream."""


def summarize(latencies_ms: Sequence[float], batch_sizes: Sequence[int], warmup: int,
              cold: int = COLD_REQUESTS) -> Dict[str, float]:
    """The serving numbers of one peer's stream: the summed ms of its first ``cold`` requests;
    p50 / p99 / p999 (numpy's linear interpolation) and mean of the requests after the first
    ``warmup``; their throughput, requests and samples per second of summed latency."""
    lat = np.asarray(latencies_ms, dtype=np.float64)
    steady, samples = lat[warmup:], np.asarray(batch_sizes[warmup:], dtype=np.int64)
    busy_s = steady.sum() / 1e3
    p50, p99, p999 = np.percentile(steady, [50, 99, 99.9])
    return {"p50_ms": float(p50), "p99_ms": float(p99), "p999_ms": float(p999), "mean_ms": float(steady.mean()),
            "requests_per_s": len(steady) / busy_s, "samples_per_s": float(samples.sum()) / busy_s,
            f"first_{cold}_ms": float(lat[:cold].sum()), "steady_requests": len(steady), "warmup_requests": warmup}


def warmup_requests(n: int) -> int:
    return min(WARMUP_REQUESTS, n // 4)


def checked_requests(batch_sizes: Sequence[int]) -> List[int]:
    """The requests whose outputs are compared: evenly spaced over the stream, and the largest."""
    n = len(batch_sizes)
    spaced = np.linspace(0, n - 1, min(n, CHECKED_REQUESTS - 1)).astype(int).tolist()
    return sorted(set(spaced) | {int(np.argmax(batch_sizes))})


def draw_stream(layout: Workload, distribution: str, seed: int, requests: int) -> Tuple[List[int], list]:
    """The batch sizes of a distribution's stream and its requests: a KJT each, on the host (each
    goes to the device as it arrives), fixed-length bags of uniform ids as the layout's make_input
    draws them. The draw depends on ``seed`` and the distribution's place in DISTRIBUTIONS alone,
    so a run of a subset of the distributions draws the same streams."""
    rng = np.random.default_rng([seed, list(DISTRIBUTIONS).index(distribution)])
    sizes = draw_batch_sizes(distribution, rng, requests).tolist()
    stream = [replace(layout, batch_size=b).make_input(torch.device("cpu"), seed=int(rng.integers(1 << 62)))
              for b in sizes]
    return sizes, stream


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _answer(forward: Callable, requests: list, device: torch.device, times: List[float],
            after_each: Optional[Callable[[int], None]] = None) -> None:
    with torch.no_grad():
        for kjt in requests:
            request = kjt.to(device)
            _sync(device)
            start = time.perf_counter()
            forward(request)
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
            if after_each is not None:
                after_each(len(times) - 1)


@contextlib.contextmanager
def _no_collection():
    """No garbage collection inside a request: it would land on whichever peer's request made the
    garbage. Collected once ahead instead."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def answer_stream(forward: Callable, requests: list, device: torch.device,
                  after_each: Optional[Callable[[int], None]] = None) -> List[float]:
    """Each request's latency (ms): from the call to its result on the host (synchronised).
    ``after_each(i)`` runs after request i's latency is taken (a tool's look at the tuners)."""
    times: List[float] = []
    with _no_collection():
        _answer(forward, requests, device, times, after_each)
    return times


def answer_streams(forwards: Dict[str, Callable], requests: list, device: torch.device,
                   block: int = STREAM_BLOCK) -> Dict[str, List[float]]:
    """Every peer's latencies (``answer_stream``) on the same requests, the peers taking turns
    ``block`` requests at a time, their order reversed every round (A B C, C B A, A B C, ...): a
    drift of the host's or the device's speed over the seconds a stream takes then falls on every
    peer alike, not on whichever peer's stream ran through it (v68: three runs on one machine put
    ours' float p50 at 0.19-0.41 ms and fbgemm's at 0.21-0.55 ms, their ratio at 0.60-1.57x, each
    peer having answered its whole stream alone)."""
    names = list(forwards)
    times: Dict[str, List[float]] = {name: [] for name in names}
    with _no_collection():
        for k, first in enumerate(range(0, len(requests), block)):
            for name in names if k % 2 == 0 else names[::-1]:
                _answer(forwards[name], requests[first:first + block], device, times[name])
    return times


def float_peers(layout: Workload, device: torch.device, wanted: Sequence[str], backend: str) -> Dict[str, Callable]:
    """Forwards of the float peers on torchrec's module's weights (drawn from seed 0)."""
    from .peers import make_peer

    torch.manual_seed(0)
    theirs = make_peer("torchrec", layout, device, "none")
    peers: Dict[str, Callable] = {}
    if "recom_rec" in wanted:
        ours = make_peer("recom_rec", layout, device, "none", backend)
        ours.load(theirs.tables())
        ours.module.eval()
        peers["recom_rec"] = ours.forward
    if "fbgemm" in wanted:
        fbgemm = make_peer("fbgemm", layout, device, "sgd")  # (its optimizer is never stepped here)
        fbgemm.load(theirs.tables())
        fbgemm.tbe.eval()
        peers["fbgemm"] = fbgemm.forward
    if "torchrec" in wanted:
        theirs.module.eval()
        peers["torchrec"] = theirs.forward
    return peers


def int8_peers(layout: Workload, device: torch.device, wanted: Sequence[str], backend: str) -> Dict[str, Callable]:
    """Forwards of the INT8 peers, on the same rows (inference.build_peers)."""
    from torchrec.modules.embedding_configs import DataType

    from .inference import build_peers

    return {name: peer.forward for name, peer in build_peers(layout, DataType.INT8, device, wanted).items()}


BUILDERS = {"float": float_peers, "int8": int8_peers}


def _forget_choices(device: torch.device) -> None:
    if device.type == "cuda":
        from ..kernels.selection import forget_all

        forget_all()


def _trial_launches(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    from ..kernels.selection import trial_launches

    return trial_launches()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_process(layout: Workload, device: torch.device, wanted: Sequence[str], backend: str) -> None:
    """Every peer answers PROCESS_WARMUP_BATCHES untimed, once a process: the CUDA context, the
    libraries' lazy loading and the compilations are then paid before any peer's timed stream."""
    with torch.no_grad():
        for build in BUILDERS.values():
            forwards = build(layout, device, wanted, backend)
            for b in PROCESS_WARMUP_BATCHES:
                kjt = replace(layout, batch_size=b).make_input(device, seed=b)
                for forward in forwards.values():
                    forward(kjt)
            _sync(device)
            del forwards, forward  # (the loop's name holds a peer too) freed before the next precision's are built
            _free(device)
    _forget_choices(device)


def compare_outputs(outputs: Dict[str, List[torch.Tensor]], tolerance: float, where: str) -> Dict[str, float]:
    """Each peer's largest difference from ours over the checked requests; raises OutputMismatch
    when one is not allclose at ``tolerance`` (rtol and atol)."""
    ours = outputs["recom_rec"]
    diffs, bad = {}, []
    for name, theirs in outputs.items():
        if name == "recom_rec":
            continue
        diffs[name] = max(float("inf") if a.shape != b.shape else float((a - b).abs().max()) if a.numel() else 0.0
                          for a, b in zip(ours, theirs))
        if not all(a.shape == b.shape and torch.allclose(a, b, rtol=tolerance, atol=tolerance)
                   for a, b in zip(ours, theirs)):
            bad.append(f"{name} (largest difference {diffs[name]:.3g})")
    if bad:
        raise OutputMismatch(f"serving {where}: outputs differ from ours beyond {tolerance:g}: {', '.join(bad)}")
    return diffs


def run_serving(device: torch.device, small: bool, seed: int, requests: int,
                distributions: Optional[Sequence[str]] = None, peers: Sequence[str] = SERVING_PEERS,
                backend: str = "auto") -> List[Dict]:
    """A row per distribution, precision and peer: its stream's summary (``summarize``), ``ms`` its
    p50 (the chart's), ``max_diff`` its largest difference from ours on the checked requests."""
    from .peers import fbgemm_available

    layout = serving_layout(small)
    wanted = [p for p in SERVING_PEERS if (p == "recom_rec" or p in peers)
              and (p != "fbgemm" or fbgemm_available(device))]
    names = list(distributions or DISTRIBUTIONS)
    warm_process(layout, device, wanted, backend)
    rows: List[Dict] = []
    for name in tqdm(names, desc="serving distributions", file=sys.stderr):
        sizes, stream = draw_stream(layout, name, seed, requests)
        checked = checked_requests(sizes)
        warmup = warmup_requests(requests)
        for precision in PRECISIONS:
            forwards = BUILDERS[precision](layout, device, wanted, backend)
            outputs: Dict[str, List[torch.Tensor]] = {}
            found = []
            _forget_choices(device)  # ours tunes as a new model does
            trials = _trial_launches(device)
            latencies = answer_streams(forwards, stream, device)
            for peer, forward in forwards.items():
                row = {"workload": f"serving {name}", "distribution": name, "phase": precision, "peer": peer,
                       "seed": seed, "requests": requests, "samples": int(sum(sizes)),
                       **summarize(latencies[peer], sizes, warmup)}
                row["ms"] = row["p50_ms"]
                if device.type == "cuda" and peer == "recom_rec":
                    # launches of undecided shapes over the stream: the tuners' trials, paid by requests
                    # (only ours' modules launch through the tuners)
                    row["trial_launches"] = _trial_launches(device) - trials
                with torch.no_grad():
                    outputs[peer] = [forward(stream[i].to(device)).float().cpu() for i in checked]
                found.append(row)
            diffs = compare_outputs(outputs, TOLERANCE[precision], f"{name} {precision}")
            for row in found:
                if row["peer"] in diffs:
                    row["max_diff"] = diffs[row["peer"]]
            rows += found
            del forwards, forward, outputs
            _free(device)
        del stream
    return rows


def format_serving(rows: List[Dict]) -> str:
    """A line per distribution, precision and peer; beside each other peer's number, ours' speed-up
    over it in () (its latency over ours; our throughput over its)."""
    lines = ["serving: request latency in ms (synchronised, one request at a time; steady state after the "
             "warm-up), throughput over the steady state, first-100: the first 100 requests' summed ms; "
             "(x): ours' speed-up over that peer in this run"]
    if rows:
        lines.append(f"batch sizes drawn with --seed {rows[0]['seed']}, {rows[0]['requests']} requests a "
                     f"distribution, the first {rows[0]['warmup_requests']} left out of the steady state")
    latency = ("p50_ms", "p99_ms", "p999_ms", f"first_{COLD_REQUESTS}_ms")
    rates = ("requests_per_s", "samples_per_s")
    head = ["distribution", "precision", "peer", "p50", "p99", "p999", "first-100", "req/s", "samples/s", "max diff"]
    table = []
    by = {(r["distribution"], r["phase"], r["peer"]): r for r in rows}
    for (dist, phase, peer), r in by.items():
        ours = by.get((dist, phase, "recom_rec"))
        cells = [dist, phase, peer]
        for key in latency + rates:
            ratio = ""
            if peer != "recom_rec" and ours:
                x = r[key] / ours[key] if key in latency else ours[key] / r[key]
                ratio = f" ({x:.2f}x)"
            cells.append(f"{r[key]:.3f}{ratio}" if key in latency else f"{r[key]:.0f}{ratio}")
        cells.append(f"{r['max_diff']:.1e}" if "max_diff" in r else "-")
        table.append(cells)
    widths = [max(len(c) for c in col) for col in zip(head, *table)]
    lines.append("  ".join(f"{h:<{w}}" for h, w in zip(head, widths)))
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)) for cells in table]
    trials = [f"{r['distribution']} {r['phase']} {r['trial_launches']}" for r in rows if "trial_launches" in r]
    if trials:
        lines.append("ours' launches of shapes still on trial over the stream: " + ", ".join(trials))
    return "\n".join(lines)
