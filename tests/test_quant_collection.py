"""recom_rec.quant.EmbeddingCollection against torchrec's quantized EmbeddingCollection (fbgemm's IntN
TBE in PoolingMode.NONE, on the CPU; on the GPU with RECOM_TEST_DEVICE=cuda): outputs bit for bit
on every row type, the state_dict layout, checkpoints both ways, from_float of our float module,
recom_rec.quantize, fx tracing, bad ids."""
import copy
import io

import pytest
import torch
import torchrec
from torch import quantization as tq
from torchrec.modules.embedding_configs import EmbeddingConfig, QuantConfig
from torchrec.quant.embedding_modules import EmbeddingCollection as TorchrecQuantEC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE, KJTInTheGraph
from recom_rec.quant import EmbeddingCollection as QuantEC

DIM = 16
# fbgemm's unpooled IntN TBE gives wrong INT2 rows on CUDA (only the first 4 of 16 columns are
# dequantized; the rest are raw codes, seen on the H200 with fbgemm-gpu 1.6.0): there, INT2 rows
# are compared with the CPU's instead (test_int2_rows_on_the_gpu_match_the_cpu_s).
WEIGHT_DTYPES = {"t0": torch.qint8, "t1": torch.quint4x2, "t2": torch.quint2x4 if DEVICE.type == "cpu" else torch.qint8,
                 "t3": torch.half, "t4": torch.float, "t5": torch.qint8}
BACKENDS = ["torch", "triton"] if DEVICE.type == "cpu" else ["triton"]


def _tables():
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=11 + 3 * i, feature_names=[f"f{i}"])
              for i in range(6)]
    tables[5].feature_names = ["f5", "f0"]  # a feature read by two tables, a table with two features
    return tables


def _float_ec(seed=0, need_indices=False):
    torch.manual_seed(seed)
    return torchrec.EmbeddingCollection(tables=_tables(), need_indices=need_indices, device=DEVICE)


def _qconfig(output_dtype, weight_dtypes=WEIGHT_DTYPES):
    return QuantConfig(activation=tq.PlaceholderObserver.with_args(dtype=output_dtype),
                       weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8),
                       per_table_weight_dtype=weight_dtypes)


def _kjt(batch_size=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    keys = ["f3", "extra", "f1", "f0", "f2", "f5", "f4"]  # not the module's order, plus a key it ignores
    lengths = torch.randint(0, 5, (len(keys) * batch_size,), generator=g)
    lengths[::4] = 0
    lengths[3 * batch_size:4 * batch_size] = 0  # f0 without ids in the whole batch
    values = torch.randint(0, 11, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths).to(DEVICE)


def _pair(output_dtype, split=False, backend="auto", need_indices=False):
    float_ec = _float_ec(need_indices=need_indices)
    float_ec.qconfig = _qconfig(output_dtype)
    if split:
        setattr(float_ec, "__quant_state_dict_split_scale_bias", True)
    return TorchrecQuantEC.from_float(float_ec), QuantEC.from_float(float_ec, backend=backend)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_equal(a, b, output_dtype):
    assert list(a) == list(b)
    for k in a:
        assert b[k].values().dtype == output_dtype
        assert torch.equal(_bits(a[k].values()), _bits(b[k].values())), k
        assert torch.equal(a[k].lengths(), b[k].lengths()), k
        assert (a[k].weights_or_none() is None) == (b[k].weights_or_none() is None), k
        if a[k].weights_or_none() is not None:
            assert torch.equal(a[k].weights(), b[k].weights()), k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("need_indices", [False, True])
def test_outputs_equal_torchrec_bit_for_bit(backend, output_dtype, need_indices):
    theirs, ours = _pair(output_dtype, backend=backend, need_indices=need_indices)
    for seed in (1, 2):
        _assert_equal(theirs(_kjt(seed=seed)), ours(_kjt(seed=seed)), output_dtype)


@pytest.mark.parametrize("split", [False, True])
def test_state_dict_layout_and_checkpoints_both_ways(split):
    theirs, ours = _pair(torch.float16, split)
    sd_theirs, sd_ours = theirs.state_dict(), ours.state_dict()
    assert list(sd_theirs) == list(sd_ours)
    for k in sd_theirs:
        t, o = sd_theirs[k], sd_ours[k]
        assert type(t) is type(o) and t.shape == o.shape and t.dtype == o.dtype, k
        assert torch.equal(t.view(torch.uint8) if t.dtype != torch.float16 else t,
                           o.view(torch.uint8) if o.dtype != torch.float16 else o), k
    other = _float_ec(seed=5)
    other.qconfig = _qconfig(torch.float16)
    if split:
        setattr(other, "__quant_state_dict_split_scale_bias", True)
    kjt = _kjt()
    fresh_ours = QuantEC.from_float(other)
    fresh_ours.load_state_dict(theirs.state_dict())
    _assert_equal(theirs(kjt), fresh_ours(kjt), torch.float16)
    fresh_theirs = TorchrecQuantEC.from_float(other)
    fresh_theirs.load_state_dict(ours.state_dict())
    _assert_equal(fresh_theirs(kjt), ours(kjt), torch.float16)


def test_from_float_of_our_float_module_and_quantize():
    """Our float EmbeddingCollection quantizes to the same module; recom_rec.quantize converts the
    EmbeddingCollections of a model (torchrec's and ours)."""
    torch.manual_seed(0)
    ours_float = recom_rec.EmbeddingCollection(tables=_tables(), device=DEVICE)
    theirs_float = _float_ec()
    theirs_float.load_state_dict(ours_float.state_dict())
    for module in (ours_float, theirs_float):
        module.qconfig = _qconfig(torch.float32)
    a, b = QuantEC.from_float(ours_float), TorchrecQuantEC.from_float(theirs_float)
    _assert_equal(b(_kjt()), a(_kjt()), torch.float32)

    model = torch.nn.ModuleDict({"ours": recom_rec.EmbeddingCollection(tables=_tables(), device=DEVICE),
                                 "theirs": _float_ec()})
    quantized = recom_rec.quantize(model, torch.qint8)
    assert all(isinstance(m, QuantEC) for m in quantized.values())
    assert isinstance(model["theirs"], torchrec.EmbeddingCollection)  # not in place by default


def _graphs(module):
    """The module as torchrec's inference flow makes it (fx traced, then scripted), and traced by
    torch.fx, scripted, scripted and saved and loaded."""
    from torchrec.fx import symbolic_trace

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    buffer.seek(0)
    return {"torchrec fx": symbolic_trace(module), "torch fx": torch.fx.symbolic_trace(module),
            "script": torch.jit.script(module), "fx then script": torch.jit.script(symbolic_trace(module)),
            "script saved and loaded": torch.jit.load(buffer)}


@pytest.mark.parametrize("need_indices", [False, True])
def test_fx_and_torchscript_give_the_module_s_outputs(need_indices):
    """fx traces (one call of the lookup, the row metadata read as buffers) and TorchScript (the
    registered ops) give the module's outputs bit for bit; a bad id raises there too, naming its
    feature and table."""
    _, ours = _pair(torch.float16, need_indices=need_indices)
    for name, graph in _graphs(ours).items():
        for seed in (1, 2):
            _assert_equal(ours(_kjt(seed=seed)), graph(_kjt(seed=seed)), torch.float16)
        bad = _kjt()
        values = bad.values().clone()
        values[-1] = 1000
        bad = KeyedJaggedTensor(keys=bad.keys(), values=values, lengths=bad.lengths())
        # (TorchScript's interpreter re-raises the op's ValueError as a RuntimeError with its text)
        with pytest.raises((ValueError, RuntimeError), match=r"feature '\w+' \(table '\w+'\): id 1000"):
            graph(bad)
            if hasattr(ours, "check_inputs"):
                ours.check_inputs()


def test_compile_and_export_with_the_kjt_built_in_the_graph():
    """torch.compile(fullgraph=True) and torch.export (saved and loaded) take a KJT built inside the
    graph, as torchrec's quantized module does: the module's outputs for batches of other lengths."""
    _, ours = _pair(torch.float16)
    kjts = [_kjt(seed=seed) for seed in (1, 2, 3)]
    model = KJTInTheGraph(ours, kjts[0].keys())
    compiled = torch.compile(model, fullgraph=True)
    n_values = torch.export.Dim("n_values", min=2, max=10_000)
    exported = torch.export.export(model, (kjts[0].values(), kjts[0].lengths()), dynamic_shapes=({0: n_values}, None))
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    for kjt in kjts:
        want = model(kjt.values(), kjt.lengths())
        for graph in (compiled, exported.module(), loaded):
            assert torch.equal(_bits(graph(kjt.values(), kjt.lengths())), _bits(want))


def test_deepcopy_and_to_keep_the_tables_on_the_kernel_s_buffer():
    _, ours = _pair(torch.float32)
    kjt = _kjt()
    expected = ours(kjt)
    copied = copy.deepcopy(ours)
    with torch.no_grad():
        copied.embeddings["t4"].weight.zero_()  # fp32 rows: all zeros
    assert not torch.equal(copied(kjt)["f4"].values(), expected["f4"].values())
    assert torch.equal(ours(kjt)["f4"].values(), expected["f4"].values())
    moved = ours.to(DEVICE)
    _assert_equal(expected, moved(kjt), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_id_names_feature_table_and_batch_index(backend):
    _, ours = _pair(torch.float32, backend=backend)
    # f1 reads t1 (14 rows): id 20 in its second bag
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2", "f3", "f4", "f5"],
                                              values=torch.tensor([1, 3, 2, 20, 1, 1, 1, 1]),
                                              lengths=torch.tensor([1, 0, 1, 2, 1, 0, 1, 0, 1, 0, 1, 0])).to(DEVICE)
    with pytest.raises(ValueError) as error:
        ours(kjt)
        ours.check_inputs()
    message = str(error.value)
    assert "'f1'" in message and "'t1'" in message and "id 20" in message and "batch index 1" in message
    ours(_kjt())
    ours.check_inputs()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_the_host_can_tell_are_bad(backend):
    """Lengths that do not add up (named by feature and table), a lengths count that is not the
    keys' bags, float ids: refused before any kernel."""
    _, ours = _pair(torch.float32, backend=backend)
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]
    bad = {
        "lengths add up to 3 but there are 2 values: feature 'f2' \\(table 't2'\\)":
            KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 0, 0, 2] + [0] * 7)),
        "11 lengths for 6 keys of 6 bags": KeyedJaggedTensor(keys=keys, values=torch.tensor([1]),
                                                             lengths=torch.tensor([1] + [0] * 10)),
        "integer ids": KeyedJaggedTensor(keys=keys, values=torch.tensor([1.0]), lengths=torch.tensor([1] + [0] * 11)),
    }
    for message, kjt in bad.items():
        with pytest.raises(ValueError, match=message):
            ours(kjt.to(DEVICE))
    ours(_kjt())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_negative_length_names_its_feature(backend):
    _, ours = _pair(torch.float32, backend=backend)
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 0, 0, 3, -1] + [0] * 6))
    with pytest.raises(ValueError, match="feature 'f2' \\(table 't2'\\): negative length.* batch index 1"):
        ours(kjt.to(DEVICE))
        ours.check_inputs()
    ours(_kjt())
    ours.check_inputs()


def test_construction_errors_as_torchrec():
    with pytest.raises(ValueError, match="same embedding dimension"):
        QuantEC([EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=4, feature_names=["x"]),
                 EmbeddingConfig(name="b", embedding_dim=16, num_embeddings=4, feature_names=["y"])],
                device=torch.device("cpu"))
    with pytest.raises(ValueError, match="Duplicate table name"):
        QuantEC([EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=4, feature_names=["x"]),
                 EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=4, feature_names=["y"])],
                device=torch.device("cpu"))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CPU comparison above covers INT2 bit for bit")
def test_int2_rows_on_the_gpu_match_the_cpu_s():
    """INT2 rows on the GPU (fbgemm's CUDA arithmetic: the element rounded to fp16) against
    torchrec's module on the CPU (fp32 arithmetic): within fp16 rounding."""
    float_ec = _float_ec()
    float_ec.qconfig = _qconfig(torch.float32, {t.name: torch.quint2x4 for t in _tables()})
    ours = QuantEC.from_float(float_ec)
    cpu_float = torchrec.EmbeddingCollection(tables=_tables())
    cpu_float.load_state_dict({k: v.cpu() for k, v in float_ec.state_dict().items()})
    cpu_float.qconfig = float_ec.qconfig
    theirs = TorchrecQuantEC.from_float(cpu_float)
    kjt = _kjt()
    a, b = theirs(kjt.to("cpu")), ours(kjt)
    for k in a:
        torch.testing.assert_close(b[k].values().cpu(), a[k].values(), rtol=0, atol=5e-4)


def test_more_ids_than_one_launch_takes_bags(monkeypatch):
    """Past the kernel's bags a launch (its grid's y axis) the ids spread over virtual features:
    the same rows (the limit lowered here so that a small batch crosses it)."""
    import recom_rec.ops.quantized_rows as qec

    theirs, ours = _pair(torch.float32)
    kjt = _kjt(batch_size=9, seed=4)
    expected = ours(kjt)
    monkeypatch.setattr(qec, "MAX_BAGS", 5)
    _assert_equal(expected, ours(kjt), torch.float32)
    _assert_equal(theirs(kjt), ours(kjt), torch.float32)
