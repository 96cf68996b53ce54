"""open_store dispatch, register_store, redact_url, and memory:// namespaces."""
from __future__ import annotations

import pytest
import torch

from recom_rec.ps import RowStore, open_store, redact_url, register_store
from recom_rec.ps.stores import MemoryStore, known_schemes
from recom_rec.ps.stores.memory import drop_memory_namespace


def test_unknown_scheme_lists_known_ones():
    with pytest.raises(ValueError) as info:
        open_store("nosuch://u:secret@host/x")
    message = str(info.value)
    for scheme in ("memory", "redis", "rediss", "unix", "redis+cluster"):
        assert scheme in message
    assert "secret" not in message


def test_url_without_scheme_is_rejected():
    with pytest.raises(ValueError, match="scheme://"):
        open_store("localhost:6379")


def test_register_custom_scheme():
    opened = []

    def factory(url: str) -> RowStore:
        opened.append(url)
        return MemoryStore()

    register_store("customkv", factory)
    assert "customkv" in known_schemes()
    with open_store("CustomKV://anything") as store:
        store.put("t", torch.tensor([1]), torch.ones(1, 2))
        assert store.scan_ids("t").tolist() == [1]
    assert opened == ["CustomKV://anything"]

    with pytest.raises(ValueError, match="already registered"):
        register_store("customkv", factory)
    register_store("customkv", lambda url: MemoryStore(), replace=True)
    with pytest.raises(ValueError):
        register_store("bad://", factory)
    with pytest.raises(TypeError):
        register_store("notcallable", 42)


@pytest.mark.parametrize(
    "url, expected",
    [
        ("redis://alice:secret@h:1/0?prefix=p", "redis://alice:***@h:1/0?prefix=p"),
        ("redis://:secret@h:1", "redis://:***@h:1"),
        ("redis://alice@h:1", "redis://alice@h:1"),
        ("redis://h:1/0?password=secret&prefix=p", "redis://h:1/0?password=***&prefix=p"),
        ("redis+cluster://u:p%40ss@a:1,b:2?prefix=x", "redis+cluster://u:***@a:1,b:2?prefix=x"),
        ("unix:///tmp/r.sock?db=2", "unix:///tmp/r.sock?db=2"),
        ("memory://shared", "memory://shared"),
    ],
)
def test_redact_url(url, expected):
    assert redact_url(url) == expected


def test_named_memory_namespace_is_shared_and_plain_memory_is_private():
    try:
        a, b = open_store("memory://shared-ns"), open_store("memory://shared-ns")
        a.put("t", torch.tensor([4]), torch.full((1, 3), 2.0))
        got, found = b.get("t", torch.tensor([4]), 3, torch.float32)
        assert found.all() and got.eq(2.0).all()
        a.close()  # the namespace outlives its handles, like a server
        with open_store("memory://shared-ns") as c:
            assert c.scan_ids("t").tolist() == [4]

        p, q = open_store("memory://"), open_store("memory://")
        p.put("t", torch.tensor([1]), torch.ones(1, 1))
        assert q.scan_ids("t").numel() == 0
        assert repr(p) == "MemoryStore('memory://')"
    finally:
        drop_memory_namespace("shared-ns")


def test_memory_store_reuses_deleted_slots_and_grows():
    store = MemoryStore()
    ids = torch.arange(3000)
    store.put("t", ids, ids.float().unsqueeze(1))
    store.delete("t", ids[:1000])
    store.put("t", torch.arange(5000, 6500), torch.full((1500, 1), -1.0))
    got, found = store.get("t", torch.tensor([0, 999, 1000, 2999, 5000, 6499]), 1, torch.float32)
    assert found.tolist() == [False, False, True, True, True, True]
    assert got.flatten().tolist() == [0.0, 0.0, 1000.0, 2999.0, -1.0, -1.0]
    assert store.scan_ids("t").numel() == 2000 + 1500


def test_memory_url_rejects_extras():
    with pytest.raises(ValueError):
        open_store("memory://name/path")
    with pytest.raises(ValueError):
        open_store("memory://name?x=1")
