"""Timing: medians of many runs after a warm-up that lets the product's tuners decide; CUDA events
on the GPU, perf_counter on the CPU. Peers compared with each other are timed interleaved."""
import gc
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

# Warm-up runs beyond ``warmup`` while the product's tuners still have a shape on trial: a forward
# of up to 7 candidates (6 CUDA launches and Triton) takes up to 7 x 31 launches when unclear, and a
# training step adds the backward path's.
MAX_SETTLE_RUNS = 400


def _timed_run(fn: Callable[[], object], device: torch.device) -> float:
    """One run of ``fn`` in ms. On a GPU, the span between events recorded before and after it: work
    queued earlier is outside it (time_ms's runs start on an idle device)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def settle(fn: Callable[[], object], device: torch.device, warmup: int,
           any_rank: Optional[Callable[[bool], bool]] = None) -> int:
    """Runs ``fn`` ``warmup`` times, then on a GPU until a run launches nothing on trial (the trials
    unpaced: launch_tuner.unpaced_trials): every shape it runs has its measured choice
    (kernels/selection.trial_launches), so no timed run is a tuner's trial of a slower candidate. Waits for each run there, so the trials' timing events
    have finished when the next run's launches look at them. ``any_rank(flag)``: in a distributed
    step, whether any process's flag is set (an all-reduce), so that every process goes on while
    one still has trials and all run as many steps (their collectives pair up). Returns the number
    of runs."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return warmup
    from ..kernels.launch_tuner import unpaced_trials
    from ..kernels.selection import trial_launches

    with unpaced_trials():  # (a warm-up tunes: the trials back to back, as recom_rec.tune runs them)
        for extra in range(1, MAX_SETTLE_RUNS + 1):
            before = trial_launches()
            fn()
            torch.cuda.synchronize(device)
            on_trial = trial_launches() != before
            if not (any_rank(on_trial) if any_rank else on_trial):
                break
    return warmup + extra


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 5, iters: int = 50,
            any_rank: Optional[Callable[[bool], bool]] = None) -> float:
    """The median of ``iters`` timed runs after ``settle``."""
    settle(fn, device, warmup, any_rank)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(_timed_run(fn, device) for _ in range(iters))


def time_second_half_ms(first: Callable[[], object], second: Callable[[object], object], device: torch.device,
                        iters: int = 50) -> float:
    """The median time of ``second(first())`` counting ``second`` alone, ``first`` run untimed before each
    (on a GPU its kernels are queued ahead of the start event, so they are outside the span), e.g. a
    training step's backward without its forward. Warm the steps up with ``time_ms`` first."""
    times = []
    for _ in range(iters):
        x = first()
        times.append(_timed_run(lambda: second(x), device))
        del x
    return statistics.median(times)


def time_interleaved(steps: Dict[str, Callable[[], object]], device: torch.device, warmup: int = 5,
                     min_iters: int = 20, min_ms: float = 50.0, block: int = 4,
                     max_iters: int = 4000) -> Dict[str, List[float]]:
    """Timed samples (ms) of each step, taken in rounds that visit the steps in order, then reversed
    (A B B A, repeated): a drift of the device or host over the rounds (clocks, other processes)
    falls on every step alike, which back-to-back blocks of one step then the other do not give.
    A visit is one untimed run (the other steps left their data in the caches), then timed runs:
    ``block`` (at most ``min_iters``) and at least a quarter of ``min_ms``. Rounds go on until every
    step has ``min_iters`` samples summing to ``min_ms`` at least (time-bound, so that a 0.1 ms
    step gets hundreds of samples and its median is steady), ending on a whole A B B A pair, or
    until a step has ``max_iters``. Each step is first ``settle``d. Python's garbage collector is
    off while the rounds run (a collection inside a host-bound step's timing is a slow sample
    that falls on whichever step made the garbage)."""
    for fn in steps.values():
        settle(fn, device, warmup)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _rounds(steps, device, min_iters, min_ms, block, max_iters)
    finally:
        if was_enabled:
            gc.enable()


def time_beside(row: Dict[str, object], ours: Callable[[], object], theirs: Callable[[], object],
                device: torch.device, warmup: int, iters: int) -> List[float]:
    """A peer's step timed beside ours in alternating rounds (``time_interleaved``): its median in
    ``row["ms"]``, ours' median of the same rounds in ``row["recom_rec_ms"]`` (its ratio's
    denominator). Returns ours' samples."""
    samples = time_interleaved({"recom_rec": ours, "peer": theirs}, device, warmup=warmup, min_iters=iters)
    row["ms"] = statistics.median(samples["peer"])
    row["recom_rec_ms"] = statistics.median(samples["recom_rec"])
    return samples["recom_rec"]


def _rounds(steps: Dict[str, Callable[[], object]], device: torch.device, min_iters: int, min_ms: float,
            block: int, max_iters: int) -> Dict[str, List[float]]:
    names = list(steps)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    visit_runs, visit_ms = max(1, min(block, min_iters)), min_ms / 4

    def enough() -> bool:
        return (all(len(s) >= min_iters and sum(s) >= min_ms for s in samples.values())
                or any(len(s) >= max_iters for s in samples.values()))

    rounds = 0
    while rounds % 2 or not enough():
        for name in (names if rounds % 2 == 0 else names[::-1]):
            steps[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            visit: List[float] = []
            while (len(visit) < visit_runs or sum(visit) < visit_ms) and len(samples[name]) + len(visit) < max_iters:
                visit.append(_timed_run(steps[name], device))
            samples[name] += visit
        rounds += 1
    return samples


def graph_replay(peer, kjt, device: torch.device) -> Callable[[], None]:
    """Captures ``peer.forward(kjt)`` in a CUDA graph; returns its replay: the forward's device time
    without the host's (its Python and launches), which a run from an idle device also counts."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        # Warm up outside the graph: Triton compiles, caches fill, and the forward's choices are
        # measured (until a run launches nothing on trial) so the graph captures the decided
        # choices rather than the defaults.
        settle(lambda: peer.forward(kjt), device, warmup=1)
        stream.synchronize()
        for _ in range(2):
            peer.forward(kjt)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        peer.forward(kjt)
    return graph.replay


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate, bytes read + written per second: the ceiling of a gather."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, iters=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def phase_step(peer, kjt, phase: str, comparable: Callable,
               reference: Optional[torch.Tensor]) -> Tuple[Callable[[], None], bool, Optional[torch.Tensor]]:
    """A peer's step for ``phase``: ``forward`` (under no_grad) or a training step
    (``peer.train_step``). A forward's output, as ``comparable(output)`` makes it, is compared with
    ``reference`` (the first peer's; this one's where None). Returns the step, whether the output
    equalled the reference (True for a training step) and the reference for the next peers."""
    if phase != "forward":
        return (lambda: peer.train_step(kjt)), True, reference
    with torch.no_grad():
        out = comparable(peer.forward(kjt))
        reference = out if reference is None else reference
        identical = bool(torch.equal(out, reference))
        del out

    def step():
        with torch.no_grad():
            peer.forward(kjt)
    return step, identical, reference


def time_beside_ours(names: List[str], make: Callable[[str], object], kjt, phase: str, device: torch.device,
                     warmup: int, iters: int, comparable: Callable[[str, object], Callable],
                     row: Dict[str, object], annotate: Optional[Callable[[str, object, Dict], None]] = None,
                     ) -> List[Dict[str, object]]:
    """One phase of a workload for each peer in ``names`` (ours, "recom_rec", first): ours is built
    (``make(name)``), then each other peer in turn, timed beside ours in alternating rounds
    (``time_interleaved``); its row keeps ours' median of the same rounds (``recom_rec_ms``), which
    its ratio divides by. Two peers are resident at a time. A forward's output
    (``comparable(name, peer)(output)``) is compared with ours (``identical``). Each row starts as a
    copy of ``row``; ``annotate(name, peer, row)`` adds a peer's own fields. A peer that cannot be
    built or run gives an ``error`` row."""
    errors = (RuntimeError, ValueError, torch.OutOfMemoryError)
    ours_row: Dict[str, object] = dict(row, peer=names[0])
    ours_step, reference, ours_samples = None, None, []
    try:
        ours = make(names[0])
        ours_step, ours_row["identical"], reference = phase_step(ours, kjt, phase, comparable(names[0], ours), None)
    except errors as e:
        ours_row["error"] = str(e)[:200]
    rows = [ours_row]
    for name in names[1:]:
        other_row: Dict[str, object] = dict(row, peer=name)
        try:
            peer = make(name)
            step, other_row["identical"], reference = phase_step(peer, kjt, phase, comparable(name, peer), reference)
            if ours_step is not None:
                ours_samples += time_beside(other_row, ours_step, step, device, warmup, iters)
            else:
                other_row["ms"] = time_ms(step, device, warmup=warmup, iters=iters)
            if annotate:
                annotate(name, peer, other_row)
        except errors as e:
            other_row["error"] = str(e)[:200]
        rows.append(other_row)
        peer = step = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if ours_step is not None:
        try:
            ours_row["ms"] = (statistics.median(ours_samples) if ours_samples
                              else time_ms(ours_step, device, warmup=warmup, iters=iters))
            if annotate:
                annotate(names[0], ours, ours_row)
        except errors as e:
            ours_row["error"] = str(e)[:200]
    for r in rows:
        if phase != "forward":
            r.pop("identical", None)
    return rows
