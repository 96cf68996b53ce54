"""The parameter-server tier: cached PS tables train exactly like in-memory tables."""
from __future__ import annotations

import uuid

import pytest
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from recom_rec import ps
from recom_rec.ps import PSConfig, StoreUnavailable, register_store
from recom_rec.ps.stores import MemoryStore

BIG, SMALL, DIM = 1000, 20, 8


def configs(dtype=DataType.FP32):
    return [
        EmbeddingBagConfig(name="big", embedding_dim=DIM, num_embeddings=BIG, feature_names=["f_big"],
                           data_type=dtype),
        # one dtype for both: a module with two dtype groups and a fused optimizer fails its
        # backward on this branch's base (the groups share the in-place step counter)
        EmbeddingBagConfig(name="small", embedding_dim=DIM, num_embeddings=SMALL, feature_names=["f_small"],
                           data_type=dtype),
    ]


def batches(n, batch_size=16, seed=0, big=BIG):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lb = torch.randint(0, 4, (batch_size,), generator=g)
        ls = torch.randint(0, 3, (batch_size,), generator=g)
        vb = torch.randint(0, big, (int(lb.sum()),), generator=g)
        vs = torch.randint(0, SMALL, (int(ls.sum()),), generator=g)
        out.append(KeyedJaggedTensor(keys=["f_big", "f_small"], values=torch.cat([vb, vs]),
                                     lengths=torch.cat([lb, ls])))
    return out


def ps_model(url, cache_rows=40, eviction="lru", optimizer="sgd", dtype=DataType.FP32, device=None, **kw):
    torch.manual_seed(0)
    m = recom_rec.EmbeddingBagCollection(configs(dtype), ps={"big": PSConfig(url, cache_rows, eviction)},
                                         device=device, **kw)
    if optimizer:
        m.enable_fused_optimizer(optimizer, **opt_kwargs(optimizer))
    return m


def opt_kwargs(optimizer):
    return {"lr": 0.1} if optimizer != "adagrad" else {"lr": 0.1, "initial_accumulator_value": 0.1}


def reference_model(small_weight, optimizer="sgd", dtype=DataType.FP32, device=None):
    """The same tables all in memory, big initialised by the PS init rule."""
    m = recom_rec.EmbeddingBagCollection(configs(dtype), device=device)
    with torch.no_grad():
        m.embedding_bags["big"].weight.copy_(ps.init_rows(configs(dtype)[0], torch.arange(BIG), seed=0))
        m.embedding_bags["small"].weight.copy_(small_weight)
    if optimizer:
        m.enable_fused_optimizer(optimizer, **opt_kwargs(optimizer))
    return m


def step(model, kjt):
    out = model(kjt).values()
    target = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    loss = ((out - target) ** 2).sum()
    loss.backward()
    return out.detach().clone()


def train(model, data, prefetch=None):
    it = data if prefetch is None else ps.wrap(data, model, prefetch=prefetch)
    return [step(model, kjt) for kjt in it]


def assert_same_tables(ps_m, ref):
    assert torch.equal(ps.export_table(ps_m, "big"), ref.embedding_bags["big"].weight.detach().cpu())
    assert torch.equal(ps_m.embedding_bags["small"].weight.detach(), ref.embedding_bags["small"].weight.detach())


def redis_url(server, **query):
    return server.url(prefix=f"t{uuid.uuid4().hex[:8]}", **query)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_cached_training_matches_in_memory(store, redis_server):
    url = "memory://" if store == "memory" else redis_url(redis_server)
    data = batches(12)
    m = ps_model(url, cache_rows=40)  # ~30 distinct ids per batch: evictions every step
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    outs = train(m, data)
    ref_outs = train(ref, data)
    for a, b in zip(outs, ref_outs):
        assert torch.equal(a, b)
    stats = m._ps.tables["big"].cache.stats
    assert stats["evictions"] >= len(data) * 10 and stats["pushed"] > 0 and stats["hits"] > 0
    assert ps.flush(m) > 0
    assert_same_tables(m, ref)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("prefetch", [None, 1, 2, 4])
def test_cached_training_on_the_test_device_matches_in_memory(optimizer, prefetch):
    # RECOM_TEST_DEVICE=cuda (the GPU run) puts the cache on the GPU and runs the Triton kernels;
    # with prefetch the tier stages on its own CUDA stream while the batch before trains, so a
    # missing wait between the streams shows here as a row read before its update.
    from ebc_cases import DEVICE

    data = [kjt.to(DEVICE) for kjt in batches(16, seed=8, big=200)]
    m = ps_model("memory://", cache_rows=48, optimizer=optimizer, device=DEVICE)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone(), optimizer, device=DEVICE)
    for a, b in zip(train(m, data, prefetch=prefetch), train(ref, data)):
        assert torch.equal(a, b)
    assert m._ps.tables["big"].cache.stats["pushed"] > 0
    assert_same_tables(m, ref)


@pytest.mark.parametrize("optimizer,eviction", [("rowwise_adagrad", "lru"), ("adagrad", "lfu"), ("adam", "lru")])
def test_optimizer_state_travels_with_rows(optimizer, eviction):
    data = batches(8, seed=1, big=120)  # ids repeat across batches, so state read back matters
    m = ps_model("memory://", cache_rows=40, eviction=eviction, optimizer=optimizer)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone(), optimizer)
    for a, b in zip(train(m, data), train(ref, data)):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)


@pytest.mark.parametrize("dtype", [DataType.FP16, DataType.BF16])
def test_half_precision_tables_round_trip_exactly(dtype):
    data = batches(6, seed=6, big=120)
    m = ps_model("memory://", cache_rows=40, optimizer="rowwise_adagrad", dtype=dtype)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone(), "rowwise_adagrad", dtype)
    assert m.embedding_bags["big"].weight.dtype == ps.export_table(m, "big").dtype != torch.float32
    for a, b in zip(train(m, data), train(ref, data)):
        assert torch.equal(a, b)
    assert m._ps.tables["big"].cache.stats["pushed"] > 0
    assert_same_tables(m, ref)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_wrap_gives_identical_results(prefetch):
    data = batches(10, seed=2, big=150)
    plain = ps_model("memory://", cache_rows=64)
    wrapped = ps_model("memory://", cache_rows=64)
    # a parent model and (kjt, label) batches, as a training loop would have them
    parent = torch.nn.Sequential(torch.nn.ModuleDict({"ebc": wrapped}))
    wrapped_outs = [step(wrapped, kjt) for kjt, _ in ps.wrap([(k, 0) for k in data], parent, prefetch=prefetch)]
    for a, b in zip(train(plain, data), wrapped_outs):
        assert torch.equal(a, b)
    assert wrapped._ps.prefetched == len(data) and plain._ps.prefetched == 0
    assert not wrapped._ps.tables["big"].cache.pins.any()  # every batch released
    assert torch.equal(ps.export_table(plain, "big"), ps.export_table(wrapped, "big"))


def test_wrap_stopped_early_releases_everything():
    data = batches(6, seed=7, big=150)
    m = ps_model("memory://", cache_rows=64)
    for i, kjt in enumerate(ps.wrap(data, m, prefetch=2)):
        step(m, kjt)
        if i == 2:
            break
    assert not m._ps.tables["big"].cache.pins.any() and not m._ps._prepared
    train(m, data[3:])  # and training goes on without wrap


def test_a_batch_wrap_did_not_stage_is_refused_inside_its_loop_not_waited_for():
    # The cache holds about one batch: the batch wrap() staged ahead waits for the running one's
    # slots, so staging any other batch inside the loop (an evaluation) could only wait forever.
    data = batches(6, seed=12, big=120)
    other = batches(1, seed=13, big=120)[0]
    per_batch = max(int(torch.unique(kjt["f_big"].values()).numel()) for kjt in data + [other])
    m = ps_model("memory://", cache_rows=per_batch + 2)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    outs = []
    for i, kjt in enumerate(ps.wrap(data, m, prefetch=2)):
        outs.append(step(m, kjt))
        if i == 1:
            with torch.no_grad(), pytest.raises(RuntimeError, match="not staged by recom_rec.ps.wrap"):
                m(other)
    for a, b in zip(outs, train(ref, data)):  # the refusal changed nothing
        assert torch.equal(a, b)
    assert not m._ps.tables["big"].cache.pins.any() and m._ps.wrap_loops == 0
    with torch.no_grad():  # after the loop, any batch goes through
        torch.testing.assert_close(m(other).values(), ref(other).values(), rtol=0, atol=0)


def test_restart_from_store_continues_exactly(redis_server):
    url = redis_url(redis_server)
    data = batches(10, seed=3)
    first = ps_model(url)
    small = first.embedding_bags["small"].weight.detach().clone()
    train(first, data[:6])
    ps.flush(first)
    saved = first.state_dict()  # the ordinary tables; PS tables live in the store
    assert not any(k.startswith("embedding_bags.big.") for k in saved)
    del first
    second = ps_model(url)
    second.load_state_dict(saved)
    train(second, data[6:])
    ref = reference_model(small)
    train(ref, data)
    assert_same_tables(second, ref)


@pytest.mark.parametrize("prefetch", [None, 2])
def test_redis_killed_mid_run_loses_no_dirty_row(start_redis, prefetch):
    # the rows go through the staging job's own Redis client (csrc/ps/ps_redis.c)
    server = start_redis(appendonly=True)
    url = redis_url(server, retry_timeout=0.3)
    data = batches(8, seed=4)
    m = ps_model(url)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    train(m, data[:3], prefetch)
    train(ref, data[:3])
    cache = m._ps.tables["big"].cache
    dirty_before = set(cache.id_of[cache.dirty.astype(bool)].tolist())
    server.stop()
    with pytest.raises(StoreUnavailable) as info:
        train(m, data[3:4], prefetch)  # its misses need evictions, whose pushes fail
    assert "retry" in str(info.value) or "unreachable" in str(info.value)
    dirty_after = set(cache.id_of[cache.dirty.astype(bool)].tolist())
    assert dirty_before <= dirty_after  # nothing dirty was dropped
    with pytest.raises(StoreUnavailable):
        ps.flush(m)
    assert not cache.pins.any()
    server.start()  # same port, AOF replays the acknowledged rows
    assert ps.flush(m) >= len(dirty_before)
    train(m, data[3:], prefetch)
    train(ref, data[3:])
    assert_same_tables(m, ref)


def test_unreachable_store_at_start_names_url_without_password():
    from tests.redis_server import free_port

    url = f"redis://user:hunter2@127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailable) as info:
        ps_model(url)
    assert "hunter2" not in str(info.value) and "127.0.0.1" in str(info.value)


def test_load_state_dict_writes_full_table_to_store():
    m = ps_model("memory://", cache_rows=40)
    full = torch.randn(BIG, DIM)
    sd = {"embedding_bags.big.weight": full, "embedding_bags.small.weight": torch.randn(SMALL, DIM)}
    m.load_state_dict(sd)
    assert torch.equal(ps.export_table(m, "big"), full)
    kjt = batches(1, seed=5)[0]
    ref = reference_model(sd["embedding_bags.small.weight"])
    with torch.no_grad():
        ref.embedding_bags["big"].weight.copy_(full)
        assert torch.equal(m(kjt).values(), ref(kjt).values())


def test_eviction_policies_and_errors():
    m = ps_model("memory://", cache_rows=4, optimizer=None)
    kjt = KeyedJaggedTensor(keys=["f_big", "f_small"], values=torch.arange(5), lengths=torch.tensor([5, 0]))
    with pytest.raises(RuntimeError, match="cache_rows=4"):
        m(kjt)
    bad = KeyedJaggedTensor(keys=["f_big", "f_small"], values=torch.tensor([-1]), lengths=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="feature 'f_big' \\(table 'big'\\): id -1 is negative; .*ids >= 0"):
        m(bad)
    # ids beyond int32 and beyond num_embeddings are fine for a PS table
    huge = KeyedJaggedTensor(keys=["f_big", "f_small"], values=torch.tensor([2**40, 7]), lengths=torch.tensor([1, 1]))
    with torch.no_grad():
        out = m(huge).values()
    expected = ps.init_rows(configs()[0], torch.tensor([2**40]))
    assert torch.equal(out[0, :DIM], expected[0])
    with pytest.raises(ValueError, match="eviction"):
        PSConfig("memory://", 4, "fifo")


def test_dense_gradients_with_plain_sgd_match_in_memory():
    data = batches(6, seed=9, big=150)
    m = ps_model("memory://", cache_rows=40, optimizer=None)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone(), optimizer=None)
    opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in (m, ref)]
    for kjt in data:
        for x, opt in zip((m, ref), opts):
            opt.zero_grad()
            step(x, kjt)
            opt.step()
    assert m._ps.tables["big"].cache.stats["pushed"] > 0
    assert_same_tables(m, ref)


def test_wrap_after_unwrapped_batches_does_not_wait_on_their_pins():
    # Warm-up batches trained without wrap() leave the last one pinned until the next prepare;
    # wrap() must unpin it, or a cache with room for about two batches waits forever.
    data = batches(6, seed=3, big=120)
    per_batch = max(int(torch.unique(kjt["f_big"].values()).numel()) for kjt in data)
    m = ps_model("memory://", cache_rows=int(per_batch * 1.9), optimizer="sgd")
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone(), "sgd")
    outs = [step(m, kjt) for kjt in data[:2]] + [step(m, kjt) for kjt in ps.wrap(data[2:], m, prefetch=1)]
    for a, b in zip(outs, train(ref, data)):
        assert torch.equal(a, b)


class _FlakyStore(MemoryStore):
    """memory:// that fails every put or get while ``down`` is set (a store that went away)."""

    def __init__(self):
        super().__init__()
        self.down = False

    def _check(self, what):
        if self.down:
            raise StoreUnavailable(f"flaky://: {what} failed (down)")

    def _get(self, table, ids, width, dtype):
        self._check("get")
        return super()._get(table, ids, width, dtype)

    def _put(self, table, ids, rows):
        self._check("put")
        super()._put(table, ids, rows)


@pytest.mark.parametrize("prefetch", [None, 1, 2])
def test_store_failing_mid_run_loses_no_row_and_training_continues_exactly(prefetch):
    # The failing staging (in wrap()'s thread with prefetch) gives its slots back without moving
    # any id: the rows the store never acknowledged stay cached and dirty.
    stores = []
    register_store("flaky", lambda url: stores.append(_FlakyStore()) or stores[-1], replace=True)
    data = batches(10, seed=6)
    m = ps_model("flaky://", cache_rows=40)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    store, cache = stores[-1], m._ps.tables["big"].cache
    done = train(m, data[:4], prefetch)
    assert all(torch.equal(a, b) for a, b in zip(done, train(ref, data[:4])))
    dirty_before = set(cache.id_of[cache.dirty.astype(bool)].tolist())
    store.down = True
    with pytest.raises(StoreUnavailable, match="down"):
        train(m, data[4:6], prefetch)  # the first batch's misses need pushes
    assert dirty_before <= set(cache.id_of[cache.dirty.astype(bool)].tolist())
    assert not cache.pins.any() and not m._ps._prepared
    store.down = False
    outs = train(m, data[4:], prefetch)
    for a, b in zip(outs, train(ref, data[4:])):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)


def test_flush_inside_the_wrap_loop_while_staging_waits_for_slots():
    # The cache holds about two batches, so staging the next batch waits until the running one
    # is released; a flush between steps must neither deadlock with that wait nor change results.
    data = batches(8, seed=11, big=120)
    per_batch = max(int(torch.unique(kjt["f_big"].values()).numel()) for kjt in data)
    m = ps_model("memory://", cache_rows=int(per_batch * 1.9))
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    outs = []
    for kjt in ps.wrap(data, m, prefetch=2):
        outs.append(step(m, kjt))
        ps.flush(m)
    for a, b in zip(outs, train(ref, data)):
        assert torch.equal(a, b)
    assert_same_tables(m, ref)


def test_two_ps_tables_around_an_ordinary_feature_with_int32_ids():
    tables = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f_{n}"])
              for n, rows in (("a", 300), ("mid", 30), ("b", 200))]

    def model(ps_cfg):
        torch.manual_seed(1)
        m = recom_rec.EmbeddingBagCollection(tables, ps=ps_cfg)
        m.enable_fused_optimizer("rowwise_adagrad", lr=0.1)
        return m

    m = model({"a": PSConfig("memory://", 40), "b": PSConfig("memory://", 30, "lfu")})
    ref = model(None)
    with torch.no_grad():
        for t in ("a", "b"):
            ref.embedding_bags[t].weight.copy_(ps.init_rows(tables[0 if t == "a" else 2], torch.arange(
                tables[0 if t == "a" else 2].num_embeddings)))
        ref.embedding_bags["mid"].weight.copy_(m.embedding_bags["mid"].weight)
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(8):
        lengths = torch.randint(0, 4, (3 * 8,), generator=g)
        counts = lengths.view(3, 8).sum(1).tolist()
        values = torch.cat([torch.randint(0, rows, (c,), generator=g) for rows, c in zip((300, 30, 200), counts)])
        data.append(KeyedJaggedTensor(keys=["f_a", "f_mid", "f_b"], values=values.to(torch.int32),
                                      lengths=lengths.to(torch.int32)))
    for prefetch in (None, 1):
        for a, b in zip(train(m, data, prefetch), train(ref, data)):
            assert torch.equal(a, b)
    for t in ("a", "b"):
        assert torch.equal(ps.export_table(m, t), ref.embedding_bags[t].weight.detach())
        assert m._ps.tables[t].cache.stats["pushed"] > 0
    assert torch.equal(m.embedding_bags["mid"].weight, ref.embedding_bags["mid"].weight)


def _variable_batches(n, seed=3):
    """VBE KJTs: f_big at the full batch, f_small at a quarter of it, inverse indices for both."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lb = torch.randint(0, 4, (8,), generator=g)
        ls = torch.randint(0, 3, (2,), generator=g)
        values = torch.cat([torch.randint(0, BIG, (int(lb.sum()),), generator=g),
                            torch.randint(0, SMALL, (int(ls.sum()),), generator=g)])
        inverse = torch.stack([torch.arange(8), torch.randint(0, 2, (8,), generator=g)])
        out.append(KeyedJaggedTensor(keys=["f_big", "f_small"], values=values, lengths=torch.cat([lb, ls]),
                                     stride_per_key_per_rank=[[8], [2]], inverse_indices=(["f_big", "f_small"], inverse)))
    return out


@pytest.mark.parametrize("prefetch", [None, 2])
def test_variable_batch_per_feature_trains_as_in_memory(prefetch):
    """A batch size per feature (VBE KJTs) through parameter-server tables: the tier remaps each
    key's ids whatever its bags; outputs and tables equal the in-memory module's."""
    data = _variable_batches(10)
    m = ps_model("memory://", cache_rows=40)
    ref = reference_model(m.embedding_bags["small"].weight.detach().clone())
    for a, b in zip(train(m, data, prefetch=prefetch), train(ref, data)):
        assert torch.equal(a, b)
    assert m._ps.tables["big"].cache.stats["evictions"] > 0
    ps.flush(m)
    assert_same_tables(m, ref)


def _pull_back(m, ids):
    """Stages a batch of ``ids`` (f_big only) without training; the slot of each id."""
    kjt = KeyedJaggedTensor(keys=["f_big", "f_small"], values=ids,
                            lengths=torch.tensor([1] * ids.numel() + [0] * ids.numel()))
    with torch.no_grad():
        m(kjt)
    slot_of = {int(i): s for s, i in enumerate(m._ps.tables["big"].cache.id_of.tolist())}
    return torch.tensor([slot_of[int(i)] for i in ids])


def test_rows_pulled_after_the_fused_optimizer_is_enabled_again_carry_their_state_into_its_new_buffers():
    """Enabling the same fused optimizer again makes new state buffers (an equal spec). The
    staging's row layout follows them: a pulled row's stored optimizer state lands in the buffer
    the kernels read, not in the old buffer the layout pointed at (freed or about to be: the row
    ops would write it from their own threads)."""
    m = ps_model("memory://", cache_rows=40, optimizer="adagrad")
    for kjt in batches(6, seed=1):
        step(m, kjt)
    tier, bag = m._ps, m.embedding_bags["big"]
    store, cache = tier.tables["big"].store, tier.tables["big"].cache
    stored = store.scan_ids("big")
    evicted = stored[~torch.isin(stored, torch.from_numpy(cache.id_of.copy()))][:8]
    assert evicted.numel() == 8
    rows, found = store.get("big", evicted, tier.width(tier.tables["big"]), torch.float32)
    assert found.all() and (rows[:, DIM:] != 0.1).any()  # trained state, not the initial value
    old = bag._buffers["optimizer_sum"].data_ptr()
    m.enable_fused_optimizer("adagrad", **opt_kwargs("adagrad"))
    assert bag._buffers["optimizer_sum"].data_ptr() != old
    slots = _pull_back(m, evicted)
    assert torch.equal(bag._buffers["optimizer_sum"][slots], rows[:, DIM:])
    assert torch.equal(bag.weight.detach()[slots], rows[:, :DIM])


def test_optimizer_state_converted_from_float32_is_refused_not_overrun():
    """The row ops move optimizer state as float32 rows: after ``module.half()`` (which converts
    the fused optimizer's state buffers too) the tier refuses to stage instead of reading and
    writing float32 rows past the end of the float16 buffers (a heap overflow on the CPU)."""
    m = ps_model("memory://", cache_rows=40, optimizer="adagrad")
    data = batches(4, seed=1)
    for kjt in data[:2]:
        step(m, kjt)
    m.half()
    assert m.embedding_bags["big"]._buffers["optimizer_sum"].dtype == torch.float16
    with pytest.raises(TypeError, match="must stay a contiguous float32"):
        step(m, data[2])
    # converted before the optimizer is enabled, the state is float32 and the weights train in half
    m = ps_model("memory://", cache_rows=40, optimizer=None).half()
    m.enable_fused_optimizer("adagrad", **opt_kwargs("adagrad"))
    for kjt in data:
        step(m, kjt)
    assert m._ps.tables["big"].cache.stats["evictions"] > 0
