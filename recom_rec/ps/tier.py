"""The parameter-server tier of one fused module: per-batch prepare (find ids, pull misses,
evict), id -> slot remap, flush, export, and state_dict integration.

Rows are moved to and from the store as float32 rows ``[embedding | optimizer state...]``
(fp16/bf16 weights round-trip exactly through float32), so a row evicted and pulled back is
bit-identical to the row that never left the cache.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import inspect
import threading
import weakref
import zlib
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from . import host_lib, native
from .cache import CacheFull, SlotCache
from .config import PSConfig
from .stores import RowStore, StoreError, open_store

Handle = Dict[str, np.ndarray]  # table -> slots pinned by one batch

_MASK63 = (1 << 63) - 1


def cache_configs(tables, ps: Dict[str, PSConfig]):
    """Copies of ``tables`` where each PS-backed table has ``num_embeddings = cache_rows`` (its
    size inside the fused buffer); the other configs are returned as they are."""
    names = {t.name for t in tables}
    unknown = sorted(set(ps) - names)
    if unknown:
        raise ValueError(f"ps names unknown table(s) {unknown}; tables are {sorted(names)}")
    for name, cfg in ps.items():
        if not isinstance(cfg, PSConfig):
            raise TypeError(f"ps[{name!r}] must be a recom_rec.ps.PSConfig, got {type(cfg).__name__}")
    return [dataclasses.replace(t, num_embeddings=int(ps[t.name].cache_rows)) if t.name in ps else t
            for t in tables]


def _row_seed(table: str, seed: int, row: int) -> int:
    """splitmix64 of (table, seed, id): the seed of one row's initial value."""
    x = (zlib.crc32(table.encode()) * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9 + row) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


_GLOBAL_RNG_LOCK = threading.Lock()


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream (a Stream object costs tens of microseconds)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_M1, _M2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _lsr(x, 30)) * _M1  # int64 multiplication wraps, as uint64 would
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def _uniform_bounds(init_fn) -> Optional[Tuple[float, float]]:
    """(a, b) when ``init_fn`` is ``partial(torch.nn.init.uniform_, a=..., b=...)`` (torchrec's
    default), else None."""
    if isinstance(init_fn, functools.partial) and init_fn.func is torch.nn.init.uniform_ and not init_fn.args:
        kw = init_fn.keywords or {}
        if set(kw) <= {"a", "b"}:
            return float(kw.get("a", 0.0)), float(kw.get("b", 1.0))
    return None


def init_rows(config, ids: torch.Tensor, seed: int = 0, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Initial rows ``[len(ids), dim]`` of ``config``'s table, a pure function of
    ``(table name, id, seed)``: they do not depend on cache size, eviction order or which batch
    first used the row.

    torchrec's default ``init_fn`` (uniform in ``[a, b]``) is computed vectorised from a
    splitmix64 hash of (table, seed, id, column), on the ids' device (integer ops and one
    float64 multiply-add: the same bits on the CPU and a GPU); any other
    ``init_fn`` is applied to a ``[1, dim]`` tensor per row under a generator seeded from
    ``(table, id, seed)`` (tens of microseconds per row)."""
    # (the float modules' rule, modules/embedding_modules._table_dtype: integer types are fp16 tables)
    dtype = dtype or {"FP32": torch.float32, "BF16": torch.bfloat16}.get(config.data_type.name, torch.float16)
    ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
    device = ids.device
    init_fn = config.init_fn
    bounds = _uniform_bounds(init_fn)
    if bounds is not None:
        a, b = bounds
        base = _signed(_row_seed(config.name, int(seed), 0))
        cols = torch.arange(config.embedding_dim, dtype=torch.int64, device=ids.device) * _GOLDEN
        h = _splitmix(_splitmix(ids * _M2 + base).unsqueeze(1) + cols)
        u = _lsr(h, 11).to(torch.float64) * (1.0 / (1 << 53))  # [0, 1), 53 random bits
        return (a + (b - a) * u).to(dtype)
    ids = ids.cpu()
    out = torch.empty(ids.numel(), config.embedding_dim, dtype=dtype)
    gen = torch.Generator()
    takes_generator = True
    for k, row in enumerate(ids.tolist()):
        s = _row_seed(config.name, int(seed), row)
        if takes_generator:
            gen.manual_seed(s)
            try:
                init_fn(out[k:k + 1], generator=gen)
                continue
            except TypeError:
                takes_generator = False
        # init_fn without a generator argument: seed the global RNG (restored afterwards)
        with _GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(s)
            init_fn(out[k:k + 1])
    return out.to(device)


class _Table:
    def __init__(self, config, ps: PSConfig, store: RowStore) -> None:
        self.name = config.name
        self.config = config  # as declared (num_embeddings = the real table size)
        self.ps = ps
        self.store = store
        self.features = set(config.feature_names)
        self.cache = SlotCache(config.name, int(ps.cache_rows), ps.eviction)
        # What a staging job reads (native.py): where the cache's rows are, and the store's ops.
        self.layout = native.RowLayout()
        self.layout_key = None  # (weight and state addresses and dtypes, fused optimizer) it was made for
        self.store_ops = (native.StoreOps * 1)()  # per store lane (connections of their own)
        self.py_ops: Optional[native.PythonStoreOps] = None  # callbacks, made for the current row width
        self.native_store = None  # the store's C table the store ops point at (lane 0)
        self.lane_tables: list = []  # the C tables of every store lane
        # Read and written by the job itself (memory://, redis://...): the store's own class
        # offers a C table; a subclass, which may override the I/O, is called back in Python.
        self.native_io = "native_table" in type(store).__dict__
        # its native_table takes a lane: connections of their own per staging I/O thread (Redis)
        self.laned = self.native_io and "lane" in inspect.signature(store.native_table).parameters


class _Pending:
    """A batch's staging job, alive until the job is finished: ``parts`` (table, its TableJob, the
    slots array it fills) per PS table, ``refs`` whatever else the job's pointers point into."""

    def __init__(self, kjt, job, parts, refs, out, stager, ran) -> None:
        self.kjt, self.job, self.parts, self.refs, self.out = kjt, job, parts, refs, out
        self.stager = stager
        self.ran = ran  # run in the calling thread (done), else submitted to the worker


class PSTier:
    """Attached to a ``recom_rec.EmbeddingBagCollection`` built with ``ps={...}`` as ``module._ps``.

    A batch's staging (find its ids' slots, push dirty victims, pull misses, remap) is one native
    job (csrc/ps/ps_stage.c), run in the calling thread by :meth:`stage`, or on the tier's
    worker thread by :meth:`submit` and :meth:`finish` (``wrap``), up to :meth:`set_depth` jobs in
    flight; flush and load wait for the jobs in flight and run before the next one is planned."""

    def __init__(self, module, ps: Dict[str, PSConfig]) -> None:
        self._module_ref = module  # plain attribute: nn.Module does not register it
        stores: Dict[str, RowStore] = {}
        self.tables: Dict[str, _Table] = {}
        for config in module.embedding_bag_configs():
            if config.name in ps:
                cfg = ps[config.name]
                if cfg.url not in stores:
                    stores[cfg.url] = open_store(cfg.url)  # raises StoreUnavailable (password redacted)
                self.tables[config.name] = _Table(config, cfg, stores[cfg.url])
        self.stores = list(stores.values())
        self._prepared: Dict[int, Tuple[KeyedJaggedTensor, KeyedJaggedTensor, Handle]] = {}
        self._sync_handle: Optional[Handle] = None
        self._stream = None  # the tier's CUDA stream (see the per-batch section)
        self._stager_of: Optional[native.Stager] = None
        self._depth = 1  # jobs in flight (set_depth)
        self._store_locks: Dict[int, threading.Lock] = {}  # a store of Python callbacks: one thread at a time
        self._flush_lock = threading.RLock()
        self._load_prefix: Optional[str] = None
        self.prefetched = 0  # batches whose rows wrap() staged ahead of the forward
        self.wrap_loops = 0  # wrap() loops running over this tier (their batches pin cache slots)
        module._register_state_dict_hook(_drop_ps_keys_hook)
        module._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)
        module.register_load_state_dict_post_hook(_load_post_hook)

    # ------------------------------------------------------------------ row layout
    @property
    def module(self):
        return self._module_ref

    def _states(self) -> List[Tuple[str, str]]:
        spec = self.module._fused_spec
        return spec.state_names() if spec is not None else []

    def width(self, t: _Table) -> int:
        dim = t.config.embedding_dim
        return dim + sum(1 if kind == "row" else dim for _, kind in self._states())

    def _slots_on_device(self, t: _Table, slots: np.ndarray) -> torch.Tensor:
        w = self.module.embedding_bags[t.name].weight
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(w.device)

    def _read_rows(self, t: _Table, at: torch.Tensor) -> torch.Tensor:
        """``[len(at), width]`` float32 CPU rows ``[embedding | optimizer state...]`` of the slots
        ``at`` (on the rows' device)."""
        bag = self.module.embedding_bags[t.name]
        parts = [bag.weight.detach().index_select(0, at).float()]
        for name, _ in self._states():
            s = bag._buffers[f"optimizer_{name}"]
            parts.append(s.index_select(0, at).float().reshape(at.numel(), -1))
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).cpu()

    def _initial_states(self, t: _Table):
        """(name, kind, first column in a row, width, initial value) of each optimizer state."""
        spec = self.module._fused_spec
        col = t.config.embedding_dim
        for name, kind in self._states():
            n = 1 if kind == "row" else t.config.embedding_dim
            yield name, kind, col, n, spec.initial_value(name)
            col += n

    def _fill_initial_state(self, t: _Table, rows: torch.Tensor, at=slice(None)) -> None:
        """The optimizer state columns of rows ``at`` (zero) get the optimizer's initial state."""
        for _, _, col, n, value in self._initial_states(t):
            if value != 0.0:
                rows[at, col:col + n] = value

    def _initial_rows(self, t: _Table, ids: torch.Tensor) -> torch.Tensor:
        """float32 store rows of never-seen ``ids``: the init rule in the table's dtype (so they
        round-trip exactly), the optimizer's initial state."""
        dtype = self.module.embedding_bags[t.name].weight.dtype
        rows = torch.zeros(ids.numel(), self.width(t), dtype=torch.float32)
        rows[:, :t.config.embedding_dim] = init_rows(t.config, ids, t.ps.seed, dtype).float()
        self._fill_initial_state(t, rows)
        return rows

    def _initial_rows_of(self, t: _Table):
        """The store ops' init callback for ``t``. It holds the tier weakly: a submitted job holds
        its store ops until the job is waited for or the stager ends (native.Stager), and must not
        keep the module alive."""
        tier = weakref.ref(self)

        def initial_rows(ids: torch.Tensor) -> torch.Tensor:
            live = tier()
            if live is None:
                raise RuntimeError(f"PS table {t.name!r}: its module was freed while a staging job ran")
            return live._initial_rows(t, ids)

        return initial_rows

    def _refresh_native(self, t: _Table) -> None:
        """Points the table's row layout at its rows and state (when they moved, or a fused
        optimizer was enabled: its state widens the rows), and its store ops at the store.

        The row ops (csrc/ps) read and write the state as float32 rows at the addresses the layout
        holds, so the layout is made again whenever the weight or any state buffer moved or changed
        dtype (enabling the same optimizer again makes new state buffers; ``module.half()``
        converts them), and state that is not float32 is refused rather than overrun. A new layout
        each time: the jobs in flight keep the one they were given (``_Pending.refs``)."""
        bag = self.module.embedding_bags[t.name]
        w = bag.weight
        buffers = [bag._buffers[f"optimizer_{name}"] for name, _ in self._states()]
        key = (w.data_ptr(), w.dtype, w.stride(0), self.module._fused_spec,
               tuple((s.data_ptr(), s.dtype, s.numel()) for s in buffers))
        if key != t.layout_key:
            states = list(self._initial_states(t))
            if w.dtype not in native.DTYPES or w.dim() != 2 or w.stride(1) != 1:
                raise TypeError(f"PS table {t.name!r}: its cache rows must be row-contiguous float32, float16 or "
                                f"bfloat16, got {w.dtype} with strides {tuple(w.stride())}")
            for (name, _, _, n, _), s in zip(states, buffers):
                if s.dtype != torch.float32 or not s.is_contiguous() or s.numel() != n * w.shape[0]:
                    raise TypeError(
                        f"PS table {t.name!r}: the fused optimizer's state {name!r} must stay a contiguous float32 "
                        f"buffer of {n} value(s) a row (the parameter-server tier moves it as float32 rows), got "
                        f"{s.dtype} of shape {tuple(s.shape)}; convert the module before enabling the fused optimizer "
                        "(its state is made float32 then)")
            L = native.RowLayout()
            L.weight, L.weight_dtype, L.weight_stride = w.data_ptr(), native.DTYPES[w.dtype], w.stride(0)
            L.dim = t.config.embedding_dim
            L.n_states = len(states)
            for q, ((_, _, _, n, value), s) in enumerate(zip(states, buffers)):
                L.state[q] = s.data_ptr()
                L.state_width[q], L.state_init[q] = n, value
            L.width = self.width(t)
            bounds = _uniform_bounds(t.config.init_fn)
            L.init_uniform = int(bounds is not None and w.dtype == torch.float32)
            if bounds is not None:
                L.init_base = _signed(_row_seed(t.config.name, int(t.ps.seed), 0))
                L.init_a, L.init_b = bounds
            t.layout, t.layout_key = L, key
        L = t.layout
        width = L.width
        table = t.store.native_table(t.name, width) if t.native_io else None  # memory://'s clear() replaces it
        # a store with lanes (Redis: connections per lane) serves each I/O thread on its own lane
        lanes = self._depth if t.laned else 1
        if t.py_ops is None or t.py_ops.width != width or table is not t.native_store or len(t.store_ops) != lanes:
            name = t.name
            ops = (native.StoreOps * lanes)()
            if table is not None:
                t.lane_tables = [table] + [t.store.native_table(name, width, lane=k) for k in range(1, lanes)]
                for op, lane_table in zip(ops, t.lane_tables):
                    lane_table.fill_store_ops(op)
                py = native.PythonStoreOps(None, None, self._initial_rows_of(t), width)
            else:
                t.lane_tables = []
                py = native.PythonStoreOps(lambda ids: t.store.get(name, ids, width, torch.float32),
                                           lambda ids, rows: t.store.put(name, ids, rows, unique_ids=True),
                                           self._initial_rows_of(t), width,
                                           self._store_locks.setdefault(id(t.store), threading.Lock()))
            for op in ops:  # the init of never-seen rows (and a Python store's I/O): one callback
                py.fill(op)
            t.store_ops, t.py_ops, t.native_store = ops, py, table

    # ------------------------------------------------------------------ per batch
    #
    # The metadata (id -> slot, pins, dirty, recency) lives on the host, in C. On a GPU the rows
    # move on a stream of the tier's own, so that a job can stage the next batch while the
    # training stream runs this one. The ordering that keeps results equal to a serial run:
    # - a batch's release makes the tier's stream wait for what the training stream has issued
    #   (the batch's backward): only then may its rows be read for a push or overwritten;
    # - prepare() makes the training stream wait for the tier's stream: the forward reads the
    #   rows just pulled;
    # - a job starts after the training stream's work issued before it (the batch's ids).
    # The staging of batch N+1 never touches a slot of batch N in flight (pinned), so the two
    # streams never write the same rows.

    def _side(self, device: torch.device):
        """The tier's stream on ``device`` (None on the CPU)."""
        if device.type != "cuda":
            return None
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _on_side(self, device: torch.device):
        side = self._side(device)
        return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()

    def _device(self) -> torch.device:
        return next(iter(self.module.embedding_bags[t].weight.device for t in self.tables))

    def _stager(self, device: torch.device) -> native.Stager:
        """The stager moving rows on ``device`` (on the tier's stream on a GPU)."""
        st = self._stager_of
        if st is None or st.device_ops.device != device:
            st = self._stager_of = native.Stager(native.DeviceOps(device, self._side(device)))
        return st

    def _training_waits(self, device: torch.device) -> None:
        if device.type == "cuda":
            side = self._side(device).cuda_stream
            self._stager(device).device_ops.order(side, _current_stream(device))

    def _tier_waits(self, device: torch.device) -> None:
        """The tier's stream waits for what the training stream has issued so far."""
        if device.type == "cuda":
            side = self._side(device).cuda_stream
            self._stager(device).device_ops.order(_current_stream(device), side)

    def prepare(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The module's forward hook: the KJT with PS tables' ids replaced by cache slots."""
        device = self._device()
        entry = self._prepared.pop(id(kjt), None)
        if entry is not None and entry[0] is kjt:
            remapped, handle = entry[1], entry[2]  # staged by wrap(); wrap() releases it
            self.prefetched += 1
        else:
            if self.wrap_loops:
                # The batches wrap() handed out or staged ahead pin their slots until its loop
                # moves on, which it cannot while this forward waits: staging here could wait for
                # those slots forever.
                raise RuntimeError(
                    f"PS tables {sorted(self.tables)}: this batch was not staged by recom_rec.ps.wrap(), whose "
                    "loop is running with batches staged ahead; only the batches it hands out can go through "
                    "the module until the loop ends. Evaluate between wrap() loops (e.g. a loop per epoch "
                    "or per evaluation interval).")
            self.release_sync(device)  # the previous batch is done
            remapped, handle = self.stage(kjt, device)
            self._sync_handle = handle
        if torch.is_grad_enabled() and handle:  # training: the batch's rows will change
            for name, slots in handle.items():
                self.tables[name].cache.mark_dirty(slots)
        self._training_waits(device)
        return remapped

    def uses(self, kjt: KeyedJaggedTensor) -> bool:
        return any(k in t.features for k in kjt.keys() for t in self.tables.values())

    def stage(self, kjt: KeyedJaggedTensor,
              device: Optional[torch.device] = None) -> Tuple[KeyedJaggedTensor, Handle]:
        """Pin the batch's rows in the cache (pulling and evicting as needed) and remap its ids,
        in this thread."""
        pending = self._start(kjt, device or self._device(), submit=False)
        return (kjt, {}) if pending is None else self.finish(pending)

    def set_depth(self, depth: int) -> None:
        """Submitted jobs in flight at most (``wrap``'s prefetch): planned in batch order, their
        store I/O at once, finished in batch order (csrc/ps/ps_stage.c)."""
        self._depth = max(1, min(int(depth), native.Stager.MAX_DEPTH))
        self._stager(self._device()).set_depth(self._depth)

    def submit(self, kjt: KeyedJaggedTensor) -> Optional[_Pending]:
        """Start staging ``kjt`` on the tier's worker thread; :meth:`finish` waits for it. None when
        the batch has no ids of PS tables."""
        return self._start(kjt, self._device(), submit=True)

    def _start(self, kjt: KeyedJaggedTensor, device: torch.device, submit: bool) -> Optional[_Pending]:
        keys = kjt.keys()
        opk = kjt.offset_per_key()
        plan = [(t, [(opk[i], opk[i + 1]) for i, k in enumerate(keys) if k in t.features and opk[i + 1] > opk[i]])
                for t in self.tables.values()]
        plan = [(t, segs) for t, segs in plan if segs]
        if not plan:
            return None
        values = kjt.values()
        if values.device != device:
            raise ValueError(f"the KJT's ids are on {values.device}, the PS tables' cache on {device}")
        if values.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"KJT values must be int64 or int32 for PS tables, got {values.dtype}")
        # The job reads the span holding every PS feature's ids and writes it remapped into a new
        # values tensor (ids of other features inside it pass through unchanged).
        lo = min(a for _, segs in plan for a, _ in segs)
        hi = max(b for _, segs in plan for _, b in segs)
        values = values.contiguous()
        # Made on the training stream, which reads it; the tier's stream writes it after waiting
        # for everything issued so far (the batch's ids, and the memory's last users).
        out = torch.empty_like(values) if lo == 0 and hi == values.numel() else values.clone()
        self._tier_waits(device)
        stager = self._stager(device)
        item = values.element_size()
        tables = (native.TableJob * len(plan))()
        parts, refs = [], [tables, values]
        for tj, (t, segs) in zip(tables, plan):
            self._refresh_native(t)
            seg = torch.tensor([x - lo for ab in segs for x in ab], dtype=torch.int64)
            slots = torch.empty(sum(b - a for a, b in segs), dtype=torch.int64)
            parts.append((t, tj, slots))
            refs += [seg, t.store_ops, t.layout, t.py_ops, t.native_store, list(t.lane_tables)]
            tj.cache, tj.store, tj.layout = t.cache.handle, ctypes.addressof(t.store_ops), ctypes.addressof(t.layout)
            tj.segs, tj.n_segs, tj.slots = seg.data_ptr(), len(segs), slots.data_ptr()
            tj.store_lanes = len(t.store_ops)
        job = native.Job(span=values.data_ptr() + lo * item, id_bytes=item, n=hi - lo,
                         out=out.data_ptr() + lo * item, tables=ctypes.addressof(tables), n_tables=len(plan))
        pending = _Pending(kjt, job, parts, refs, out, stager, ran=not submit)
        if submit:
            stager.submit(job, keep=(parts, refs, out))
        else:
            stager.run(job)
        return pending

    def finish(self, pending: _Pending) -> Tuple[KeyedJaggedTensor, Handle]:
        """Wait for a job; the remapped KJT and the slots it pinned (release them when the batch is
        done). A failed job raises; it gave every slot back itself (ps_stage.c)."""
        job = pending.job
        status = job.status if pending.ran else pending.stager.wait(job)
        if status != host_lib.STAGE_OK:
            t, tj, _ = pending.parts[min(job.done, len(pending.parts) - 1)]
            raise self._job_error(t, tj, status, job, pending.stager)
        handle: Handle = {}
        for t, tj, slots in pending.parts:
            distinct, misses, hits, pushed, evictions = tj.counts
            handle[t.name] = slots[:distinct].numpy()
            stats = t.cache.stats
            stats["hits"] += hits
            stats["misses"] += misses
            stats["pushed"] += pushed
            stats["evictions"] += evictions
        kjt = pending.kjt
        # The same KJT with its ids replaced (a variable batch per feature keeps its strides and
        # inverse indices: the remap works on each key's span of values, whatever its bags).
        variable = kjt.variable_stride_per_key()
        remapped = KeyedJaggedTensor(
            keys=kjt.keys(), values=pending.out, weights=kjt.weights_or_none(), lengths=kjt.lengths(),
            offsets=kjt.offsets(), stride=None if variable else kjt.stride(),
            stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
            length_per_key=kjt.length_per_key(), offset_per_key=kjt.offset_per_key(),
            inverse_indices=kjt.inverse_indices_or_none(),
        )
        return remapped, handle

    def _job_error(self, t: _Table, tj, status: int, job, stager: native.Stager) -> BaseException:
        name, rows = t.name, t.cache.cache_rows
        if status == host_lib.STAGE_STORE_ERROR:
            exc, t.py_ops.error = t.py_ops.error, None  # raised by a Python store or init
            for lane_table in t.lane_tables if exc is None else ():
                exc = lane_table.error()  # the C store's (None: memory:// out of memory)
                if exc is not None:
                    break
            return exc if exc is not None else StoreError(f"{t.store.url} table {name!r}: out of host memory")
        if status == host_lib.STAGE_NEGATIVE_ID:
            names = list(t.config.feature_names)
            which = ("feature " if len(names) == 1 else "features ") + ", ".join(repr(f) for f in names)
            return ValueError(f"{which} (table {name!r}): id {job.error_at} is negative; PS-backed tables take "
                              "ids >= 0")
        if status == host_lib.STAGE_FULL:
            distinct, m, available = tj.counts[0], tj.counts[1], tj.counts[2]
            if distinct > rows:
                return CacheFull(f"table {name!r}: a batch uses {distinct} distinct ids, more than cache_rows={rows}")
            return CacheFull(f"table {name!r}: a batch needs {m} slots but only {available} of cache_rows={rows} "
                             "are free or can be evicted (the rest hold rows of this batch or of batches in "
                             "flight); raise cache_rows")
        if status == host_lib.STAGE_NO_MEMORY:
            return MemoryError(f"table {name!r}: out of host memory staging a batch")
        if status == host_lib.STAGE_ABORTED:
            return StoreError(f"{t.store.url}: a batch staged ahead was given back because the staging of an "
                              "earlier batch failed (that batch raised the cause)")
        return RuntimeError(f"table {name!r}: moving rows failed: {stager.device_ops.error()}")

    def release(self, handle: Optional[Handle], device: Optional[torch.device] = None) -> None:
        """Unpin a batch's slots. On a GPU the tier's stream first waits for what the training
        stream has issued so far (the batch's backward): its rows may be evicted after this."""
        if not handle:
            return
        self._tier_waits(device or self._device())
        for name, slots in handle.items():
            self.tables[name].cache.unpin(slots)

    def join(self) -> None:
        """Order the tier's stream and the training stream both ways."""
        if self._stream is not None:
            main = torch.cuda.current_stream(self._stream.device)
            self._stream.wait_stream(main)
            main.wait_stream(self._stream)

    @contextlib.contextmanager
    def _joined(self):
        """Move rows alone (no staging job running), on the tier's stream after everything issued
        so far, the training stream waiting for it afterwards (flush, load)."""
        device = self._device()
        stager = self._stager(device)
        with self._flush_lock:
            stager.lock()
            try:
                self.join()
                with self._on_side(device):
                    yield
                self._training_waits(device)
            finally:
                stager.unlock()

    def stager_times(self) -> Dict[str, float]:
        """Seconds per phase of the staging jobs since the last call (csrc/ps/ps_stage.c)."""
        return self._stager_of.times() if self._stager_of is not None else {}

    def release_sync(self, device: Optional[torch.device] = None) -> None:
        """Unpin the batch the last synchronous ``prepare`` staged (it is done once the next batch
        comes, from ``prepare`` or from ``wrap``, which calls this before it starts staging)."""
        self.release(self._sync_handle, device)
        self._sync_handle = None

    def register_prepared(self, kjt, remapped, handle) -> None:
        self._prepared[id(kjt)] = (kjt, remapped, handle)

    def unregister_prepared(self, kjt) -> None:
        entry = self._prepared.get(id(kjt))
        if entry is not None and entry[0] is kjt:
            del self._prepared[id(kjt)]

    # ------------------------------------------------------------------ flush / load / export
    def _put_rows(self, t: _Table, ids: np.ndarray, slots: np.ndarray) -> None:
        """Write the rows of cache ``slots`` to the store under ``ids`` (distinct); returns once the
        store has them."""
        t.store.put(t.name, ids, self._read_rows(t, self._slots_on_device(t, slots)), unique_ids=True)

    def flush(self, tables=None) -> int:
        """Push every dirty cached row (with optimizer state); returns how many were written."""
        written = 0
        with self._joined():
            for t in self.tables.values():
                if tables is not None and t.name not in tables:
                    continue
                c = t.cache
                dirty = np.flatnonzero(c.dirty)
                if dirty.size:
                    self._put_rows(t, c.id_of[dirty], dirty)
                    c.dirty[dirty] = 0  # only after the store acknowledged
                    written += int(dirty.size)
        return written

    def _evict(self, t: _Table, victims: np.ndarray) -> None:
        """Push the dirty victims (the store acknowledges), then free the slots."""
        c = t.cache
        dirty = victims[c.dirty[victims].astype(bool)]
        if dirty.size:
            self._put_rows(t, c.id_of[dirty], dirty)
            c.stats["pushed"] += int(dirty.size)
        c.drop(victims)

    def load_table(self, name: str, weight: torch.Tensor, chunk: int = 65536) -> None:
        """Write ``weight`` (rows = ids 0..n-1) into the store, with fresh optimizer state, and
        drop the table's cached rows (their dirty ones are pushed first)."""
        t = self.tables[name]
        weight = weight.detach().cpu()
        if weight.dim() != 2 or weight.shape[1] != t.config.embedding_dim:
            raise ValueError(f"table {name!r}: expected a [n, {t.config.embedding_dim}] weight, got {tuple(weight.shape)}")
        with self._joined():
            c = t.cache
            if bool((c.pins > 0).any()):
                raise RuntimeError(f"table {name!r}: cannot load while batches are in flight")
            _, occupied = c.occupied()
            if occupied.size:
                self._evict(t, occupied)
            n = weight.shape[0]
            for a in range(0, n, chunk):
                ids = torch.arange(a, min(a + chunk, n), dtype=torch.int64)
                rows = torch.zeros(ids.numel(), self.width(t), dtype=torch.float32)
                self._fill_initial_state(t, rows)
                rows[:, :t.config.embedding_dim] = weight[a:a + ids.numel()].float()
                t.store.put(name, ids, rows, unique_ids=True)

    def export_table(self, name: str, max_rows: int = 1 << 24) -> torch.Tensor:
        """The table's full weight ``[num_embeddings, dim]`` (after a flush): stored rows from the
        store, never-seen rows by the init rule."""
        t = self.tables[name]
        n = t.config.num_embeddings
        if n > max_rows:
            raise ValueError(f"table {name!r} has {n} rows, more than max_rows={max_rows}")
        self.flush([name])
        dim = t.config.embedding_dim
        stored = t.store.scan_ids(name)
        stored = stored[stored < n]
        rows, _ = t.store.get(name, stored, self.width(t), torch.float32)
        weight = torch.empty(n, dim, dtype=self.module.embedding_bags[name].weight.dtype)
        seen = torch.zeros(n, dtype=torch.bool)
        seen[stored] = True
        missing = (~seen).nonzero().flatten()
        if missing.numel():
            weight[missing] = init_rows(t.config, missing, t.ps.seed, weight.dtype)
        weight[stored] = rows[:, :dim].to(weight.dtype)
        return weight


# ---------------------------------------------------------------------- state_dict hooks


def _ps_key(key: str, prefix: str, tables) -> bool:
    rest = key[len(prefix):] if key.startswith(prefix) else None
    return rest is not None and any(rest.startswith(f"embedding_bags.{t}.") for t in tables)


def _drop_ps_keys_hook(module, state_dict, prefix, local_metadata):
    """PS-backed tables live in their store (see ``recom_rec.ps.flush``), not in the state_dict."""
    for key in [k for k in state_dict if _ps_key(k, prefix, module._ps.tables)]:
        del state_dict[key]
    return state_dict


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    tier = module._ps
    tier._load_prefix = prefix
    for name in tier.tables:
        key = f"{prefix}embedding_bags.{name}.weight"
        if key in state_dict:
            tier.load_table(name, state_dict[key])
    for key in [k for k in state_dict if _ps_key(k, prefix, tier.tables)]:
        del state_dict[key]  # load_state_dict passes its own copy of the user's dict


def _load_post_hook(module, incompatible_keys):
    tier = module._ps
    prefix = tier._load_prefix or ""
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys
                                         if not _ps_key(k, prefix, tier.tables)]


# ---------------------------------------------------------------------- public helpers


def tiers_of(model) -> List[PSTier]:
    """The PS tiers of ``model``'s modules, including those a module keeps outside its submodule
    tree and reports with ``ps_tiers()`` (a sharded module's per-rank lookups)."""
    tiers = {}
    for m in model.modules():
        if getattr(m, "_ps", None) is not None:
            tiers[id(m._ps)] = m._ps
        if callable(getattr(m, "ps_tiers", None)):
            tiers.update((id(t), t) for t in m.ps_tiers())
    return list(tiers.values())


def flush(model) -> int:
    """Write every dirty cached row of every PS-backed table in ``model`` to its store."""
    return sum(t.flush() for t in tiers_of(model))


def export_table(model, table: str, max_rows: int = 1 << 24) -> torch.Tensor:
    """Read PS-backed ``table`` back as a full ``[num_embeddings, dim]`` weight (flushes first)."""
    for tier in tiers_of(model):
        if table in tier.tables:
            return tier.export_table(table, max_rows)
    raise KeyError(f"no PS-backed table {table!r} in the model")
