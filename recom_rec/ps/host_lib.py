"""The tier's host library, csrc/ps/ps_*.c (see ps_host.h): compiled with the system C
compiler (``CC``, else ``cc``) on first use, cached per source and compiler under
``RECOM_REC_HOST_CACHE`` (by default ``~/.cache/recom_rec/host``), loaded with ctypes.

Why C through ctypes: the per-batch bookkeeping is a few thousand hash-map operations, which C
does in tens of microseconds; as torch or numpy ops it was ~100 calls of 30-40 us each. ctypes
releases the GIL for the length of each call, and a batch's whole staging is one call (or a job
on the tier's own worker thread), so it does not hold up the training thread.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "ps"
SOURCES = [CSRC / f"ps_{name}.c" for name in ("host", "mem", "pool", "stage", "cuda", "resp", "tls", "redis")]
HEADERS = [CSRC / "ps_host.h", CSRC / "ps_map.h", CSRC / "ps_redis.h"]
# -ffp-contract=off: the init must round like torch's separate multiply and add. gnu99: POSIX
# threads, clocks and dlopen (ps_cuda.c loads the CUDA driver, ps_tls.c libssl, at run time, never
# at link time).
FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off", "-std=gnu99", "-pthread"]
LIBS = ["-ldl"]

(STAGE_OK, STAGE_WOULD_BLOCK, STAGE_FULL, STAGE_NEGATIVE_ID, STAGE_NO_MEMORY, STAGE_STORE_ERROR,
 STAGE_DEVICE_ERROR) = 0, -1, -2, -3, -4, -5, -6

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


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("recom_rec's parameter-server tier compiles csrc/ps/ps_*.c on first use "
                           "and needs a C compiler: install gcc or set CC")
    return cc


def _cache_file(cc: str) -> Path:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + f"{cc}|{FLAGS}|{LIBS}".encode()
                         ).hexdigest()[:16]
    root = Path(os.environ.get("RECOM_REC_HOST_CACHE", Path.home() / ".cache" / "recom_rec" / "host"))
    return root / f"ps_host-{key}.so"


@lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    """The loaded library (built first when this source has no cached build)."""
    with _lock:
        cc = _compiler()
        target = _cache_file(cc)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                try:
                    done = subprocess.run([cc, *FLAGS, "-o", str(built), *map(str, SOURCES), *LIBS],
                                          capture_output=True, text=True)
                except OSError as exc:
                    raise RuntimeError(f"recom_rec's parameter-server tier compiles csrc/ps/ps_*.c on first "
                                       f"use, but the C compiler {cc!r} cannot run ({exc}); install gcc or set CC"
                                       ) from None
                if done.returncode != 0:
                    raise RuntimeError(f"building csrc/ps/ps_*.c with {cc} failed:\n{done.stderr[-4000:]}")
                os.replace(built, target)  # atomic: a concurrent process loads a whole file or builds its own
        handle = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(handle, name)
        fn.restype, fn.argtypes = restype, argtypes
    return handle


def ptr(array: np.ndarray) -> int:
    """The address of a C-contiguous numpy array's data."""
    return array.ctypes.data
