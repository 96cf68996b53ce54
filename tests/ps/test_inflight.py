"""Several batches' staging jobs in flight (``wrap(prefetch=N)``, csrc/ps/ps_stage.c): plans made in
batch order, store I/O of several jobs at once, jobs finished in order. Results equal the in-memory
run; a job missing ids that an earlier job in flight still pushes takes their rows from that job's
push buffer and never pulls them; a failure with jobs in flight gives them all back and loses no
row, also when the failed job's pushes had been forwarded."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recom_rec import ps
from recom_rec.ps import StoreError, StoreUnavailable, register_store
from recom_rec.ps.stores import MemoryStore
from tests.subprocess_env import child_env
from tests.ps.test_tier import SMALL, assert_same_tables, ps_model, redis_url, reference_model, step, train

GROUP = 12  # ids a batch uses; the cache holds three groups


def cycling_batches(n, groups=4, seed=0):
    """Batch k uses the ids of group k % groups: with a cache of three groups, batch k evicts the
    rows of batch k - 3 and batch k + 1 pulls them back, right after they were pushed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        big = (k % groups) * GROUP + torch.randperm(GROUP, generator=g)
        lb = torch.tensor([1] * GROUP + [0] * 4)
        ls = torch.randint(0, 3, (16,), generator=g)
        vs = torch.randint(0, SMALL, (int(ls.sum()),), generator=g)
        out.append(KeyedJaggedTensor(keys=["f_big", "f_small"], values=torch.cat([big, vs]),
                                     lengths=torch.cat([lb, ls])))
    return out


class _SlowStore(MemoryStore):
    """memory:// whose puts take a while (a far store). A put or get called while ``down`` is set,
    or a put from the ``fail_put``-th call on, fails after a second (the jobs after it are
    planned by then). It counts the ids it was asked to get while a put of the same id was still
    running: the store's answer for those is not defined."""

    def __init__(self, put_seconds):
        super().__init__()
        self.put_seconds = put_seconds
        self.down = False
        self.fail_put = None
        self.puts = 0
        self.put_calls = 0
        self.putting = {}  # id -> puts of it running
        self.pulled_while_putting = 0
        self.lock = threading.Lock()

    def _fail_later(self, what):
        time.sleep(1.0)
        raise StoreUnavailable(f"slow://: {what} failed (down)")

    def _put(self, table, ids, rows):
        with self.lock:
            self.put_calls += 1
            failing = self.down or (self.fail_put is not None and self.put_calls >= self.fail_put)
            for i in ids.tolist():
                self.putting[i] = self.putting.get(i, 0) + 1
        try:
            if failing:
                self._fail_later("put")
            time.sleep(self.put_seconds)
            self.puts += 1
            super()._put(table, ids, rows)
        finally:
            with self.lock:
                for i in ids.tolist():
                    self.putting[i] -= 1

    def _get(self, table, ids, width, dtype):
        with self.lock:
            self.pulled_while_putting += sum(self.putting.get(i, 0) > 0 for i in ids.tolist())
        if self.down:
            self._fail_later("get")
        return super()._get(table, ids, width, dtype)


def slow_model(put_seconds, cache_rows=3 * GROUP):
    stores = []
    register_store("slow", lambda url: stores.append(_SlowStore(put_seconds)) or stores[-1], replace=True)
    m = ps_model("slow://", cache_rows=cache_rows)
    return m, stores[-1]


@pytest.mark.parametrize("prefetch", [2, 3])
def test_misses_an_earlier_job_still_pushes_take_its_rows_and_never_pull_them(prefetch):
    data = cycling_batches(12)
    m, store = slow_model(put_seconds=0.15)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    tier = m._ps
    tier.stager_times()  # zeroed
    outs = train(m, data, prefetch)
    times = tier.stager_times()
    for a, b in zip(outs, train(ref, data)):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)
    # the case this test is about happened: jobs planned while the job before them was still
    # pushing the rows they miss (every batch from the fourth on misses the previous one's
    # evictions) took those rows from its push buffer ...
    assert times["rows forwarded"] >= GROUP, times
    # ... and no job asked the store for a row whose put was still running
    assert store.pulled_while_putting == 0
    assert times["jobs given back"] == 0
    assert not tier.tables["big"].cache.pins.any()


def train_in_bursts(model, data, depth, outs=None):
    """wrap's loop (recom_rec/ps/wrap.py) with ``depth`` jobs in flight, except that the jobs of
    ``depth`` batches at a time are submitted while the stager plans nothing, then planned back to
    back: the second job of a burst is planned while the first is surely in flight, however fast
    the store (with wrap that depends on the store's time against the step's). ``outs`` gets the
    outputs of the batches trained, also when a job fails."""
    tier = model._ps
    tier.release_sync()
    tier.join()
    tier.set_depth(depth)
    stager = tier._stager(tier._device())
    outs = [] if outs is None else outs
    for at in range(0, len(data), depth):
        burst = data[at:at + depth]
        stager.lock()
        try:
            pending = [tier.submit(kjt) for kjt in burst]
        finally:
            stager.unlock()
        for k, (kjt, job) in enumerate(zip(burst, pending)):
            try:
                remapped, handle = tier.finish(job)
            except BaseException:
                for later in pending[k + 1:]:  # given back with it (they raise) or done: unpinned
                    try:
                        tier.release(tier.finish(later)[1])
                    except StoreError:
                        pass
                raise
            tier.register_prepared(kjt, remapped, handle)
            outs.append(step(model, kjt))
            tier.unregister_prepared(kjt)
            tier.release(handle)
    return outs


def test_a_job_whose_pushes_were_forwarded_failing_gives_back_the_jobs_that_took_them():
    # bursts of three jobs: batch 6 evicts (pushes) batch 3's rows, which batch 7, planned right
    # after it, takes from its push buffer; batch 6's put fails after a second, when 7 and 8 are
    # planned: all three are given back, and every row ends up where the in-memory run has it
    data = cycling_batches(15, seed=4)
    m, store = slow_model(put_seconds=0.01)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    tier, cache = m._ps, m._ps.tables["big"].cache
    store.fail_put = 4  # batches 3, 4, 5 push once each: the 4th put is batch 6's
    tier.stager_times()
    done = []
    with pytest.raises(StoreUnavailable, match="down"):
        train_in_bursts(m, data, 3, done)
    times = tier.stager_times()
    assert len(done) == 6 and times["jobs given back"] == 3, times
    assert times["rows forwarded"] >= GROUP  # batch 4 took batch 3's pushes, 5 took 4's
    assert not cache.pins.any() and not tier._prepared
    for a, b in zip(done, train(ref, data[:6])):
        assert torch.equal(a, b)
    store.fail_put = None
    tier.stager_times()
    for a, b in zip(train_in_bursts(m, data[6:], 3), train(ref, data[6:])):
        assert torch.equal(a, b)
    assert tier.stager_times()["rows forwarded"] >= 3 * GROUP  # batch 7 takes batch 6's pushes again
    assert store.pulled_while_putting == 0
    assert_same_tables(m, ref)


@pytest.mark.parametrize("prefetch", [1, 2, 4])
@pytest.mark.parametrize("where", ["memory", "redis", "cluster"])
def test_rows_forwarded_between_jobs_in_flight_match_in_memory(where, prefetch, redis_server, redis_cluster):
    # batch k evicts the rows batch k + 1 uses (a cache of three groups, four cycling): a burst's
    # second job misses exactly the rows its first job pushes
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = {"memory": "memory://", "redis": redis_server.url(prefix=prefix),
           "cluster": redis_cluster.url(prefix=prefix)}[where]
    data = cycling_batches(16, seed=7)
    m = ps_model(url, cache_rows=3 * GROUP)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    t = m._ps.tables["big"]
    m._ps.stager_times()
    for a, b in zip(train_in_bursts(m, data, prefetch), train(ref, data)):
        assert torch.equal(a, b)
    forwarded = m._ps.stager_times()["rows forwarded"]
    if prefetch == 1:
        assert forwarded == 0  # one job at a time: every push acknowledged before the next plan
    else:  # the bursts after the first cycle: at least their second job's twelve rows
        assert forwarded >= GROUP * (len(data) // prefetch - 4 // prefetch - 1), forwarded
    if where != "memory":  # the store was asked only for the misses not forwarded
        assert t.store.native_stats()["rows_got"] == t.cache.stats["misses"] - forwarded
    # and with wrap, on the same tables: no result bit changes
    more = cycling_batches(8, seed=8)
    for a, b in zip(train(m, more, prefetch), train(ref, more)):
        assert torch.equal(a, b)
    assert ps.flush(m) > 0
    assert_same_tables(m, ref)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("depth", [2, 4])
def test_forwarded_rows_carry_optimizer_state_on_the_test_device(optimizer, depth):
    # a forwarded row is the pushed row whole: weights and optimizer state (a wrong state shows in
    # the next updates). RECOM_TEST_DEVICE=cuda (the GPU run): the CUDA row ops, pinned buffers
    from ebc_cases import DEVICE

    data = [kjt.to(DEVICE) for kjt in cycling_batches(16, seed=11)]
    m = ps_model("memory://", cache_rows=3 * GROUP, optimizer=optimizer, device=DEVICE)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone(), optimizer, device=DEVICE)
    m._ps.stager_times()
    for a, b in zip(train_in_bursts(m, data, depth), train(ref, data)):
        assert torch.equal(a, b)
    assert m._ps.stager_times()["rows forwarded"] >= GROUP
    more = [kjt.to(DEVICE) for kjt in cycling_batches(8, seed=12)]
    for a, b in zip(train(m, more, depth), train(ref, more)):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)


def test_a_store_failing_with_jobs_in_flight_gives_them_all_back_and_loses_no_row():
    # a cache of four groups, five cycling: a job's slots are free when it is submitted (three
    # batches ahead), so every submitted job is in flight
    data = cycling_batches(14, groups=5)
    m, store = slow_model(put_seconds=0.1, cache_rows=4 * GROUP)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    tier, cache = m._ps, m._ps.tables["big"].cache
    tier.stager_times()
    done = []
    with pytest.raises(StoreUnavailable, match="down"):
        for kjt in ps.wrap(data, m, prefetch=3):
            done.append(step(m, kjt))
            if len(done) == 5:
                # jobs of the next three batches are submitted; the store's calls from now on
                # fail after a second, so the oldest unfinished job fails with later ones planned
                # on top of it
                store.down = True
    times = tier.stager_times()
    assert times["jobs given back"] >= 2, times  # the failed job and at least one after it
    assert not cache.pins.any() and not tier._prepared
    trained = len(done)
    for a, b in zip(done, train(ref, data[:trained])):
        assert torch.equal(a, b)
    # every row the store did not acknowledge is still cached: training goes on exactly
    store.down = False
    for a, b in zip(train(m, data[trained:], prefetch=3), train(ref, data[trained:])):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_redis_jobs_in_flight_on_lanes_of_their_own_match_in_memory(redis_server, prefetch):
    data = cycling_batches(12, seed=3)
    m = ps_model(redis_url(redis_server), cache_rows=3 * GROUP)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    for a, b in zip(train(m, data, prefetch), train(ref, data)):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)
    store = m._ps.tables["big"].store
    lanes = store._lanes
    assert len(lanes) == prefetch and len(set(map(id, lanes))) == prefetch  # a client per I/O thread
    # Which I/O thread takes a job is the scheduler's choice: on a loaded 2-core machine one
    # thread carried every row of a run (CI, 2026-11-26), so only the total is checked.
    assert sum(lane.stats()["rows_put"] + lane.stats()["rows_got"] for lane in lanes) > 0


def test_prepare_after_wrap_waits_for_nothing_left_in_flight():
    # a synchronous prepare (no wrap) after a prefetching loop runs in the calling thread; the
    # stager's depth does not matter to it
    data = cycling_batches(10, seed=5)
    m = ps_model("memory://", cache_rows=3 * GROUP)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    outs = train(m, data[:6], prefetch=4) + train(m, data[6:])
    for a, b in zip(outs, train(ref, data)):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)


class _RandomlyFailingStore(MemoryStore):
    """memory:// whose gets and puts fail at random (seeded), a store with a bad link."""

    def __init__(self, p):
        super().__init__()
        self.p = p
        self.rng = torch.Generator().manual_seed(1)
        self.failures = 0

    def _maybe_fail(self, what):
        if torch.rand((), generator=self.rng).item() < self.p:
            self.failures += 1
            raise StoreUnavailable(f"flaky://: {what} failed")

    def _put(self, table, ids, rows):
        self._maybe_fail("put")
        super()._put(table, ids, rows)

    def _get(self, table, ids, width, dtype):
        self._maybe_fail("get")
        return super()._get(table, ids, width, dtype)


@pytest.mark.parametrize("loop", ["wrap", "bursts"])
def test_random_store_failures_with_four_jobs_in_flight_lose_no_row(loop):
    # every failure takes back the failed job and the ones in flight after it; training restarts
    # at the failed batch and must end exactly where the in-memory run ends. In bursts, a burst's
    # third job takes the rows its first job pushes (batch k evicts batch k + 2's rows), so the
    # failures also hit jobs whose pushes were forwarded and jobs that took forwarded rows.
    stores = []
    register_store("randfail", lambda url: stores.append(_RandomlyFailingStore(0.15)) or stores[-1], replace=True)
    data = cycling_batches(40, groups=5, seed=9)
    m = ps_model("randfail://", cache_rows=3 * GROUP)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    store, tier = stores[-1], m._ps
    tier.stager_times()
    outs, restarts = [], 0
    while len(outs) < len(data):
        try:
            if loop == "wrap":
                for kjt in ps.wrap(data[len(outs):], m, prefetch=4):
                    outs.append(step(m, kjt))
            else:
                train_in_bursts(m, data[len(outs):], 4, outs)
        except StoreUnavailable:
            restarts += 1
            assert not tier.tables["big"].cache.pins.any() and not tier._prepared
            assert restarts < 100
    assert restarts > 0 and store.failures >= restarts
    times = tier.stager_times()
    assert times["jobs given back"] >= restarts
    if loop == "bursts":
        assert times["rows forwarded"] >= GROUP, times
    store.p = 0.0
    for a, b in zip(outs, train(ref, data)):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)


_DROPPED_WITH_JOBS_QUEUED = """
import gc, weakref
from tests.ps.test_inflight import cycling_batches, slow_model
m, store = slow_model(put_seconds=0.05)
tier = m._ps
tier.set_depth(2)
data = cycling_batches(6)
handles = [tier.stage(kjt)[1] for kjt in data[:3]]  # three groups pinned: the cache is full
pending = [tier.submit(kjt) for kjt in data[3:]]  # the first waits for slots that nothing releases
stager = weakref.ref(tier._stager_of)
cycle = [m, tier, pending, handles]
cycle.append(cycle)
del m, tier, pending, handles, cycle
gc.collect()
print("stager ended:", stager() is None)
"""


def test_a_module_dropped_with_jobs_queued_ends_its_stager():
    # A model dropped (here in a reference cycle, as a module and its tier always are) while a job
    # waits for slots only its own batches could release, and more are queued: collecting it ends
    # the stager (the queued jobs given back) instead of waiting forever, and no finalizer frees
    # memory a job still points into.
    out = subprocess.run([sys.executable, "-c", _DROPPED_WITH_JOBS_QUEUED], env=child_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "stager ended: True", out.stdout
