"""Picks the faster of two equivalent launches per launch shape, by measuring them: the CUDA
forward kernel's launch order, and the CUDA backward's path (pooled_cuda.BACKWARD_PATH_TUNER:
rows of one lookup through the pieces or through their own kernel).

The forward kernel runs feature-major (every feature's first bags at once) or bag-major (one
feature's bags at once, its repeated rows staying in L2); both give bit-identical results, only
block scheduling differs. Neither wins everywhere (H100: feature-major on dlrm-kaggle and
many-500/1000, bag-major on mixed and zipf) and zipf's win depends on the id distribution, so no
rule on the shape decides: the first launches of each shape run each candidate once untimed, then
in rounds of A B B A order timed with CUDA events (a drift over the rounds favours none).

A timed trial measures the kernels alone: a sleep kernel queued ahead of its start event keeps the
device busy while the host makes the call (``hold_device``), so the interval holds no host time.
On an idle device the start event would fire at once and the interval would also hold the host's
time until the kernels start: 10-50 us that jitter on the GPU hosts, against kernels of 20-300 us,
and choices then differed between runs and between models of one shape (docs/perf-notes.md v27).
Candidates whose host paths are one code path (the CUDA launches: one call to the extension with
other flags) are compared on their device time alone. A candidate with a host path of its own (the
Triton kernel, whose launch costs the host more) is compared on the longer of its device time and
its host time in the call: a shape whose host call outlasts its kernels runs at the host's pace.

A shape keeps its default unless a candidate is faster by a clear margin (see ``decide``): MARGIN
(3%) on the medians, beyond what the samples' spread allows. While that is unclear, another pair
of rounds runs, up to MAX_TRIALS samples a candidate; still unclear then, the default stays. So
near-equal candidates do not flip from run to run (issue 18: 14 of 156 choices differed between
two sweeps when the faster median of 4 samples won), and a clear winner is taken after MIN_TRIALS.

The host never waits for a timing: events are read with ``query()`` on later launches, and a shape
stays undecided (running its default, untimed) until its samples have finished. While a stream
is capturing a CUDA graph nothing is recorded or queried (a timing event would become part of the
graph, and the capture must stay free of host-side CUDA calls); the capture gets the shape's
decided choice, or the default.

Tests and tools force one choice with :meth:`LaunchOrderTuner.force` (the product always measures).
With ``RECOM_REC_CACHE`` set, decisions are also kept on disk (its ``decisions.json``) and a shape
the file knows is decided at its first call (decision_cache.py). A candidate clearly slower than
the default after DROP_AFTER samples each stops being tried, and one clearly faster becomes the
default at once. Timed trials, and another candidate's first launch (a Triton compile), are paced
so that they cost a shape's calls at most TRIAL_BUDGET of their time (``unpaced_trials`` lifts that
for tuning ahead of time). Where the package ships a prior for
the GPU's architecture (decision_prior.py: decisions recorded on other machines), a shape it
predicts for starts on the predicted choice, which is then the default, and it and the runner-up
are measured first, with any candidate the recorded shapes behind the prediction were not
measured against (one offered since the prior was fitted: the decision file keeps what each
decision was measured among); once they are decided, the candidates the prior did not predict
are measured against the winner, each one's first launch paced as if it took twice the
winner's time, so that a prior whose nearest shapes are far from this one costs no steady-state
speed (v71). Decisions taken out of another process (``recom_rec.kernel_decisions``)
and put into this one (``recom_rec.use_kernel_decisions``, ``recom_rec.load_exported``) are looked
up ahead of the file, the same way: a shape they know is decided at its first call.
"""
import collections
import contextlib
import math
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, TypeVar

import torch

FEATURE_MAJOR = False  # the extension's ``bag_major`` flag
BAG_MAJOR = True
ORDER_NAMES = {FEATURE_MAJOR: "features", BAG_MAJOR: "bags"}
DEFAULT_ORDER = FEATURE_MAJOR  # what an undecided shape runs untimed (and in a graph capture)
MAX_BAG_MAJOR_FEATURES = 65535  # bag-major puts the features on the grid's y axis
# Samples per candidate: at least MIN_TRIALS (four A B B A pairs: fewer make the samples' spread
# itself too uncertain), then pairs of rounds while the verdict is unclear, up to MAX_TRIALS (a
# 10 ms backward: 0.6 s of tuning for two candidates).
MIN_TRIALS = 8
MAX_TRIALS = 30
# A candidate replaces the default only if its median is more than 3% below: gains under that are
# within the run-to-run spread of the 0.1-0.4 ms launches measured (v13 sweep, two runs on one
# H100), so taking them would flip choices between runs for nothing a user could see.
MARGIN = 0.03
# ... and only when the gain is beyond the margin by CONFIDENCE_Z standard errors. 3.5 rather than
# the textbook 2-3: a shape's verdict is looked at up to 12 times (after each pair of rounds), and
# samples that hold host time (Triton's, against a CUDA launch) spread by 10-30%; with equal
# candidates at a 15-30% spread, 3.5 switched in under 1% of simulated runs (3: 1-2%).
CONFIDENCE_Z = 3.5
# A candidate stops being tried once, after DROP_AFTER samples each, its fastest sample is slower
# than the default's slowest by DROP_MARGIN: a clear loser costs the user's first calls little.
DROP_AFTER = 2
DROP_MARGIN = 0.25
# The hold ahead of a timed trial: twice the host's last call for the shape plus HOLD_SLACK_MS (its
# time jitters; a call that outlasts the hold gives one slow sample, which the medians ignore), at
# most MAX_HOLD_MS (a first call may compile for seconds). Held only while a shape is on trial. A
# candidate's first launch for a shape does not count as its last call: until the shape has made
# another, the median of the tuner's last TYPICAL_HOST_CALLS such calls (other shapes') stands in.
HOLD_SLACK_MS = 0.02
MAX_HOLD_MS = 2.0
TYPICAL_HOST_CALLS = 16
# A shape's timed trials may cost its calls at most TRIAL_BUDGET of their time: a timed launch (its
# hold, and a slower candidate's extra device time) waits until the shape's calls so far leave room
# for it, the shape running its default untimed meanwhile. A trial behind a hold of twice the host's
# call cost a host-bound call ~2-25x its time (a 0.07 ms kernel behind a ~0.9 ms call: 1.7 ms a call
# for 90 calls in a row, perf-notes v55), where issue 51 allows a shape's first calls a few percent
# over the predicted choice's alone. ``recom_rec.tune`` and the benchmarks' warm-up run trials
# unpaced (``unpaced_trials``): tuning is what they are for.
TRIAL_BUDGET = 0.03
# A candidate's first launch, untimed, is paced too, at what it is expected to cost beyond the
# default's call: the tuner's ``first_launch_ms`` (a Triton kernel's JIT, ~450 ms on the H200, v55)
# until one has been measured in this process, then the last measured. Unpaced, the first call of
# every new shape class ran the Triton candidate's compile: 555 ms of a drawn layout's first 10
# forwards (v55), 1.4 s of a serving stream's first 100 requests on a fresh machine (v57).
# torch.cuda._sleep counts clock cycles: at 3 GHz, above any GPU's clock, a hold lasts at least as
# long as asked.
HOLD_CYCLES_PER_MS = 3_000_000

Result = TypeVar("Result")


class ForwardLaunchShape(NamedTuple):
    """What a forward launch's timing depends on, as the tuner's key: a shape class. The batch size
    and the lookup count are rounded up to powers of two so that requests of varying batch sizes
    and batches of varying lengths share a decision (a server's batch sizes would otherwise each
    tune anew, issue 51). The weight buffer's address stands for the model: two models of one
    shape (uniform and Zipf ids) tune apart. Its size, in bytes rounded up to a power of two, says
    how much of the tables the L2 holds (the predicted choice of an unmeasured shape depends on it)."""
    weights_at: int
    num_features: int
    batch_bucket: int
    total_dim: int
    max_dim: int
    lookups_bucket: int
    weight_dtype: torch.dtype
    index_dtype: torch.dtype
    weighted: bool
    weight_bytes_bucket: int = 0

    @classmethod
    def of(cls, flat, values, per_sample_weights, feature_meta, batch_size, total_dim, max_dim):
        return cls.of_sizes(flat, feature_meta.shape[0], batch_size, total_dim, max_dim, values.numel(), values.dtype,
                            per_sample_weights is not None)

    @classmethod
    def of_sizes(cls, flat, num_features, batch_size, total_dim, max_dim, num_lookups, index_dtype, weighted):
        """``of`` from the lookups' count and dtype (a backward whose row keys are made later)."""
        return cls(flat.data_ptr(), num_features, _power_of_two_at_least(batch_size), total_dim, max_dim,
                   _power_of_two_at_least(num_lookups), flat.dtype, index_dtype, weighted,
                   _power_of_two_at_least(flat.numel() * flat.element_size()))


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _orders_for(shape) -> Tuple[bool, ...]:
    return (FEATURE_MAJOR, BAG_MAJOR) if shape.num_features <= MAX_BAG_MAJOR_FEATURES else (FEATURE_MAJOR,)


# Process-wide, not per thread: autograd runs a CUDA backward on its own device thread, so the
# backward's tuners inside ``recom_rec.tune`` would otherwise stay paced (v57: a shape tuned for
# 1,000 passes still on trial).
_UNPACED_DEPTH = 0
_UNPACED_LOCK = threading.Lock()


@contextlib.contextmanager
def unpaced_trials():
    """Within it, every tuner runs its trials back to back, unbudgeted, in every thread (autograd's
    backward threads too): for tuning ahead of time (``recom_rec.tune``, a benchmark's warm-up)."""
    global _UNPACED_DEPTH
    with _UNPACED_LOCK:
        _UNPACED_DEPTH += 1
    try:
        yield
    finally:
        with _UNPACED_LOCK:
            _UNPACED_DEPTH -= 1


def trials_unpaced() -> bool:
    return _UNPACED_DEPTH > 0


def record_timing_event(device: torch.device):
    """A timing event recorded now on ``device``'s current stream (the one the extension launches on)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def hold_device(device: torch.device, ms: float) -> None:
    """Queues a kernel that keeps ``device``'s current stream busy for at least ``ms``."""
    with torch.cuda.device(device):
        torch.cuda._sleep(int(ms * HOLD_CYCLES_PER_MS))


def stream_is_capturing(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _active_prior(device: torch.device):
    from .decision_prior import active_prior

    return active_prior(device)


def load_decisions(device: torch.device) -> None:
    """Loads the decision file's reader (``RECOM_REC_CACHE``; the file itself is read at a shape's
    first look-up), reads ``device``'s shipped prior and readies its timing (``prepare_timing``)
    now (a module's construction) rather than in the first launches."""
    from .decision_cache import active_cache

    active_cache()
    _active_prior(device)
    prepare_timing(device)


_TIMING_READY: set = set()


def prepare_timing(device: torch.device) -> None:
    """Runs a timed trial's CUDA work once on ``device`` (a hold, two timing events, their elapsed
    time): the first of each in a process loads its kernel or sets up its driver state, which cost
    the first timed trial of a warmed serving process 9-10 ms on the H200 (perf-notes v69), on a
    user's request."""
    if device.type != "cuda" or device in _TIMING_READY:
        return
    hold_device(device, 0.0)
    start = record_timing_event(device)
    end = record_timing_event(device)
    end.synchronize()
    start.elapsed_time(end)
    _TIMING_READY.add(device)


def parse_forced_order(value: Optional[str], names: Dict[bool, str] = ORDER_NAMES) -> Optional[bool]:
    """The choice named ``value`` (one of ``names``' values), or None to measure (None or "auto")."""
    if value is None or value in ("", "auto"):
        return None
    for order, name in names.items():
        if value == name:
            return order
    choices = [repr(name) for name in names.values()]
    raise ValueError(f"the choice must be 'auto', {', '.join(choices[:-1])} or {choices[-1]} (got {value!r})")


def trial_round(candidates: tuple, k: int) -> list:
    """The k-th timed round's launches: the candidates in order on even rounds, reversed on odd
    ones (A B B A), so that a drift over the rounds (clocks ramping up, caches warming) favours
    none."""
    return [(c, True) for c in (candidates if k % 2 == 0 else candidates[::-1])]


def relative_gain(current: List[float], challenger: List[float]) -> Tuple[float, float]:
    """(gain, error): the share of the current choice's median time that the challenger's median
    saves, and the gain's standard error. The spread is the median absolute deviation relative to
    each sample set's own median, pooled over both sets (robust to the odd slow launch, and steadier
    than either set's alone at a few samples); 1.4826 MAD estimates a normal spread's sigma, and
    1.2533 sigma / sqrt(n) the error of a median of n samples."""
    m_cur, m_new = statistics.median(current), statistics.median(challenger)
    if m_cur <= 0 or m_new <= 0:  # no measurable time (a fake or a broken timer): no evidence of a gain
        return 0.0, 0.0
    deviations = [abs(x / m_cur - 1.0) for x in current] + [abs(x / m_new - 1.0) for x in challenger]
    sigma = 1.4826 * statistics.median(deviations)
    error = 1.2533 * sigma * math.sqrt(1.0 / len(current) + 1.0 / len(challenger))
    return 1.0 - m_new / m_cur, error


def sample_costs(samples: Dict[object, List[float]], host: Optional[Dict[object, List[float]]],
                 host_path: Optional[Callable[[object], object]], choice, other) -> List[float]:
    """``choice``'s samples as compared with ``other``'s: its device times, or, where the two
    choices' host paths differ, each trial's longer of device and host time."""
    if host is None or host_path is None or host_path(choice) == host_path(other):
        return samples[choice]
    return [max(d, h) for d, h in zip(samples[choice], host[choice])]


def decide(candidates: tuple, samples: Dict[object, List[float]], default, margin: float = MARGIN,
           z: float = CONFIDENCE_Z, host: Optional[Dict[object, List[float]]] = None,
           host_path: Optional[Callable[[object], object]] = None) -> Tuple[object, bool]:
    """(choice, clear): the default, or a candidate clearly faster. Walks the candidates from the
    default on: one replaces the current choice when its median is below the current one's by more
    than ``margin`` (relative) plus ``z`` standard errors. ``clear`` is False when a comparison
    could go either way (its gain within ``z`` errors of the margin): more samples may settle it.
    Candidates' order breaks ties the same way every run, so the result does not depend on which
    of two near-equal candidates happened to measure faster. ``samples`` are device times; two
    candidates whose ``host_path`` differs are compared on each trial's longer of the device's and
    the host's time (``host``, the same trials in the same order)."""
    current = default if default in candidates else candidates[0]
    clear = True
    for challenger in [c for c in candidates if c != current]:
        gain, error = relative_gain(sample_costs(samples, host, host_path, current, challenger),
                                    sample_costs(samples, host, host_path, challenger, current))
        if gain - z * error > margin:
            current = challenger
        elif gain + z * error > margin:
            clear = False
    return current, clear


@dataclass
class _ShapeTrials:
    """An undecided shape's launches: those planned and not made yet, finished samples (ms) and
    those still in flight."""
    candidates: tuple
    default: object  # what the shape runs untimed meanwhile, and what a candidate must clearly beat
    planned: List[Tuple[object, bool]] = field(default_factory=list)  # (choice, timed), in launch order
    rounds: int = 0  # timed rounds planned so far
    samples: Dict[object, List[float]] = field(default_factory=dict)  # device ms
    host: Dict[object, List[float]] = field(default_factory=dict)  # the host's ms in the same trials' calls
    in_flight: List[Tuple[object, object, object, float]] = field(default_factory=list)  # (choice, start, end, host)
    host_ms: float = MAX_HOLD_MS  # the host's time in the shape's last call
    # ... and in its last call that was not a candidate's first launch for it (None before one):
    # a first launch's call may load kernels or compile, and a hold twice that long is latency
    # a synchronous caller (a server's request) waits out
    regular_host_ms: Optional[float] = None
    launched: set = field(default_factory=set)  # the choices run for the shape so far
    # The pacing's ledger (TRIAL_BUDGET): the shape's calls' time while on trial as the default takes
    # them (the longer of its host call and its device time), and what the trials cost beyond that:
    # a timed launch's hold, and another candidate's extra device time and extra host time (its
    # first launch's compile, say).
    calls: int = 0
    calls_host_ms: float = 0.0
    trials_ms: float = 0.0
    default_host_ms: float = 0.0  # the host's time in the default's last call
    # Candidates the prior did not predict, measured once these are decided (a second phase against
    # the winner), and the candidates whose first launch is paced at the default's device time
    # (what an unpredicted candidate might cost extra: nothing is known of it)
    later: tuple = ()
    unpredicted: frozenset = frozenset()

    def hold_ms(self, typical_host_ms: Optional[float] = None) -> float:
        """The hold ahead of a timed launch: twice the host's call plus the slack. The call is the
        shape's last one that was not a first launch; before one, the tuner's typical such call
        (``typical_host_ms``, its other shapes'), else the shape's last call."""
        host = self.regular_host_ms if self.regular_host_ms is not None else \
            typical_host_ms if typical_host_ms is not None else self.host_ms
        return min(MAX_HOLD_MS, 2 * host + HOLD_SLACK_MS)

    def device_ms(self, choice) -> float:
        """The choice's median device time so far (0 before its first sample)."""
        samples = self.samples.get(choice)
        return statistics.median(samples) if samples else 0.0

    def _extra_ms(self, choice, host_ms: float) -> float:
        """What a call of ``choice`` costs beyond the default's (device and host)."""
        if choice == self.default:
            return 0.0
        return max(0.0, self.device_ms(choice) - self.device_ms(self.default)) + \
            max(0.0, host_ms - self.default_host_ms)

    def trial_cost(self, choice, typical_host_ms: Optional[float] = None) -> float:
        """A timed launch of ``choice`` now: its hold, and its extra time as measured so far."""
        host = self.host.get(choice)
        return self.hold_ms(typical_host_ms) + self._extra_ms(choice, statistics.median(host) if host else 0.0)

    def calls_ms(self) -> float:
        """The calls' time: their host time, or their count at the default's device time once
        measured if more (the sum of the longer of the two, from below)."""
        return max(self.calls_host_ms, self.calls * self.device_ms(self.default))

    def account(self, choice, host_ms: float, hold_ms: Optional[float]) -> None:
        """Enters one call of ``choice`` (``hold_ms``: the hold ahead of it, None if untimed). What
        trials cost within ``unpaced_trials`` was asked for, and is not held against later ones."""
        if choice == self.default:
            self.default_host_ms = host_ms
        self.calls += 1
        self.calls_host_ms += self.default_host_ms
        if not trials_unpaced():
            self.trials_ms += (hold_ms or 0.0) + self._extra_ms(choice, host_ms)

    def affords(self, choice, budget: float, typical_host_ms: Optional[float] = None) -> bool:
        """Whether a timed launch of ``choice`` now keeps the trials within ``budget`` of the calls.
        The default's first timed launch always may: until it is measured, the calls' time is
        only their host time, which a device-bound shape's calls far exceed (one hold, ~2 calls
        of a host-bound shape)."""
        if choice == self.default and not self.samples.get(choice) and \
                not any(c == choice for c, *_ in self.in_flight):
            return True
        return self.fits(self.trial_cost(choice, typical_host_ms), budget)

    def fits(self, cost_ms: float, budget: float) -> bool:
        """Whether a launch costing ``cost_ms`` beyond the default's call keeps the trials within
        ``budget`` of the calls."""
        return self.trials_ms + cost_ms <= budget * self.calls_ms()

    def then_the_rest(self, winner) -> "_ShapeTrials":
        """The next phase: ``later`` measured against ``winner``, which runs untimed meanwhile;
        the winner's samples and the pacing's ledger carried over."""
        return replace(self, candidates=(winner,) + self.later, default=winner,
                       planned=[(c, False) for c in self.later], rounds=0,
                       samples={winner: list(self.samples.get(winner, ()))},
                       host={winner: list(self.host.get(winner, ()))},
                       in_flight=[f for f in self.in_flight if f[0] == winner], launched=set(self.launched),
                       later=(), unpredicted=frozenset(self.later))

    def plan_rounds(self, n: int) -> None:
        for k in range(self.rounds, self.rounds + n):
            self.planned += trial_round(self.candidates, k)
        self.rounds += n

    def collect_finished(self) -> None:
        still_running = []
        for choice, start, end, host_ms in self.in_flight:
            if end.query():  # non-blocking; the end finished so the start (earlier, same stream) did
                self.samples.setdefault(choice, []).append(start.elapsed_time(end))
                self.host.setdefault(choice, []).append(host_ms)
            else:
                still_running.append((choice, start, end, host_ms))
        self.in_flight = still_running

    def all_in(self) -> bool:
        """Whether every planned sample has been launched and has finished."""
        return not self.planned and not self.in_flight and all(
            len(self.samples.get(c, ())) >= self.rounds for c in self.candidates)


# Every tuner with a cache name: recom_rec.kernel_decisions() reads their decisions, and imported
# decisions reach them all (a tuner of tests or tools too, while it lives).
_NAMED_TUNERS: "weakref.WeakSet[LaunchOrderTuner]" = weakref.WeakSet()


def named_tuners() -> List["LaunchOrderTuner"]:
    """The live tuners whose decisions are kept and shared (those with a ``cache_name``)."""
    return list(_NAMED_TUNERS)


class LaunchOrderTuner:
    """Per ``ForwardLaunchShape``, the launch order (the extension's ``bag_major`` flag) that
    measured clearly faster than the default, else the default; or, with other ``names``, any
    launches that compute the same thing, keyed by any hashable shape with a ``num_features``.
    ``record_event(device)``, ``hold(device, ms)`` and ``capturing(device)`` are the CUDA hooks and
    ``clock()`` the host's (seconds), to be replaced by fakes in tests."""

    def __init__(self, min_trials: int = MIN_TRIALS, max_trials: int = MAX_TRIALS, margin: float = MARGIN,
                 z: float = CONFIDENCE_Z, record_event: Callable = record_timing_event,
                 capturing: Callable = stream_is_capturing, names: Dict[bool, str] = ORDER_NAMES,
                 candidates: Optional[Callable] = None, default=DEFAULT_ORDER,
                 host_path: Optional[Callable[[object], object]] = None, hold: Callable = hold_device,
                 clock: Callable[[], float] = time.perf_counter, cache_name: Optional[str] = None,
                 prior: Optional[Callable[[torch.device], object]] = None,
                 trial_budget: Optional[float] = TRIAL_BUDGET,
                 first_launch_ms: Optional[Callable[[object], float]] = None):
        if not 1 <= min_trials <= max_trials:
            raise ValueError(f"need 1 <= min_trials <= max_trials (got {min_trials}, {max_trials})")
        self.min_trials, self.max_trials, self.margin, self.z = min_trials, max_trials, margin, z
        # at most this share of an undecided shape's call time goes to its timed trials (None: no pacing)
        self.trial_budget = trial_budget
        # ``first_launch_ms(choice)``: what a choice's first launch in the process is expected to
        # cost beyond the default's call (a JIT compile) before one is measured (None: nothing);
        # then the last measured, per choice
        self._first_launch_ms = first_launch_ms or (lambda choice: 0.0)
        self._first_launch_seen: Dict[object, float] = {}
        self.names = names
        # ``candidates(shape)``: the choices to measure for a shape (default: both launch orders,
        # bag-major only where the features fit the grid's y axis); ``default`` runs undecided
        # and stays unless a candidate is clearly faster.
        self._candidates = candidates or _orders_for
        self.default = default
        # ``host_path(choice)``: equal for choices whose host calls are one code path (compared on
        # device time); None: all are.
        self.host_path = host_path
        self.forced_order = None  # a choice every shape runs, unmeasured (force)
        # Launches of a forced choice that their shape could not take, which ran the default
        # instead (a tool timing a forced choice checks it did run)
        self.forced_fallbacks = 0
        self._record_event = record_event
        self._capturing = capturing
        self._hold = hold
        self._clock = clock
        self._decided: Dict[ForwardLaunchShape, bool] = {}
        self._trials: Dict[ForwardLaunchShape, _ShapeTrials] = {}
        # Launches that ran while their shape was undecided (the benchmark warms up until a step
        # makes none: every shape it runs is decided before it is timed).
        self.trial_launches = 0
        # The PS tier may run forwards from a background thread: the dicts change under this lock.
        self._lock = threading.Lock()
        # The host's time in the last calls of undecided shapes that were not first launches: a new
        # shape's first hold goes by them rather than by its own first launches' calls (_ShapeTrials
        # .hold_ms). A serving stream's new batch-size classes each began with a hold of up to
        # MAX_HOLD_MS that way, paid by a request.
        self._regular_host_ms: "collections.deque[float]" = collections.deque(maxlen=TYPICAL_HOST_CALLS)
        # Under this name the tuner's decisions go to, and come from, the on-disk cache
        # (decision_cache.py, RECOM_REC_CACHE); a shape the cache lacked is looked up once.
        self.cache_name = cache_name
        self._cache_missed: set = set()
        # The device of each shape decided by measurement or by a kept decision (what
        # recom_rec.kernel_decisions() exports, under that device's context); not shapes with one
        # candidate, which need no decision.
        self._decided_on: Dict[object, torch.device] = {}
        if cache_name is not None:
            _NAMED_TUNERS.add(self)
        # ``prior(device)``: the decision_prior.DecisionPrior of the device's architecture, or None
        # (default: decision_prior.active_prior, the one shipped with the package). A shape it predicts for starts on the
        # predicted choice and measures it against the runner-up first, the rest later; per shape,
        # (default, the candidates measured first, those measured after), worked out on its first
        # undecided call.
        self._prior = prior if prior is not None else _active_prior
        self._starts: Dict[object, Tuple[object, tuple, tuple]] = {}

    def _typical_host_ms(self) -> Optional[float]:
        recent = list(self._regular_host_ms)  # (a copy: other threads append)
        return statistics.median(recent) if recent else None

    def force(self, name: Optional[str]) -> None:
        """Tests and tools: run every shape with the choice called ``name`` (one of ``names``'
        values), unmeasured; None or "auto" measures again. A choice a shape cannot take (bag-major
        beyond 65535 features) runs the default there, counted in ``forced_fallbacks``."""
        self.forced_order = parse_forced_order(name, self.names)

    def launch(self, shape: ForwardLaunchShape, run: Callable[[bool], Result], device: torch.device) -> Result:
        """``run(bag_major)`` in the order chosen for ``shape``, timed while the shape is on trial."""
        decided = self._decided.get(shape)  # read without the lock: a dict lookup is atomic
        if decided is not None and self.forced_order is None:  # a decided shape's launch: nothing more
            return run(decided)
        candidates = self._candidates(shape)
        if self.forced_order is not None:
            if self.forced_order in candidates:
                return run(self.forced_order)
            self.forced_fallbacks += 1
            return run(self.default)
        if len(candidates) == 1:
            with self._lock:
                self._decided[shape] = candidates[0]
            return run(candidates[0])
        if self.cache_name is not None and shape not in self._cache_missed:
            cached = self._from_cache(shape, candidates, device)
            if cached is not None:
                return run(cached)
        default, trial_candidates, later = self._start(shape, candidates, device)
        if self._capturing(device):
            trials = self._trials.get(shape)
            return run(trials.default if trials is not None else default)
        with self._lock:
            self.trial_launches += 1
            order, timed = self._next_launch(shape, trial_candidates, default, later)
            trials = self._trials.get(shape)
        if trials is None:  # decided by this call
            with self._lock:
                self._decided_on[shape] = device
            self._to_cache(shape, order, trial_candidates + later, device)
            return run(order)
        hold_ms = None
        if timed:  # the device busy until the call has queued the trial's kernels
            hold_ms = trials.hold_ms(self._typical_host_ms())
            self._hold(device, hold_ms)
            start = self._record_event(device)
        began = self._clock()
        result = run(order)
        host_ms = trials.host_ms = (self._clock() - began) * 1e3
        end = self._record_event(device) if timed else None
        with self._lock:
            if order in trials.launched:  # (not a first launch: a call the holds may go by)
                trials.regular_host_ms = host_ms
                self._regular_host_ms.append(host_ms)
            trials.launched.add(order)
            # else another thread decided meanwhile, or the trials were forgotten and begun anew:
            # this call belongs to none
            if self._trials.get(shape) is trials:
                if not timed and order != trials.default:  # (untimed, only a candidate's first launch)
                    self._first_launch_seen[order] = max(0.0, host_ms - trials.default_host_ms)
                trials.account(order, host_ms, hold_ms)
                if timed:
                    trials.in_flight.append((order, start, end, host_ms))
        return result

    def _early_comparisons(self, trials: "_ShapeTrials"):
        """(candidate, its costs, the default's) for every other candidate, once both have
        DROP_AFTER samples (sample_costs: as decide compares them)."""
        default = trials.default
        if len(trials.samples.get(default, ())) < DROP_AFTER:
            return []
        return [(c, sample_costs(trials.samples, trials.host, self.host_path, c, default),
                 sample_costs(trials.samples, trials.host, self.host_path, default, c))
                for c in trials.candidates if c != default and len(trials.samples.get(c, ())) >= DROP_AFTER]

    def _drop_clear_losers(self, trials: "_ShapeTrials") -> None:
        """Stops trying a candidate once it is clearly slower than the default: after DROP_AFTER
        samples each, its fastest sample above the default's slowest by DROP_MARGIN (the user's
        calls run the candidates on trial; a clear loser need not run MIN_TRIALS times)."""
        losers = [c for c, mine, base in self._early_comparisons(trials) if min(mine) > max(base) * (1 + DROP_MARGIN)]
        if losers:
            trials.candidates = tuple(c for c in trials.candidates if c not in losers)
            trials.planned = [(c, timed) for c, timed in trials.planned if c not in losers]

    def _promote_clear_winner(self, trials: "_ShapeTrials") -> None:
        """The default's mirror of _drop_clear_losers: a candidate whose slowest sample, after
        DROP_AFTER samples each, beats the default's fastest by DROP_MARGIN becomes the default at
        once (the one with the lowest median, if several): the shape's untimed calls run it while
        the trials go on, and it is what the others must clearly beat. A misprediction then costs a
        shape's first calls a few launches, not MIN_TRIALS rounds."""
        winners = [(statistics.median(mine), c) for c, mine, base in self._early_comparisons(trials)
                   if max(mine) * (1 + DROP_MARGIN) < min(base)]
        if winners:
            trials.default = min(winners, key=lambda w: w[0])[1]

    def _from_cache(self, shape, candidates, device: torch.device):
        """The kept choice for ``shape`` (then decided here too): an imported decision's, else the
        decision file's; or None."""
        from .decision_cache import IMPORTED, active_cache

        by_name = {n: choice for choice, n in self.names.items()}
        name = IMPORTED.lookup(self.cache_name, device, shape)
        if name not in by_name or by_name[name] not in candidates:
            cache = active_cache()
            name = cache.lookup(self.cache_name, device, shape) if cache is not None else None
        if name not in by_name or by_name[name] not in candidates:
            self._cache_missed.add(shape)
            return None
        with self._lock:
            self._decided[shape] = by_name[name]
            self._decided_on[shape] = device
            self._trials.pop(shape, None)
        return by_name[name]

    def look_again(self) -> None:
        """Decisions were imported: shapes that found none kept look again on their next call (an
        undecided shape's trials end there if one is found); decided shapes keep their choice."""
        with self._lock:
            self._cache_missed.clear()

    def _to_cache(self, shape, choice, candidates: tuple, device: torch.device) -> None:
        if self.cache_name is None:
            return
        from .decision_cache import active_cache

        cache = active_cache()
        if cache is not None:  # (with what it was measured against: a prior fitted from the file needs it)
            cache.record(self.cache_name, device, shape, self.names[choice], [self.names[c] for c in candidates])

    def _start(self, shape, candidates: tuple, device: torch.device) -> Tuple[object, tuple, tuple]:
        """(default, the candidates to measure first, those measured after) of an undecided shape:
        the tuner's default and every candidate, none after; or, where the prior predicts, the
        predicted choice and its runner-up (the next in the prior's ranking, else the tuner's
        default, else the first other candidate) and any candidate the recorded shapes behind the
        prediction were decided without, then the rest against the winner. The prior's nearest
        shapes can be far from this one, and a candidate none of them chose is not ranked: v71's
        drawn 6.8M x 543 table ran its forward bag-major at 578 us where four rounds, never
        measured, took 479."""
        start = self._starts.get(shape)
        if start is not None:
            return start
        default = self.default if self.default in candidates else candidates[0]
        start = (default, candidates, ())
        ranked, unmeasured = self._predicted(shape, candidates, device)
        if ranked:
            first = ranked[0]
            others = list(ranked[1:]) + [default] + list(candidates)
            runner_up = next(c for c in others if c != first)
            measured = (first, runner_up) + tuple(c for c in unmeasured if c not in (first, runner_up))
            start = (first, measured, tuple(c for c in candidates if c not in measured))
        with self._lock:
            self._starts[shape] = start
        return start

    def _predicted(self, shape, candidates: tuple, device: torch.device) -> Tuple[list, list]:
        """The prior's ranking of ``candidates`` for ``shape`` (most likely first), or []; and those
        of them the recorded shapes behind it were decided without (measured too)."""
        prior = self._prior(device) if self.cache_name is not None else None
        if prior is None:
            return [], []
        by_name = {n: choice for choice, n in self.names.items()}
        ranked = [by_name[n] for n in prior.ranked(self.cache_name, shape) if n in by_name]
        unmeasured = prior.unmeasured(self.cache_name, shape, [self.names[c] for c in candidates])
        return [c for c in ranked if c in candidates], [by_name[n] for n in unmeasured if n in by_name]

    def first_launch_estimate(self, choice) -> float:
        """What ``choice``'s first launch for a shape is expected to cost beyond the default's call:
        the last such launch measured in this process, else ``first_launch_ms``."""
        seen = self._first_launch_seen.get(choice)
        return seen if seen is not None else self._first_launch_ms(choice)

    def _first_launch_cost(self, trials: "_ShapeTrials", choice) -> float:
        """What ``choice``'s untimed first launch for the shape is expected to cost beyond the
        default's call: first_launch_estimate, and for a candidate the prior did not predict at
        least the default's device time (it might take twice as long: nothing says otherwise)."""
        estimate = self.first_launch_estimate(choice)
        return max(estimate, trials.device_ms(trials.default)) if choice in trials.unpredicted else estimate

    def _next_launch(self, shape, candidates: tuple, default, later: tuple = ()) -> Tuple[object, bool]:
        """(choice, whether to time it) for an undecided shape; decides it once its samples are
        in and the verdict is clear (or MAX_TRIALS samples did not make it clear), then measures
        ``later`` against that choice the same way."""
        trials = self._trials.get(shape)
        if trials is None:
            trials = self._trials[shape] = _ShapeTrials(candidates, default, [(c, False) for c in candidates],
                                                        later=later)
            trials.plan_rounds(self.min_trials)
        trials.collect_finished()
        self._promote_clear_winner(trials)
        self._drop_clear_losers(trials)
        if trials.all_in() or len(trials.candidates) == 1:  # (the others all dropped: nothing to compare)
            choice, clear = decide(trials.candidates, trials.samples, trials.default, self.margin, self.z,
                                   trials.host, self.host_path)
            if clear or trials.rounds >= self.max_trials:
                if trials.later:  # the candidates the prior did not predict, against the winner
                    trials = self._trials[shape] = trials.then_the_rest(choice)
                    trials.plan_rounds(self.min_trials)
                    return self._next_launch(shape, trials.candidates, choice)
                self._decided[shape] = choice
                del self._trials[shape]
                return choice, False
            trials.plan_rounds(min(2, self.max_trials - trials.rounds))  # one more A B B A pair
        if trials.planned:
            choice, timed = trials.planned[0]
            if self.trial_budget is not None and not trials_unpaced():
                if timed and not trials.affords(choice, self.trial_budget, self._typical_host_ms()):
                    return trials.default, False  # paced: the shape's calls have not paid for it yet
                # (the planned untimed launches are the candidates' first)
                if not timed and choice != trials.default and \
                        not trials.fits(self._first_launch_cost(trials, choice), self.trial_budget):
                    # paced: its first launch (a compile) waits likewise; the default's first timed
                    # launch goes ahead of it (the budget is a share of the calls' device time too)
                    first_timed = (trials.default, True)
                    if first_timed in trials.planned and not trials.samples.get(trials.default) and \
                            not any(c == trials.default for c, *_ in trials.in_flight):
                        trials.planned.remove(first_timed)
                        return first_timed
                    return trials.default, False
            return trials.planned.pop(0)
        return trials.default, False  # wait for samples, untimed

    def forget(self) -> None:
        """Drop every decision and trial. A model built where a freed one's weights were gets the
        freed one's decisions (the weights' address is part of the key): a caller that builds
        models of one shape with other data (the benchmark's workloads) forgets between them.
        The host's typical call time stays: it is the host's, not a decision."""
        with self._lock:
            self._decided.clear()
            self._decided_on.clear()
            self._trials.clear()
            self._cache_missed.clear()
            self._starts.clear()

    def decisions(self) -> Dict[ForwardLaunchShape, str]:
        """The decided shapes and their choice's name ("features" or "bags" for the forward)."""
        with self._lock:
            return {shape: self.names[order] for shape, order in self._decided.items()}

    def kept_decisions(self) -> Dict[str, Dict[str, str]]:
        """The decisions worth keeping (measured, or taken from a kept decision) in the decision
        file's terms: {context: {shape class: choice name}}. Two models of one layout whose shapes
        decided apart share a class: the later decision is kept."""
        from .decision_cache import context_of, shape_class

        with self._lock:
            decided = [(shape, device, self._decided[shape]) for shape, device in self._decided_on.items()
                       if shape in self._decided]
        kept: Dict[str, Dict[str, str]] = {}
        for shape, device, choice in decided:
            kept.setdefault(context_of(device), {})[shape_class(shape)] = self.names[choice]
        return kept

    def decisions_since(self, seen: set) -> Dict[ForwardLaunchShape, str]:
        """The decisions whose shapes are not in ``seen`` (reports of what a run decided);
        adds them to ``seen``."""
        new = {shape: order for shape, order in self.decisions().items() if shape not in seen}
        seen.update(new)
        return new
