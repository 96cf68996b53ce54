"""The tier's host library, csrc/ps/ps_*.c (see ps_host.h), loaded with ctypes: the build made
when the package was installed (recom_rec/ps/_host*.so, setup.py), else a build with the system C
compiler (``CC``, else ``cc``) on first use, cached under ``~/.cache/recom_rec/host``
(``RECOM_REC_CACHE``). The sources and flags are listed in recom_rec/native_build.py.

Why C through ctypes: the per-batch bookkeeping is a few thousand hash-map operations, which C
does in tens of microseconds; as torch or numpy ops it was ~100 calls of 30-40 us each. ctypes
releases the GIL for the length of each call, and a batch's whole staging is one call (or a job
on the tier's own worker thread), so it does not hold up the training thread.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from .. import native_build as spec

(STAGE_OK, STAGE_WOULD_BLOCK, STAGE_FULL, STAGE_NEGATIVE_ID, STAGE_NO_MEMORY, STAGE_STORE_ERROR,
 STAGE_DEVICE_ERROR, STAGE_ABORTED) = 0, -1, -2, -3, -4, -5, -6, -7

_lock = threading.Lock()
_P = ctypes.c_void_p
_I = ctypes.c_int64

_SIGNATURES = {
    "ps_cache_new": (_P, [_I, ctypes.c_int, _P, _P, _P, _P, _P]),
    "ps_cache_free": (None, [_P]),
    "ps_cache_stage": (_I, [_P, _P, _I, _P, _P, _P, _P, _P, _P, _P]),
    "ps_cache_commit": (_I, [_P, _P, _I, _P, _P, _I]),
    "ps_cache_abort": (None, [_P, _P, _I]),
    "ps_cache_unpin": (ctypes.c_int, [_P, _P, _I]),
    "ps_cache_sync": (None, [_P]),
    "ps_cache_mark_dirty": (None, [_P, _P, _I]),
    "ps_cache_drop": (None, [_P, _P, _I]),
    "ps_cache_releases": (_I, [_P]),
    "ps_cache_wait_release": (_I, [_P, _I, _I]),
    "ps_mem_new": (_P, [_I]),
    "ps_mem_free": (None, [_P]),
    "ps_mem_get": (ctypes.c_int, [_P, _P, _I, _P, _P]),
    "ps_mem_put": (ctypes.c_int, [_P, _P, _I, _P]),
    "ps_mem_delete": (ctypes.c_int, [_P, _P, _I]),
    "ps_mem_scan": (_I, [_P, _P, _I]),
    "ps_mem_store_ops": (None, [_P, _P]),
    "ps_init_uniform": (None, [_P, _P, _I, _I, _I, ctypes.c_double, ctypes.c_double, _P, _I]),
    "ps_stager_new": (_P, [_P]),
    "ps_stager_free": (None, [_P]),
    "ps_stager_run": (_I, [_P, _P]),
    "ps_stager_submit": (ctypes.c_int, [_P, _P]),
    "ps_stager_wait": (_I, [_P, _P]),
    "ps_stager_lock": (None, [_P]),
    "ps_stager_unlock": (None, [_P]),
    "ps_stager_times": (_I, [_P, _P]),
    "ps_stager_set_depth": (None, [_P, _I]),
    "ps_cpu_ops_new": (ctypes.c_int, [_P]),
    "ps_cpu_ops_free": (None, [_P]),
    "ps_cuda_ops_new": (ctypes.c_int, [_P, ctypes.c_int, _P, ctypes.c_char_p, _P, _I]),
    "ps_cuda_ops_free": (None, [_P]),
    "ps_cuda_order": (ctypes.c_int, [_P, _P, _P]),
    "ps_f32_to_f16": (ctypes.c_uint16, [ctypes.c_float]),
    "ps_f32_to_bf16": (ctypes.c_uint16, [ctypes.c_float]),
    "ps_f16_to_f32": (ctypes.c_float, [ctypes.c_uint16]),
    "ps_bf16_to_f32": (ctypes.c_float, [ctypes.c_uint16]),
    "ps_pool_workers": (ctypes.c_int, []),
    "ps_sources_sha256": (ctypes.c_char_p, []),
    "ps_redis_client_new": (_P, [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                 ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_double]),
    "ps_redis_client_add_node": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_int]),
    "ps_redis_client_tls": (ctypes.c_int, [_P, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_char_p]),
    "ps_redis_client_free": (None, [_P]),
    "ps_redis_client_disconnect": (None, [_P]),
    "ps_redis_stats": (ctypes.c_int, [_P, _P]),
    "ps_redis_table_new": (_P, [_P, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, _I]),
    "ps_redis_table_free": (None, [_P]),
    "ps_redis_get": (ctypes.c_int, [_P, _P, _I, _P, _P]),
    "ps_redis_put": (ctypes.c_int, [_P, _P, _I, _P]),
    "ps_redis_put_get": (ctypes.c_int, [_P, _P, _I, _P, _P, _I, _P, _P]),
    "ps_redis_take_error": (ctypes.c_int, [_P, _P, ctypes.c_int]),
    "ps_redis_store_ops": (None, [_P, _P]),
    "ps_redis_key_slot": (ctypes.c_int, [ctypes.c_char_p, _I]),
}


def installed_library() -> Optional[Path]:
    """The shared library setup.py built into the package, if it did."""
    name = spec.PS_EXTENSION.rsplit(".", 1)[1]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).resolve().parent / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("recom_rec's parameter-server tier compiles csrc/ps/ps_*.c on first use "
                           "and needs a C compiler: install gcc or set CC")
    return cc


def _jit_build(csrc: Path, sha: str, why: str) -> Path:
    """The fallback: csrc/ps compiled with the system C compiler into the cache (once per hash)."""
    cc = _compiler()
    target = spec.jit_cache_dir("host") / f"ps_host-{sha}-{Path(cc).name}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    sources = [str(csrc / "ps" / name) for name in spec.PS_SOURCES]
    print(f"recom_rec: {why}", file=sys.stderr, flush=True)
    with spec.compiling("the parameter-server library csrc/ps", "a few seconds"), \
            tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [cc, *spec.PS_CFLAGS, spec.hash_define(sha), "-shared", "-o", str(built), *sources,
                   *("-l" + lib for lib in spec.PS_LIBRARIES)]
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as exc:
            raise RuntimeError(f"recom_rec's parameter-server tier compiles csrc/ps/ps_*.c on first use, "
                               f"but the C compiler {cc!r} cannot run ({exc}); install gcc or set CC") from None
        if done.returncode != 0:
            raise RuntimeError(f"building csrc/ps/ps_*.c with {cc} failed:\n{done.stderr[-4000:]}")
        os.replace(built, target)  # atomic: a concurrent process loads a whole file or builds its own
    return target


def _choose() -> Tuple[Path, str]:
    """(the library to load, where it comes from): the installed build unless the sources beside
    it changed since, else the just-in-time build."""
    csrc = spec.csrc_dir()
    installed = installed_library()
    sha = spec.ps_sha256(csrc) if csrc is not None else None
    if installed is not None:
        built_from = ctypes.CDLL(str(installed)).ps_sources_sha256
        built_from.restype = ctypes.c_char_p
        if sha is None or built_from().decode() == sha:
            return installed, "installed"
        why = "csrc/ps changed since the package was built (pip install --no-build-isolation -e . builds it ahead)"
    else:
        why = "the parameter-server library was not built at install time (pip install --no-build-isolation .)"
    if csrc is None:
        raise RuntimeError("recom_rec's parameter-server library was not built at install time and its sources "
                           "(csrc/ps) are missing: reinstall recom_rec")
    return _jit_build(csrc, sha, why), "compiled on first use"


@lru_cache(maxsize=None)
def _loaded() -> Tuple[ctypes.CDLL, Path, str]:
    with _lock:
        path, origin = _choose()
        handle = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(handle, name)
        fn.restype, fn.argtypes = restype, argtypes
    return handle, path, origin


def lib() -> ctypes.CDLL:
    """The loaded library (the installed build, else built on first use)."""
    return _loaded()[0]


def where() -> str:
    """Which library is loaded and where it came from ("installed" or "compiled on first use")."""
    _, path, origin = _loaded()
    return f"{path} ({origin})"


def ptr(array: np.ndarray) -> int:
    """The address of a C-contiguous numpy array's data."""
    return array.ctypes.data
