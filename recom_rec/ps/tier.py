"""The parameter-server tier of one fused module: per-batch prepare (find ids, pull misses,
evict), id -> slot remap, flush, export, and state_dict integration.

Rows are moved to and from the store as float32 rows ``[embedding | optimizer state...]``
(fp16/bf16 weights round-trip exactly through float32), so a row evicted and pulled back is
bit-identical to the row that never left the cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import zlib
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from . import host_lib
from .cache import SlotCache, Staged
from .config import PSConfig
from .stores import RowStore, open_store

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
    dtype = dtype or {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}[config.data_type.name]
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
        self.device_init: Optional[bool] = None  # see PSTier._inits_on_device


class PSTier:
    """Attached to a ``recom_rec.EmbeddingBagCollection`` built with ``ps={...}`` as ``module._ps``.

    Two locks: ``lock`` (a condition) guards the caches' metadata, held only for the C calls that
    change it, and is notified when a batch releases its slots; ``_staging`` serialises the
    stagings (a stage and its commit enclose the store I/O, during which the reserved slots'
    ids must not be looked up by another staging) and the other row movers (flush, load)."""

    def __init__(self, module, ps: Dict[str, PSConfig]) -> None:
        self._module_ref = module  # plain attribute: nn.Module does not register it
        self.lock = threading.Condition(threading.RLock())
        self._staging = threading.RLock()
        self._releases = 0  # batches released so far (a staging waiting for slots waits for the next)
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
        self._load_prefix: Optional[str] = None
        self.prefetched = 0  # batches whose rows wrap() staged ahead of the forward
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

    def _write_rows(self, t: _Table, at: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows ``[embedding | optimizer state...]`` (float32) into the slots ``at``."""
        bag = self.module.embedding_bags[t.name]
        dim = t.config.embedding_dim
        w = bag.weight
        rows = rows.to(w.device)
        # Through .data: wrap()'s thread writes rows (never the running batch's) while that
        # batch's autograd graph holds the flat buffer; .data keeps its version counter as is.
        with torch.no_grad():
            w.data.index_copy_(0, at, rows if rows.shape[1] == dim and w.dtype == rows.dtype
                               else rows[:, :dim].to(w.dtype))
            col = dim
            for name, kind in self._states():
                s = bag._buffers[f"optimizer_{name}"]
                n = 1 if kind == "row" else dim
                part = rows[:, col:col + n]
                s.data.index_copy_(0, at, (part.flatten() if kind == "row" else part).to(s.dtype))
                col += n

    def _init_rows_into(self, t: _Table, rows: torch.Tensor, ids: np.ndarray, at: np.ndarray) -> None:
        """Rows ``at`` of ``rows`` (float32, zero) get the initial rows of ``ids[at]``."""
        dim = t.config.embedding_dim
        bounds = _uniform_bounds(t.config.init_fn)
        at_t = torch.from_numpy(at)
        if bounds is not None and t.config.data_type.name == "FP32" and rows.is_contiguous():
            # init_rows' arithmetic in C, straight into the rows (same bits; tested against it)
            base = _signed(_row_seed(t.config.name, int(t.ps.seed), 0))
            host_lib.lib().ps_init_uniform(host_lib.ptr(ids), host_lib.ptr(at), at.size, dim, base, bounds[0],
                                           bounds[1], rows.data_ptr(), rows.shape[1])
        else:
            rows[at_t, :dim] = init_rows(t.config, torch.from_numpy(ids[at]), t.ps.seed).float()
        self._fill_initial_state(t, rows, at_t)

    def _initial_states(self, t: _Table):
        """(name, kind, first column in a row, width, initial value) of each optimizer state."""
        spec = self.module._fused_spec
        col = t.config.embedding_dim
        for name, kind in self._states():
            n = 1 if kind == "row" else t.config.embedding_dim
            yield name, kind, col, n, spec.initial_accumulator_value if name == "sum" else 0.0
            col += n

    def _fill_initial_state(self, t: _Table, rows: torch.Tensor, at=slice(None)) -> None:
        """The optimizer state columns of rows ``at`` (zero) get the optimizer's initial state."""
        for _, _, col, n, value in self._initial_states(t):
            if value != 0.0:
                rows[at, col:col + n] = value

    # ------------------------------------------------------------------ per batch
    #
    # The metadata (id -> slot, pins, dirty, recency) lives on the host, in C: a batch's ids are
    # copied to the host once, and the slots come back in one copy. On a GPU the rows move on a
    # stream of the tier's own, so that wrap()'s thread can stage the next batch while the
    # training stream runs this one. The ordering that keeps results equal to a serial run:
    # - a batch's release makes the tier's stream wait for what the training stream has issued
    #   (the batch's backward): only then may its rows be read for a push or overwritten;
    # - prepare() makes the training stream wait for the tier's stream: the forward reads the
    #   rows just pulled.
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

    def _training_waits(self, device: torch.device) -> None:
        side = self._side(device)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)

    def prepare(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The module's forward hook: the KJT with PS tables' ids replaced by cache slots."""
        device = self._device()
        entry = self._prepared.pop(id(kjt), None)
        if entry is not None and entry[0] is kjt:
            remapped, handle = entry[1], entry[2]  # staged by wrap(); wrap() releases it
            self.prefetched += 1
        else:
            self.release_sync()  # the previous batch is done
            remapped, handle = self.stage(kjt)
            self._sync_handle = handle
        if torch.is_grad_enabled() and handle:
            with self.lock:  # training: the batch's rows will change
                for name, slots in handle.items():
                    self.tables[name].cache.mark_dirty(slots)
        self._training_waits(device)
        if device.type == "cuda" and remapped is not kjt:
            remapped.values().record_stream(torch.cuda.current_stream(device))  # made on the tier's stream
        return remapped

    def uses(self, kjt: KeyedJaggedTensor) -> bool:
        return any(k in t.features for k in kjt.keys() for t in self.tables.values())

    def stage(self, kjt: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, Handle]:
        """Pin the batch's rows in the cache (pulling and evicting as needed) and remap its ids."""
        device = self._device()
        side = self._side(device)
        if side is not None:  # after the batch's ids were made (and, unprefetched, the last step)
            side.wait_stream(torch.cuda.current_stream(device))
        with self._on_side(device):
            return self._stage(kjt, device)

    def _stage(self, kjt: KeyedJaggedTensor, device: torch.device) -> Tuple[KeyedJaggedTensor, Handle]:
        keys = kjt.keys()
        opk = kjt.offset_per_key()
        plan = [(t, [(opk[i], opk[i + 1]) for i, k in enumerate(keys) if k in t.features and opk[i + 1] > opk[i]])
                for t in self.tables.values()]
        plan = [(t, segs) for t, segs in plan if segs]
        if not plan:
            return kjt, {}
        values = kjt.values()
        # One device -> host copy of the span holding every PS feature's ids, one copy back of
        # the span remapped (ids of other features inside it pass through unchanged).
        lo = min(a for _, segs in plan for a, _ in segs)
        hi = max(b for _, segs in plan for _, b in segs)
        span = values[lo:hi].to("cpu", torch.int64).numpy()
        remapped_span = span.copy()
        handle: Handle = {}
        try:
            for t, segs in plan:
                ids = span[segs[0][0] - lo:segs[0][1] - lo] if len(segs) == 1 else np.concatenate(
                    [span[a - lo:b - lo] for a, b in segs])
                staged = self._assign(t, ids)
                handle[t.name] = staged.slots
                pos = 0
                for a, b in segs:
                    remapped_span[a - lo:b - lo] = staged.pos_slot[pos:pos + b - a]
                    pos += b - a
        except BaseException:
            self.release(handle)
            raise
        on_device = torch.from_numpy(remapped_span).to(values.device, values.dtype)
        if lo == 0 and hi == values.numel():
            new_values = on_device
        else:
            new_values = values.clone()
            new_values[lo:hi] = on_device
        remapped = KeyedJaggedTensor(
            keys=keys, values=new_values, weights=kjt.weights_or_none(), lengths=kjt.lengths(),
            offsets=kjt.offsets(), stride=kjt.stride(),
        )
        return remapped, handle

    def _assign(self, t: _Table, ids: np.ndarray) -> Staged:
        """Reserve and fill the slots of a batch's ids of ``t`` (int64, duplicates allowed):
        misses are pulled into free slots or the policy's victims, dirty victims pushed first.
        Waits while batches in flight hold the slots it needs."""
        c = t.cache
        while True:
            with self._staging:
                with self.lock:
                    staged = c.stage(ids)  # raises CacheFull, or ValueError for a negative id
                    seen = self._releases
                if staged is not None:
                    try:
                        self._move_rows(t, staged)
                    except BaseException:
                        with self.lock:
                            c.abort(staged)
                            self.lock.notify_all()
                        raise
                    with self.lock:
                        c.commit(staged)
                    return staged
            with self.lock:  # outside _staging: a flush may run while this waits
                while self._releases == seen:
                    self.lock.wait()

    def _move_rows(self, t: _Table, staged: Staged) -> None:
        """Push the dirty victims (the store acknowledges before their slots are reused), pull
        the misses (never-seen ids get their initial rows) into their slots."""
        m = staged.misses
        if not m:
            return
        push = np.flatnonzero(staged.push)
        rows, found = t.store.get(t.name, staged.new_ids, self.width(t), torch.float32)
        found = found.numpy()
        if self._inits_on_device(t):
            # The initial rows are written on the device: only the stored rows travel. One copy to
            # the device of the slots to read, the slots of stored rows, and the new ids' slots and ids.
            kept, fresh = np.flatnonzero(found), np.flatnonzero(~found)
            parts = [staged.take[push], staged.take[kept], staged.take[fresh], staged.new_ids[fresh]]
            on_device = self._slots_on_device(t, np.concatenate(parts))
            at = np.cumsum([0] + [p.size for p in parts])
            self._push(t, staged, push, on_device[at[0]:at[1]])
            if kept.size:
                self._write_rows(t, on_device[at[1]:at[2]], rows[torch.from_numpy(kept)])
            if fresh.size:
                self._init_rows_on_device(t, on_device[at[2]:at[3]], on_device[at[3]:at[4]])
            return
        fresh = np.flatnonzero(~found)
        if fresh.size:
            self._init_rows_into(t, rows, staged.new_ids, fresh)
        # one copy to the device of the slots to read and the slots to write
        on_device = self._slots_on_device(t, np.concatenate([staged.take[push], staged.take]) if push.size
                                          else staged.take)
        self._push(t, staged, push, on_device[:push.size])
        self._write_rows(t, on_device[push.size:], rows)

    def _push(self, t: _Table, staged: Staged, push: np.ndarray, at: torch.Tensor) -> None:
        if push.size:
            self._put_rows(t, staged.evicted[push], at)
            t.cache.stats["pushed"] += int(push.size)

    def _put_rows(self, t: _Table, ids: np.ndarray, at) -> None:
        """Write the rows of the slots ``at`` (on the rows' device, or host slots) to the store
        under ``ids`` (distinct); returns once the store has them."""
        if isinstance(at, np.ndarray):
            at = self._slots_on_device(t, at)
        t.store.put(t.name, ids, self._read_rows(t, at), unique_ids=True)

    def _inits_on_device(self, t: _Table) -> bool:
        """Whether never-seen rows are written by the GPU kernel (torchrec's uniform init, fp32
        rows on a GPU with Triton)."""
        if t.device_init is None:
            t.device_init = False
            if _uniform_bounds(t.config.init_fn) is not None:
                try:
                    from ..kernels import ps_init  # noqa: F401 - needs Triton
                    t.device_init = True
                except ImportError:
                    pass
        w = self.module.embedding_bags[t.name].weight
        return t.device_init and w.is_cuda and w.dtype == torch.float32

    def _init_rows_on_device(self, t: _Table, slots: torch.Tensor, ids: torch.Tensor) -> None:
        from ..kernels.ps_init import init_uniform_rows

        bag = self.module.embedding_bags[t.name]
        a, b = _uniform_bounds(t.config.init_fn)
        init_uniform_rows(bag.weight.data, slots, ids, _signed(_row_seed(t.config.name, int(t.ps.seed), 0)), a, b)
        for name, _, _, _, value in self._initial_states(t):  # the slots held other rows: their state starts afresh
            bag._buffers[f"optimizer_{name}"].data.index_fill_(0, slots, value)

    def release(self, handle: Optional[Handle]) -> None:
        """Unpin a batch's slots. On a GPU the tier's stream first waits for what the training
        stream has issued so far (the batch's backward): its rows may be evicted after this."""
        if not handle:
            return
        device = self._device()
        side = self._side(device)
        with self.lock:
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(device))
            for name, slots in handle.items():
                self.tables[name].cache.unpin(slots)
            self._releases += 1
            self.lock.notify_all()

    def join(self) -> None:
        """Order the tier's stream and the training stream both ways."""
        if self._stream is not None:
            main = torch.cuda.current_stream(self._stream.device)
            self._stream.wait_stream(main)
            main.wait_stream(self._stream)

    @contextlib.contextmanager
    def _joined(self):
        """Move rows alone (no staging in progress), on the tier's stream after everything issued
        so far, the training stream waiting for it afterwards (flush, load)."""
        device = self._device()
        with self._staging, self.lock:
            self.join()
            with self._on_side(device):
                yield
            self._training_waits(device)

    def release_sync(self) -> None:
        """Unpin the batch the last synchronous ``prepare`` staged (it is done once the next batch
        comes, from ``prepare`` or from ``wrap``, which calls this before it starts staging)."""
        self.release(self._sync_handle)
        self._sync_handle = None

    def register_prepared(self, kjt, remapped, handle) -> None:
        self._prepared[id(kjt)] = (kjt, remapped, handle)

    def unregister_prepared(self, kjt) -> None:
        entry = self._prepared.get(id(kjt))
        if entry is not None and entry[0] is kjt:
            del self._prepared[id(kjt)]

    # ------------------------------------------------------------------ flush / load / export
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
