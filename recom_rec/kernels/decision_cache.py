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
"""
import fcntl
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Dict, Optional

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


class DecisionCache:
    """The file's decisions in memory, re-read when the file changes; writes merge under a lock."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._entries: Dict[str, Dict[str, Dict[str, str]]] = {}
        self._stamp = None
        self._contexts: Dict[torch.device, str] = {}
        self._lock = threading.Lock()

    def _context(self, device: torch.device) -> str:
        key = self._contexts.get(device)
        if key is None:
            key = self._contexts[device] = context_key(device)
        return key

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
            return self._entries.get(self._context(device), {}).get(tuner, {}).get(shape_class(shape))

    def record(self, tuner: str, device: torch.device, shape, choice: str) -> None:
        """Adds a decision to the file (other processes' entries kept)."""
        context, key = self._context(device), shape_class(shape)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(self.path.suffix + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                entries = _read(self.path)
                entries.setdefault(context, {}).setdefault(tuner, {})[key] = choice
                temporary = self.path.with_suffix(self.path.suffix + f".{os.getpid()}.tmp")
                temporary.write_text(json.dumps({"version": VERSION, "entries": entries}, indent=1, sort_keys=True))
                os.replace(temporary, self.path)
                self._entries = entries
                stat = self.path.stat()
                self._stamp = (stat.st_mtime_ns, stat.st_size)


def _read(path: Path) -> Dict[str, Dict[str, Dict[str, str]]]:
    """The file's entries; an unreadable or foreign file counts as empty (it is rewritten on the next
    decision)."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


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
