"""The input check of the GPU kernels: ids and bags checked as the kernels read them, reported
without a device-to-host sync.

Every kernel that reads a KJT keeps its reads in bounds whatever the batch holds: an id outside
``[0, num_embeddings)`` reads row 0 of its table (fbgemm's default clamps so too) and a bag whose
range leaves the values reads nothing. The forward kernels also report the first bad lookup they
meet: its kind, feature, batch index and values go to a few words of pinned host memory, which the
kernels write directly (mapped memory: no copy, no sync). The host reads the first word on the
module's next call and raises the ``ValueError`` the synchronous check (ops/validation.py) would
have raised, one batch late; ``check_reported()`` (``EmbeddingBagCollection.check_inputs()``)
waits for the kernels queued so far and raises at once.

Reports belong to the call that made them. A slot is kept per module (``report_id``, drawn at
random for each module, its copies included, so that a module freed and another built at its
address never share one), per thread, per group (its weight buffer) and per names
(validation.encode_names: the KJT's keys and each feature's table, so that the feature index
decodes to the right names). A module's next call in the same thread raises what that thread's
earlier calls of it reported; ``check_reported(report_id)`` waits for the streams those calls ran
on (the whole device once a CUDA graph captured a launch: replays run on any stream) and raises
the calling thread's reports of that module only. A bad batch of model A is never raised by model B, nor by
another thread's calls of A.

A slot dropped (its module freed, or the oldest idle slots past MAX_REPORTS) may still have kernels
queued that write it: its pinned words would go back to torch's host allocator and be handed to
the next slot (the same size), whose module would then raise a report it never made. So a dropped
slot is retired, not freed: kept until events recorded on its streams at the drop have passed
(looked at when a new slot is made), and kept for good once a CUDA graph captured a launch of it
(a replay writes it whenever it runs).
"""
import collections
import itertools
import secrets
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from .validation import decode_names

REPORT_WORDS = 6  # kind, feature, batch index, a, b, the KJT's values (csrc/lookup/kernels.cuh: report_bad)
REPORT_ID, REPORT_BAG, REPORT_TOTAL, REPORT_INVERSE, REPORT_LENGTH = 1, 2, 3, 4, 5


class KernelReport:
    """Where one group's kernels report, for one module and thread: ``claim``, an int32 device
    word the first bad lookup takes (so the report is one lookup's), and ``words``, REPORT_WORDS
    int64 in pinned host memory (plain host memory when the kernels run in Triton's CPU
    interpreter)."""

    __slots__ = ("claim", "words", "names", "device", "streams", "captured", "_view")

    def __init__(self, device: torch.device, names: str):
        self.claim = torch.zeros(1, dtype=torch.int32, device=device)
        # The kernels write these words through their device address, so they are pinned; the
        # extension relies on that rather than checking each launch.
        self.words = torch.zeros(REPORT_WORDS, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.names = names
        self.device = device
        # The streams the slot's kernels were launched on (raw handle -> stream): waiting for them,
        # not the device, waits for those kernels only. A captured launch replays on any stream.
        self.streams: Dict[int, torch.cuda.Stream] = {}
        self.captured = False
        self._view = self.words.numpy()  # read without torch's dispatch: a few hundred ns a call

    def launched_on(self, raw_stream: int, capturing: bool) -> None:
        if capturing:
            self.captured = True
        elif raw_stream not in self.streams:
            self.streams[raw_stream] = torch.cuda.current_stream(self.device)

    def pending(self) -> bool:
        return bool(self._view[0])

    def wait(self) -> None:
        """Waits for the kernels queued so far that may write the slot."""
        if self.captured:
            torch.cuda.synchronize(self.device)
        else:
            for stream in tuple(self.streams.values()):
                stream.synchronize()

    def take(self) -> Tuple[int, ...]:
        """The report, after the kernels that may still write it have finished; clears it."""
        self.wait()
        report = tuple(int(w) for w in self._view)
        self._view[:] = 0
        self.claim.zero_()
        return report


_SlotKey = Tuple[torch.device, int, str]  # device, weight buffer address, names
# (thread, module) -> that thread's slots of that module's groups
_SLOTS: Dict[Tuple[int, int], Dict[_SlotKey, KernelReport]] = {}
_LOCK = threading.Lock()
_THREAD = threading.local()
_THREAD_TOKENS = itertools.count(1)  # a thread's token, unlike its ident, is never reused
# Slots of threads that have ended are not seen go: past this many slots, the oldest half of those
# without a pending report is dropped (a live group's slot is made again on its next call).
MAX_REPORTS = 4096


def new_report_id(owner: object) -> int:
    """A report id for a new module (or a copy of one): random 63 bits, so that ids are not reused
    within a process nor shared with a module saved by another process (TorchScript, export). The
    module's slots are dropped with it, unless a graph made from it keeps them (``keep_reports``);
    such a graph (and a scripted module) reports under the module's id: the module's own
    ``check_inputs()`` raises the graph's report too."""
    report_id = secrets.randbits(63) or 1
    _FINALIZERS[report_id] = weakref.finalize(owner, forget_reports, report_id)
    return report_id


def keep_reports(report_id: int) -> None:
    """Module ``report_id``'s slots stay for as long as the process runs, not only as long as the
    Python module: a graph made from it runs under the same id and may outlive it (an fx trace
    holds no reference to the module), and a forgotten id's slots are retired, which would lose the
    graph's reports."""
    finalizer = _FINALIZERS.pop(report_id, None)
    if finalizer is not None:
        finalizer.detach()


def forget_reports(report_id: int) -> None:
    """Module ``report_id`` was freed: its slots are retired at the next slot made. Only noted
    here: weakref.finalize runs this inside whatever allocation set off the collection, possibly
    in a thread holding _LOCK."""
    _FINALIZERS.pop(report_id, None)
    _FORGOTTEN.append(report_id)


_FORGOTTEN: "collections.deque[int]" = collections.deque()  # freed modules' report ids (deque: atomic appends)
_FINALIZERS: Dict[int, "weakref.finalize"] = {}  # live modules' report ids -> what forgets them


def _retire_forgotten() -> None:
    """Retires the slots of the modules freed since the last call (call with _LOCK held)."""
    while _FORGOTTEN:
        report_id = _FORGOTTEN.popleft()
        for key in [k for k in _SLOTS if k[1] == report_id]:
            for report in _SLOTS.pop(key).values():
                _retire(report)


# Dropped slots whose kernels may still write them (see the module's docstring): (slot, events
# recorded on its streams at the drop), and slots kept while the process runs: those a CUDA graph
# captured, and any whose events could not be recorded.
_RETIRED: List[Tuple[KernelReport, List["torch.cuda.Event"]]] = []
_KEPT: List[KernelReport] = []


def _retire(report: KernelReport) -> None:
    """Keeps a dropped slot until its queued kernels have passed (call with _LOCK held)."""
    if report.device.type != "cuda":
        return  # the CPU's kernels have run by the time the call returns
    if report.captured or torch.cuda.is_current_stream_capturing():
        # a replay may write it at any time; and no event is recorded while this thread captures
        _KEPT.append(report)
        return
    try:
        events = []
        for stream in report.streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
    except RuntimeError:  # e.g. a module freed while the process exits: nothing left to reuse the block
        _KEPT.append(report)
        return
    _RETIRED.append((report, events))


def _free_passed_retired() -> None:
    """Frees the retired slots whose kernels have all passed (call with _LOCK held, not while this
    thread captures a CUDA graph: an event query is not allowed then)."""
    if _RETIRED:
        _RETIRED[:] = [(r, events) for r, events in _RETIRED if not all(e.query() for e in events)]


def _thread_token() -> int:
    token = getattr(_THREAD, "token", 0)
    if not token:
        token = _THREAD.token = next(_THREAD_TOKENS)
    return token


def _raw_stream(device: torch.device) -> int:
    # the raw stream handle: a few hundred ns, where torch.cuda.current_stream() costs microseconds
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else
                                               torch.cuda.current_device())


def kernel_report(flat: torch.Tensor, names: str, report_id: int) -> Optional[KernelReport]:
    """The report slot of module ``report_id``'s group whose weights are ``flat``, for its next
    launch from this thread (on the current stream). Raises first the error the module's kernels
    reported for an earlier batch of this thread. None while a CUDA graph is being captured and
    the slot does not exist yet (its allocation would be captured): that launch clamps without
    reporting."""
    device = flat.device
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    slots = _SLOTS.get((_thread_token(), report_id))
    if slots is not None and not capturing:
        for report in tuple(slots.values()):  # (a copy: another thread may drop idle slots meanwhile)
            if report.pending():
                raise _error(report.take(), report.names)
    key = (device, flat.data_ptr(), names)
    report = slots.get(key) if slots is not None else None
    if report is None:
        if capturing:
            return None
        with _LOCK:
            # before the new slot's pinned words are allocated: the blocks of passed slots first
            _retire_forgotten()
            _free_passed_retired()
        report = KernelReport(device, names)
        with _LOCK:
            if sum(map(len, _SLOTS.values())) >= MAX_REPORTS:
                _drop_idle_half()
            _SLOTS.setdefault((_thread_token(), report_id), {})[key] = report
    if device.type == "cuda":
        report.launched_on(_raw_stream(device), capturing)
    return report


def _drop_idle_half() -> None:
    idle = [(owner, key) for owner, slots in _SLOTS.items() for key, r in slots.items() if not r.pending()]
    for owner, key in idle[:len(idle) // 2 + 1]:
        slots = _SLOTS[owner]
        _retire(slots.pop(key))
        if not slots:
            del _SLOTS[owner]


def check_reported(report_id: int) -> None:
    """Waits for the kernels this thread has queued for module ``report_id`` (on their streams)
    and raises the input error they reported, if any."""
    slots = _SLOTS.get((_thread_token(), report_id))
    if not slots:
        return
    reports = tuple(slots.values())
    for report in reports:
        report.wait()
    for report in reports:
        if report.pending():
            raise _error(report.take(), report.names)


# ``check_reported`` as an op: what a module's ``check_inputs()`` calls, so that it runs the same
# eager, scripted (``torch.jit.export``) and traced. Defined with conservative alias analysis: its
# schema returns nothing, and TorchScript would drop a call it took for pure.
_LIB = torch.library.Library("recom_rec", "FRAGMENT")
_LIB.define("check_input_reports(int report_id) -> ()", alias_analysis="CONSERVATIVE")
_LIB.impl("check_input_reports", check_reported, "CompositeExplicitAutograd")


@torch.library.register_fake("recom_rec::check_input_reports", lib=_LIB)
def _(report_id):
    return None


def pending_report_count() -> int:
    """How many live modules' slots hold a report not raised yet, in every thread (for tests and soaks)."""
    with _LOCK:
        _retire_forgotten()
        return sum(r.pending() for slots in _SLOTS.values() for r in slots.values())


def _error(report: Tuple[int, ...], names: str) -> ValueError:
    kind, feature, bag, a, b, num_values = report
    late = " (reported by the GPU kernels for a batch already run: there, bad ids read row 0 and bad bags nothing)"
    if kind == REPORT_TOTAL:
        return ValueError(f"KeyedJaggedTensor lengths add up to {b - a} but there are {num_values} values{late}")
    name, table = decode_names(names)[1][feature]
    if kind == REPORT_INVERSE:  # (the expansion of a variable batch: ops/variable_batch.inverse_check)
        return ValueError(
            f"KeyedJaggedTensor inverse_indices of feature {name!r} send output row {bag} to bag {a}, but the "
            f"feature has {b} bags in this batch: each must lie in [0, {b}) (the feature of table {table!r}; "
            "reported by the GPU kernels for a batch already run: there, such a row read an empty bag or bag 0)")
    if kind == REPORT_LENGTH:  # (the unpooled lookup's kernels: csrc/lookup/unpooled.cu, kernels/unpooled_triton.py)
        return ValueError(f"feature {name!r} (table {table!r}): negative length ({a}) at batch index {bag}; the "
                          "lengths must not be negative (reported by the GPU kernels for a batch already run: its "
                          "ids were read all the same)")
    if kind == REPORT_BAG:
        return ValueError(
            f"KeyedJaggedTensor lengths add up past its {num_values} values: feature {name!r} (table {table!r}) "
            f"reads values [{a}, {b}) at batch index {bag}{late}")
    what = "negative" if a < 0 else f"out of range for {b} rows"
    return ValueError(f"feature {name!r} (table {table!r}): id {a} at batch index {bag} is {what}; ids must lie "
                      f"in [0, {b}){late}")
