"""The native side of a batch's staging (csrc/ps/ps_stage.c, ps_cuda.c) as Python sees it:
the ctypes mirrors of its structs, the row ops of a device (CPU, or a CUDA GPU through the
driver API), a table's store ops (memory:// natively, any other store through Python callbacks),
and :class:`Stager`, which runs a job in the calling thread or on its own worker thread.
"""
from __future__ import annotations

import ctypes
import hashlib
import threading
import weakref
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from .. import native_build
from . import host_lib

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
MAX_STATES = 2
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# The row kernels' PTX, read at run time (csrc/ps in a checkout, its copy in an installed package).
PTX = (native_build.csrc_dir() or Path("csrc")) / "ps" / "ps_rows.ptx"
PTX_SOURCE = PTX.with_suffix(".cu")


class RowLayout(ctypes.Structure):
    _fields_ = [("weight", _P), ("weight_dtype", _I), ("weight_stride", _I), ("dim", _I), ("n_states", _I),
                ("state", _P * MAX_STATES), ("state_width", _I * MAX_STATES), ("state_init", _D * MAX_STATES),
                ("width", _I), ("init_uniform", _I), ("init_base", _I), ("init_a", _D), ("init_b", _D)]


class RowOps(ctypes.Structure):
    _fields_ = [("ctx", _P), ("fetch_ids", _P), ("sync", _P), ("read_rows", _P), ("write_rows", _P),
                ("init_rows", _P), ("put_ids", _P), ("host_buffer", _P), ("error", _P)]


class StoreOps(ctypes.Structure):
    _fields_ = [("ctx", _P), ("get", _P), ("put", _P), ("init", _P), ("put_get", _P)]


class TableJob(ctypes.Structure):
    _fields_ = [("cache", _P), ("store", _P), ("layout", _P), ("segs", _P), ("n_segs", _I), ("slots", _P),
                ("counts", _I * 5), ("store_lanes", _I)]


class Job(ctypes.Structure):
    _fields_ = [("span", _P), ("id_bytes", _I), ("n", _I), ("out", _P), ("tables", _P), ("n_tables", _I),
                ("status", _I), ("done", _I), ("error_at", _I), ("state", _I), ("next", _P)]


_ERROR = ctypes.CFUNCTYPE(ctypes.c_char_p, _P)
_GET = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _I, _P, _P)
_PUT = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _I, _P)
_INIT = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _I, _P)


def _int64s(address: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(address)) if n else np.empty(0, np.int64)


def _rows(address: int, n: int, width: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * (n * width)).from_address(address)).reshape(n, width)


def ptx_text() -> bytes:
    """ps_rows.ptx, checked against the source it was generated from (tools/gen_ps_ptx.py)."""
    text = PTX.read_bytes()
    digest = hashlib.sha256(PTX_SOURCE.read_bytes()).hexdigest()
    if f"sha256={digest}".encode() not in text.split(b"\n", 1)[0]:
        raise RuntimeError(f"{PTX.name} was not generated from this {PTX_SOURCE.name}: run tools/gen_ps_ptx.py")
    return text + b"\0"


class DeviceOps:
    """The row ops of one device: host memory on the CPU, a GPU through the CUDA driver API (on the
    stream ``stream``, where the tier moves rows)."""

    def __init__(self, device: torch.device, stream: Optional[torch.cuda.Stream] = None) -> None:
        self.device = device
        self.ops = RowOps()
        self._lib = host_lib.lib()
        if device.type == "cpu":
            if self._lib.ps_cpu_ops_new(ctypes.byref(self.ops)) != 0:
                raise MemoryError("cannot allocate the parameter-server tier's row ops")
            self._free = self._lib.ps_cpu_ops_free
        elif device.type == "cuda":
            err = ctypes.create_string_buffer(512)
            index = device.index if device.index is not None else torch.cuda.current_device()
            if self._lib.ps_cuda_ops_new(ctypes.byref(self.ops), index, ctypes.c_void_p(stream.cuda_stream),
                                         ptx_text(), err, len(err)) != 0:
                raise RuntimeError(f"the parameter-server tier cannot move rows on {device}: "
                                   f"{err.value.decode(errors='replace')}")
            self._free = self._lib.ps_cuda_ops_free
        else:
            raise NotImplementedError(f"parameter-server tables on {device.type} devices are not supported "
                                      "(cpu and cuda are)")

    def error(self) -> str:
        return _ERROR(self.ops.error)(self.ops.ctx).decode(errors="replace")

    def order(self, signal: int, waiter: int) -> None:
        """CUDA: work queued on stream ``waiter`` from now on runs after the work queued on stream
        ``signal`` so far (raw stream handles; Stream.wait_stream without its Python objects)."""
        if self._lib.ps_cuda_order(ctypes.byref(self.ops), signal, waiter) != 0:
            raise RuntimeError(f"the parameter-server tier cannot order its CUDA streams: {self.error()}")

    def __del__(self) -> None:
        ops = getattr(self, "ops", None)
        if ops is not None and ops.ctx:
            self._free(ctypes.byref(ops))


class PythonStoreOps:
    """A table's store ops as ctypes callbacks: ``get``/``put`` of a :class:`RowStore` (any but a
    memory:// table, which is native) and the init of never-seen rows made on the host. A worker
    thread calling them takes the GIL for their length. An exception is kept in ``error`` for the
    tier to raise, and the call reports failure."""

    def __init__(self, get: Optional[Callable], put: Optional[Callable], init: Callable, width: int,
                 lock: Optional[threading.Lock] = None) -> None:
        self.width = width
        self.error: Optional[BaseException] = None
        # several jobs' store I/O may run at once (ps_stager_set_depth): a store registered by a
        # user is called by one thread at a time (`lock`: one per store)
        self._one_at_a_time = lock if lock is not None else threading.Lock()
        self._get, self._put, self._init = get, put, init
        # the CFUNCTYPE objects live as long as this object: C holds their addresses
        self.get_fn, self.put_fn, self.init_fn = _GET(self._on_get), _PUT(self._on_put), _INIT(self._on_init)

    def _guard(self, fn, *args) -> int:
        try:
            with self._one_at_a_time:
                fn(*args)
            return 0
        except BaseException as exc:  # noqa: BLE001 - raised again by the tier after the job
            self.error = exc
            return -1

    def _on_get(self, ctx, ids, n, rows, found) -> int:
        def get():
            got, hit = self._get(torch.from_numpy(_int64s(ids, n).copy()))
            _rows(rows, n, self.width)[:] = got.numpy()
            np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(found))[:] = hit.numpy()
        return self._guard(get)

    def _on_put(self, ctx, ids, n, rows) -> int:
        return self._guard(lambda: self._put(torch.from_numpy(_int64s(ids, n).copy()),
                                             torch.from_numpy(_rows(rows, n, self.width).copy())))

    def _on_init(self, ctx, ids, n, rows) -> int:
        def init():
            _rows(rows, n, self.width)[:] = self._init(torch.from_numpy(_int64s(ids, n).copy())).numpy()
        return self._guard(init)

    def fill(self, ops: StoreOps) -> None:
        for name in ("get", "put"):
            if getattr(self, f"_{name}") is not None:
                setattr(ops, name, ctypes.cast(getattr(self, f"{name}_fn"), _P).value)
        ops.init = ctypes.cast(self.init_fn, _P).value


def _free_stager(lib, st: int, device_ops: DeviceOps, held: dict) -> None:
    """A stager's end (its weakref.finalize): the jobs in flight finish and those queued are given
    back (ps_stager_free) while ``device_ops`` and ``held`` keep alive what they touch."""
    lib.ps_stager_free(st)
    held.clear()


class Stager:
    """Runs staging jobs (one batch's PS tables) now, or submitted: planned and finished in order
    on a worker thread of its own, their store I/O on I/O threads, up to :meth:`set_depth` jobs in
    flight. :meth:`lock` waits for the jobs in flight and excludes new ones (flush, load).

    A submitted job's memory and the caches, stores and row ops it touches stay alive until it is
    waited for or the stager ends, whatever order a garbage collection finalizes its owners in:
    the stager ends in a weakref.finalize (run before any ``__del__`` of a collected cycle) that
    holds them."""

    def __init__(self, ops: DeviceOps) -> None:
        self.device_ops = ops
        self._lib = host_lib.lib()
        self._st = self._lib.ps_stager_new(ctypes.byref(ops.ops))
        if not self._st:
            raise MemoryError("cannot allocate the parameter-server tier's stager")
        self._held: dict = {}  # a submitted job's address -> what its pointers point into
        self._end = weakref.finalize(self, _free_stager, self._lib, self._st, ops, self._held)
        self._lock_depth = threading.local()

    def _handle(self) -> int:
        if not self._end.alive:
            raise RuntimeError("the parameter-server tier's stager has ended")
        return self._st

    def run(self, job: Job) -> int:
        return self._lib.ps_stager_run(self._handle(), ctypes.byref(job))

    def submit(self, job: Job, keep: object = None) -> None:
        """Queue ``job``; ``keep``: the objects its pointers point into (kept until it is waited for)."""
        st = self._handle()
        self._held[ctypes.addressof(job)] = (job, keep)
        if self._lib.ps_stager_submit(st, ctypes.byref(job)) != 0:
            self._held.pop(ctypes.addressof(job), None)
            raise RuntimeError("cannot start the parameter-server tier's staging thread")

    def wait(self, job: Job) -> int:
        """The job's status once it is done (at once if the stager has ended: it gave the job back
        or finished it then)."""
        status = self._lib.ps_stager_wait(self._st, ctypes.byref(job)) if self._end.alive else job.status
        self._held.pop(ctypes.addressof(job), None)
        return status

    MAX_DEPTH = 4  # ps_stage.c's MAX_FLIGHTS

    def set_depth(self, depth: int) -> None:
        """Submitted jobs in flight at most: their plans are made in order, their store I/O runs
        at once on ``depth`` threads (store lane k on thread k), they finish in order."""
        self._lib.ps_stager_set_depth(self._handle(), int(depth))

    PHASES = ("fetch ids", "cache stage", "wait for slots", "read pushed rows", "store put", "store get",
              "write pulled rows", "init new rows", "cache commit", "remapped ids", "job", "store put+get",
              "rows forwarded", "jobs given back")

    def times(self) -> dict:
        """Seconds per phase of the jobs since the last call (ps_stage.c's timers); the last two
        are counts: rows a job took from an earlier job's push in flight instead of pulling them
        from the store, and jobs given back (a failed job and the jobs in flight after it)."""
        out = (ctypes.c_double * len(self.PHASES))()
        self._lib.ps_stager_times(self._handle(), out)
        return dict(zip(self.PHASES, out))

    def lock(self) -> None:
        depth = getattr(self._lock_depth, "n", 0)
        if depth == 0:
            self._lib.ps_stager_lock(self._handle())  # waits for a running job (ctypes lets the GIL go)
        self._lock_depth.n = depth + 1

    def unlock(self) -> None:
        self._lock_depth.n -= 1
        if self._lock_depth.n == 0:
            self._lib.ps_stager_unlock(self._handle())
