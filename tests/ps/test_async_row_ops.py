"""The stager keeps the row ops' contract of asynchronous devices (csrc/ps/ps_host.h, RowOps): the
CUDA ops (ps_cuda.c) stage a write_rows' or init_rows' arguments in one pinned buffer per op and
copy it to the GPU asynchronously, so a second call of the same op must come after a sync. Here the
CPU ops are wrapped to behave the same way (the moves run at the next sync, reading the staged
arguments then), so a broken ordering shows on the CPU as it does on a GPU: rows written into the
wrong slots, or an id taken for a slot (the GPU's illegal memory access)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from recom_rec import ps
from recom_rec.ps import PSConfig, native
from tests.ps.test_tier import DIM, train

_I, _P = ctypes.c_int64, ctypes.c_void_p
_FETCH = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, ctypes.c_int, _I, _P)
_SYNC = ctypes.CFUNCTYPE(ctypes.c_int, _P)
_ROWS = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _I, _P)
_INIT = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _P, _I)
_PUT_IDS = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _I, _P, ctypes.c_int)
_HOST_BUFFER = ctypes.CFUNCTYPE(_P, _P, ctypes.c_int, _I)
_ERROR = ctypes.CFUNCTYPE(ctypes.c_char_p, _P)


class DeferredOps:
    """The CPU row ops, with write_rows and init_rows made asynchronous as on a GPU: each call
    copies its slots (and ids) into the op's one staging buffer and queues the move, which runs at
    the next sync (fetch_ids, sync, read_rows, a host buffer, or the job's put_ids, after which
    the training reads the cache), reading the staging buffer and the caller's rows then. A slot outside its cache fails the sync, as the GPU's
    kernel faults. ``rows_of``: cache rows per weight address."""

    def __init__(self, rows_of):
        self.device = torch.device("cpu")
        self.cpu = native.DeviceOps(self.device)
        c = self.cpu.ops
        self._fetch, self._sync = _FETCH(c.fetch_ids), _SYNC(c.sync)
        self._read, self._write, self._init = _ROWS(c.read_rows), _ROWS(c.write_rows), _INIT(c.init_rows)
        self._put_ids, self._host_buffer = _PUT_IDS(c.put_ids), _HOST_BUFFER(c.host_buffer)
        self.rows_of = rows_of
        self.staging = {"write": np.zeros(0, np.int64), "init": np.zeros(0, np.int64)}
        self.queue = []
        self.failure = b""
        self.moves = 0
        self._cbs = [_FETCH(self._on_fetch), _SYNC(self._on_sync), _ROWS(self._on_read), _ROWS(self._on_write),
                     _INIT(self._on_init), _PUT_IDS(self._on_put_ids), _HOST_BUFFER(self._on_host_buffer),
                     _ERROR(self._on_error)]
        self.ops = native.RowOps(c.ctx, *[ctypes.cast(cb, _P) for cb in self._cbs])

    def _run_queue(self) -> int:
        queue, self.queue = self.queue, []
        for kind, layout, k, src in queue:
            st = self.staging[kind]
            slots = st[:k]
            L = native.RowLayout.from_address(layout)
            rows = self.rows_of[L.weight]
            if slots.size and (slots.min() < 0 or slots.max() >= rows):
                bad = int(slots[(slots < 0) | (slots >= rows)][0])
                self.failure = f"slot {bad} outside the cache's {rows} rows ({kind})".encode()
            if self.failure:
                return -1
            self.moves += 1
            ptr = st.ctypes.data
            if kind == "write":
                rc = self._write(self.cpu.ops.ctx, layout, ptr, k, src)
            else:
                rc = self._init(self.cpu.ops.ctx, layout, ptr, ptr + 8 * k, k)
            if rc:
                return rc
        return 0

    def _stage(self, kind, n):
        if self.staging[kind].size < n:  # grown only after the moves reading it (ps_cuda.c's pinned())
            if self._run_queue():
                return None
            self.staging[kind] = np.zeros(2 * n, np.int64)
        return self.staging[kind]

    def _on_fetch(self, ctx, src, id_bytes, n, dst):
        return self._run_queue() or self._fetch(ctx, src, id_bytes, n, dst)

    def _on_sync(self, ctx):
        return self._run_queue()

    def _on_read(self, ctx, layout, slots, k, dst):
        return self._run_queue() or self._read(ctx, layout, slots, k, dst)

    def _on_write(self, ctx, layout, slots, k, src):
        st = self._stage("write", k)
        if st is None:
            return -1
        st[:k] = native._int64s(slots, k)
        self.queue.append(("write", layout, k, src))
        return 0

    def _on_init(self, ctx, layout, slots, ids, k):
        st = self._stage("init", 2 * k)
        if st is None:
            return -1
        st[:k] = native._int64s(slots, k)
        st[k:2 * k] = native._int64s(ids, k)
        self.queue.append(("init", layout, k, None))
        return 0

    def _on_put_ids(self, ctx, values, n, dst, id_bytes):
        # a job's last op; the training reads the cache right after the job (on a GPU, its stream
        # waits for the tier's): the moves queued so far land now, the remapped ids with them
        return self._run_queue() or self._put_ids(ctx, values, n, dst, id_bytes)

    def _on_host_buffer(self, ctx, which, nbytes):
        # the CPU buffer may move when it grows, and a queued write reads its rows from it
        return None if self._run_queue() else self._host_buffer(ctx, which, nbytes)

    def _on_error(self, ctx):
        return self.failure

    def error(self) -> str:
        return self.failure.decode()


TABLES = [EmbeddingBagConfig(name=f"t{k}", embedding_dim=DIM, num_embeddings=5000 + 1000 * k,
                             feature_names=[f"f{k}"]) for k in range(3)]


def model(cache_rows=None):
    torch.manual_seed(3)
    m = recom_rec.EmbeddingBagCollection(
        TABLES, ps=None if cache_rows is None else {t.name: PSConfig("memory://", cache_rows) for t in TABLES})
    m.enable_fused_optimizer("sgd", lr=0.1)
    return m


def data(n, batch=24, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (len(TABLES) * batch,), generator=g)
        counts = lengths.view(len(TABLES), batch).sum(1).tolist()
        values = torch.cat([torch.randint(0, t.num_embeddings, (c,), generator=g) for t, c in zip(TABLES, counts)])
        out.append(KeyedJaggedTensor(keys=[f"f{k}" for k in range(len(TABLES))], values=values, lengths=lengths))
    return out


@pytest.mark.parametrize("prefetch", [None, 1, 3])
def test_several_tables_on_asynchronous_row_ops_train_like_in_memory(prefetch):
    """Every job writes and inits rows of three tables (most ids new, some evicted and pulled back):
    each table's moves must read its own slots, however the ops defer them."""
    cache_rows = 64
    m, ref = model(cache_rows), model()
    with torch.no_grad():
        for t in TABLES:
            ref.embedding_bags[t.name].weight.copy_(ps.init_rows(t, torch.arange(t.num_embeddings)))
    ops = DeferredOps({m.embedding_bags[t.name].weight.data_ptr(): cache_rows for t in TABLES})
    tier = m._ps
    tier._stager_of = native.Stager(ops)
    batches = data(10)
    for a, b in zip(train(m, batches, prefetch), train(ref, batches)):
        assert torch.equal(a, b)
    assert ops.moves > 0 and not ops.failure
    for t in TABLES:
        assert torch.equal(ps.export_table(m, t.name), ref.embedding_bags[t.name].weight.detach())
        assert tier.tables[t.name].cache.stats["pushed"] > 0
