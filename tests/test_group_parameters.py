"""``group_parameters=True``: one trainable Parameter per dtype group instead of one per table. Its
gradient is the tables' gradients laid out as the flat buffer (the same bits as the per-table
mode's), ``torch.optim`` trains it to the same weights, ``state_dict`` keeps torchrec's keys,
copies, device moves, meta construction and replaced Parameters keep the tables viewing it, and
TorchScript of its trace runs it."""
import copy

import pytest
import torch
import torchrec
from torch.overrides import TorchFunctionMode
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_configs import DataType

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS, make_kjt


def _tables(is_weighted=False, half=DataType.FP16):
    # Two dtype groups (fp32, fp16), equal and changing widths, a shared feature, MEAN pooling.
    spec = [("a", 4, 11, ["f0"], DataType.FP32), ("b", 4, 7, ["f1", "f0"], DataType.FP32),
            ("c", 8, 5, ["f2"], DataType.FP32), ("e", 3, 6, ["f3"], DataType.FP32),
            ("h", 5, 8, ["f4"], half)]
    return [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=f, data_type=t,
                               pooling=PoolingType.MEAN if n == "e" and not is_weighted else PoolingType.SUM)
            for n, d, r, f, t in spec]


def _pair(backend="torch", is_weighted=False, half=DataType.FP16, **kwargs):
    """(per-table module, group-parameter module) with the same weights."""
    tables = _tables(is_weighted, half)
    per_table = recom_rec.EmbeddingBagCollection(tables, is_weighted=is_weighted, device=DEVICE, backend=backend,
                                                 **kwargs)
    grouped = recom_rec.EmbeddingBagCollection(tables, is_weighted=is_weighted, device=DEVICE, backend=backend,
                                               group_parameters=True, **kwargs)
    grouped.load_state_dict(per_table.state_dict())
    return per_table, grouped


def _kjt(is_weighted=False, seed=0):
    return make_kjt(_tables(), 6, 4, seed, is_weighted, zero_fraction=0.3).to(DEVICE)


def _backward(module, kjt, seed=0):
    out = module(kjt).values()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    (out * g).sum().backward()


def _group_params(module):
    return [module._flat(g) for g in module._groups]


def _as_flat(module, per_table, group):
    """The per-table module's gradients laid out as ``group``'s flat buffer."""
    return torch.cat([per_table.embedding_bags[s.name].weight.grad.reshape(-1) for s in group.slots])


def _same(got, want):
    if DEVICE.type == "cuda":  # a backend may add a row's (or a bag's) lookups in no fixed order on a GPU
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("is_weighted", [False, True])
def test_group_gradient_is_the_tables_gradients(backend, is_weighted):
    per_table, grouped = _pair(backend, is_weighted)
    kjt = _kjt(is_weighted, seed=1)
    _backward(per_table, kjt)
    _backward(grouped, kjt)
    assert len(grouped._groups) == 2
    for group in grouped._groups:
        flat = grouped._flat(group)
        assert flat.grad is not None and flat.grad.shape == flat.shape and flat.grad.dtype == flat.dtype
        _same(flat.grad, _as_flat(grouped, per_table, group))
    assert all(b.weight.grad is None for b in grouped.embedding_bags.values())


class _Passthrough(TorchFunctionMode):
    """Any function mode sends the lookup through the registered custom op and its formula."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_registered_op_gives_the_group_the_same_gradient():
    _, eager = _pair()
    op = copy.deepcopy(eager)
    kjt = _kjt(seed=2)
    _backward(eager, kjt)
    with _Passthrough():
        _backward(op, kjt)
    for a, b in zip(_group_params(eager), _group_params(op)):
        _same(b.grad, a.grad)


def test_parameters_and_state_dict():
    per_table, grouped = _pair()
    trainable = [n for n, p in grouped.named_parameters() if p.requires_grad]
    assert trainable == [g.flat_name for g in grouped._groups]
    assert all(not b.weight.requires_grad and isinstance(b.weight, torch.nn.Parameter)
               for b in grouped.embedding_bags.values())
    # The tables view their group's Parameter.
    for group in grouped._groups:
        flat = grouped._flat(group)
        for s in group.slots:
            w = grouped.embedding_bags[s.name].weight
            assert w.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert w.storage_offset() == flat.storage_offset() + s.elem_base
    # torchrec's keys and values, and a torchrec checkpoint loads strictly.
    ref = torchrec.EmbeddingBagCollection(_tables(), device=DEVICE)
    assert list(grouped.state_dict()) == list(ref.state_dict()) == list(per_table.state_dict())
    for k, v in per_table.state_dict().items():
        assert torch.equal(grouped.state_dict()[k], v), k
    grouped.load_state_dict(ref.state_dict())
    for name, bag in ref.embedding_bags.items():
        assert torch.equal(grouped.embedding_bags[name].weight, bag.weight), name
    assert "group_parameters=True" in repr(grouped)


# Adam's and Adagrad's eps underflow in fp16 (torch's optimizers make NaN of fp16 rows that get no
# gradient, in either mode): their cases keep every table in fp32.
@pytest.mark.parametrize("make_opt,half", [(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), DataType.FP16),
                                           (lambda p: torch.optim.Adam(p, lr=0.05), DataType.FP32),
                                           (lambda p: torch.optim.Adagrad(p, lr=0.1), DataType.FP32)],
                         ids=["sgd", "adam", "adagrad"])
def test_torch_optim_trains_to_the_same_weights(make_opt, half):
    per_table, grouped = _pair(half=half)
    opts = [make_opt(per_table.parameters()), make_opt(grouped.parameters())]
    for step in range(3):
        kjt = _kjt(seed=10 + step)
        for module, opt in zip((per_table, grouped), opts):
            opt.zero_grad()
            _backward(module, kjt, seed=step)
            opt.step()
    for k, v in per_table.state_dict().items():
        # fp16 rows: torch's elementwise kernels may round a long tensor's vectorised body and a
        # short one's tail apart by an ulp
        tol = 1e-6 if v.dtype == torch.float32 else 2e-3
        torch.testing.assert_close(grouped.state_dict()[k].float(), v.float(), atol=tol, rtol=tol, msg=k)


def test_grad_accumulates_over_two_backwards():
    per_table, grouped = _pair()
    for seed in (4, 5):
        kjt = _kjt(seed=seed)
        _backward(per_table, kjt, seed=seed)
        _backward(grouped, kjt, seed=seed)
    for group in grouped._groups:
        torch.testing.assert_close(grouped._flat(group).grad, _as_flat(grouped, per_table, group), atol=1e-6,
                                   rtol=1e-6)


def test_copies_moves_and_replaced_parameters_keep_the_tables_viewing_the_group():
    _, grouped = _pair()
    cases = {"deepcopy": copy.deepcopy(grouped), "to": copy.deepcopy(grouped).to(DEVICE)}
    meta = recom_rec.EmbeddingBagCollection(_tables(), device="meta", group_parameters=True)
    meta.to_empty(device=DEVICE)
    meta.load_state_dict(grouped.state_dict())
    cases["meta"] = meta
    assigned = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE, group_parameters=True)
    assigned.load_state_dict({k: v.clone() for k, v in grouped.state_dict().items()}, assign=True)
    cases["assign"] = assigned
    kjt = _kjt(seed=6)
    want = grouped(kjt).values()
    for name, module in cases.items():
        assert [n for n, p in module.named_parameters() if p.requires_grad] == \
            [g.flat_name for g in module._groups], name
        torch.testing.assert_close(module(kjt).values(), want, msg=name)  # (re-packs a replaced table first)
        with torch.no_grad():
            for p in _group_params(module):
                p.add_(1.0)
        for n, bag in module.embedding_bags.items():
            torch.testing.assert_close(bag.weight.float(), grouped.embedding_bags[n].weight.float() + 1,
                                       atol=2e-3, rtol=0, msg=f"{name} {n}")
        _backward(module, kjt)
        assert all(p.grad is not None for p in _group_params(module)), name
    _same(grouped(kjt).values(), want)  # the copies share nothing with the original (the +1 would show)


def test_fused_optimizer_updates_as_without_group_parameters():
    per_table, grouped = _pair()
    for module in (per_table, grouped):
        module.enable_fused_optimizer("sgd", lr=0.1)
        for seed in (7, 8):
            module(_kjt(seed=seed)).values().sum().backward()
    for k, v in per_table.state_dict().items():
        torch.testing.assert_close(grouped.state_dict()[k].float(), v.float(), atol=1e-6, rtol=1e-6, msg=k)
    assert all(p.grad is None for p in _group_params(grouped))


def test_group_parameters_take_no_parameter_server_tables():
    from recom_rec.ps import PSConfig

    with pytest.raises(ValueError, match="group_parameters does not take parameter-server tables"):
        recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE, group_parameters=True,
                                         ps={"a": PSConfig(url="memory://group-params", cache_rows=4)})


def test_compiled_module_gives_the_group_the_eager_gradient():
    """torch.compile (one graph, the registered op's formula) hands the group's Parameter the same
    gradient as eager."""
    _, eager = _pair()
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True, dynamic=False)
    kjt = _kjt(seed=9)
    _backward(eager, kjt)
    _backward(compiled, kjt)
    for a, b in zip(_group_params(eager), _group_params(compiled_module)):
        _same(b.grad, a.grad)


def test_torchscript_of_the_trace_gives_the_same_output():
    _, grouped = _pair()
    grouped.eval()
    scripted = torch.jit.script(torchrec.fx.symbolic_trace(grouped))
    kjt = _kjt(seed=3)
    torch.testing.assert_close(scripted(kjt).values(), grouped(kjt).values())
