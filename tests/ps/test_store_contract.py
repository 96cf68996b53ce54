"""Behaviour every RowStore must have, run against memory:// and a real redis://."""
from __future__ import annotations

import uuid

import pytest
import torch

from recom_rec.ps import StoreError, open_store

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=["memory", "redis"])
def store_url(request):
    if request.param == "memory":
        return "memory://"
    server = request.getfixturevalue("redis_server")
    # A fresh prefix per test keeps tests on the shared server independent.
    return server.url(prefix=f"t{uuid.uuid4().hex}", retry_timeout=5)


@pytest.fixture
def store(store_url):
    with open_store(store_url) as s:
        yield s


def random_rows(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [1, 7, 64, 300])
def test_round_trip_is_bit_exact(store, dtype, width):
    g = torch.Generator().manual_seed(width)
    ids = torch.randint(-(2**62), 2**62, (500,), generator=g)  # negative and huge ids too
    ids = torch.unique(ids)
    rows = random_rows(ids.numel(), width, dtype, seed=width)
    store.put("emb", ids, rows)

    perm = torch.randperm(ids.numel(), generator=g)
    got, found = store.get("emb", ids[perm], width, dtype)
    assert found.all()
    assert got.dtype == dtype and got.shape == (ids.numel(), width)
    assert torch.equal(got.view(torch.uint8), rows[perm].view(torch.uint8))


def test_duplicate_ids_in_one_put_last_wins(store):
    ids = torch.tensor([5, 3, 5, 9, 3, 5])
    rows = torch.arange(6, dtype=torch.float32).unsqueeze(1).repeat(1, 4)
    store.put("t", ids, rows)
    got, found = store.get("t", torch.tensor([5, 3, 9, 5]), 4, torch.float32)
    assert found.all()
    assert got[:, 0].tolist() == [5.0, 4.0, 3.0, 5.0]


def test_missing_ids_are_zero_and_not_found(store):
    store.put("t", torch.tensor([1, 2]), torch.ones(2, 3))
    got, found = store.get("t", torch.tensor([7, 1, 8, 2]), 3, torch.float32)
    assert found.tolist() == [False, True, False, True]
    assert torch.equal(got[~found], torch.zeros(2, 3))
    assert torch.equal(got[found], torch.ones(2, 3))

    got, found = store.get("never_written", torch.tensor([1, 2]), 3, torch.float16)
    assert not found.any() and got.dtype == torch.float16 and not got.any()


def test_overwrite_replaces_rows(store):
    ids = torch.arange(10)
    store.put("t", ids, torch.zeros(10, 2))
    store.put("t", ids[::2], torch.ones(5, 2))
    got, _ = store.get("t", ids, 2, torch.float32)
    assert got[:, 0].tolist() == [1.0, 0.0] * 5


def test_large_batch(store):
    n, width = 50_000, 32
    ids = torch.randperm(10 * n)[:n]
    rows = random_rows(n, width, torch.float32, seed=1)
    store.put("big", ids, rows)
    got, found = store.get("big", ids.flip(0), width, torch.float32)
    assert found.all()
    assert torch.equal(got, rows.flip(0))
    assert torch.equal(store.scan_ids("big"), torch.sort(ids).values)


def test_scan_delete_clear(store):
    store.put("a", torch.tensor([3, 1, 2, -4]), torch.ones(4, 2))
    store.put("b", torch.tensor([10]), torch.ones(1, 2))
    assert store.scan_ids("a").tolist() == [-4, 1, 2, 3]

    store.delete("a", torch.tensor([1, 1, 99]))  # duplicates and unknown ids are fine
    assert store.scan_ids("a").tolist() == [-4, 2, 3]
    _, found = store.get("a", torch.tensor([1, 2]), 2, torch.float32)
    assert found.tolist() == [False, True]

    store.clear("a")
    assert store.scan_ids("a").numel() == 0
    assert store.scan_ids("b").tolist() == [10]  # other tables untouched
    assert store.scan_ids("empty").dtype == torch.int64


def test_tables_with_glob_characters_are_separate(store):
    store.put("t*", torch.tensor([1]), torch.ones(1, 1))
    store.put("t[x]", torch.tensor([2]), torch.ones(1, 1))
    store.put("tt", torch.tensor([3]), torch.ones(1, 1))
    assert store.scan_ids("t*").tolist() == [1]
    assert store.scan_ids("t[x]").tolist() == [2]
    store.clear("t*")
    assert store.scan_ids("tt").tolist() == [3]


def test_reading_with_wrong_layout_is_an_error(store):
    store.put("t", torch.tensor([1]), torch.ones(1, 4))
    with pytest.raises(StoreError, match="width"):
        store.get("t", torch.tensor([1]), 5, torch.float32)


def test_empty_batches_and_bad_arguments(store):
    store.put("t", torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3))
    got, found = store.get("t", torch.zeros(0, dtype=torch.int64), 3, torch.float32)
    assert got.shape == (0, 3) and found.shape == (0,)
    with pytest.raises(ValueError):
        store.put("t", torch.tensor([1, 2]), torch.ones(3, 2))
    with pytest.raises(ValueError):
        store.put("t", torch.tensor([1]), torch.ones(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError):
        store.put("a:b", torch.tensor([1]), torch.ones(1, 2))


def test_closed_store_refuses_work(store_url):
    store = open_store(store_url)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        store.get("t", torch.tensor([1]), 1, torch.float32)


def test_large_batches_with_absent_duplicate_and_deleted_ids(store):
    # Batches past a few hundred ids run memory://'s shards on several threads (where the machine
    # has the cores): the same answers as one id at a time.
    g = torch.Generator().manual_seed(11)
    ids = torch.unique(torch.randint(0, 2**40, (6000,), generator=g))
    rows = random_rows(ids.numel(), 16, torch.float32, seed=3)
    store.put("big", ids, rows)
    absent = ids[:300] + 2**41
    asked = torch.cat([ids, ids[:1000], absent])[torch.randperm(ids.numel() + 1300, generator=g)]
    got, found = store.get("big", asked, 16, torch.float32)
    expected = dict(zip(ids.tolist(), rows))
    for i, (k, hit) in enumerate(zip(asked.tolist(), found.tolist())):
        assert hit == (k in expected)
        assert torch.equal(got[i], expected[k] if hit else torch.zeros(16))
    store.delete("big", ids[::2])
    assert torch.equal(store.scan_ids("big"), torch.sort(ids[1::2]).values)
    store.put("big", ids[::2], rows[::2] + 1)  # rows of deleted ids are reused
    got, found = store.get("big", ids, 16, torch.float32)
    assert found.all() and torch.equal(got[::2], rows[::2] + 1) and torch.equal(got[1::2], rows[1::2])
