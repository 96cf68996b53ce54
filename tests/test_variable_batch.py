"""Variable batch per feature (torchrec's VBE KeyedJaggedTensors: a batch size per key and the
inverse indices that expand each key's bags to the output's rows) through the fused lookup, against
torchrec's EmbeddingBagCollection: the same outputs (bit for bit in fp32 unweighted sum pooling), the same gradients, and
fused training equal to torchrec's module trained by a torch optimizer; the quantized module pools a
VBE batch as it pools the same bags spelled out row by row. The padding's offsets (the Triton kernel,
under the interpreter on the CPU, and the torch version) against padded lengths summed."""
import random

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_configs import DataType

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS
from recom_rec.kernels import pad_offsets_triton
from recom_rec.ops.variable_batch import pad_to_uniform, padded_offsets


def _tables(seed: int, dtype=DataType.FP32):
    rng = random.Random(seed)
    tables, feature = [], 0
    for t in range(rng.randint(1, 4)):
        features = [f"f{feature + i}" for i in range(rng.randint(1, 2))]
        feature += len(features)
        tables.append(EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=rng.randint(3, 40), embedding_dim=rng.choice([1, 3, 4, 8, 12, 33]),
            feature_names=features, pooling=rng.choice([PoolingType.SUM, PoolingType.MEAN]), data_type=dtype))
    return tables


def _vbe_kjt(tables, seed: int, weighted: bool = False, batch: int = 6) -> KeyedJaggedTensor:
    """Each key its own bag count (1 to batch, some keys at the full batch), bags of 0-3 ids
    (some empty), keys in a shuffled order, inverse indices mapping the batch's rows to bags."""
    rng = random.Random(seed)
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    keys = list(rows)
    rng.shuffle(keys)
    strides = [rng.choice([1, 2, batch // 2, batch]) for _ in keys]
    lengths = [rng.randint(0, 3) for s in strides for _ in range(s)]
    values, at = [], 0
    for key, stride in zip(keys, strides):
        for length in lengths[at:at + stride]:
            values.extend(rng.randrange(rows[key]) for _ in range(length))
        at += stride
    inverse = torch.tensor([[rng.randrange(s) for _ in range(batch)] for s in strides])
    return KeyedJaggedTensor(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths),
        weights=torch.rand(len(values)) if weighted else None,
        stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(keys, inverse)).to(DEVICE)


def _pair(tables, backend, weighted=False):
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingBagCollection(tables, is_weighted=weighted, device=DEVICE)
    ours = recom_rec.EmbeddingBagCollection([EmbeddingBagConfig(**{**vars(t), "feature_names": list(t.feature_names)})
                                             for t in tables], is_weighted=weighted, device=DEVICE, backend=backend)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_forward_and_gradients_match_torchrec(backend, weighted, seed):
    tables = _tables(seed)
    if weighted:  # torchrec's module refuses weighted MEAN
        tables = [EmbeddingBagConfig(**{**vars(t), "pooling": PoolingType.SUM}) for t in tables]
    ours, theirs = _pair(tables, backend, weighted)
    kjt = _vbe_kjt(tables, seed, weighted)
    a, b = ours(kjt), theirs(kjt)
    assert a.keys() == b.keys() and a.length_per_key() == b.length_per_key()
    if not weighted and all(t.pooling == PoolingType.SUM for t in tables):
        assert torch.equal(a.values(), b.values())
    else:  # nn.EmbeddingBag rounds its mean's division and its weights' products its own way
        torch.testing.assert_close(a.values(), b.values(), rtol=1e-6, atol=1e-7)
    target = torch.randn_like(a.values())
    (a.values() * target).sum().backward()
    (b.values() * target).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_half_tables(backend):
    """fp16 tables: ours pools in fp32 (its rule for every batch), torchrec in fp16."""
    tables = _tables(3, DataType.FP16)
    ours, theirs = _pair(tables, backend)
    kjt = _vbe_kjt(tables, 3)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values().float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_fused_training_matches_torchrec_trained_by_torch(backend, optimizer):
    tables = [EmbeddingBagConfig(**{**vars(t), "pooling": PoolingType.SUM}) for t in _tables(7)]
    ours, theirs = _pair(tables, backend)
    ours.enable_fused_optimizer(optimizer, lr=0.1, **({"eps": 1e-8} if optimizer != "sgd" else {}))
    if optimizer == "sgd":
        opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    else:
        opt = torchrec.optim.RowWiseAdagrad(theirs.parameters(), lr=0.1, eps=1e-8)
    for step in range(4):
        kjt = _vbe_kjt(tables, 100 + step)
        target = torch.linspace(-1, 1, kjt.stride() * sum(t.embedding_dim * len(t.feature_names) for t in tables),
                                device=DEVICE).view(kjt.stride(), -1)
        ((ours(kjt).values() - target) ** 2).sum().backward()
        opt.zero_grad()
        ((theirs(kjt).values() - target) ** 2).sum().backward()
        opt.step()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_uniform_batch_with_inverse_indices_is_expanded_as_torchrec_does():
    tables = _tables(2)
    ours, theirs = _pair(tables, "torch")
    plain = _vbe_kjt(tables, 2, batch=4)
    keys = plain.keys()
    uniform = KeyedJaggedTensor(keys=keys, values=torch.arange(len(keys) * 3) % 3,
                                lengths=torch.ones(len(keys) * 3, dtype=torch.int64), stride=3,
                                inverse_indices=(keys, torch.tensor([[2, 0, 1, 1]] * len(keys)))).to(DEVICE)
    assert torch.equal(ours(uniform).values(), theirs(uniform).values())


def test_variable_batch_without_inverse_indices_is_refused():
    tables = _tables(1)
    kjt = _vbe_kjt(tables, 1)
    bare = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                             stride_per_key_per_rank=kjt.stride_per_key_per_rank())
    with pytest.raises(ValueError, match="needs its inverse_indices"):
        _pair(tables, "torch")[0](bare)


@pytest.mark.parametrize("lengths", [[1, 1, 1, 1], [1, 1]])
@pytest.mark.parametrize("module", ["float", "quantized", "sequence"])
def test_a_lengths_count_other_than_the_bags_is_refused(module, lengths):
    """Keys of 1 and 2 bags (3 in all) with 4 or 2 lengths: a ValueError saying so at the call,
    where the padding to a uniform batch failed with a bare shape error (or, with more lengths,
    blamed the values)."""
    bag_tables = [EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=4, feature_names=["f0"]),
                  EmbeddingBagConfig(name="t1", num_embeddings=5, embedding_dim=4, feature_names=["f1"])]
    if module == "sequence":
        from torchrec import EmbeddingConfig

        ours = recom_rec.EmbeddingCollection(
            tables=[EmbeddingConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=4,
                                    feature_names=list(t.feature_names)) for t in bag_tables], device=DEVICE)
    else:
        ours = recom_rec.EmbeddingBagCollection(bag_tables, device=DEVICE)
    if module == "quantized":
        ours.qconfig = torch.quantization.QConfig(
            activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
            weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8))
        ours = recom_rec.quant.EmbeddingBagCollection.from_float(ours)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.arange(len(lengths)) % 5, lengths=torch.tensor(lengths),
                            stride_per_key_per_rank=[[1], [2]],
                            inverse_indices=(["f0", "f1"], torch.tensor([[0, 0], [0, 1]]))).to(DEVICE)
    with pytest.raises(ValueError, match=f"{len(lengths)} lengths for 2 keys of 3 bags"):
        ours(kjt)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_compiled_forward_and_backward_match_eager(backend):
    torch._dynamo.reset()
    tables = [EmbeddingBagConfig(**{**vars(t), "pooling": PoolingType.SUM}) for t in _tables(4)]
    ours, _ = _pair(tables, backend)
    kjt = _vbe_kjt(tables, 4)
    compiled = torch.compile(ours)
    out = compiled(kjt).values()
    expected = ours(kjt).values()
    assert torch.equal(out, expected)
    out.sum().backward()
    grads = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    expected.sum().backward()
    for g, p in zip(grads, ours.parameters()):
        torch.testing.assert_close(g, p.grad)


def _spelled_out(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The uniform KJT of the same rows: row b of key f is a copy of the bag inverse[f][b]."""
    keys, inverse = kjt.inverse_indices()
    by_key = kjt.to_dict()
    values, lengths = [], []
    for f, key in enumerate(keys):
        bags = list(torch.split(by_key[key].values(), by_key[key].lengths().tolist()))
        for b in inverse[f].tolist():
            values.append(bags[b])
            lengths.append(bags[b].numel())
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.tensor(lengths),
                             stride=inverse.shape[1]).to(DEVICE)


QUANT_BACKENDS = ["torch"] + (["triton"] if DEVICE.type == "cuda" or recom_rec.ops.backends.triton_interpreting()
                              else [])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("backend", QUANT_BACKENDS)
def test_quantized_module_pools_a_vbe_batch_as_its_rows_spelled_out(backend, seed):
    tables = [EmbeddingBagConfig(**{**vars(t), "embedding_dim": 4 * max(1, t.embedding_dim // 4)})
              for t in _tables(seed)]  # INT8 rows want an even dim
    float_ebc = recom_rec.EmbeddingBagCollection(tables, device=DEVICE)
    float_ebc.qconfig = torch.quantization.QConfig(
        activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
        weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8))
    quant = recom_rec.quant.EmbeddingBagCollection.from_float(float_ebc, backend=backend)
    kjt = _vbe_kjt(tables, seed)
    assert torch.equal(quant(kjt).values(), quant(_spelled_out(kjt)).values())
    with torch.no_grad():
        assert torch.equal(float_ebc(kjt).values(), float_ebc(_spelled_out(kjt)).values())


@pytest.mark.parametrize("backend", QUANT_BACKENDS)
def test_quantized_module_names_a_feature_whose_inverse_indices_leave_its_bags(backend):
    """At the call on the CPU; on a GPU by the expansion kernel's report (check_inputs())."""
    tables = [EmbeddingBagConfig(**{**vars(t), "embedding_dim": 4 * max(1, t.embedding_dim // 4)})
              for t in _tables(0)]
    float_ebc = recom_rec.EmbeddingBagCollection(tables, device=DEVICE)
    float_ebc.qconfig = torch.quantization.QConfig(
        activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
        weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8))
    quant = recom_rec.quant.EmbeddingBagCollection.from_float(float_ebc, backend=backend)
    kjt = _vbe_kjt(tables, 0)
    keys, inverse = kjt.inverse_indices()
    strides = kjt.stride_per_key()
    bad = inverse.clone()
    bad[0, 1] = strides[0]  # one past the first key's bags
    kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                            stride_per_key_per_rank=kjt.stride_per_key_per_rank(), inverse_indices=(keys, bad))
    with pytest.raises(ValueError, match=rf"inverse_indices of feature '{keys[0]}' send output row 1 to bag "
                                         rf"{strides[0]}, but the feature has {strides[0]} bags"):
        quant(kjt)
        quant.check_inputs()


def test_scripted_module_pools_variable_batches_as_eager():
    """TorchScript (torch.jit.script of the module, and of its fx trace) takes VBE KJTs too."""
    from torchrec.fx import symbolic_trace

    tables = _tables(5)
    ours, _ = _pair(tables, "torch")
    kjt = _vbe_kjt(tables, 5)
    expected = ours(kjt).values()
    for scripted in (torch.jit.script(ours), torch.jit.script(symbolic_trace(ours))):
        assert torch.equal(scripted(kjt).values(), expected)


def _even_vbe_kjt(strides, batch: int, seed: int) -> KeyedJaggedTensor:
    """Keys f1, f0 (the tables' order reversed, so the inverse indices' rows are reordered), key f
    with ``strides[f]`` bags of two ids each, ``batch`` output rows."""
    g = torch.Generator().manual_seed(seed)
    keys = ["f1", "f0"]
    bags = [strides[k] for k in keys]
    values = torch.randint(0, 30, (2 * sum(bags),), generator=g)
    inverse = torch.stack([torch.randint(0, s, (batch,), generator=g) for s in bags])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.full((sum(bags),), 2),
                             stride_per_key_per_rank=[[s] for s in bags], inverse_indices=(keys, inverse)).to(DEVICE)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a GPU property: whether a forward or backward makes the host "
                                                  "wait for the device (torch.cuda.set_sync_debug_mode)")
@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b != "torch"] + ["auto"])
def test_vbe_forward_and_fused_training_step_do_not_synchronize(backend):
    """A VBE batch's forward and fused SGD step queue their work without waiting for the GPU
    (the padding's and the expansion's index tensors are cached, or copied from pinned memory
    without blocking), with a batch size per key seen before and with a new one."""
    from recom_rec.kernels.selection import trial_launches

    # Each key read by one table, every key read (counting the lookups would sync: pooled_triton.lookup_bases).
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=30, feature_names=["f0"]),
              EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=30, feature_names=["f1"],
                                 pooling=PoolingType.MEAN)]
    ebc = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
    ebc.enable_fused_optimizer("sgd", lr=0.1)
    seen = _even_vbe_kjt({"f0": 3, "f1": 6}, batch=6, seed=0)
    # Strides not seen before, in the kernels' tuned shapes all the same: the launch tuner rounds
    # the padded batch (6) and the ids (18 and 22) up to powers of two (launch_tuner.ForwardLaunchShape).
    new = _even_vbe_kjt({"f0": 6, "f1": 5}, batch=6, seed=1)
    # The measured kernel choices made ahead (their trials time launches with CUDA events), the
    # kernels built and the module's caches filled; tune puts the weights back afterwards. A pass
    # is one step here: up to ~220 of them for seven forward candidates that measure alike.
    recom_rec.tune(ebc, [seen], train=True, max_passes=1000)
    trials = trial_launches()
    ebc(seen).values().sum().backward()
    torch.cuda.synchronize()
    assert trial_launches() == trials, "the launch tuner had not decided every shape"
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        ebc(seen).values().sum().backward()
        ebc(new).values().sum().backward()
        with torch.no_grad():
            out = ebc(new).values()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert trial_launches() == trials, "a shape was still on trial: the test ran the tuner, not just the lookup"
    torch.cuda.synchronize()
    ebc.check_inputs()
    with torch.no_grad():  # the new strides were copied right: the same rows as the batch spelled out
        torch.testing.assert_close(out, ebc(_spelled_out(new)).values())


def _padded_by_lengths(lengths: torch.Tensor, strides) -> torch.Tensor:
    """The padding as first defined: each key's lengths at the start of its ``width`` bags, the
    others 0, summed into offsets."""
    width = max(strides, default=0)
    padded = lengths.new_zeros(len(strides) * width)
    for k, part in enumerate(lengths.split(strides)):
        padded[k * width:k * width + part.numel()] = part
    return torch.cat([padded.new_zeros(1), padded.cumsum(0).to(lengths.dtype)])


# a key without bags, two at the largest count, width 1, every key empty, more than one kernel block
PAD_STRIDES = [[3, 0, 5, 5, 1], [1], [1, 1, 1], [0, 0], [0, 4], [1500, 3, 0, 1500]] + [
    [r.choice([0, 1, 2, r.randint(1, 40)]) for _ in range(r.randint(1, 8))]
    for r in (random.Random(seed) for seed in range(6))]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("strides", PAD_STRIDES, ids=str)
def test_padded_offsets_are_the_padded_lengths_summed(strides, dtype):
    g = torch.Generator().manual_seed(len(strides) + sum(strides))
    lengths = torch.randint(0, 4, (sum(strides),), generator=g).to(dtype)  # empty bags among them
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0).to(dtype)]).to(DEVICE)
    expected = _padded_by_lengths(lengths, strides).to(DEVICE)
    first = [sum(strides[:k]) for k in range(len(strides))]
    per_key = torch.tensor(first + strides, device=DEVICE)
    width, bags = max(strides), sum(strides)
    runs = [pad_offsets_triton.pad_offsets(offsets, per_key, width, bags), padded_offsets(offsets, per_key, width, bags)]
    if DEVICE.type == "cuda":  # the CUDA extension's (csrc/lookup/pad_offsets.cu: the eager module's where loaded)
        from recom_rec.kernels import cuda_ext

        runs.append(cuda_ext.extension().pad_offsets(offsets, per_key, width, bags))
    for got in runs:
        assert got.dtype == dtype and torch.equal(got, expected)
    # the module's path (on a GPU the kernel), from the VBE KJT
    kjt = KeyedJaggedTensor(keys=[f"f{k}" for k in range(len(strides))], values=torch.arange(int(offsets[-1]),
                            device=DEVICE), offsets=offsets, stride_per_key_per_rank=[[s] for s in strides])
    uniform = pad_to_uniform(kjt)
    assert uniform.stride() == width and torch.equal(uniform.offsets(), expected)
    assert torch.equal(uniform.values(), kjt.values())
