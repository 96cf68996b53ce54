"""recom_rec.quant.EmbeddingBagCollection against torchrec's quantized EmbeddingBagCollection
(fbgemm's CPU IntN TBE): outputs bit for bit, state_dict layout, checkpoints both ways."""
import copy
import io

import pytest
import torch
import torchrec
from torch import quantization as tq
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType, QuantConfig
from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchrecQuantEBC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
import recom_rec.ops.backends
from recom_rec.quant import EmbeddingBagCollection as QuantEBC
from ebc_cases import capture_forward

WEIGHT_DTYPES = {"t0": torch.qint8, "t1": torch.quint4x2, "t2": torch.quint2x4, "t3": torch.half,
                 "t4": torch.float, "t5": torch.qint8}


def _tables():
    dims = [8, 16, 32, 24, 8, 40]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=11 + 3 * i, feature_names=[f"f{i}"],
                                 pooling=PoolingType.MEAN if i % 2 else PoolingType.SUM) for i, d in enumerate(dims)]
    tables[5].feature_names = ["f5", "f0"]  # a feature read by two tables, a table with two features
    return tables


def _float_ebc(weighted, seed=0):
    torch.manual_seed(seed)
    return torchrec.EmbeddingBagCollection(tables=_tables(), is_weighted=weighted)


def _qconfig(output_dtype, per_table=WEIGHT_DTYPES):
    return QuantConfig(activation=tq.PlaceholderObserver.with_args(dtype=output_dtype),
                       weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8), per_table_weight_dtype=per_table)


def _kjt(weighted, batch_size=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    keys = ["f3", "extra", "f1", "f0", "f2", "f5", "f4"]  # not the module's order, plus a key it ignores
    lengths = torch.randint(0, 5, (len(keys) * batch_size,), generator=g)
    lengths[::4] = 0
    values = torch.randint(0, 11, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) * 2 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)


def _pair(weighted, output_dtype, split=False):
    float_ebc = _float_ebc(weighted)
    float_ebc.qconfig = _qconfig(output_dtype)
    if split:
        setattr(float_ebc, "__quant_state_dict_split_scale_bias", True)
    return TorchrecQuantEBC.from_float(float_ebc), QuantEBC.from_float(float_ebc)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16])
def test_outputs_equal_torchrec_bit_for_bit(weighted, output_dtype):
    theirs, ours = _pair(weighted, output_dtype)
    kjt = _kjt(weighted)
    a, b = theirs(kjt), ours(kjt)
    assert a.keys() == b.keys() and a.length_per_key() == b.length_per_key()
    assert b.values().dtype == output_dtype
    assert torch.equal(_bits(a.values()), _bits(b.values()))


def test_scripting_a_model_leaves_its_quantized_module_and_checkpoint_alone():
    """torch.jit.script writes what a submodule's __prepare_scriptable__ returns into the model
    being scripted: the eager model keeps its module (INT4 and INT2 tables among them), its
    state_dict (torchrec's UInt4Tensor / UInt2Tensor views) and so its checkpoints."""
    _, ours = _pair(True, torch.float16)
    model = torch.nn.Module()
    model.ebc = ours
    before = {k: (type(v), v.shape) for k, v in model.state_dict().items()}

    class _Model(torch.nn.Module):
        def __init__(self, ebc):
            super().__init__()
            self.ebc = ebc

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.ebc(kjt).values()

    wrapper = _Model(ours)
    scripted = torch.jit.script(wrapper)
    assert wrapper.ebc is ours
    assert {k: (type(v), v.shape) for k, v in model.state_dict().items()} == before
    fresh = _pair(True, torch.float16)[1]
    fresh.load_state_dict({k[len("ebc."):]: v for k, v in model.state_dict().items()})
    kjt = _kjt(True)
    assert torch.equal(_bits(fresh(kjt).values()), _bits(ours(kjt).values()))
    assert torch.equal(_bits(scripted(kjt)), _bits(ours(kjt).values()))


def test_fx_and_torchscript_give_the_module_s_outputs():
    """torchrec's inference flow (torchrec.fx's trace, then TorchScript), torch.fx's trace, the
    module scripted, and scripted, saved and loaded (INT4 and INT2 tables among them) give the
    module's KeyedTensor bit for bit; a bad id raises there, naming its feature and table."""
    from torchrec.fx import symbolic_trace

    _, ours = _pair(True, torch.float16)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(ours), buffer)
    buffer.seek(0)
    graphs = {"torchrec fx": symbolic_trace(ours), "torch fx": torch.fx.symbolic_trace(ours),
              "script": torch.jit.script(ours), "fx then script": torch.jit.script(symbolic_trace(ours)),
              "script saved and loaded": torch.jit.load(buffer)}
    for name, graph in graphs.items():
        for seed in (1, 2):
            kjt = _kjt(True, seed=seed)
            a, b = ours(kjt), graph(kjt)
            assert a.keys() == b.keys() and a.length_per_key() == b.length_per_key(), name
            assert torch.equal(_bits(a.values()), _bits(b.values())), name
        kjt = _kjt(True)
        values = kjt.values().clone()
        values[0] = 1000
        bad = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(), weights=kjt.weights())
        # (TorchScript's interpreter re-raises the op's ValueError as a RuntimeError with its text)
        with pytest.raises((ValueError, RuntimeError), match=r"feature '\w+' \(table '\w+'\): id 1000"):
            graph(bad)
            ours.check_inputs()


@pytest.mark.parametrize("split", [False, True])
def test_state_dict_layout_is_torchrec_s(split):
    theirs, ours = _pair(True, torch.float16, split)
    sd_theirs, sd_ours = theirs.state_dict(), ours.state_dict()
    assert list(sd_theirs) == list(sd_ours)
    for k in sd_theirs:
        t, o = sd_theirs[k], sd_ours[k]
        assert type(t) is type(o) and t.shape == o.shape and t.dtype == o.dtype, k
        assert torch.equal(t.view(torch.uint8) if t.dtype != torch.float16 else t,
                           o.view(torch.uint8) if o.dtype != torch.float16 else o), k


@pytest.mark.parametrize("split", [False, True])
def test_checkpoints_load_both_ways(split):
    theirs, ours = _pair(False, torch.float32, split)
    other = _float_ebc(False, seed=5)
    other.qconfig = _qconfig(torch.float32)
    if split:
        setattr(other, "__quant_state_dict_split_scale_bias", True)
    kjt = _kjt(False)
    # torchrec -> ours
    fresh_ours = QuantEBC.from_float(other)
    assert not torch.equal(fresh_ours(kjt).values(), ours(kjt).values())
    fresh_ours.load_state_dict(theirs.state_dict())
    assert torch.equal(fresh_ours(kjt).values(), theirs(kjt).values())
    # ours -> torchrec
    fresh_theirs = TorchrecQuantEBC.from_float(other)
    fresh_theirs.load_state_dict(ours.state_dict())
    assert torch.equal(fresh_theirs(kjt).values(), ours(kjt).values())


def test_from_float_of_our_float_module_equals_from_torchrec_s():
    float_ebc = _float_ebc(True)
    fused = recom_rec.swap_modules(copy.deepcopy(float_ebc))
    float_ebc.qconfig = fused.qconfig = _qconfig(torch.float16)
    kjt = _kjt(True)
    assert torch.equal(QuantEBC.from_float(fused)(kjt).values(), TorchrecQuantEBC.from_float(float_ebc)(kjt).values())


def test_constructor_with_quantized_weights_like_torchrec():
    theirs, _ = _pair(False, torch.float32)
    configs = theirs.embedding_bag_configs()
    weights = {name: (tbe_rows[0], tbe_rows[1]) for tbe in theirs._emb_modules
               for name, tbe_rows in zip([s[0] for s in tbe.embedding_specs], tbe.split_embedding_weights())}
    ours = QuantEBC(configs, is_weighted=False, device=torch.device("cpu"), table_name_to_quantized_weights=weights)
    kjt = _kjt(False)
    assert torch.equal(ours(kjt).values(), theirs(kjt).values())


def test_deepcopy_and_to_keep_tables_on_the_kernel_s_buffer():
    _, ours = _pair(False, torch.float32)
    kjt = _kjt(False)
    before = ours(kjt).values()
    dup = copy.deepcopy(ours).to("cpu")
    dup.embedding_bags["t0"].weight.zero_()  # reaches the copy's buffer, not the original's
    assert torch.equal(ours(kjt).values(), before)
    assert not torch.equal(dup(kjt).values(), before)
    assert torch.equal(dup(kjt)["f0@t0"], torch.zeros(7, 8))  # f0 also feeds t5


def test_fp8_rows_from_float8_e4m3fn():
    if not hasattr(DataType, "NFP8"):
        pytest.skip("torchrec < 1.7 has no 8-bit float data type to ask for FP8 rows with")
    float_ebc = _float_ebc(False)
    float_ebc.qconfig = _qconfig(torch.float32, {name: torch.float8_e4m3fn for name in WEIGHT_DTYPES})
    ours = QuantEBC.from_float(float_ebc)
    kjt = _kjt(False)
    # (the quantized module orders its output by pooling type, as torchrec's does)
    expected = float_ebc(kjt).to_dict()
    for key, pooled in ours(kjt).to_dict().items():
        torch.testing.assert_close(pooled, expected[key], rtol=0.07, atol=0.07)


def test_bad_id_names_feature_and_table():
    _, ours = _pair(False, torch.float32)
    kjt = _kjt(False)
    values = kjt.values().clone()
    values[-1] = 1000
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    with pytest.raises(ValueError, match=r"feature 'f4' \(table 't4'\): id 1000"):
        ours(bad)


@pytest.mark.skipif(not recom_rec.ops.backends.triton_interpreting(),
                    reason="the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
def test_triton_backend_matches_torchrec():
    float_ebc = _float_ebc(True)
    float_ebc.qconfig = _qconfig(torch.float32)
    theirs = TorchrecQuantEBC.from_float(float_ebc)
    ours = QuantEBC.from_float(float_ebc, backend="triton")
    kjt = _kjt(True)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values(), rtol=1e-5, atol=1e-5)


def test_other_row_alignment_keeps_torchrec_s_rows():
    """torchrec's row-alignment attribute (here 4, rows not a multiple of 16 bytes): the same
    state_dict rows and outputs as torchrec's (our row stride stays a multiple of 16 inside)."""
    float_ebc = _float_ebc(True)
    float_ebc.qconfig = _qconfig(torch.float32)
    setattr(float_ebc, "__register_row_alignment_in_named_modules", 4)
    theirs, ours = TorchrecQuantEBC.from_float(float_ebc), QuantEBC.from_float(float_ebc)
    assert ours.row_alignment == 4
    for key, t in theirs.state_dict().items():
        o = ours.state_dict()[key]
        assert t.shape == o.shape and torch.equal(t.view(torch.uint8), o.view(torch.uint8)), key
    kjt = _kjt(True)
    assert torch.equal(ours(kjt).values(), theirs(kjt).values())


def test_from_float_refuses_parameter_server_tables():
    from recom_rec.ps import PSConfig

    tables = _tables()
    fused = recom_rec.EmbeddingBagCollection(tables, ps={"t4": PSConfig(url="memory://", cache_rows=8)})
    fused.qconfig = _qconfig(torch.float32)
    with pytest.raises(ValueError, match="parameter-server"):
        QuantEBC.from_float(fused)


# ---- bad input: the Triton kernel's own check (ops/input_check.py), as the float kernels' --------
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() or recom_rec.ops.backends.triton_interpreting()),
                                  reason="the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")


def _kernel_module(backend="triton", **kw):
    float_ebc = _float_ebc(False)
    float_ebc.qconfig = _qconfig(torch.float32)
    return QuantEBC.from_float(float_ebc, backend=backend, **kw).to(KERNEL_DEVICE)


def _with_value(kjt, position, value):
    values = kjt.values().clone()
    values[position] = value
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths()).to(KERNEL_DEVICE)


@needs_kernel
@pytest.mark.parametrize("bad_id, message", [(1000, r"id 1000 at batch index \d+ is out of range for 23 rows"),
                                             (-2, r"id -2 at batch index \d+ is negative")])
def test_kernel_reports_a_bad_id_on_the_next_call_and_reads_row_zero(bad_id, message):
    ours, kjt = _kernel_module(), _kjt(False)
    bad, as_row_zero = _with_value(kjt, -1, bad_id), _with_value(kjt, -1, 0)  # the last value is f4's (t4)
    out = ours(bad).values()  # no sync and no error yet
    with pytest.raises(ValueError, match=rf"feature 'f4' \(table 't4'\): {message}.*reported by the GPU kernels"):
        ours(as_row_zero)
    assert torch.equal(out, ours(as_row_zero).values())
    ours.check_inputs()  # reported once


@needs_kernel
def test_check_inputs_raises_the_kernel_s_report_at_once():
    ours = _kernel_module()
    ours(_with_value(_kjt(False), -1, 1000))
    with pytest.raises(ValueError, match=r"feature 'f4' \(table 't4'\): id 1000"):
        ours.check_inputs()


@needs_kernel
@pytest.mark.parametrize("extra", [-3, 2])
def test_kernel_lengths_that_do_not_add_up_stay_in_bounds(extra):
    """Values short of the lengths (a bag ends past them) or longer (values no bag covers): the
    kernel reads nothing outside them and the error follows."""
    ours, kjt = _kernel_module(), _kjt(False)
    n = kjt.values().numel()
    values = torch.cat([kjt.values(), torch.zeros(max(extra, 0), dtype=kjt.values().dtype)])[:n + extra]
    out = ours(KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths()).to(KERNEL_DEVICE)).values()
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"lengths add up (to \d+ but there are|past its) \d+ values"):
        ours.check_inputs()


@needs_kernel
def test_unchecked_kernel_clamps_silently():
    ours = _kernel_module(validate_inputs=False)
    kjt = _kjt(False)
    out = ours(_with_value(kjt, -1, 1000)).values()
    ours.check_inputs()  # nothing reported
    assert torch.equal(out, ours(_with_value(kjt, -1, 0)).values())


def test_a_traced_module_checks_at_the_call():
    """Traced (torch.compile, export), the check is an op of the graph: it raises at the call."""
    ours = torch.compile(_kernel_module(backend="auto"), backend="eager", fullgraph=True)
    kjt = _kjt(False)
    ours(kjt.to(KERNEL_DEVICE))
    with pytest.raises(ValueError, match=r"feature 'f4' \(table 't4'\): id 1000"):
        ours(_with_value(kjt, -1, 1000))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_quantized_forward_reports_bad_input_from_its_replays():
    ours, kjt = _kernel_module(), _kjt(False)
    static, bad = _with_value(kjt, -1, 0), _with_value(kjt, -1, 1000)
    expected = ours(static).values()
    with torch.no_grad():
        graph, out = capture_forward(lambda: ours(static).values(), 3)
    graph.replay()
    ours.check_inputs()
    assert torch.equal(out, expected)
    static.values().copy_(bad.values())
    graph.replay()
    with pytest.raises(ValueError, match=r"feature 'f4' \(table 't4'\): id 1000"):
        ours.check_inputs()
    assert torch.equal(out, expected)  # the bad id read row 0
