"""The launch tuners' decisions kept on disk between processes, one file per GPU model.

A shape's last decided choice is the incumbent that the next process's measurement starts from
(``launch_tuner.decide`` walks from it): a candidate replaces it only when clearly faster, as it
replaces the default in a first run. Candidates within the tuner's margin of each other therefore
keep the choice a previous run made instead of flipping with this run's noise (issue 18: 13-20 of
156 sweep choices differed between two runs on one H100, all between launches a few percent
apart), and a CUDA-graph capture made before a shape's trials end records the remembered choice
instead of the default. The file is a prior, never a verdict: every process still measures.

The key is the launch shape without the weights' address (``portable_key``), so models of one
shape with other id distributions share a prior; each still decides by its own measurement.

Where: ``$RECOM_REC_CACHE/choices/<GPU name>.json`` (default ``~/.cache/recom_rec``). Deleting the
file makes the next process start from the defaults. Writes are atomic (a temporary file renamed
over the old one) and merge what other processes (ranks) wrote meanwhile; a file that cannot be
read or written is ignored with one warning, and the tuners work as without it.
"""
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

FORMAT = 1


def portable_key(shape) -> str:
    """A launch shape as a string that means the same in another process: named tuples by field,
    the weights' address (``weights_at``) left out, dtypes by name."""
    def strip(value):
        if isinstance(value, tuple):
            fields = getattr(value, "_fields", None)
            if fields:
                return tuple((f, strip(v)) for f, v in zip(fields, value) if f != "weights_at")
            return tuple(strip(v) for v in value)
        if isinstance(value, torch.dtype):
            return str(value)
        return value

    return repr(strip(shape))


def _cuda_device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _default_directory() -> Path:
    from ..native_build import jit_cache_dir

    return jit_cache_dir("choices")


class ChoiceMemory:
    """The remembered choices, per device model and tuner: ``recall`` and ``remember`` by launch
    shape. ``directory`` and ``device_name`` are injectable for tests."""

    def __init__(self, directory: Optional[Callable[[], Path]] = None,
                 device_name: Callable[[torch.device], str] = _cuda_device_name):
        self._directory = directory or _default_directory
        self._device_name = device_name
        self._lock = threading.Lock()
        self._loaded: Dict[str, Dict[str, Dict[str, str]]] = {}  # file -> tuner -> key -> choice name
        self._warned = False

    def path(self, device: torch.device) -> Path:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", self._device_name(device)).strip("-") or "device"
        return Path(self._directory()) / f"{slug}.json"

    def recall(self, device: torch.device, tuner: str, shape) -> Optional[str]:
        """The choice's name last remembered for ``shape`` by ``tuner`` on this device model, or None."""
        with self._lock:
            choices = self._choices(self.path(device))
        return choices.get(tuner, {}).get(portable_key(shape))

    def remember(self, device: torch.device, tuner: str, shape, name: str) -> None:
        """Keeps ``name`` as ``shape``'s choice, here and in the file (merged with the file's current
        contents, so that processes deciding other shapes meanwhile keep theirs)."""
        path, key = self.path(device), portable_key(shape)
        with self._lock:
            choices = self._choices(path)
            if choices.get(tuner, {}).get(key) == name:
                return
            choices.setdefault(tuner, {})[key] = name
            on_disk = self._read(path)
            for t, entries in choices.items():
                on_disk.setdefault(t, {}).update(entries)
            self._loaded[str(path)] = on_disk
            self._write(path, on_disk)

    def count(self, device: torch.device) -> int:
        """How many choices are remembered for this device model, over every tuner."""
        with self._lock:
            return sum(len(entries) for entries in self._choices(self.path(device)).values())

    def forget(self) -> None:
        """Drops what this process has loaded (the next recall reads the file again)."""
        with self._lock:
            self._loaded.clear()

    def _choices(self, path: Path) -> Dict[str, Dict[str, str]]:
        loaded = self._loaded.get(str(path))
        if loaded is None:
            loaded = self._loaded[str(path)] = self._read(path)
        return loaded

    def _read(self, path: Path) -> Dict[str, Dict[str, str]]:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self._warn(f"cannot read {path} ({e}); starting from the defaults")
            return {}
        choices = data.get("choices") if isinstance(data, dict) and data.get("format") == FORMAT else None
        if not isinstance(choices, dict):
            self._warn(f"{path} is not a remembered-choices file of format {FORMAT}; starting from the defaults")
            return {}
        return {t: {k: v for k, v in entries.items() if isinstance(v, str)}
                for t, entries in choices.items() if isinstance(entries, dict)}

    def _write(self, path: Path, choices: Dict[str, Dict[str, str]]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"format": FORMAT, "choices": choices}, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            self._warn(f"cannot write {path} ({e}); choices are not kept for the next process")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"recom_rec remembered launch choices: {message}", RuntimeWarning, stacklevel=3)


REMEMBERED = ChoiceMemory()  # the product tuners' memory
