"""Measured launch choices kept on disk, shared by processes and ranks (``RECOM_REC_CACHE``).

The tuners (launch_tuner.py) measure a shape's candidates on its first calls; without this cache a
new process, or each rank of a job, measures again, and a server's first requests run the losing
candidates meanwhile. When ``RECOM_REC_CACHE`` is set (the directory first-use builds go to, which
defaults to ``~/.cache/recom_rec`` when unset), its ``decisions.json`` keeps them: a shape the file
knows is decided at its first call, and a shape decided by measurement is written to the file
(merged under a file lock, replaced atomically), so the next process and every rank starts from it.
Opt-in, by setting the variable: an unlucky measurement kept on disk holds for every later process
(docs/measured-choices.md, "Kept between processes?").

Entries are keyed by the *context*, the GPU model, its compute capability, the CUDA and driver
versions and the package build (a hash of the tuned kernels' sources: a changed kernel measures
afresh), then by tuner, then by the shape's *class*: the tuner key without the weights' address
(two models of one layout share a decision) as canonical JSON. ``recom_rec.tune(model, batches)``
fills it ahead of time.

The same format carries decisions in memory (``IMPORTED``): ``recom_rec.use_kernel_decisions``
puts decisions taken out of another process (``recom_rec.kernel_decisions``, shipped with an
exported model by ``recom_rec.save_exported``) into this one's tuners, which look them up ahead
of the file. They are checked on the way in: a malformed set of decisions is an error there,
where a malformed cache file only counts as empty.
"""
import fcntl
import hashlib
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

ENV = "RECOM_REC_CACHE"
FILE_NAME = "decisions.json"
VERSION = 1
_KERNEL_SOURCES = ("kernels/launch_tuner.py", "kernels/selection.py", "kernels/pooled_cuda.py",
                   "kernels/pooled_triton.py")


def shape_class(shape) -> str:
    """The tuner key without the weights' address, as canonical JSON (named tuples by field name)."""
    return json.dumps(_plain(shape), sort_keys=True, separators=(",", ":"))


def _plain(value):
    fields = getattr(value, "_fields", None)
    if fields is not None:
        return {name: _plain(v) for name, v in zip(fields, value) if name != "weights_at"}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)  # dtypes


def _build_hash() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in _KERNEL_SOURCES:
        path = root / name
        if path.exists():
            digest.update(path.read_bytes())
    csrc = root.parent / "csrc" / "lookup"
    if csrc.is_dir():  # a source checkout (an installed wheel's extension is built from the same files)
        for path in sorted(csrc.glob("*")):
            digest.update(path.read_bytes())
    return "build " + digest.hexdigest()[:16]


def context_key(device: torch.device) -> str:
    """What a measured choice holds for: GPU model, compute capability, CUDA, driver, package build."""
    if device.type != "cuda":  # (the tuners run on GPUs; a CPU context serves tests with fake timers)
        return f"{device.type}|{_build_hash()}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    try:
        driver = str(torch._C._cuda_getDriverVersion())
    except (AttributeError, RuntimeError):
        driver = "?"
    return f"{props.name}|sm_{props.major}{props.minor}|cuda {torch.version.cuda}|driver {driver}|{_build_hash()}"


_CONTEXTS: Dict[torch.device, str] = {}


def context_of(device: torch.device) -> str:
    """``context_key(device)``, worked out once per device."""
    key = _CONTEXTS.get(device)
    if key is None:
        key = _CONTEXTS[device] = context_key(device)
    return key


Entries = Dict[str, Dict[str, Dict[str, str]]]  # context -> tuner -> shape class -> choice name
# context -> tuner -> shape class -> the names of the candidates the decision was measured among:
# a prior fitted from the file knows which choices its points never measured (decision_prior).
Offered = Dict[str, Dict[str, Dict[str, List[str]]]]


class DecisionCache:
    """The file's decisions in memory, re-read when the file changes; writes merge under a lock."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._entries: Dict[str, Dict[str, Dict[str, str]]] = {}
        self._stamp = None
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._entries = _read(self.path)
            self._stamp = stamp

    def lookup(self, tuner: str, device: torch.device, shape) -> Optional[str]:
        """The choice recorded for ``shape`` under ``tuner`` in this context, or None."""
        with self._lock:
            self._refresh()
            return self._entries.get(context_of(device), {}).get(tuner, {}).get(shape_class(shape))

    def record(self, tuner: str, device: torch.device, shape, choice: str,
               offered: Optional[Sequence[str]] = None) -> None:
        """Adds a decision to the file (other processes' entries kept), with the names of the
        candidates it was measured among when given."""
        context, key = context_of(device), shape_class(shape)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(self.path.suffix + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                entries, among = read_decisions(self.path)
                entries.setdefault(context, {}).setdefault(tuner, {})[key] = choice
                if offered is not None:
                    among.setdefault(context, {}).setdefault(tuner, {})[key] = sorted(offered)
                temporary = self.path.with_suffix(self.path.suffix + f".{os.getpid()}.tmp")
                temporary.write_text(json.dumps({"version": VERSION, "entries": entries, "offered": among}, indent=1,
                                                sort_keys=True))
                os.replace(temporary, self.path)
                self._entries = entries
                stat = self.path.stat()
                self._stamp = (stat.st_mtime_ns, stat.st_size)


def _read(path: Path) -> Entries:
    """The file's entries; an unreadable or foreign file counts as empty (it is rewritten on the next
    decision)."""
    return read_decisions(path)[0]


def read_decisions(path: Path) -> Tuple[Entries, Offered]:
    """The file's entries, and its record of the candidates each decision was measured among (files
    written before it was kept have none); an unreadable or foreign file counts as empty."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}, {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
        return {}, {}
    offered = data.get("offered")
    return data["entries"], offered if isinstance(offered, dict) else {}


def checked_decisions(data, source: str = "kernel decisions") -> Entries:
    """The entries of ``data``, a set of decisions in the decision file's format
    (``{"version": 1, "entries": {context: {tuner: {shape class: choice}}}}``); a ValueError that
    says what is wrong, and where, when it is not one. ``source`` names it in the message."""
    def fail(what: str):
        raise ValueError(f"{source}: not recom_rec kernel decisions: {what}")

    if not isinstance(data, dict):
        fail(f"expected a JSON object with 'version' and 'entries', got {type(data).__name__}")
    if "version" not in data or "entries" not in data:
        fail(f"expected the keys 'version' and 'entries', got {sorted(map(str, data))}")
    if data["version"] != VERSION:
        raise ValueError(f"{source}: kernel decisions of version {data['version']!r}; this recom_rec reads "
                         f"version {VERSION}")
    entries = data["entries"]
    if not isinstance(entries, dict):
        fail(f"'entries' is a {type(entries).__name__}, expected an object of contexts")
    for context, tuners in entries.items():
        if not isinstance(context, str) or not isinstance(tuners, dict):
            fail(f"entries[{context!r}] is a {type(tuners).__name__}, expected an object of tuners")
        for tuner, classes in tuners.items():
            if not isinstance(classes, dict):
                fail(f"entries[{context!r}][{tuner!r}] is a {type(classes).__name__}, expected an object of "
                     f"shape classes")
            for key, choice in classes.items():
                try:
                    json.loads(key)
                except ValueError:
                    fail(f"entries[{context!r}][{tuner!r}] has the key {key!r}, which is no shape class (JSON)")
                if not isinstance(choice, str):
                    fail(f"entries[{context!r}][{tuner!r}][{key!r}] is {choice!r}, expected a choice's name")
    return entries


class ImportedDecisions:
    """Decisions put into this process (``recom_rec.use_kernel_decisions``), looked up by the tuners
    ahead of the decision file. Merged: a later set's decision replaces an earlier one's of the same
    context, tuner and shape class."""

    def __init__(self) -> None:
        self._entries: Entries = {}
        self._lock = threading.Lock()
        self._warned: set = set()

    def add(self, entries: Entries) -> int:
        """Merges ``entries`` (checked_decisions' output); returns how many decisions they hold."""
        count = 0
        with self._lock:
            for context, tuners in entries.items():
                for tuner, classes in tuners.items():
                    self._entries.setdefault(context, {}).setdefault(tuner, {}).update(classes)
                    count += len(classes)
            self._warned.clear()
        return count

    def lookup(self, tuner: str, device: torch.device, shape) -> Optional[str]:
        """The imported choice for ``shape`` under ``tuner`` in this context, or None. Warns once per
        context when decisions were imported for other contexts only (another GPU, driver or build)."""
        if not self._entries:
            return None
        context = context_of(device)
        with self._lock:
            ours = self._entries.get(context)
            if ours is None:
                if context not in self._warned:
                    self._warned.add(context)
                    others = "; ".join(sorted(self._entries))
                    warnings.warn(f"recom_rec: the kernel decisions imported are for other contexts ({others}), "
                                  f"not this device's ({context}): its kernels measure their choices here",
                                  stacklevel=4)
                return None
            return ours.get(tuner, {}).get(shape_class(shape))

    def entries(self) -> Entries:
        with self._lock:
            return {c: {t: dict(k) for t, k in tuners.items()} for c, tuners in self._entries.items()}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._warned.clear()


IMPORTED = ImportedDecisions()

_CACHES: Dict[str, DecisionCache] = {}


def active_cache() -> Optional[DecisionCache]:
    """The cache in the directory ``RECOM_REC_CACHE`` names (read at each call: tests and tools may
    set it late), or None when the variable is unset."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = str(Path(directory) / FILE_NAME)
    cache = _CACHES.get(path)
    if cache is None:
        cache = _CACHES[path] = DecisionCache(path)
    return cache
