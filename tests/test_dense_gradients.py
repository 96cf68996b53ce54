"""Dense gradients (no fused optimizer): what a plain ``torch.optim`` optimizer over
``model.parameters()`` sees. Each table's ``.grad`` against torchrec's pure-torch module, the eager
lookup's gradients bit for bit against the registered op's formula, the gradients as views of one
buffer (taken by autograd without a copy), accumulation, ``zero_grad`` both ways, frozen tables, and
Parameters replaced or copied after construction."""
import copy

import pytest
import torch
import torchrec
from torch.overrides import TorchFunctionMode
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_configs import DataType

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS, make_kjt
from recom_rec.ops.layout import POOLING_SUM, FeatureSlot, feature_meta_tensor, pack_tables


def _tables(data_type=DataType.FP32, is_weighted=False, fp16_table=DataType.FP16):
    # Runs of equal widths and width changes (the gradient splits per run), a shared feature, a
    # table without feature names (read by its own name), a one-row table, MEAN pooling, and a
    # second dtype group. (torchrec's module rejects weighted MEAN pooling.)
    spec = [("a", 4, 11, ["f0"]), ("b", 4, 7, ["f1", "f0"]), ("c", 8, 5, ["f2"]), ("d", 3, 9, []),
            ("e", 3, 6, ["f3"]), ("f", 3, 1, ["f4"]), ("g", 16, 13, ["f1"])]
    tables = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=list(f),
                                 pooling=PoolingType.MEAN if n == "e" and not is_weighted else PoolingType.SUM,
                                 data_type=data_type)
              for n, d, r, f in spec]
    tables.append(EmbeddingBagConfig(name="h", embedding_dim=5, num_embeddings=8, feature_names=["f5"],
                                     data_type=fp16_table))
    return tables


def _pair(backend, is_weighted=False, data_type=DataType.FP32):
    """(pure-torch reference, ours) with the same weights: the reference is torchrec's module with
    every table in fp32 (it cannot weight fp16 tables), loaded with our weights."""
    ours = recom_rec.EmbeddingBagCollection(_tables(data_type, is_weighted), is_weighted=is_weighted, device=DEVICE,
                                            backend=backend)
    ref = torchrec.EmbeddingBagCollection(_tables(DataType.FP32, is_weighted, fp16_table=DataType.FP32),
                                          is_weighted=is_weighted, device=DEVICE)
    ref.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    return ref, ours


def _kjt(is_weighted=False, seed=0, batch_size=5):
    # zero_fraction: about a third of the bags are empty.
    return make_kjt(_tables(), batch_size, 4, seed, is_weighted, zero_fraction=0.35).to(DEVICE)


def _close(got, want, tol=1e-5):
    # Table "h" is fp16: its gradient is rounded to fp16 (ours once, torchrec's per addition).
    tol = tol if got.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _backward(module, kjt, seed=0):
    out = module(kjt).values()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    (out * g).sum().backward()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("is_weighted", [False, True])
@pytest.mark.parametrize("data_type", [DataType.FP32, DataType.FP16])
def test_each_table_gradient_matches_torchrec(backend, is_weighted, data_type):
    ref, ours = _pair(backend, is_weighted, data_type)
    kjt = _kjt(is_weighted)
    _backward(ref, kjt)
    _backward(ours, kjt)
    for name, table in ref.embedding_bags.items():
        got = ours.embedding_bags[name].weight.grad
        assert got is not None, name
        assert got.dtype == ours.embedding_bags[name].weight.dtype and got.shape == table.weight.shape, name
        tol = dict(atol=1e-5, rtol=1e-5) if got.dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got.float(), table.weight.grad.float(), **tol,
                                   msg=lambda m: f"table {name}: {m}")


def _sparse_tables(half=DataType.FP16):
    # Tables several of the CUDA zero kernel's blocks long (32,768 fp32 elements a block), dims that
    # are and are not multiples of a 16-byte chunk, a feature shared by two tables, a table without
    # feature names, an fp16 group: with 2 ids a bag, most rows get no lookup.
    spec = [("w0", 20, 3000, ["g0"], DataType.FP32), ("w1", 7, 5000, ["g1"], DataType.FP32),
            ("w2", 64, 1000, ["g2", "g0"], DataType.FP32), ("w3", 4, 2000, [], DataType.FP32),
            ("w4", 12, 4000, ["g3"], half), ("w5", 5, 3000, ["g4"], half)]
    return [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=f, data_type=t)
            for n, d, r, f, t in spec]


def _refill_freed_memory(numels, dtypes):
    """Leaves memory that tensors of these sizes filled with NaN to the allocator (CUDA's caching
    allocator hands such blocks out again to the next tensors of their size)."""
    held = [torch.full((n,), float("nan"), dtype=d, device=DEVICE) for n in numels for d in dtypes for _ in range(2)]
    del held


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_rows_no_lookup_reads_get_exact_zeros_in_reused_memory(backend):
    """The dense gradient may be built in memory a freed tensor left NaN in: every row the batch
    does not read is exactly zero, the others are torchrec's (the CUDA backend writes each element
    once, zeros around the touched rows, instead of zeroing the buffer first)."""
    tables = _sparse_tables()
    ours = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
    ref = torchrec.EmbeddingBagCollection(_sparse_tables(half=DataType.FP32), device=DEVICE)
    ref.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    kjt = make_kjt(tables, 6, 2, 4, False, zero_fraction=0.2).to(DEVICE)
    _backward(ref, kjt)
    numels = [sum(t.num_embeddings * t.embedding_dim for t in tables if t.data_type == dt)
              for dt in (DataType.FP32, DataType.FP16)]
    out = ours(kjt).values()
    # just before the lookup's backward allocates the gradient buffers
    out.register_hook(lambda grad: _refill_freed_memory(numels, (torch.float32, torch.float16)))
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device)).sum().backward()
    for name, table in ref.embedding_bags.items():
        got, want = ours.embedding_bags[name].weight.grad.float(), table.weight.grad
        untouched = want.abs().sum(1) == 0
        assert untouched.sum() > want.shape[0] // 2, name  # the case is mostly rows no lookup reads
        assert torch.equal(got[untouched], torch.zeros_like(got[untouched])), name
        _close(ours.embedding_bags[name].weight.grad, want, 1e-5)


def _op_gradient(tables, kjt, features, backend):
    """The registered dense backward on one group of ``tables``, its features (name, table) in the
    given order, each feature's output gradient seeded by its name; in memory a freed tensor left NaN."""
    slots = pack_tables([t.name for t in tables], [t.num_embeddings for t in tables], [t.embedding_dim for t in tables])
    cols, col = [], 0
    for _, table in features:
        cols.append(col)
        col += tables[table].embedding_dim
    meta = feature_meta_tensor(slots, [FeatureSlot(f, f"{f}@{t}", t, 0, POOLING_SUM) for f, t in features], cols)
    grads = [torch.randn(kjt.stride(), tables[t].embedding_dim,
                         generator=torch.Generator().manual_seed(sum(map(ord, f)) + 97 * t)) for f, t in features]
    key_index = torch.tensor([kjt.keys().index(f) for f, _ in features], dtype=torch.int64)
    numel = sum(s.numel for s in slots)
    _refill_freed_memory([numel], (torch.float32,))
    return torch.ops.recom_rec.pooled_embedding_backward(
        torch.cat(grads, 1).to(DEVICE), kjt.values(), kjt.offsets(), None, meta.to(DEVICE), key_index.to(DEVICE),
        kjt.stride(), numel, max(t.embedding_dim for t in tables), torch.float32, backend, -1,
        sum(t.num_embeddings for t in tables))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_features_in_another_order_than_their_tables_get_the_same_gradient(backend):
    """The registered backward takes a group's features in any order, not only table by table as a
    module lists them (the CUDA zero kernel finds each element's table by a search that assumes
    that order, and must still leave no element unwritten): the same gradient, every row no lookup
    reads exactly zero, in reused memory."""
    tables = _sparse_tables(half=DataType.FP32)
    kjt = make_kjt(tables, 6, 2, 4, False, zero_fraction=0.2).to(DEVICE)
    in_order = [(f, i) for i, t in enumerate(tables) for f in t.feature_names]
    want = _op_gradient(tables, kjt, in_order, "torch")
    for features in (in_order, in_order[::-1], in_order[1:] + in_order[:1]):
        got = _op_gradient(tables, kjt, features, backend)
        assert not torch.isnan(got).any(), features
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[want == 0], want[want == 0]), features


class _Passthrough(TorchFunctionMode):
    """Any function mode sends the lookup through the registered custom op (its own autograd
    formula, which makes the tables' views with unflatten_dense_tensors)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("is_weighted", [False, True])
def test_eager_gradients_are_the_registered_ops_bits(backend, is_weighted):
    _, eager = _pair(backend, is_weighted)
    op = copy.deepcopy(eager)
    kjt = _kjt(is_weighted, seed=3)
    _backward(eager, kjt)
    with _Passthrough():
        _backward(op, kjt)
    for name, bag in eager.embedding_bags.items():
        if backend == "torch" and bag.weight.is_cuda:  # torch's index_add_ adds in no fixed order on a GPU
            torch.testing.assert_close(bag.weight.grad, op.embedding_bags[name].weight.grad, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(bag.weight.grad, op.embedding_bags[name].weight.grad), name


def test_gradients_are_views_of_one_buffer_taken_without_a_copy():
    _, ours = _pair("torch")
    _backward(ours, _kjt())
    for group in ours._groups:
        grads = [ours.embedding_bags[s.name].weight.grad for s in group.slots]
        base = grads[0].untyped_storage().data_ptr()
        for slot, grad in zip(group.slots, grads):
            assert grad.untyped_storage().data_ptr() == base, slot.name
            assert grad.storage_offset() == slot.elem_base and grad.is_contiguous(), slot.name


def test_grad_accumulates_over_two_backwards():
    _, ours = _pair("torch")
    kjt = _kjt(seed=1)
    _backward(ours, kjt, seed=1)
    once = {n: b.weight.grad.clone() for n, b in ours.embedding_bags.items()}
    _backward(ours, _kjt(seed=2), seed=2)
    ref, _ = _pair("torch")
    _backward(ref, kjt, seed=1)
    _backward(ref, _kjt(seed=2), seed=2)
    for name, table in ref.embedding_bags.items():
        got = ours.embedding_bags[name].weight.grad
        _close(got, table.weight.grad, 1e-4)
        assert not torch.equal(got, once[name]), name
    # The same batch twice: exactly twice the gradient (g + g is exact in floating point), where
    # the backward adds in a fixed order (not torch's index_add_ on a GPU: within 1e-6 there).
    _, twice = _pair("torch")
    _backward(twice, kjt, seed=1)
    _backward(twice, kjt, seed=1)
    for name, bag in twice.embedding_bags.items():
        if bag.weight.is_cuda:
            torch.testing.assert_close(bag.weight.grad, 2 * once[name], rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(bag.weight.grad, 2 * once[name]), name


@pytest.mark.parametrize("set_to_none", [True, False])
def test_optimizer_zero_grad_both_ways(set_to_none):
    ref, ours = _pair("torch")
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, ours)]
    for step in range(3):
        kjt = _kjt(seed=10 + step)
        for module, opt in zip((ref, ours), opts):
            opt.zero_grad(set_to_none=set_to_none)
            if step and not set_to_none:
                assert all(p.grad is not None and not p.grad.any() for p in module.parameters())
            if step and set_to_none:
                assert all(p.grad is None for p in module.parameters())
            _backward(module, kjt, seed=step)
            opt.step()
    for name, table in ref.embedding_bags.items():
        w = ours.embedding_bags[name].weight
        _close(w.grad, table.weight.grad, 1e-4)
        _close(w, table.weight, 1e-4)
    # The optimizer updated the tables in place: the fused lookup reads the new values.
    torch.testing.assert_close(ours(_kjt(seed=20)).values(), ref(_kjt(seed=20)).values(), atol=2e-3, rtol=2e-3)


def test_frozen_tables_get_no_grad():
    ref, ours = _pair("torch")
    for module in (ref, ours):
        module.embedding_bags["b"].weight.requires_grad_(False)
        module.embedding_bags["g"].weight.requires_grad_(False)
    kjt = _kjt(seed=4)
    _backward(ref, kjt)
    _backward(ours, kjt)
    for name, table in ref.embedding_bags.items():
        got = ours.embedding_bags[name].weight.grad
        if name in ("b", "g"):
            assert got is None, name
        else:
            _close(got, table.weight.grad)
    for module in (ref, ours):  # every table frozen: no graph at all
        for p in module.parameters():
            p.requires_grad_(False)
            p.grad = None
    assert not ours(kjt).values().requires_grad


def test_autograd_grad_reaches_each_table():
    _, ours = _pair("torch")
    out = ours(_kjt(seed=5)).values().sum()
    weights = [b.weight for b in ours.embedding_bags.values()]
    grads = torch.autograd.grad(out, weights)
    assert [g.shape for g in grads] == [w.shape for w in weights]
    assert all(w.grad is None for w in weights)


def test_replaced_and_copied_parameters_get_the_gradients():
    ref, ours = _pair("torch")
    # load_state_dict(assign=True) puts new Parameter objects in the tables.
    ours.load_state_dict(ref.state_dict(), assign=True)
    kjt = _kjt(seed=6)
    _backward(ref, kjt)
    _backward(ours, kjt)
    clone = copy.deepcopy(ours)
    for p in clone.parameters():
        p.grad = None
    _backward(clone, kjt)
    for name, table in ref.embedding_bags.items():
        for module in (ours, clone):
            w = module.embedding_bags[name].weight
            assert w is module.state_dict(keep_vars=True)[f"embedding_bags.{name}.weight"]
            _close(w.grad, table.weight.grad)
    assert ours.embedding_bags["a"].weight.grad is not clone.embedding_bags["a"].weight.grad


def test_meta_module_materialised_gets_gradients():
    ref, built = _pair("torch")
    ours = recom_rec.EmbeddingBagCollection(_tables(), device="meta", backend="torch")
    ours.to_empty(device=DEVICE)  # new Parameter objects (meta tensors cannot be re-pointed)
    ours.load_state_dict(built.state_dict())
    kjt = _kjt(seed=7)
    _backward(ref, kjt)
    _backward(ours, kjt)
    for name, table in ref.embedding_bags.items():
        got = ours.embedding_bags[name].weight.grad
        _close(got, table.weight.grad)


def test_per_table_hooks_fire_once_a_backward():
    # What DDP and FSDP-style gradient bucketing rely on: each table is its own autograd leaf.
    _, ours = _pair("torch")
    seen, hooked = [], []
    for name, bag in ours.embedding_bags.items():
        bag.weight.register_post_accumulate_grad_hook(lambda p, name=name: seen.append(name))
        bag.weight.register_hook(lambda g, name=name: hooked.append(name))
    _backward(ours, _kjt(seed=8))
    assert sorted(seen) == sorted(hooked) == sorted(ours.embedding_bags)
