"""Optimizers fused into the backward, against torch's optimizers on dense gradients (where the
semantics agree), fbgemm's CPU TBE (SGD, row-wise Adagrad, Adagrad) and a row-by-row sparse Adam
reference; plus the torchrec contract: apply_optimizer_in_backward, KeyedOptimizer, checkpoints."""
import io
import warnings

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim import RowWiseAdagrad

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS, SLOW_ON_CPU, make_kjt

BACKENDS = KERNEL_BACKENDS


def _tables(dims=(4, 8, 12), pooling=PoolingType.SUM):
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=9 + 3 * i, feature_names=[f"f{i}"],
                               pooling=pooling) for i, d in enumerate(dims)]


def _batches(tables, steps, weighted=False):
    # Short ids ranges with several ids per bag: many duplicates within and across bags.
    return [make_kjt(tables, batch_size=5, max_len=4, seed=100 + s, is_weighted=weighted, shuffle_keys=False,
                     zero_fraction=0.2).to(DEVICE) for s in range(steps)]


def _loss(out: torch.Tensor, step: int) -> torch.Tensor:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(step)).to(out.device)
    return (out * g).sum() + 0.1 * out.pow(2).sum()


def _fused_module(tables, backend, opt, **kw):
    m = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
    m.enable_fused_optimizer(opt, **kw)
    return m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("opt_class,kwargs", [
    (torch.optim.SGD, {"lr": 0.3}),
    (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.0}),
    (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-8}),
    (torch.optim.Adagrad, {"lr": 0.2, "initial_accumulator_value": 0.1}),
    (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8}),
])
@pytest.mark.parametrize("dims", [(3, 17, 5), (6, 6, 6)])
def test_matches_torch_optimizer_on_dense_gradients(backend, pooling, opt_class, kwargs, dims):
    # For these optimizers an untouched row does not move under dense gradients either, so the
    # fused sparse update must equal torch's dense one.
    tables = _tables(dims, pooling)
    ref = torchrec.EmbeddingBagCollection(_tables(dims, pooling), device=DEVICE)
    ours = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
    ours.load_state_dict(ref.state_dict())
    ours.enable_fused_optimizer(opt_class, **kwargs)
    dense = opt_class(ref.parameters(), **kwargs)
    for step, kjt in enumerate(_batches(tables, 4)):
        dense.zero_grad()
        _loss(ref(kjt).values(), step).backward()
        dense.step()
        _loss(ours(kjt).values(), step).backward()
    for name, bag in ref.embedding_bags.items():
        assert ours.embedding_bags[name].weight.grad is None
        torch.testing.assert_close(ours.embedding_bags[name].weight, bag.weight, atol=1e-5, rtol=1e-5)


def _tbe(tables, optimizer, lr, eps=1e-8, weight_decay=0.0):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
    )
    kind = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "adagrad": EmbOptimType.EXACT_ADAGRAD}[optimizer]
    extra = {}
    if weight_decay:
        from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
        extra = {"weight_decay": weight_decay, "weight_decay_mode": WeightDecayMode.L2}
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables],
        optimizer=kind, learning_rate=lr, eps=eps, pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP32, output_dtype=SparseType.FP32, **extra,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer,kwargs", [
    ("sgd", {"lr": 0.3}),
    ("rowwise_adagrad", {"lr": 0.2, "eps": 1e-8}),
    ("adagrad", {"lr": 0.2, "eps": 1e-8}),
])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dims", [(4, 8, 12), (8, 8, 8)])  # mixed dims; one dim (whole-row fast path)
def test_matches_fbgemm_cpu_tbe(backend, optimizer, kwargs, weighted, dims):
    tables = _tables(dims)
    tbe = _tbe(tables, optimizer, **kwargs)
    ours = recom_rec.EmbeddingBagCollection(tables, is_weighted=weighted, device=DEVICE, backend=backend)
    with torch.no_grad():
        for w, t in zip(tbe.split_embedding_weights(), tables):
            w.copy_(ours.embedding_bags[t.name].weight.cpu())
    ours.enable_fused_optimizer(optimizer, **kwargs)
    for step, kjt in enumerate(_batches(tables, 5, weighted)):
        psw = kjt.weights().cpu() if weighted else None
        out = tbe(kjt.values().cpu().long(), kjt.offsets().cpu().long(), per_sample_weights=psw)
        _loss(out, step).backward()
        _loss(ours(kjt).values(), step).backward()
    states = tbe.split_optimizer_states()
    for i, t in enumerate(tables):
        torch.testing.assert_close(ours.embedding_bags[t.name].weight.cpu(), tbe.split_embedding_weights()[i],
                                   atol=1e-5, rtol=1e-5)
        if optimizer != "sgd":
            torch.testing.assert_close(ours.embedding_bags[t.name].optimizer_sum.cpu(), states[i][0].view(
                ours.embedding_bags[t.name].optimizer_sum.shape), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rowwise_adagrad_l2_weight_decay_formula(backend):
    # fbgemm's CUDA rule (weight_decay_mode=L2): g' = g + wd * w, state += mean(g'^2),
    # w -= lr * g' / (sqrt(state) + eps). Its CPU TBE ignores weight_decay, so the formula is
    # written out here; rows the batch does not touch must not move.
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3, feature_names=["f"])]
    ours = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
    w = torch.tensor([[1.0, 2, 3, 4], [0.5, 0.5, 0.5, 0.5], [1, 1, 1, 1]])
    with torch.no_grad():
        ours.embedding_bags["t"].weight.copy_(w)
    ours.enable_fused_optimizer(RowWiseAdagrad, lr=0.2, eps=1e-8, weight_decay=0.5)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([0, 0]), torch.tensor([1, 1])).to(DEVICE)
    g = torch.tensor([[0.1, 0.2, -0.1, 0.3], [0.05, 0.0, 0.1, 0.0]])
    ours(kjt).values().backward(g.to(DEVICE))
    g_row = g.sum(0) + 0.5 * w[0]
    state = (g_row ** 2).mean()
    expected = w.clone()
    expected[0] = w[0] - 0.2 * g_row / (state.sqrt() + 1e-8)
    torch.testing.assert_close(ours.embedding_bags["t"].weight.cpu(), expected)
    torch.testing.assert_close(ours.embedding_bags["t"].optimizer_sum.cpu(), torch.tensor([float(state), 0, 0]))


def _sparse_adam_reference(weights, states, grads_by_row, step, lr, beta1, beta2, eps, weight_decay, decoupled):
    """fbgemm's sparse Adam, one touched row at a time (``grads_by_row``: {(table, row): grad})."""
    for (t, r), g in grads_by_row.items():
        w = weights[t][r]
        if not decoupled:
            g = g + weight_decay * w
        m, v = states[t]
        m[r] = beta1 * m[r] + (1 - beta1) * g
        v[r] = beta2 * v[r] + (1 - beta2) * g * g
        m_hat, v_hat = m[r] / (1 - beta1 ** step), v[r] / (1 - beta2 ** step)
        weights[t][r] = w - lr * m_hat / (v_hat.sqrt() + eps) - (lr * weight_decay * w if decoupled else 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_class,kwargs", [
    (torch.optim.Adam, {"lr": 0.05}),
    (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1, "betas": (0.8, 0.99)}),
    (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
])
def test_sparse_adam_matches_row_by_row_reference(backend, opt_class, kwargs):
    tables = _tables((3, 8, 5))
    ours = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
    ref = torchrec.EmbeddingBagCollection(_tables((3, 8, 5)), device=DEVICE)
    ref.load_state_dict(ours.state_dict())
    ours.enable_fused_optimizer(opt_class, **kwargs)
    spec = ours.fused_optimizer.spec
    weights = [ref.embedding_bags[t.name].weight.detach().clone() for t in tables]
    states = [(torch.zeros_like(w), torch.zeros_like(w)) for w in weights]
    for step, kjt in enumerate(_batches(tables, 4)):
        with torch.no_grad():
            for w, t in zip(weights, tables):
                ref.embedding_bags[t.name].weight.copy_(w)
        ref.zero_grad()
        _loss(ref(kjt).values(), step).backward()
        touched = {}
        for ti, t in enumerate(tables):
            grad = ref.embedding_bags[t.name].weight.grad
            k = kjt.keys().index(t.feature_names[0])
            for r in kjt.values()[kjt.offset_per_key()[k]:kjt.offset_per_key()[k + 1]].unique().tolist():
                touched[(ti, r)] = grad[r].clone()
        _sparse_adam_reference(weights, states, touched, step + 1, spec.lr, spec.beta1, spec.beta2, spec.eps,
                               spec.weight_decay, spec.decoupled_weight_decay)
        _loss(ours(kjt).values(), step).backward()
    for ti, t in enumerate(tables):
        bag = ours.embedding_bags[t.name]
        torch.testing.assert_close(bag.weight, weights[ti], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(bag.optimizer_exp_avg, states[ti][0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(bag.optimizer_exp_avg_sq, states[ti][1], atol=1e-6, rtol=1e-5)


def test_apply_optimizer_in_backward_is_fused():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    tables = _tables()
    ours = recom_rec.EmbeddingBagCollection(tables, device=DEVICE)
    twin = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)
    twin.load_state_dict(ours.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        apply_optimizer_in_backward(RowWiseAdagrad, ours.parameters(), {"lr": 0.1})
    twin.enable_fused_optimizer("rowwise_adagrad", lr=0.1)
    for step, kjt in enumerate(_batches(tables, 3)):
        _loss(ours(kjt).values(), step).backward()
        _loss(twin(kjt).values(), step).backward()
    assert ours.fused_optimizer is not None and ours.fused_optimizer.spec.name == "rowwise_adagrad"
    for name, bag in twin.embedding_bags.items():
        assert ours.embedding_bags[name].weight.grad is None
        torch.testing.assert_close(ours.embedding_bags[name].weight, bag.weight)


def test_unsupported_optimizers_raise_clear_errors():
    ours = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)
    with pytest.raises(ValueError, match=r"RMSprop cannot be fused.*fused optimizers: torch.optim.SGD"):
        ours.enable_fused_optimizer(torch.optim.RMSprop, lr=0.1)
    with pytest.raises(ValueError, match=r"SGD\(momentum=0.9\) cannot be fused.*momentum is not fused"):
        ours.enable_fused_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"amsgrad"):
        ours.enable_fused_optimizer(torch.optim.Adam, lr=0.1, amsgrad=True)


def test_mixed_optimizers_across_tables_rejected():
    from torch.distributed.optim import _apply_optimizer_in_backward

    ours = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)
    params = list(ours.parameters())
    _apply_optimizer_in_backward(torch.optim.SGD, params[:1], {"lr": 0.1})
    _apply_optimizer_in_backward(torch.optim.Adagrad, params[1:], {"lr": 0.1})
    with pytest.raises(ValueError, match="one optimizer to all its tables"):
        ours(_batches(_tables(), 1)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_lr_scheduler_changes_the_fused_rate(backend):
    tables = _tables()
    a = _fused_module(tables, backend, "sgd", lr=0.5)
    b = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE, backend=backend)
    b.load_state_dict(a.state_dict())
    b.enable_fused_optimizer("sgd", lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(a.fused_optimizer, step_size=1, gamma=0.1)
    kjts = _batches(tables, 2)
    _loss(a(kjts[0]).values(), 0).backward()
    _loss(b(kjts[0]).values(), 0).backward()
    sched.step()
    assert a.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    b.fused_optimizer.param_groups[0]["lr"] = 0.05
    _loss(a(kjts[1]).values(), 1).backward()
    _loss(b(kjts[1]).values(), 1).backward()
    for name in a.embedding_bags:
        torch.testing.assert_close(a.embedding_bags[name].weight, b.embedding_bags[name].weight)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "adam"])
def test_checkpoint_restores_weights_and_optimizer_state(optimizer):
    tables = _tables()
    kjts = _batches(tables, 4)
    first = _fused_module(tables, "auto", optimizer, lr=0.1)
    for step in range(2):
        _loss(first(kjts[step]).values(), step).backward()
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # weights, optimizer state and step, one checkpoint
    for step in range(2, 4):
        _loss(first(kjts[step]).values(), step).backward()

    resumed = _fused_module(_tables(), "auto", optimizer, lr=0.1)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf))
    for step in range(2, 4):
        _loss(resumed(kjts[step]).values(), step).backward()
    for key, value in first.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, msg=lambda m: f"{key}: {m}")


def test_keyed_optimizer_state_and_plain_checkpoint_interop():
    ours = _fused_module(_tables(), "auto", "rowwise_adagrad", lr=0.1)
    _loss(ours(_batches(_tables(), 1)[0]).values(), 0).backward()
    sd = ours.fused_optimizer.state_dict()
    assert set(sd["state"]) == {f"embedding_bags.t{i}.weight" for i in range(3)}
    assert sd["state"]["embedding_bags.t0.weight"]["sum"].shape == (9,)
    assert any(v.abs().sum() > 0 for v in (s["sum"] for s in sd["state"].values()))
    # A torchrec checkpoint (no optimizer state) loads into a fused module, strictly.
    ref = torchrec.EmbeddingBagCollection(_tables(), device=DEVICE)
    ours.load_state_dict(ref.state_dict())
    torch.testing.assert_close(ours.embedding_bags["t1"].weight, ref.embedding_bags["t1"].weight)


def test_keyed_optimizer_state_dict_round_trip():
    kjts = _batches(_tables(), 2)
    a = _fused_module(_tables(), "auto", "adam", lr=0.1)
    _loss(a(kjts[0]).values(), 0).backward()
    b = _fused_module(_tables(), "auto", "adam", lr=0.1)
    b.load_state_dict({k: v for k, v in a.state_dict().items() if k.endswith(".weight")})
    b.fused_optimizer.load_state_dict(a.fused_optimizer.state_dict())
    assert int(b.fused_optimizer_step) == 1
    for model in (a, b):
        _loss(model(kjts[1]).values(), 1).backward()
    for key, value in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[key], value)


def test_fused_checkpoint_into_plain_module_warns_and_loads_weights():
    a = _fused_module(_tables(), "auto", "adagrad", lr=0.1)
    _loss(a(_batches(_tables(), 1)[0]).values(), 0).backward()
    plain = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)
    with pytest.warns(UserWarning, match="ignored"):
        plain.load_state_dict(a.state_dict())
    for name, bag in a.embedding_bags.items():
        torch.testing.assert_close(plain.embedding_bags[name].weight, bag.weight)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_hot_rows_fused_update_matches_torch_backend(optimizer):
    # Thousands of lookups of 2-3 rows per step: runs span several backward chunks.
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=2 + i, feature_names=[f"f{i}"])
              for i, d in enumerate((8, 33))]
    kjts = [make_kjt(tables, batch_size=250, max_len=8, seed=s, is_weighted=False, zero_fraction=0.0).to(DEVICE)
            for s in range(2)]
    results = {}
    for backend in KERNEL_BACKENDS:
        torch.manual_seed(0)
        m = recom_rec.EmbeddingBagCollection([EmbeddingBagConfig(**{**vars(t), "feature_names": list(t.feature_names)})
                                              for t in tables], device=DEVICE, backend=backend)
        m.enable_fused_optimizer(optimizer, lr=0.01)
        for step, kjt in enumerate(kjts):
            _loss(m(kjt).values(), step).backward()
        results[backend] = m.state_dict()
    # The two backends sum a hot row's thousands of gradients in different orders; Adam divides
    # by the gradient's own magnitude, which turns last-bit differences of a small component
    # into ~1e-5 differences of the update.
    tol = 1e-4 if optimizer == "adam" else 1e-5
    for backend in KERNEL_BACKENDS[1:]:
        for key, value in results["torch"].items():
            torch.testing.assert_close(results[backend][key], value, atol=tol, rtol=tol)


def _exact_grad(shape, seed: int) -> torch.Tensor:
    """Output gradients in sixteenths from -1/4 to 1/4: a row's sum of a few thousand of them is
    exact in fp32 in any order, so backends that sum in different orders give the same bits."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float() / 16


def _hot_row_batch(seed: int, reads) -> KeyedJaggedTensor:
    """64 bags of a cold feature (5000 rows, 0-6 ids a bag) and a hot one whose rows are read
    `reads` times, shuffled over ragged bags (some empty)."""
    g = torch.Generator().manual_seed(seed)
    batch = 64
    hot = torch.repeat_interleave(torch.arange(len(reads)), torch.tensor(reads))
    hot = hot[torch.randperm(hot.numel(), generator=g)]
    cuts = torch.sort(torch.randint(0, hot.numel() + 1, (batch - 1,), generator=g)).values
    hot_lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([hot.numel()])]))
    cold_lengths = torch.randint(0, 7, (batch,), generator=g)
    cold = torch.randint(0, 5000, (int(cold_lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=["c", "h"], values=torch.cat([cold, hot]),
                                               lengths=torch.cat([cold_lengths, hot_lengths]))


# (cold dim, hot dim) and how often each hot row is read. The backward cuts a row's lookups into
# pieces of 32; on the CUDA backend a row whose pieces one group would add in a chain of more than
# 64 loads (more than 512 pieces at dims <= 128, 32 at <= 512, 16 above) has them added by a block
# (long_row_kernel), shorter ones by one group: each case has rows just over and at that bound.
# Under the Triton interpreter each case takes ~15 s: the CPU's `make test` runs the first with the
# dense gradient, `make test-slow` the rest.
MANY_PIECES = [
    ((8, 33), (2100, 1024, 1025, 33, 1, 0)),  # 1 float4 a lane, unaligned rows: every row by one group
    pytest.param((4, 16), (2100, 1024, 1025, 33, 1, 0),  # groups of 4 lanes: each lane its own lookups
                 marks=SLOW_ON_CPU),
    pytest.param((100, 256), (2100, 1024, 1025, 33, 1, 0),  # 4 float4: 66 and 33 pieces by a block, 32 by a group
                 marks=SLOW_ON_CPU),
    pytest.param((12, 516), (1100, 512, 513, 33, 1, 0),  # 8 float4: 35 and 17 pieces by a block, 16 by a group
                 marks=SLOW_ON_CPU),
    pytest.param((8, 32), (20000, 16384, 16385, 33, 1), marks=pytest.mark.skipif(
        DEVICE.type != "cuda", reason="1 float4 a lane: rows of 513+ pieces, ~50k lookups, too slow for the "
        "Triton interpreter; the CUDA backend's block path (RECOM_TEST_DEVICE=cuda)")),
    # Rows past a block's slice (csrc long_slice_pieces: 4096 pieces at 8 lanes and one float4,
    # 512 at 16 lanes and four, 128 at 32 lanes and eight) are added by a block a slice: rows of
    # three slices, of one slice and a piece, and of exactly one slice.
    pytest.param((8, 32), (300000, 131073, 131072, 1), marks=pytest.mark.skipif(
        DEVICE.type != "cuda", reason="rows of up to 9,375 pieces, ~560k lookups: the CUDA backend's slices")),
    pytest.param((100, 256), (40000, 16385, 16384, 33, 1), marks=pytest.mark.skipif(
        DEVICE.type != "cuda", reason="rows of up to 1,250 pieces, ~73k lookups: the CUDA backend's slices")),
    pytest.param((12, 516), (9000, 4097, 4096, 33, 1), marks=pytest.mark.skipif(
        DEVICE.type != "cuda", reason="rows of up to 282 pieces at 8 float4 a lane: the CUDA backend's slices")),
]


@pytest.mark.parametrize("optimizer", [None] + [pytest.param(o, marks=SLOW_ON_CPU)
                                              for o in ("sgd", "rowwise_adagrad", "adam")])
@pytest.mark.parametrize("dims,reads", MANY_PIECES)
def test_rows_of_many_pieces_match_torch_backend_and_repeat_bit_for_bit(optimizer, dims, reads):
    # The hot rows' run starts after the cold table's lookups, at a position that is no multiple
    # of 32 (the partial sums' slots). Two steps: Adam's second reads the states of the first.
    tables = [EmbeddingBagConfig(name="cold", embedding_dim=dims[0], num_embeddings=5000, feature_names=["c"]),
              EmbeddingBagConfig(name="hot", embedding_dim=dims[1], num_embeddings=len(reads), feature_names=["h"])]
    kjts = [_hot_row_batch(seed, reads).to(DEVICE) for seed in range(2)]

    def train(backend):
        torch.manual_seed(0)
        m = recom_rec.EmbeddingBagCollection([EmbeddingBagConfig(**{**vars(t), "feature_names": list(t.feature_names)})
                                              for t in tables], device=DEVICE, backend=backend)
        if optimizer is not None:
            m.enable_fused_optimizer(optimizer, lr=0.01)
        for step, kjt in enumerate(kjts):
            out = m(kjt).values()
            (out * _exact_grad(out.shape, step).to(DEVICE)).sum().backward()
        grads = {f"{n}.grad": b.weight.grad.clone() for n, b in m.embedding_bags.items() if b.weight.grad is not None}
        return {k: v.detach().clone() for k, v in m.state_dict().items()} | grads

    reference = train("torch")
    assert any(k.endswith(".grad") for k in reference) == (optimizer is None)
    # The rows' gradients are exact whatever the order of summation (_exact_grad), so the dense
    # ones must match bit for bit and the optimizers' results to their own formulas' rounding.
    tol = 0 if optimizer is None else 1e-5
    for backend in KERNEL_BACKENDS[1:]:
        first, again = train(backend), train(backend)
        assert first.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(first[key], value, atol=tol, rtol=tol, msg=lambda m: f"{backend} {key}: {m}")
            assert torch.equal(first[key], again[key]), (backend, key)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_dtype_groups_share_one_step(optimizer):
    # fp32 and fp16 tables live in two groups (two launches, two backward nodes); one training
    # step must count once and both groups must update.
    from torchrec.modules.embedding_configs import DataType
    tables = _tables((4, 8, 12))
    tables[1].data_type = DataType.FP16
    m = recom_rec.EmbeddingBagCollection(tables, device=DEVICE)
    m.enable_fused_optimizer(optimizer, lr=0.1)
    before = {n: b.weight.detach().clone() for n, b in m.embedding_bags.items()}
    for step, kjt in enumerate(_batches(tables, 2)):
        _loss(m(kjt).values(), step).backward()
    assert int(m.fused_optimizer_step) == 2
    for n, b in m.embedding_bags.items():
        assert not torch.equal(b.weight, before[n]), n


class _PassThroughMode(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing: code under it takes the registered custom ops (the
    path torch.compile and tracing see) instead of the eager shortcut."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_eager_and_registered_op_paths_agree(backend, weighted, optimizer):
    tables = _tables((3, 8, 5), PoolingType.MEAN)
    batches = _batches(tables, 3, weighted=weighted)
    runs = []
    for mode in (None, _PassThroughMode):
        torch.manual_seed(0)
        m = recom_rec.EmbeddingBagCollection(_tables((3, 8, 5), PoolingType.MEAN), device=DEVICE, backend=backend,
                                             is_weighted=weighted)
        m.enable_fused_optimizer(optimizer, lr=0.1)
        outs = []
        for step, kjt in enumerate(batches):
            if weighted:  # learnable sample weights: their gradient comes from the same backward
                kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                        weights=kjt.weights().clone().requires_grad_())
            if mode is None:
                out = m(kjt).values()
                _loss(out, step).backward()
            else:
                with mode():
                    out = m(kjt).values()
                    _loss(out, step).backward()
            outs.append((out.detach(), kjt.weights().grad if weighted else None))
        runs.append((outs, {k: v.clone() for k, v in m.state_dict().items()}))
    (outs_a, state_a), (outs_b, state_b) = runs
    # Bit-equal on the CPU; on a GPU torch's atomic index_add (the torch backend, the sample
    # weights' gradient) sums in a varying order, so allow a few ulps.
    tol = {"rtol": 0, "atol": 0} if DEVICE.type == "cpu" else {"rtol": 1e-5, "atol": 1e-7}
    for (oa, ga), (ob, gb) in zip(outs_a, outs_b):
        torch.testing.assert_close(oa, ob, **tol)
        if weighted:
            torch.testing.assert_close(ga, gb, **tol)
    for k in state_a:
        torch.testing.assert_close(state_a[k], state_b[k], **tol, msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("through_ops", [False, True])
def test_module_used_twice_in_one_graph_applies_both_batches(backend, through_ops):
    # Two lookups in one loss (e.g. a user tower and an item tower sharing tables): the fused SGD
    # update of both backwards equals dense SGD on the summed gradient.
    tables = _tables((4, 8, 12))
    first, second = _batches(tables, 2)
    ref = torchrec.EmbeddingBagCollection(_tables((4, 8, 12)), device=DEVICE)
    ours = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
    ours.load_state_dict(ref.state_dict())
    ours.enable_fused_optimizer("sgd", lr=0.2)
    dense = torch.optim.SGD(ref.parameters(), lr=0.2)
    (_loss(ref(first).values(), 0) + _loss(ref(second).values(), 1)).backward()
    dense.step()
    if through_ops:
        with _PassThroughMode():
            (_loss(ours(first).values(), 0) + _loss(ours(second).values(), 1)).backward()
    else:
        (_loss(ours(first).values(), 0) + _loss(ours(second).values(), 1)).backward()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
@pytest.mark.parametrize("optimizer,kwargs", [  # (rates that keep hot rows' weights small: fp32 sums compared)
    ("sgd", {"lr": 0.02}),
    ("rowwise_adagrad", {"lr": 0.05, "eps": 1e-8}),
    ("adagrad", {"lr": 0.05, "eps": 1e-8}),
    ("adam", {"lr": 0.01}),
])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dims", [(5, 12, 7, 16), (3, 131, 8)])
def test_tables_off_a_multiple_of_4_train_as_the_torch_backend(backend, optimizer, kwargs, weighted, dims):
    """Odd dims put the output's width and the later tables' bases off a multiple of 4: the CUDA
    backward reads its gradient rows 16 bytes at a time from a padded copy (ops/gradient_layout.py)
    and updates such rows column by column. Tables of 5 rows at batch 64 make rows of more than 32
    lookups (split rows) besides pieces; weighted batches keep the unpadded gradient."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=5 + 40 * (i % 2),
                                 feature_names=[f"f{i}"]) for i, d in enumerate(dims)]
    batches = [make_kjt(tables, batch_size=64, max_len=6, seed=300 + s, is_weighted=weighted, shuffle_keys=False,
                        zero_fraction=0.1).to(DEVICE) for s in range(2)]
    trained = {}
    for b in ("torch", backend):
        torch.manual_seed(0)
        module = _fused_module(tables, b, optimizer, **kwargs) if not weighted else None
        if weighted:
            module = recom_rec.EmbeddingBagCollection(tables, is_weighted=True, device=DEVICE, backend=b)
            module.enable_fused_optimizer(optimizer, **kwargs)
        for step, kjt in enumerate(batches):
            _loss(module(kjt).values(), step).backward()
        trained[b] = module.state_dict()
    for k, v in trained["torch"].items():
        torch.testing.assert_close(trained[backend][k], v, rtol=1e-5, atol=1e-5, msg=k)
