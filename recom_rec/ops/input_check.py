"""The input check of the GPU kernels: ids and bags checked as the kernels read them, reported
without a device-to-host sync.

Every kernel that reads a KJT keeps its reads in bounds whatever the batch holds: an id outside
``[0, num_embeddings)`` reads row 0 of its table (fbgemm's default clamps so too) and a bag whose
range leaves the values reads nothing. The forward kernels also report the first bad lookup they
meet: its kind, feature, batch index and values go to a few words of pinned host memory, which the
kernels write directly (mapped memory: no copy, no sync). The host reads the first word on the
group's next call and raises the ``ValueError`` the synchronous check (ops/validation.py) would
have raised, one batch late; ``check_reported()`` (``EmbeddingBagCollection.check_inputs()``)
waits for the kernels queued so far and raises at once.

A report is kept per group (its weight buffer's address on its device) and per names
(validation.encode_names: the KJT's keys and each feature's table), so its feature index always
decodes to the right names and one module's bad batch is raised by that module.
"""
from typing import Dict, Optional, Tuple

import torch

from .validation import decode_names

REPORT_WORDS = 6  # kind, feature, batch index, a, b, the KJT's values (csrc/lookup/kernels.cuh: report_bad)
REPORT_ID, REPORT_BAG, REPORT_TOTAL = 1, 2, 3


class KernelReport:
    """Where one group's kernels on one device report: ``claim``, an int32 device word the first
    bad lookup takes (so the report is one lookup's), and ``words``, REPORT_WORDS int64 in pinned
    host memory (plain host memory when the kernels run in Triton's CPU interpreter)."""

    __slots__ = ("claim", "words", "_view")

    def __init__(self, device: torch.device):
        self.claim = torch.zeros(1, dtype=torch.int32, device=device)
        # The kernels write these words through their device address, so they are pinned; the
        # extension relies on that rather than checking each launch.
        self.words = torch.zeros(REPORT_WORDS, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._view = self.words.numpy()  # read without torch's dispatch: a few hundred ns a call

    def pending(self) -> bool:
        return bool(self._view[0])

    def take(self) -> Tuple[int, ...]:
        """The report, after the kernels that may still write it have finished; clears it."""
        if self.claim.is_cuda:
            torch.cuda.synchronize(self.claim.device)
        report = tuple(int(w) for w in self._view)
        self._view[:] = 0
        self.claim.zero_()
        return report


_REPORTS: Dict[Tuple[torch.device, int, str], KernelReport] = {}
# Slots of freed modules cannot be told apart (the key is an address): past this many, the oldest
# half of those without a pending report is dropped (a live group's slot is made again on its
# next call).
MAX_REPORTS = 4096


def kernel_report(flat: torch.Tensor, names: str) -> Optional[KernelReport]:
    """The report slot of the group whose weights are ``flat``, for its next launch. Raises first
    the error its kernels reported for an earlier batch. None while a CUDA graph is being captured
    and the slot does not exist yet (its allocation would be captured): that launch clamps without
    reporting."""
    device = flat.device
    key = (device, flat.data_ptr(), names)
    report = _REPORTS.get(key)
    if report is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if len(_REPORTS) >= MAX_REPORTS:
            idle = [k for k, r in _REPORTS.items() if not r.pending()]
            for k in idle[:len(idle) // 2 + 1]:
                del _REPORTS[k]
        report = _REPORTS[key] = KernelReport(device)
    elif report.pending() and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        raise _error(report.take(), names)
    return report


def check_reported(device: Optional[torch.device] = None) -> None:
    """Waits for the kernels queued so far (on ``device``, or every device that has a report) and
    raises the input error they reported, if any."""
    reports = [(key, r) for key, r in list(_REPORTS.items()) if device is None or key[0] == device]
    for dev in {key[0] for key, _ in reports if key[0].type == "cuda"}:
        torch.cuda.synchronize(dev)
    for key, report in reports:
        if report.pending():
            raise _error(report.take(), key[2])


def _error(report: Tuple[int, ...], names: str) -> ValueError:
    kind, feature, bag, a, b, num_values = report
    late = " (reported by the GPU kernels for a batch already run: there, bad ids read row 0 and bad bags nothing)"
    if kind == REPORT_TOTAL:
        return ValueError(f"KeyedJaggedTensor lengths add up to {b - a} but there are {num_values} values{late}")
    name, table = decode_names(names)[1][feature]
    if kind == REPORT_BAG:
        return ValueError(
            f"KeyedJaggedTensor lengths add up past its {num_values} values: feature {name!r} (table {table!r}) "
            f"reads values [{a}, {b}) at batch index {bag}{late}")
    what = "negative" if a < 0 else f"out of range for {b} rows"
    return ValueError(f"feature {name!r} (table {table!r}): id {a} at batch index {bag} is {what}; ids must lie "
                      f"in [0, {b}){late}")
