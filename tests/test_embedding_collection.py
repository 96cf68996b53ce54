"""recom_rec.EmbeddingCollection against torchrec's EmbeddingCollection: the same keys, order, lengths,
indices and embeddings (bit for bit), the same gradients, fused training equal to torchrec's module
trained by a torch optimizer, and torchrec's own checks for the module (forward, indices, fx and
TorchScript, meta device, duplicate tables), on every kernel backend (Triton under its interpreter
on the CPU)."""
import io
import random

import pytest
import torch
import torchrec
from torchrec.fx import symbolic_trace
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS, KJTInTheGraph


def _tables(seed: int, dtype=DataType.FP32):
    """1-4 tables of one random dim, 1-3 features each, some features read by two tables."""
    rng = random.Random(seed)
    dim = rng.choice([1, 3, 4, 8, 16, 33, 64])
    tables, feature = [], 0
    for t in range(rng.randint(1, 4)):
        names = [f"f{feature + i}" for i in range(rng.randint(1, 3))]
        feature += len(names)
        if t and rng.random() < 0.4:
            names.append(tables[0].feature_names[0])  # shared with table 0: outputs "f@t0", "f@t<t>"
        tables.append(EmbeddingConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=rng.randint(1, 50),
                                      feature_names=names, data_type=dtype))
    return tables


def _copy(tables):
    return [EmbeddingConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                            feature_names=list(t.feature_names), data_type=t.data_type) for t in tables]


def _kjt(tables, seed: int, batch: int = 5, max_len: int = 6) -> KeyedJaggedTensor:
    """Keys in a shuffled order plus one the module does not read; bags of 0-max_len ids (some
    features empty for the whole batch); ids within every table that reads the key."""
    rng = random.Random(seed)
    rows = {}
    for t in tables:
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    keys = list(rows) + ["unread"]
    rows["unread"] = 1000
    rng.shuffle(keys)
    lengths, values = [], []
    for key in keys:
        empty = rng.random() < 0.15
        for _ in range(batch):
            n = 0 if empty else rng.randint(0, max_len)
            lengths.append(n)
            values.extend(rng.randrange(rows[key]) for _ in range(n))
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                                               lengths=torch.tensor(lengths)).to(DEVICE)


def _pair(tables, backend, need_indices=False):
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, need_indices=need_indices)
    torch.manual_seed(0)
    ours = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, need_indices=need_indices,
                                         backend=backend)
    return ours, theirs


def _assert_same_output(ours, theirs):
    assert list(ours) == list(theirs)
    for k in theirs:
        assert ours[k].values().dtype == theirs[k].values().dtype == torch.float32
        assert torch.equal(ours[k].values(), theirs[k].values()), k
        assert torch.equal(ours[k].lengths(), theirs[k].lengths()), k
        w, tw = ours[k].weights_or_none(), theirs[k].weights_or_none()
        assert (w is None) == (tw is None) and (w is None or torch.equal(w, tw)), k


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("seed", range(8))
def test_forward_and_weights_equal_torchrec(backend, seed):
    tables = _tables(seed, dtype=DataType.FP16 if seed % 4 == 3 else DataType.FP32)
    ours, theirs = _pair(tables, backend, need_indices=seed % 2 == 0)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for k, v in theirs.state_dict().items():  # same draws under one seed
        assert torch.equal(v, ours.state_dict()[k]), k
    for s in range(2):
        kjt = _kjt(tables, seed * 10 + s, batch=1 + s * 6)
        _assert_same_output(ours(kjt), theirs(kjt))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_tables_read_exactly(backend, dtype):
    """fp16 and bf16 rows widened to fp32 exactly (torchrec has no bf16 EmbeddingCollection: its
    non-fp32 tables are fp16): against the rows themselves."""
    tables = _tables(3, DataType.FP16 if dtype == torch.float16 else DataType.BF16)
    ours = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, backend=backend)
    kjt = _kjt(tables, 7)
    out = ours(kjt)
    features = kjt.to_dict()
    for t in tables:
        weight = ours.embeddings[t.name].weight
        assert weight.dtype == dtype
        for f in t.feature_names:
            name = f if sum(f in u.feature_names for u in tables) == 1 else f"{f}@{t.name}"
            assert torch.equal(out[name].values(), weight[features[f].values()].float())


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_dense_gradients_match_torchrec(backend, seed):
    tables = _tables(seed)
    ours, theirs = _pair(tables, backend)
    kjt = _kjt(tables, seed, batch=6)
    g = torch.Generator().manual_seed(seed)
    out, ref = ours(kjt), theirs(kjt)
    upstream = {k: torch.randn(v.values().shape, generator=g).to(DEVICE) for k, v in ref.items()}
    sum((out[k].values() * u).sum() for k, u in upstream.items()).backward()
    sum((ref[k].values() * u).sum() for k, u in upstream.items()).backward()
    for name, table in theirs.embeddings.items():
        expected = table.weight.grad if table.weight.grad is not None else torch.zeros_like(table.weight)
        got = ours.embeddings[name].weight.grad
        got = got if got is not None else torch.zeros_like(expected)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _partial_loss(out, g):
    """A loss that leaves the features' gradients as a model's would: one output unused, one read
    through a strided view, one read twice, one whose gradient starts 4 bytes into a buffer (not
    16-byte aligned), the rest concatenated first (their gradients are then views of one buffer)."""
    names = sorted(out)
    unused, strided, twice, shifted, rest = names[0], names[1:2], names[2:3], names[3:4], names[4:]
    for k in shifted:  # its gradient: a view one element into the flat gradient of `padded`
        padded = torch.cat([torch.zeros(1, device=DEVICE), out[k].values().flatten()])
        loss_shifted = (padded * torch.randn(padded.shape, generator=g).to(DEVICE)).sum()
    loss = sum((out[k].values()[:, ::2] * torch.randn(out[k].values()[:, ::2].shape, generator=g).to(DEVICE)).sum()
               for k in strided)
    loss = loss + sum(out[k].values().pow(2).sum() + out[k].values().sum() for k in twice)
    if shifted:
        loss = loss + loss_shifted
    if rest:
        joined = torch.cat([out[k].values() for k in rest])
        loss = loss + (joined * torch.randn(joined.shape, generator=g).to(DEVICE)).sum()
    assert unused not in strided + twice + shifted + rest
    return loss


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("fused", [None, "sgd", "adam"])
@pytest.mark.parametrize("dim", [4, 6, 8])
def test_gradients_where_autograd_leaves_them(backend, fused, dim):
    """The backward reads each feature's gradient where autograd left it (no copy into one block):
    features without a gradient, strided, read twice, views of one buffer, empty; against torchrec's
    dense gradients, and the fused update against the torch reference backend's."""
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=9 + i, feature_names=[f"f{i}", f"g{i}"])
              for i in range(3)]
    kjts = [_kjt(tables, 40 + s, batch=5, max_len=4) for s in range(3)]

    def run(module):
        g = torch.Generator().manual_seed(dim)
        for kjt in kjts:
            _partial_loss(module(kjt), g).backward()
        return module

    if fused is None:
        ours, theirs = _pair(tables, backend)
        run(ours), run(theirs)
        for name, table in theirs.embeddings.items():
            torch.testing.assert_close(ours.embeddings[name].weight.grad, table.weight.grad, rtol=1e-5, atol=1e-6)
        return
    trained = {}
    for b in ("torch", backend):
        torch.manual_seed(0)
        module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, backend=b)
        module.enable_fused_optimizer(fused, lr=0.1)
        trained[b] = run(module).state_dict()
    for k, v in trained["torch"].items():
        torch.testing.assert_close(trained[backend][k], v, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA extension's kernels run on a GPU only")
@pytest.mark.parametrize("optimizer", [None, "sgd", "rowwise_adagrad", "adagrad", "adam"])
@pytest.mark.parametrize("seed", range(3))
def test_the_one_call_backward_gives_the_chains_bits_on_every_path(optimizer, seed, monkeypatch):
    """The eager backward in one extension call (pooled_cuda.unpooled_backward) against the chain of
    calls it stands for (_as_pooled's row keys, then the pooled backward): the same bits on every
    backward path, fused or dense, fp32/fp16/bf16 tables, odd dims, features without a gradient,
    strided or read twice (and, in the first batch, one unaligned: the chain's alone then)."""
    from recom_rec.kernels import pooled_cuda
    from recom_rec.ops import unpooled_embedding

    rng = random.Random(seed)
    dim = rng.choice([3, 4, 8, 33, 64, 300])
    dtype = [DataType.FP32, DataType.FP16, DataType.BF16][seed]
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rng.randint(1, 60),
                              feature_names=[f"f{i}", f"g{i}"], data_type=dtype) for i in range(3)]
    kjts = [_kjt(tables, 100 * seed + s, batch=rng.randint(1, 9), max_len=rng.randint(1, 7)) for s in range(4)]
    one_calls = []
    one_call = pooled_cuda.unpooled_backward
    monkeypatch.setattr(pooled_cuda, "unpooled_backward", lambda *a: one_calls.append(1) or one_call(*a))
    monkeypatch.setattr(pooled_cuda.BACKWARD_PATH_TUNER, "forced_order", None)  # restored after the test

    def loss(out, g, step):
        if step == 0:
            return _partial_loss(out, g)
        names = sorted(out)[1:]  # one output without a gradient
        return sum((out[k].values() * torch.randn(out[k].values().shape, generator=g).to(DEVICE)).sum()
                   for k in names) + out[names[0]].values()[:, ::2].sum()

    def train(path, chain):
        pooled_cuda.BACKWARD_PATH_TUNER.force(path)
        with monkeypatch.context() as m:
            if chain:
                m.setattr(unpooled_embedding, "_one_call", lambda *a: None)
            torch.manual_seed(0)
            module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, backend="cuda")
            if optimizer is not None:
                module.enable_fused_optimizer(optimizer, lr=0.1)
            g = torch.Generator().manual_seed(seed)
            for step, kjt in enumerate(kjts):
                loss(module(kjt), g, step).backward()
        return {k: v.detach().clone() for k, v in module.state_dict().items()} | {
            f"{n}.grad": t.weight.grad.clone() for n, t in module.embeddings.items() if t.weight.grad is not None}

    for path in pooled_cuda.BACKWARD_PATHS:
        chain = train(path, chain=True)
        before = len(one_calls)
        ours = train(path, chain=False)
        assert len(one_calls) > before, path
        assert ours.keys() == chain.keys()
        for k in chain:
            assert torch.equal(ours[k], chain[k]), (path, k)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a GPU property: whether the backward makes the host wait for "
                                                  "the device")
@pytest.mark.parametrize("fused", [None, "sgd"])
def test_backward_queues_its_work_without_waiting_for_the_gpu(fused):
    """The backward's per-row gradient addresses go to the device without a wait: a copy from
    pageable memory would first wait for all the stream's earlier work (CUDA's rule; torch's
    sync debug mode does not see it), so the host could not run ahead of the GPU."""
    from recom_rec.kernels.selection import trial_launches

    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=16, num_embeddings=50, feature_names=[f"f{i}", f"g{i}"])
              for i in range(3)]
    kjt = _kjt(tables, 7, batch=8, max_len=5)
    module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE)
    if fused:
        module.enable_fused_optimizer(fused, lr=0.1)
    recom_rec.tune(module, [kjt], train=True, max_passes=1000)  # kernels built, every choice decided
    trials = trial_launches()
    loss = sum(jt.values().sum() for jt in module(kjt).values())
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 31)  # ~1 s of device time queued ahead of the backward
    slept = torch.cuda.Event()
    slept.record()
    loss.backward()
    waited = slept.query()
    torch.cuda.synchronize()
    assert trial_launches() == trials, "a shape was still on trial: the test timed the tuner, not the backward"
    assert not waited, "the backward waited for the GPU's earlier work"


def _train(module, tables, optimizer=None, steps=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for s in range(steps):
        kjt = _kjt(tables, 100 + s, batch=4, max_len=5)
        out = module(kjt)
        loss = sum((v.values() * torch.randn(v.values().shape, generator=g).to(DEVICE)).sum()
                   + 0.1 * v.values().pow(2).sum() for v in out.values())
        if optimizer is not None:
            optimizer.zero_grad()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        outs.append(torch.cat([v.values().detach() for v in out.values()]))
    return outs


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("opt_class,kwargs", [
    (torch.optim.SGD, {"lr": 0.3}),
    (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-8}),
    (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8}),
])
@pytest.mark.parametrize("seed", [0, 5])
def test_fused_training_matches_torchrec_with_torch_optimizer(backend, opt_class, kwargs, seed):
    """Duplicate ids within and across features summed before the update (as torch's dense
    optimizers see them); rows without a gradient untouched by these optimizers either way."""
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=[4, 8][seed % 2], num_embeddings=6 + 3 * i,
                              feature_names=[f"f{i}", f"g{i}"]) for i in range(3)]
    ours, theirs = _pair(tables, backend)
    ours.enable_fused_optimizer(opt_class, **kwargs)
    outs = _train(ours, tables, seed=seed)
    ref = _train(theirs, tables, opt_class(theirs.parameters(), **kwargs), seed=seed)
    for a, b in zip(outs, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_class,kwargs", [
    (torch.optim.Adam, {"lr": 0.05}),
    (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.2}),
])
def test_fused_kernels_match_the_torch_reference(opt_class, kwargs):
    """Sparse Adam (only the touched rows move, as fbgemm's) has no dense torch equivalent: the
    kernels against the torch path, which is its reference."""
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=12, num_embeddings=7 + i, feature_names=[f"f{i}"])
              for i in range(3)]
    runs = {}
    for backend in KERNEL_BACKENDS:
        torch.manual_seed(0)
        module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, backend=backend)
        module.enable_fused_optimizer(opt_class, **kwargs)
        runs[backend] = (_train(module, tables), module.state_dict())
    ref_outs, ref_state = runs.pop("torch")
    # Adam divides by sqrt(v) + eps: the GPU's and the CPU's rounding of it differ by ~1e-6 at
    # weights of ~0.1 (seen on the H200).
    for outs, state in runs.values():
        for a, b in zip(outs, ref_outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5)


def test_apply_optimizer_in_backward_is_fused_and_checkpoints_round_trip():
    from torch.distributed.optim import _apply_optimizer_in_backward

    tables = _tables(2)
    ours, theirs = _pair(tables, "auto")
    _apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.5})
    _train(ours, tables, steps=2)
    assert ours.fused_optimizer is not None
    assert all(p.grad is None for p in ours.parameters())
    _train(theirs, tables, torch.optim.SGD(theirs.parameters(), lr=0.5), steps=2)
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    fresh = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE)
    fresh.enable_fused_optimizer(torch.optim.SGD, lr=0.5)  # so that its step counter loads too
    fresh.load_state_dict(torch.load(buffer))
    assert int(fresh.fused_optimizer_step) == 2
    kjt = _kjt(tables, 3)
    _assert_same_output(fresh(kjt), theirs(kjt))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_bad_ids_name_feature_table_and_batch_index(backend):
    tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
              EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=5, feature_names=["b"])]
    module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, backend=backend)
    for bad, what in ((5, "out of range for 5 rows"), (-2, "negative")):
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.tensor([1, 2, 3, 0, 4, bad, 1]),
                                                  lengths=torch.tensor([2, 1, 2, 2])).to(DEVICE)
        with pytest.raises(ValueError) as error:
            module(kjt)
            module.check_inputs()  # the kernels report without a sync: raised here at the latest
        message = str(error.value)
        assert "'b'" in message and "'t1'" in message and f"id {bad}" in message and "batch index 1" in message
        assert what in message
    good = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.tensor([1, 4]),
                                               lengths=torch.tensor([1, 1])).to(DEVICE)
    module(good)
    module.check_inputs()  # nothing left over from the bad batches


def test_missing_keys_and_lengths_that_do_not_add_up():
    tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"])]
    module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="missing feature.*'b' \\(table 't0'\\)"):
        module(kjt.to(DEVICE))
    short = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="lengths add up to 2 but there are 3 values: feature 'b' \\(table 't0'\\)"):
        module(short.to(DEVICE))
    past = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 3, 0, 1]))
    with pytest.raises(ValueError, match="lengths add up to 5 but there are 3 values: feature 'a' \\(table 't0'\\)"):
        module(past.to(DEVICE))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_batches_the_host_can_tell_are_bad(backend):
    """A lengths count that is not the keys' bags (torchrec's own per-key sum fails on it with a
    shape error) and float ids: refused before any kernel, on every backend."""
    tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
              EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=5, feature_names=["b"])]
    module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, backend=backend)
    odd = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 2]))
    with pytest.raises(ValueError, match="3 lengths for 2 keys of 2 bags"):
        module(odd.to(DEVICE))
    floats = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="integer ids, got torch.float32"):
        module(floats.to(DEVICE))
    good = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    assert module(good.to(DEVICE))["b"].values().shape == (1, 4)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_negative_length_names_its_feature(backend):
    """Lengths adding up with a negative one among them: a key's ids are found from its summed
    lengths, so only a check of the bags sees it (the output's lengths would be the KJT's). The
    torch backend raises at the call, the kernels by check_inputs(); nothing left over after."""
    tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
              EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=5, feature_names=["b"])]
    module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, backend=backend)
    module.enable_fused_optimizer(torch.optim.SGD, lr=0.1)
    for lengths in ([1, 1, 3, -1], [3, -1, 1, 1]):  # (the bad bag in the last key, then the first)
        kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor(lengths))
        feature, table = ("b", "t1") if lengths[-1] < 0 else ("a", "t0")
        with pytest.raises(ValueError, match=f"feature '{feature}' \\(table '{table}'\\): negative length.* batch "
                                             "index 1"):
            module(kjt.to(DEVICE))
            module.check_inputs()
    good = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 2, 0]))
    out = module(good.to(DEVICE))
    module.check_inputs()
    assert out["b"].lengths().tolist() == [2, 0]


def test_construction_errors_as_torchrec():
    with pytest.raises(ValueError, match="same embedding dimension"):
        recom_rec.EmbeddingCollection(tables=[
            EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
            EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=10, feature_names=["b"])])
    with pytest.raises(ValueError, match="Duplicate table name"):
        recom_rec.EmbeddingCollection(tables=[
            EmbeddingConfig(name="t0", embedding_dim=2, num_embeddings=10, feature_names=["a"]),
            EmbeddingConfig(name="t0", embedding_dim=2, num_embeddings=10, feature_names=["b"])])
    with pytest.raises(ValueError, match="'t0'"):
        recom_rec.EmbeddingCollection(tables=[EmbeddingConfig(name="t0", embedding_dim=0, num_embeddings=10)])


def _torchrec_example():
    """torchrec's own example for the module (its tests': two tables, f2 read by both)."""
    tables = [EmbeddingConfig(name="t1", embedding_dim=5, num_embeddings=10, feature_names=["f1", "f2"]),
              EmbeddingConfig(name="t2", embedding_dim=5, num_embeddings=10, feature_names=["f2"])]
    kjt = KeyedJaggedTensor.from_offsets_sync(keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3]),
                                              offsets=torch.tensor([0, 2, 3, 3, 4]))
    return tables, kjt.to(DEVICE)


def test_torchrec_forward_indices_fx_and_script():
    tables, kjt = _torchrec_example()
    module = recom_rec.EmbeddingCollection(tables=tables, device=DEVICE, need_indices=True)
    out = module(kjt)
    assert {k: tuple(v.values().shape) for k, v in out.items()} == {"f1": (3, 5), "f2@t1": (1, 5), "f2@t2": (1, 5)}
    assert torch.equal(out["f1"].weights().cpu(), torch.tensor([0, 1, 2]))
    assert torch.equal(out["f2@t2"].weights().cpu(), torch.tensor([3]))
    traced = symbolic_trace(module)
    for graph in (traced, torch.jit.script(traced), torch.jit.script(module)):
        _assert_same_output(graph(kjt), out)


def test_meta_construction_then_materialised():
    tables, kjt = _torchrec_example()
    module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=torch.device("meta"))
    assert module.embeddings["t1"].weight.device.type == "meta"
    with torch.device("meta"):
        assert recom_rec.EmbeddingCollection(tables=_copy(tables)).embeddings["t2"].weight.device.type == "meta"
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingCollection(tables=_copy(tables), device=DEVICE)
    module = module.to_empty(device=DEVICE)
    module.load_state_dict(theirs.state_dict())
    _assert_same_output(module(kjt), theirs(kjt))


def test_torch_compile_keeps_numbers():
    tables, kjt = _torchrec_example()
    module = recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE)
    compiled = torch.compile(module, backend="eager")
    _assert_same_output(compiled(kjt), module(kjt))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_compile_and_export_with_the_kjt_built_in_the_graph(backend):
    """torch.compile(fullgraph=True) and torch.export take the KJT built inside the graph, as
    torchrec's module does: the same outputs for batches of other lengths, the same gradients
    (compiled); lengths that do not add up to the values are refused at run time."""
    tables = [EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=20, feature_names=["f1", "f2"]),
              EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=30, feature_names=["f2", "f3"])]
    kjts = [_kjt(tables, seed, batch=4, max_len=4) for seed in (3, 4)]
    keys = kjts[0].keys()
    kjts = [k.permute([k.keys().index(key) for key in keys]) for k in kjts]  # the graph's key order

    def model():
        torch.manual_seed(0)
        return KJTInTheGraph(recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE, backend=backend),
                              keys)

    eager, compiled_model = model(), model()
    compiled = torch.compile(compiled_model, fullgraph=True)
    with torch.no_grad():
        n_values = torch.export.Dim("n_values", min=2, max=10_000)
        exported = torch.export.export(eager, (kjts[0].values(), kjts[0].lengths()),
                                       dynamic_shapes=({0: n_values}, None)).module()
    for kjt in kjts:
        want = eager(kjt.values(), kjt.lengths())
        assert torch.equal(compiled(kjt.values(), kjt.lengths()), want)
        with torch.no_grad():
            assert torch.equal(exported(kjt.values(), kjt.lengths()), want)
        want.pow(2).sum().backward()
        compiled(kjt.values(), kjt.lengths()).pow(2).sum().backward()
    for a, b in zip(eager.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    values = kjts[0].values()
    # (the compiled graph's own runtime assertion: it states the relation that failed)
    with pytest.raises(RuntimeError, match=r"do not add up|Eq\(u0 \+ u1 \+ u2 \+ u3"):
        compiled(values[:-1], kjts[0].lengths())


SLOTS = 12


def _mc_wrapped(ec):
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    configs = ec.embedding_configs()
    mcc = ManagedCollisionCollection({
        c.name: MCHManagedCollisionModule(zch_size=SLOTS, device=DEVICE, eviction_interval=1, input_hash_size=500,
                                          eviction_policy=DistanceLFU_EvictionPolicy())
        for c in configs}, configs)
    return ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=True)


def test_managed_collision_wraps_ours_and_trains_with_the_fused_optimizer():
    """torchrec's ManagedCollisionEmbeddingCollection around ours: raw ids remapped to slots, the
    same embeddings and training as around torchrec's module (apply_optimizer_in_backward)."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    tables = [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=SLOTS, feature_names=["f1"]),
              EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=SLOTS, feature_names=["f2"])]
    torch.manual_seed(0)
    ours = _mc_wrapped(recom_rec.EmbeddingCollection(tables=_copy(tables), device=DEVICE))
    theirs = _mc_wrapped(torchrec.EmbeddingCollection(tables=_copy(tables), device=DEVICE))
    theirs.load_state_dict(ours.state_dict())
    for model in (ours, theirs):
        _apply_optimizer_in_backward(torch.optim.Adagrad, model._embedding_module.parameters(), {"lr": 0.2})
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (2 * 4,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"],
                                                  values=torch.randint(0, 500, (int(lengths.sum()),), generator=g),
                                                  lengths=lengths).to(DEVICE)
        (a, remapped_a), (b, remapped_b) = ours(kjt), theirs(kjt)
        for key in ("f1", "f2"):
            assert torch.equal(remapped_a[key].values(), remapped_b[key].values())
            assert bool((remapped_a[key].values() < SLOTS).all())
        assert list(a) == list(b)
        for key in a:  # after fused and torch Adagrad steps: equal up to rounding
            torch.testing.assert_close(a[key].values(), b[key].values())
            assert torch.equal(a[key].lengths(), b[key].lengths())
        sum(jt.values().square().sum() for jt in a.values()).backward()
        sum(jt.values().square().sum() for jt in b.values()).backward()
    assert ours._embedding_module.fused_optimizer is not None
    for name in ("t1", "t2"):
        torch.testing.assert_close(ours._embedding_module.embeddings[name].weight,
                                   theirs._embedding_module.embeddings[name].weight)


def test_swap_modules_replaces_torchrecs_module_in_a_model():
    """A sequence model holding torchrec's EmbeddingCollection twice (shared) and once nested:
    swapped, the same outputs and gradients, sharing kept, apply_optimizer_in_backward carried."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    tables = _tables(4)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ec = torchrec.EmbeddingCollection(tables=_copy(tables), device=DEVICE)
            self.alias = self.ec
            self.inner = torch.nn.ModuleList([torchrec.EmbeddingCollection(tables=_copy(tables), device=DEVICE)])

        def forward(self, kjt):
            out = self.ec(kjt)
            return torch.cat([jt.values() for jt in out.values()]).sum(1) + \
                torch.cat([jt.values() for jt in self.inner[0](kjt).values()]).sum(1)

    torch.manual_seed(1)
    model = Model()
    reference = Model()
    reference.load_state_dict(model.state_dict())
    _apply_optimizer_in_backward(torch.optim.SGD, model.inner[0].parameters(), {"lr": 0.1})
    swapped = recom_rec.swap_modules(model)
    assert isinstance(swapped.ec, recom_rec.EmbeddingCollection) and swapped.alias is swapped.ec
    assert isinstance(swapped.inner[0], recom_rec.EmbeddingCollection)
    assert list(swapped.state_dict()) == list(reference.state_dict())
    kjt = _kjt(tables, 9)
    out, ref = swapped(kjt), reference(kjt)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for name, table in reference.ec.embeddings.items():
        torch.testing.assert_close(swapped.ec.embeddings[name].weight.grad, table.weight.grad)
    assert swapped.inner[0].fused_optimizer is not None


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_variable_batch_per_feature_as_torchrec(backend):
    """A KJT with a batch size per feature (VBE): each feature's ids and lengths as torchrec's
    module gives them (an unpooled lookup needs no inverse indices)."""
    tables = _tables(6)
    ours, theirs = _pair(tables, backend, need_indices=True)
    features = [f for t in tables for f in t.feature_names]
    keys = list(dict.fromkeys(features))
    rows = {f: min(t.num_embeddings for t in tables if f in t.feature_names) for f in keys}
    strides = [1 + (3 * i) % 5 for i in range(len(keys))]
    g = torch.Generator().manual_seed(6)
    lengths = [int(x) for s in strides for x in torch.randint(0, 4, (s,), generator=g)]
    values, at = [], 0
    for key, stride in zip(keys, strides):
        n = sum(lengths[at:at + stride])
        values += torch.randint(0, rows[key], (n,), generator=g).tolist()
        at += stride
    kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths),
                            stride_per_key_per_rank=[[s] for s in strides]).to(DEVICE)
    _assert_same_output(ours(kjt), theirs(kjt))
