"""Several batches' staging jobs in flight (``wrap(prefetch=N)``, csrc/ps/ps_stage.c): plans made in
batch order, store I/O of several jobs at once, jobs finished in order. Results equal the in-memory
run; a job pulling ids that an earlier job in flight still pushes waits for that push; a failure
with jobs in flight gives them all back and loses no row."""
from __future__ import annotations

import time

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recom_rec import ps
from recom_rec.ps import StoreUnavailable, register_store
from recom_rec.ps.stores import MemoryStore
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
    """memory:// whose puts take a while (a far store), and that fails while ``down`` is set."""

    def __init__(self, put_seconds):
        super().__init__()
        self.put_seconds = put_seconds
        self.down = False
        self.puts = 0

    def _put(self, table, ids, rows):
        time.sleep(self.put_seconds)
        if self.down:
            raise StoreUnavailable("slow://: put failed (down)")
        self.puts += 1
        super()._put(table, ids, rows)

    def _get(self, table, ids, width, dtype):
        if self.down:
            raise StoreUnavailable("slow://: get failed (down)")
        return super()._get(table, ids, width, dtype)


def slow_model(put_seconds):
    stores = []
    register_store("slow", lambda url: stores.append(_SlowStore(put_seconds)) or stores[-1], replace=True)
    m = ps_model("slow://", cache_rows=3 * GROUP)
    return m, stores[-1]


@pytest.mark.parametrize("prefetch", [2, 3])
def test_pulls_of_rows_an_earlier_job_still_pushes_wait_for_the_push(prefetch):
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
    # the case this test is about happened: a job planned while the job before it was still
    # pushing the rows it pulls (else the run above proves nothing about the ordering)
    assert times["jobs after earlier pushes"] >= 1, times
    assert times["wait for earlier pushes"] > 0
    assert times["jobs given back"] == 0
    assert not tier.tables["big"].cache.pins.any()


def test_a_store_failing_with_jobs_in_flight_gives_them_all_back_and_loses_no_row():
    data = cycling_batches(14)
    m, store = slow_model(put_seconds=0.1)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    tier, cache = m._ps, m._ps.tables["big"].cache
    tier.stager_times()
    done = []
    with pytest.raises(StoreUnavailable, match="down"):
        for kjt in ps.wrap(data, m, prefetch=3):
            done.append(step(m, kjt))
            if len(done) == 5:
                # jobs of the next three batches are submitted; the store's puts take 0.1 s each,
                # so the oldest unfinished job fails with later ones planned on top of it
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
    assert len(lanes) == prefetch  # a client (connections) per I/O thread
    if prefetch > 1:  # more than one lane carried rows
        assert sum(lane.stats()["rows_put"] + lane.stats()["rows_got"] > 0 for lane in lanes) >= 2


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


def test_random_store_failures_with_four_jobs_in_flight_lose_no_row():
    # every failure takes back the failed job and the ones in flight after it; training restarts
    # at the failed batch and must end exactly where the in-memory run ends
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
            for kjt in ps.wrap(data[len(outs):], m, prefetch=4):
                outs.append(step(m, kjt))
        except StoreUnavailable:
            restarts += 1
            assert not tier.tables["big"].cache.pins.any() and not tier._prepared
            assert restarts < 100
    assert restarts > 0 and store.failures >= restarts
    assert tier.stager_times()["jobs given back"] >= restarts
    store.p = 0.0
    for a, b in zip(outs, train(ref, data)):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)
