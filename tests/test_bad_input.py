"""Bad input raises a ValueError naming the feature and the table, on every backend: at the call on
the torch backend, and from the GPU kernels' own check (ops/input_check.py) by the next call or
``check_inputs()`` on the kernel backends, which meanwhile read nothing out of bounds."""
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS, capture_forward

TABLES = [
    EmbeddingBagConfig(name="users", embedding_dim=4, num_embeddings=10, feature_names=["user_id"]),
    EmbeddingBagConfig(name="item_table", embedding_dim=3, num_embeddings=6, feature_names=["item_id", "shared"]),
    EmbeddingBagConfig(name="tags", embedding_dim=2, num_embeddings=100, feature_names=["shared"]),
]
BACKENDS = KERNEL_BACKENDS


def _module(backend, **kw):
    return recom_rec.EmbeddingBagCollection(
        [EmbeddingBagConfig(**{**vars(t), "feature_names": list(t.feature_names)}) for t in TABLES],
        backend=backend, device=DEVICE, **kw)


def _run(module, kjt):
    """One batch, then the kernels' report: the torch backend raises in the call, the kernel
    backends by check_inputs() (or the next call)."""
    module(kjt)
    module.check_inputs()


def _kjt(values, lengths, keys=("user_id", "item_id", "shared"), weights=None):
    return KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values), lengths=torch.tensor(lengths),
                             weights=weights).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_id_out_of_range_names_feature_and_table(backend):
    with pytest.raises(ValueError, match=r"feature 'item_id' \(table 'item_table'\): id 6 at batch index 1 .*\[0, 6\)"):
        _run(_module(backend), _kjt([1, 2, 0, 6, 3, 4], [1, 1, 1, 1, 1, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_feature_checked_against_the_smaller_table(backend):
    # 'shared' feeds items (6 rows) and tags (100 rows): id 50 is fine for tags, not for items.
    with pytest.raises(ValueError, match=r"feature 'shared' \(table 'item_table'\): id 50"):
        _run(_module(backend), _kjt([1, 2, 0, 1, 50, 4], [1, 1, 1, 1, 1, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_id(backend):
    with pytest.raises(ValueError, match=r"feature 'user_id' \(table 'users'\): id -3 .* negative"):
        _run(_module(backend), _kjt([-3, 2, 0, 1, 3, 4], [1, 1, 1, 1, 1, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [[1, 1, 1, 1, 1, 2], [1, 1, 1, 0, 1, 1], [3, 3, 1, 0, 0, 0]])
def test_lengths_that_do_not_add_up(backend, lengths):
    # The host names the first key where they disagree; the kernels name the bag that leaves the
    # values, or only the totals when the values are longer.
    with pytest.raises(ValueError, match=r"lengths add up (to \d+ but there are|past its) 6 values"):
        _run(_module(backend), _kjt([1, 2, 0, 1, 3, 4], lengths))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths,message", [
    ([0, 0, 0, 1, 0, 0], r"feature 'item_id' \(table 'item_table'\): id 6 at batch index 1"),
    ([0, 0, 0, 0, 0, 0], r"lengths add up to 0 but there are 1 values"),
])
def test_one_value_in_all(backend, lengths, message):
    # One value: a compiled Triton kernel takes the values' count as a constexpr 1, and its report
    # must still compile and name the feature and table.
    with pytest.raises(ValueError, match=message):
        _run(_module(backend), _kjt([6], lengths))


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_feature(backend):
    with pytest.raises(ValueError, match=r"missing feature\(s\) 'item_id' \(table 'item_table'\)"):
        _module(backend)(_kjt([1, 2, 0, 1], [1, 1, 1, 1], keys=("user_id", "shared")))


def test_weighted_module_needs_weights():
    with pytest.raises(ValueError, match="weighted but the KeyedJaggedTensor has no weights"):
        _module("torch", is_weighted=True)(_kjt([1, 2, 0, 1, 3, 4], [1, 1, 1, 1, 1, 1]))


def test_float_ids_rejected():
    kjt = KeyedJaggedTensor(keys=["user_id", "item_id", "shared"], values=torch.tensor([1.0, 2.0, 0.0]),
                            lengths=torch.tensor([1, 1, 1])).to(DEVICE)
    with pytest.raises(ValueError, match="integer ids"):
        _module("torch")(kjt)


def test_checks_can_be_switched_off():
    module = _module("torch", validate_inputs=False)
    good = _kjt([1, 2, 0, 1, 3, 4], [1, 1, 1, 1, 1, 1])
    checked = _module("torch")
    checked.load_state_dict(module.state_dict())
    torch.testing.assert_close(module(good).values(), checked(good).values())
    module.validate_inputs = True
    with pytest.raises(ValueError):
        module(_kjt([1, 2, 0, 6, 3, 4], [1, 1, 1, 1, 1, 1]))


def test_extra_keys_are_ignored_like_torchrec():
    module = _module("torch")
    kjt = _kjt([1, 2, 0, 1, 9, 9, 2, 3], [1] * 8, keys=("user_id", "item_id", "extra", "shared"))
    out = module(kjt)
    assert out.keys() == ["user_id", "item_id", "shared@item_table", "shared@tags"]


# ---- the kernel backends' own check (ops/input_check.py) -------------------------------------------
KERNELS = [b for b in BACKENDS if b != "torch"]
BAD = ([1, 2, 0, 6, 3, 4], [1, 1, 1, 1, 1, 1])  # item_id's id 6: item_table has 6 rows
AS_ROW_ZERO = ([1, 2, 0, 0, 3, 4], [1, 1, 1, 1, 1, 1])  # the same batch with the bad id read as row 0


def _pair(backend, **kw):
    """A kernel-backend module and a torch-backend one with the same weights."""
    module, reference = _module(backend, **kw), _module("torch")
    reference.load_state_dict(module.state_dict())
    return module, reference


@pytest.mark.parametrize("backend", KERNELS)
def test_kernels_report_a_bad_batch_on_the_next_call(backend):
    module, reference = _pair(backend)
    out = module(_kjt(*BAD)).values()  # no sync, no error yet: the bad id reads row 0
    torch.testing.assert_close(out, reference(_kjt(*AS_ROW_ZERO)).values())
    with pytest.raises(ValueError, match=r"feature 'item_id' \(table 'item_table'\): id 6 at batch index 1 .*"
                                         r"reported by the GPU kernels"):
        module(_kjt(*AS_ROW_ZERO))
    good = module(_kjt(*AS_ROW_ZERO)).values()  # reported once: the next batches run
    module.check_inputs()
    torch.testing.assert_close(good, out)


@pytest.mark.parametrize("backend", KERNELS)
def test_a_modules_report_is_its_own(backend):
    first, second = _module(backend), _module(backend)  # same tables and keys, different weights
    first(_kjt(*BAD))
    second(_kjt(*AS_ROW_ZERO))  # another module's next call does not raise the first's error
    with pytest.raises(ValueError, match="id 6"):
        first(_kjt(*AS_ROW_ZERO))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("optimizer", [None, "sgd", "rowwise_adagrad"])
def test_a_bad_id_trains_row_zero(backend, optimizer):
    """The backward reads the ids as the forward did: a bad id's gradient goes to row 0 of its
    table, nothing outside it (dense gradients and fused updates alike)."""
    module, reference = _pair(backend)
    reference.backend = backend
    if optimizer:
        module.enable_fused_optimizer(optimizer, lr=0.1)
        reference.enable_fused_optimizer(optimizer, lr=0.1)
    module(_kjt(*BAD)).values().square().sum().backward()
    with pytest.raises(ValueError, match="id 6"):
        module.check_inputs()
    reference(_kjt(*AS_ROW_ZERO)).values().square().sum().backward()
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=name)
        if optimizer is None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("values, lengths", [
    ([1, 2, 0, 1, 3, 4, 5], [1, 1, 1, 1, 1, 1]),  # a value no bag covers
    ([1, 2, 0, 1, 3], [1, 1, 1, 1, 1, 1]),  # the last bag ends past the values
    ([1, 2, 0, 1, 3, 4], [2, 2, 2, 2, 2, 2]),  # every bag past the first three
])
def test_lengths_not_adding_up_stay_in_bounds(backend, values, lengths):
    """Forward and backward run (nothing read or written outside the values, tables or gradient
    buffers); the error follows. Bags inside the values pool as usual."""
    module, reference = _pair(backend)
    kjt = _kjt(values, lengths)
    out = module(kjt).values()
    out.sum().backward()
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"lengths add up (to \d+ but there are|past its) \d+ values"):
        module.check_inputs()
    # user_id's bags (the first two, columns 0-3) end within the values in every case: they pool
    # as the reference pools them from a KJT padded to its lengths.
    padded = _kjt((values + [0] * sum(lengths))[:sum(lengths)], lengths)
    torch.testing.assert_close(out[:, :4], reference(padded).values()[:, :4])


@pytest.mark.parametrize("backend", KERNELS)
def test_unchecked_kernels_clamp_silently(backend):
    module, reference = _pair(backend, validate_inputs=False)
    out = module(_kjt(*BAD)).values()
    module.check_inputs()  # nothing reported
    module(_kjt(*AS_ROW_ZERO))
    torch.testing.assert_close(out, reference(_kjt(*AS_ROW_ZERO)).values())


@pytest.mark.parametrize("backend", KERNELS)
def test_shapes_are_checked_at_the_call(backend):
    """What the host knows without reading the batch raises at once on every backend."""
    kjt = KeyedJaggedTensor(keys=["user_id", "item_id", "shared"], values=torch.tensor([1, 2, 0]),
                            lengths=torch.tensor([1, 1, 1]), weights=torch.ones(2)).to(DEVICE)
    with pytest.raises(ValueError, match="2 weights for 3 values"):
        _module(backend, is_weighted=True)(kjt)


def test_report_slots_stay_bounded(monkeypatch):
    """A process that builds many modules keeps a bounded number of report slots, and a pending
    report survives the pruning."""
    from recom_rec.ops import input_check

    monkeypatch.setattr(input_check, "MAX_REPORTS", 8)
    monkeypatch.setattr(input_check, "_SLOTS", {})
    flats = [torch.zeros(4, device=DEVICE) for _ in range(20)]
    pending = input_check.kernel_report(flats[0], "x", report_id=1)
    pending.words[0] = input_check.REPORT_TOTAL
    for i, flat in enumerate(flats[1:]):
        input_check.kernel_report(flat, "x", report_id=2 + i)
        assert sum(map(len, input_check._SLOTS.values())) <= 8
    assert input_check.pending_report_count() == 1
    pending.words[0] = 0


@pytest.mark.parametrize("field, value", [("num_embeddings", 0), ("num_embeddings", -3), ("embedding_dim", 0),
                                          ("embedding_dim", -1)])
@pytest.mark.parametrize("module", ["float", "quantized"])
def test_a_table_without_rows_or_columns_is_refused_at_construction(module, field, value):
    """torchrec's modules accept embedding_dim=0 and divide by num_embeddings=0 (when the config
    computes its init range): ours name the table. (Init bounds given, so the config builds.)"""
    config = EmbeddingBagConfig(name="empty", feature_names=["f"], weight_init_min=-0.1, weight_init_max=0.1,
                                **{"embedding_dim": 4, "num_embeddings": 10, field: value})
    build = {"float": lambda: recom_rec.EmbeddingBagCollection([config], device=DEVICE),
             "quantized": lambda: recom_rec.quant.EmbeddingBagCollection([config], is_weighted=False,
                                                                         device=DEVICE)}[module]
    with pytest.raises(ValueError, match=rf"table 'empty': {field} must be an integer >= 1, got {value}"):
        build()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU (RECOM_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("backend", KERNELS)
def test_a_captured_forward_reports_bad_input_from_its_replays(backend):
    """No sync in the check, so a checked forward captures in a CUDA graph; a replay on a bad batch
    reads row 0 and its report is raised by check_inputs()."""
    module, reference = _pair(backend)
    static = _kjt(*AS_ROW_ZERO)
    with torch.no_grad():
        # 12 runs first: the launch tuners decide this shape's kernels
        graph, out = capture_forward(lambda: module(static).values(), 12)
        expected = reference(_kjt(*AS_ROW_ZERO)).values()
        graph.replay()
        module.check_inputs()
        torch.testing.assert_close(out, expected)
        static.values().copy_(torch.tensor(BAD[0], device=DEVICE))
        graph.replay()
        with pytest.raises(ValueError, match=r"feature 'item_id' \(table 'item_table'\): id 6"):
            module.check_inputs()
        torch.testing.assert_close(out, expected)  # the bad id read row 0
        static.values().copy_(torch.tensor(AS_ROW_ZERO[0], device=DEVICE))
        graph.replay()
        module.check_inputs()  # reported once: later replays report afresh


@pytest.mark.parametrize("module", ["float-torch", "float-triton", "float-cuda", "float-unchecked", "sequence",
                                    "quantized"])
def test_a_batch_on_another_device_is_refused_and_the_module_still_works(module):
    """A host batch to GPU tables: torchrec's module raises torch's device error; the GPU kernels
    would read host addresses and end the process's CUDA context (every later CUDA call failing).
    Ours refuse it, naming the features and tables, checks on or off, and go on working. (On the
    CPU the batch's values are on the meta device instead.)"""
    from torchrec import EmbeddingConfig

    if module == "float-cuda" and DEVICE.type != "cuda":
        pytest.skip("the CUDA backend runs on a GPU (RECOM_TEST_DEVICE=cuda)")

    def tables(config):
        return [config(**{**vars(t), "feature_names": list(t.feature_names)}) for t in TABLES]

    kind, _, backend = module.partition("-")
    if kind == "float":
        ours = recom_rec.EmbeddingBagCollection(tables(EmbeddingBagConfig), device=DEVICE,
                                               backend="triton" if backend == "unchecked" else backend,
                                               validate_inputs=backend != "unchecked")
    elif kind == "sequence":
        ours = recom_rec.EmbeddingCollection(tables=[
            EmbeddingConfig(name=t.name, embedding_dim=4, num_embeddings=t.num_embeddings,
                            feature_names=list(t.feature_names)) for t in TABLES[:2]], device=DEVICE)
    else:
        ours = recom_rec.quant.EmbeddingBagCollection(tables(EmbeddingBagConfig), is_weighted=False, device=DEVICE)
    elsewhere = torch.device("cpu") if DEVICE.type == "cuda" else torch.device("meta")
    values, lengths = torch.tensor([1, 2, 0, 1, 3, 4]), torch.tensor([1, 1, 1, 1, 1, 1])
    keys = ["user_id", "item_id", "shared"]
    with pytest.raises(ValueError, match=rf"KeyedJaggedTensor values are on {elsewhere.type} but the tables "
                                         r"\(feature 'user_id' \(table 'users'\).*\) are on (cuda:0|cpu): move the batch"):
        ours(KeyedJaggedTensor(keys=keys, values=values.to(elsewhere), lengths=lengths))
    out = ours(KeyedJaggedTensor(keys=keys, values=values, lengths=lengths).to(DEVICE))
    values = torch.cat([jt.values() for jt in out.values()]) if isinstance(out, dict) else out.values()
    assert values.device.type == DEVICE.type and torch.isfinite(values.float()).all()


def _vbe_kjt(user_bags):
    """user_id at 2 bags, item_id and shared at 3; output row 2 takes user bag ``user_bags[2]``."""
    keys = ["user_id", "item_id", "shared"]
    inverse = torch.tensor([user_bags, [0, 1, 2], [0, 1, 2]])
    return KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2, 0, 1, 2, 3, 4, 5]), lengths=torch.ones(8, dtype=torch.int64),
                             stride_per_key_per_rank=[[2], [3], [3]], inverse_indices=(keys, inverse)).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bag", [2, 7, -1])  # a padded bag (another key has 3), past every bag, negative
def test_inverse_indices_outside_the_feature_s_bags(backend, bag):
    """A VBE batch's inverse indices must name bags the feature has. Eagerly on the CPU the module
    raises, naming the feature; on a GPU the expansion's kernel reports it without a sync (raised by
    check_inputs() or the next call), and meanwhile stays in bounds: the other rows are right."""
    module = _module(backend)
    message = (rf"inverse_indices of feature 'user_id' send output row 2 to bag {bag}, but the feature has 2 bags "
               r"in this batch: each must lie in \[0, 2\)")
    with pytest.raises(ValueError, match=message):
        _run(module, _vbe_kjt([0, 1, bag]))
    if DEVICE.type != "cuda":
        return
    out = module(_vbe_kjt([0, 1, bag])).values()
    with pytest.raises(ValueError, match=r"\(the feature of table 'users'; reported by the GPU kernels"):
        module(_vbe_kjt([0, 1, 0]))  # the bad batch's report, raised by the next call
    good = module(_vbe_kjt([0, 1, 0])).values()
    module.check_inputs()
    assert torch.equal(out[:2], good[:2]) and torch.equal(out[2, 4:], good[2, 4:])
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_inverse_indices_of_a_feature_without_bags(backend):
    """A feature with no bags in a batch cannot give an output row one: raised at the call (the
    host knows the bag counts), on the CPU and on a GPU alike."""
    keys = ["user_id", "item_id", "shared"]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.ones(6, dtype=torch.int64),
                            stride_per_key_per_rank=[[0], [3], [3]],
                            inverse_indices=(keys, torch.tensor([[0, 0, 0], [0, 1, 2], [0, 1, 2]]))).to(DEVICE)
    with pytest.raises(ValueError, match=r"inverse_indices of feature 'user_id' send output row.*but the feature "
                                         r"has 0 bags in this batch"):
        _run(_module(backend), kjt)
