"""The C slot cache (csrc/ps/ps_host.c) against a pure-Python model of the same rules, and
the C init against ``init_rows`` (torch)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recom_rec import ps
from recom_rec.ps import host_lib
from recom_rec.ps.cache import FREE, CacheFull, SlotCache
from recom_rec.ps.tier import _row_seed, _signed, _uniform_bounds


class ReferenceCache:
    """The eviction rules, spelled out: free slots lowest first, then unpinned occupied slots the
    batch does not use, by (score, slot); LRU score = last batch, LFU = (uses, last batch)."""

    def __init__(self, rows, eviction):
        self.rows, self.lfu = rows, eviction == "lfu"
        self.id_of = [FREE] * rows
        self.pins = [0] * rows
        self.last = [0] * rows
        self.uses = [0] * rows
        self.clock = 0

    def stage(self, ids):
        slot_of = {i: s for s, i in enumerate(self.id_of) if i != FREE}
        hits = list(dict.fromkeys(slot_of[i] for i in ids if i in slot_of))
        misses = list(dict.fromkeys(i for i in ids if i not in slot_of))
        free = [s for s in range(self.rows) if self.id_of[s] == FREE and self.pins[s] == 0]
        able = sorted((self.uses[s] * self.lfu, self.last[s], s) for s in range(self.rows)
                      if self.id_of[s] != FREE and self.pins[s] == 0 and s not in hits)
        order = free + [s for *_, s in able]
        if len(misses) > len(order):
            return None
        take = order[:len(misses)]
        evicted = [self.id_of[s] for s in take]
        for s in hits + take:
            self.pins[s] += 1
        return hits, misses, take, evicted

    def commit(self, hits, misses, take):
        for s, i in zip(take, misses):
            self.id_of[s] = i
            self.uses[s] = 0
        self.clock += 1
        for s in hits + take:
            self.last[s] = self.clock
            self.uses[s] += 1

    def unpin(self, slots):
        for s in slots:
            self.pins[s] -= 1


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slot_cache_follows_the_reference_rules(eviction, seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(8, 40))
    c, ref = SlotCache("t", rows, eviction), ReferenceCache(rows, eviction)
    in_flight = []  # (staged, reference slots) of batches not yet released
    universe = int(rng.integers(rows, 4 * rows))
    for step in range(300):
        if in_flight and (len(in_flight) > 2 or rng.random() < 0.4):
            staged, ref_slots = in_flight.pop(int(rng.integers(len(in_flight))))
            c.unpin(staged.slots)
            ref.unpin(ref_slots)
            continue
        n = int(rng.integers(0, rows))
        ids = rng.integers(0, universe, n) * 1_000_003  # sparse ids, duplicates included
        staged = c.stage(ids)
        expected = ref.stage(ids.tolist())
        assert (staged is None) == (expected is None), step
        if staged is None:
            continue
        hits, misses, take, evicted = expected
        assert staged.slots.tolist() == hits + take
        assert staged.new_ids.tolist() == misses and staged.take.tolist() == take
        assert staged.evicted.tolist() == evicted
        if rng.random() < 0.1:  # a failed store: nothing moves
            c.abort(staged)
            ref.unpin(hits + take)
            continue
        c.commit(staged)
        ref.commit(hits, misses, take)
        slot_of = dict(zip(c.id_of.tolist(), range(rows)))
        assert [slot_of[i] for i in ids.tolist()] == staged.pos_slot.tolist()
        assert c.id_of.tolist() == ref.id_of and c.pins.tolist() == ref.pins
        in_flight.append((staged, hits + take))


def test_dirty_victims_are_flagged_and_full_cache_errors():
    c = SlotCache("t", 4, "lru")
    first = c.stage(np.array([10, 11, 12, 13]))
    c.commit(first)
    c.mark_dirty(first.slots[:2])  # 10 and 11 were trained
    c.unpin(first.slots)
    second = c.stage(np.array([13, 20, 21, 22]))
    assert sorted(zip(second.evicted.tolist(), second.push.tolist())) == [(10, True), (11, True), (12, False)]
    c.commit(second)
    assert not c.dirty[second.take].any()  # pulled rows are clean
    assert c.stage(np.array([30])) is None  # all four pinned by the batch in flight: wait
    c.unpin(second.slots)
    with pytest.raises(CacheFull, match="5 distinct ids, more than cache_rows=4"):
        c.stage(np.arange(5))
    with pytest.raises(ValueError, match="ids >= 0, got -3"):
        c.stage(np.array([1, -3]))
    assert c.stats["misses"] == 7 and c.stats["hits"] == 1 and c.stats["evictions"] == 3


def test_drop_frees_slots_lowest_first():
    c = SlotCache("t", 6, "lfu")
    staged = c.stage(np.arange(6) + 100)
    c.commit(staged)
    c.unpin(staged.slots)
    c.drop(np.array([4, 1]))
    assert c.occupied()[0].tolist() == [100, 102, 103, 105]
    again = c.stage(np.array([7, 8, 100]))
    assert again.take.tolist() == [1, 4] and again.pos_slot.tolist() == [1, 4, 0]


@pytest.mark.parametrize("bounds", [(-0.01, 0.01), (0.0, 1.0), (-3.5, 2.25)])
def test_c_init_matches_init_rows(bounds):
    a, b = bounds
    config = EmbeddingBagConfig(name="tbl", embedding_dim=19, num_embeddings=10,
                                feature_names=["f"], init_fn=functools.partial(torch.nn.init.uniform_, a=a, b=b))
    ids = np.array([0, 1, 7, 2**40 + 3, 2**62 + 11, 123456789], dtype=np.int64)
    for seed in (0, 5):
        out = np.zeros((ids.size, 23), dtype=np.float32)  # wider rows: the stride is honoured
        base = _signed(_row_seed("tbl", seed, 0))
        lo, hi = _uniform_bounds(config.init_fn)
        host_lib.lib().ps_init_uniform(host_lib.ptr(ids), None, ids.size, 19, base, lo, hi, host_lib.ptr(out), 23)
        expected = ps.init_rows(config, torch.from_numpy(ids), seed)
        assert torch.equal(torch.from_numpy(out[:, :19]), expected)
        assert not out[:, 19:].any()
        some = np.zeros_like(out)  # only the rows at the given positions
        at = np.array([4, 1], dtype=np.int64)
        host_lib.lib().ps_init_uniform(host_lib.ptr(ids), host_lib.ptr(at), 2, 19, base, lo, hi, host_lib.ptr(some), 23)
        assert torch.equal(torch.from_numpy(some[at, :19]), expected[at])
        assert not np.delete(some, at, axis=0).any()


def test_a_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("RECOM_REC_CACHE", str(tmp_path / "cache"))  # nothing built there yet
    monkeypatch.setattr(host_lib, "installed_library", lambda: None)  # as if installed without the build
    host_lib._loaded.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"compiles csrc/ps/ps_\*\.c on first use.*no-such-cc.*install gcc or set CC"):
            host_lib.lib()
    finally:
        host_lib._loaded.cache_clear()  # the next caller loads the real build again
