"""Picks the faster of two equivalent launches per launch shape, by measuring them: the CUDA
forward kernel's launch order, and the CUDA backward's path (pooled_cuda.BACKWARD_PATH_TUNER:
rows of one lookup through the pieces or through their own kernel).

The forward kernel runs feature-major (every feature's first bags at once) or bag-major (one
feature's bags at once, its repeated rows staying in L2); both give bit-identical results, only
block scheduling differs. Neither wins everywhere (H100: feature-major on dlrm-kaggle and
many-500/1000, bag-major on mixed and zipf) and zipf's win depends on the id distribution, so no
rule on the shape decides: the first launches of each shape run each order once untimed, then
alternate the two orders in A B B A order timed with CUDA events, and the shape keeps the order of
the smaller median.

The host never waits for a timing: events are read with ``query()`` on later launches, and a shape
stays undecided (running feature-major, untimed) until its samples have finished. While a stream
is capturing a CUDA graph nothing is recorded or queried (a timing event would become part of the
graph, and the capture must stay free of host-side CUDA calls); the capture gets the shape's
decided order, or feature-major.

Tests and tools force one choice with :meth:`LaunchOrderTuner.force` (the product always measures).
"""
import statistics
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, TypeVar

import torch

FEATURE_MAJOR = False  # the extension's ``bag_major`` flag
BAG_MAJOR = True
ORDER_NAMES = {FEATURE_MAJOR: "features", BAG_MAJOR: "bags"}
DEFAULT_ORDER = FEATURE_MAJOR  # what an undecided shape runs untimed (and in a graph capture)
MAX_BAG_MAJOR_FEATURES = 65535  # bag-major puts the features on the grid's y axis
TRIALS = 4  # finished samples per order before a shape is decided (median: outliers are ignored)

Result = TypeVar("Result")


class ForwardLaunchShape(NamedTuple):
    """What a forward launch's timing depends on, as the tuner's key. The lookup count is rounded
    up to a power of two so that batches of varying lengths share a decision. The weight buffer's
    address stands for the model: two models of one shape (uniform and Zipf ids) tune apart."""
    weights_at: int
    num_features: int
    batch_size: int
    total_dim: int
    max_dim: int
    lookups_bucket: int
    weight_dtype: torch.dtype
    index_dtype: torch.dtype
    weighted: bool

    @classmethod
    def of(cls, flat, values, per_sample_weights, feature_meta, batch_size, total_dim, max_dim):
        lookups = values.numel()
        return cls(flat.data_ptr(), feature_meta.shape[0], batch_size, total_dim, max_dim, 1 << max(lookups - 1, 0).bit_length(),
                   flat.dtype, values.dtype, per_sample_weights is not None)


def _orders_for(shape) -> Tuple[bool, ...]:
    return (FEATURE_MAJOR, BAG_MAJOR) if shape.num_features <= MAX_BAG_MAJOR_FEATURES else (FEATURE_MAJOR,)


def record_timing_event(device: torch.device):
    """A timing event recorded now on ``device``'s current stream (the one the extension launches on)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def stream_is_capturing(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def parse_forced_order(value: Optional[str], names: Dict[bool, str] = ORDER_NAMES) -> Optional[bool]:
    """The choice named ``value`` (one of ``names``' values), or None to measure (None or "auto")."""
    if value is None or value in ("", "auto"):
        return None
    for order, name in names.items():
        if value == name:
            return order
    choices = [repr(name) for name in names.values()]
    raise ValueError(f"the choice must be 'auto', {', '.join(choices[:-1])} or {choices[-1]} (got {value!r})")


def trial_plan(candidates: Tuple[bool, ...], trials: int) -> List[Tuple[bool, bool]]:
    """The (order, timed) launches that decide a shape: each candidate once untimed (a first launch
    runs on cold caches and clocks), then ``trials`` timed launches of each in A B B A order, so
    that a drift over the trials (clocks ramping up, caches warming) favours neither order."""
    plan = [(order, False) for order in candidates]
    for k in range(trials):
        plan += [(order, True) for order in (candidates if k % 2 == 0 else candidates[::-1])]
    return plan


@dataclass
class _ShapeTrials:
    """An undecided shape's launches: the plan, finished samples (ms) and those still in flight."""
    candidates: Tuple[bool, ...]
    plan: List[Tuple[bool, bool]] = field(default_factory=list)
    planned: int = 0  # launches of the plan made so far
    samples: Dict[bool, List[float]] = field(default_factory=dict)
    in_flight: List[Tuple[bool, object, object]] = field(default_factory=list)  # (order, start, end)

    def collect_finished(self) -> None:
        still_running = []
        for order, start, end in self.in_flight:
            if end.query():  # non-blocking; the end finished so the start (earlier, same stream) did
                self.samples.setdefault(order, []).append(start.elapsed_time(end))
            else:
                still_running.append((order, start, end))
        self.in_flight = still_running

    def faster_order(self, trials: int) -> Optional[bool]:
        """The order of the smaller median once every candidate has ``trials`` samples, else None
        (a tie keeps the first candidate, feature-major)."""
        if any(len(self.samples.get(order, ())) < trials for order in self.candidates):
            return None
        return min(self.candidates, key=lambda order: statistics.median(self.samples[order]))


class LaunchOrderTuner:
    """Per ``ForwardLaunchShape``, the launch order (the extension's ``bag_major`` flag) that
    measured faster; or, with other ``names``, any two launches (False, True) that compute the same
    thing, keyed by any hashable shape with a ``num_features``. ``record_event(device)`` and
    ``capturing(device)`` are the CUDA hooks, to be replaced by fakes in tests."""

    def __init__(self, trials: int = TRIALS, record_event: Callable = record_timing_event,
                 capturing: Callable = stream_is_capturing, names: Dict[bool, str] = ORDER_NAMES,
                 candidates: Optional[Callable] = None, default=DEFAULT_ORDER):
        self.trials = trials
        self.names = names
        # ``candidates(shape)``: the choices to measure for a shape (default: both launch orders,
        # bag-major only where the features fit the grid's y axis); ``default`` runs undecided.
        self._candidates = candidates or _orders_for
        self.default = default
        self.forced_order = None  # a choice every shape runs, unmeasured (force)
        self._record_event = record_event
        self._capturing = capturing
        self._decided: Dict[ForwardLaunchShape, bool] = {}
        self._trials: Dict[ForwardLaunchShape, _ShapeTrials] = {}
        # The PS tier may run forwards from a background thread: the dicts change under this lock.
        self._lock = threading.Lock()

    def force(self, name: Optional[str]) -> None:
        """Tests and tools: run every shape with the choice called ``name`` (one of ``names``'
        values), unmeasured; None or "auto" measures again. A choice a shape cannot take (bag-major
        beyond 65535 features) runs the default there."""
        self.forced_order = parse_forced_order(name, self.names)

    def launch(self, shape: ForwardLaunchShape, run: Callable[[bool], Result], device: torch.device) -> Result:
        """``run(bag_major)`` in the order chosen for ``shape``, timed while the shape is on trial."""
        candidates = self._candidates(shape)
        if self.forced_order is not None:
            return run(self.forced_order if self.forced_order in candidates else self.default)
        decided = self._decided.get(shape)  # read without the lock: a dict lookup is atomic
        if decided is not None:
            return run(decided)
        if len(candidates) == 1:
            with self._lock:
                self._decided[shape] = candidates[0]
            return run(candidates[0])
        if self._capturing(device):
            return run(self.default)
        with self._lock:
            order, timed = self._next_launch(shape, candidates)
        if not timed:
            return run(order)
        start = self._record_event(device)
        result = run(order)
        end = self._record_event(device)
        with self._lock:
            trials = self._trials.get(shape)
            if trials is not None:  # else another thread decided meanwhile: this sample is not needed
                trials.in_flight.append((order, start, end))
        return result

    def _next_launch(self, shape, candidates) -> Tuple[bool, bool]:
        """(order, whether to time it) for an undecided shape; decides it once its samples are in."""
        trials = self._trials.get(shape)
        if trials is None:
            trials = self._trials[shape] = _ShapeTrials(candidates, trial_plan(candidates, self.trials))
        trials.collect_finished()
        faster = trials.faster_order(self.trials)
        if faster is not None:
            self._decided[shape] = faster
            del self._trials[shape]
            return faster, False
        if trials.planned < len(trials.plan):
            trials.planned += 1
            return trials.plan[trials.planned - 1]
        return self.default, False  # every sample launched: wait for them to finish, untimed

    def forget(self) -> None:
        """Drop every decision and trial. A model built where a freed one's weights were gets the
        freed one's decisions (the weights' address is part of the key): a caller that builds
        models of one shape with other data (the benchmark's workloads) forgets between them."""
        with self._lock:
            self._decided.clear()
            self._trials.clear()

    def decisions(self) -> Dict[ForwardLaunchShape, str]:
        """The decided shapes and their choice's name ("features" or "bags" for the forward)."""
        with self._lock:
            return {shape: self.names[order] for shape, order in self._decided.items()}

    def decisions_since(self, seen: set) -> Dict[ForwardLaunchShape, str]:
        """The decisions whose shapes are not in ``seen`` (reports of what a run decided);
        adds them to ``seen``."""
        new = {shape: order for shape, order in self.decisions().items() if shape not in seen}
        seen.update(new)
        return new
