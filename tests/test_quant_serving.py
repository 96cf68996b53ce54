"""A trained DLRM quantized by recom_rec.quantize: equal to torchrec's quantize_embeddings, under
torch.compile(fullgraph=True), torch.export (saved and loaded) and AOTInductor (a package loaded
and run in a fresh process)."""
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.inference.modules import quantize_embeddings, quantize_inference_model
from torchrec.models.dlrm import DLRM

import recom_rec
from recom_rec.data import synthetic_criteo_batches
from recom_rec.quant import EmbeddingBagCollection as QuantEBC
from ebc_cases import DEVICE

HASH_SIZES = [40 + 3 * i for i in range(26)]
KEYS = [f"C{i + 1}" for i in range(26)]
# On the CPU both run fbgemm's arithmetic: equal bits. fbgemm's CUDA kernel rounds differently.
EXACT = dict(rtol=0, atol=0) if DEVICE.type == "cpu" else dict(rtol=1e-5, atol=1e-5)


def _trained_dlrm(ours: bool, seed=0):
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=n, feature_names=[k])
              for k, n in zip(KEYS, HASH_SIZES)]
    torch.manual_seed(seed)
    import torchrec

    ebc = (recom_rec.EmbeddingBagCollection if ours else torchrec.EmbeddingBagCollection)(tables, device=DEVICE)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[16, 8],
                 over_arch_layer_sizes=[16, 1]).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for b in _batches(3, seed=1):
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(b.dense_features, b.sparse_features).squeeze(-1),
                                                       b.labels).backward()
        opt.step()
    return model.eval()


def _batches(n, batch_size=16, seed=0):
    return [b.to(DEVICE) for b in synthetic_criteo_batches(n, batch_size, HASH_SIZES, seed=seed)]


def _ebc(model):
    return model.sparse_arch.embedding_bag_collection


@pytest.mark.parametrize("ours", [False, True], ids=["torchrec_ebc", "recom_rec_ebc"])
@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint4x2, torch.half])
def test_quantize_dlrm_equals_torchrec_quantize_embeddings(ours, dtype):
    model = _trained_dlrm(ours)
    quantized = recom_rec.quantize(model, dtype)
    assert isinstance(_ebc(quantized), QuantEBC) and _ebc(model) is not _ebc(quantized)  # a copy by default
    stock = _trained_dlrm(False)
    stock.load_state_dict(model.state_dict())  # the very weights quantized above
    reference = quantize_embeddings(stock, dtype=dtype, inplace=True)
    with torch.no_grad():
        for b in _batches(2, seed=3):
            torch.testing.assert_close(quantized(b.dense_features, b.sparse_features),
                                       reference(b.dense_features, b.sparse_features), **EXACT)
    assert list(_ebc(quantized).state_dict()) == list(_ebc(reference).state_dict())


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint4x2])
def test_torchrecs_inference_flow_quantizes_ours(dtype):
    """torchrec's quantize_inference_model (its serving flow) makes our float EBC and EC our quantized
    modules, equal to what it makes of torchrec's; per-table dtypes reach the configs, as torchrec's."""
    from torchrec import EmbeddingConfig
    from recom_rec.quant import EmbeddingCollection as QuantEC

    def sequence_tables():
        return [EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=HASH_SIZES[0], feature_names=["C1"])]

    def model(ours: bool):
        m = _trained_dlrm(ours)
        torch.manual_seed(1)
        m.ec = (recom_rec.EmbeddingCollection if ours else torchrec.EmbeddingCollection)(sequence_tables(),
                                                                                          device=DEVICE)
        return m

    import torchrec

    ours, stock = model(True), model(False)
    stock.load_state_dict(ours.state_dict())
    per_table = {"t_C2": torch.half}
    quantize_inference_model(ours, quantization_dtype=dtype, per_table_weight_dtype=per_table)
    quantize_inference_model(stock, quantization_dtype=dtype, per_table_weight_dtype=per_table)
    assert isinstance(_ebc(ours), QuantEBC) and isinstance(ours.ec, QuantEC)
    assert ([(c.name, c.data_type) for c in _ebc(ours).embedding_bag_configs()]
            == [(c.name, c.data_type) for c in _ebc(stock).embedding_bag_configs()])
    with torch.no_grad():
        for b in _batches(2, seed=3):
            torch.testing.assert_close(ours(b.dense_features, b.sparse_features),
                                       stock(b.dense_features, b.sparse_features), **EXACT)
            got, want = ours.ec(b.sparse_features), stock.ec(b.sparse_features)
            torch.testing.assert_close(got["C1"].values(), want["C1"].values(), **EXACT)


def test_quantize_keeps_shared_modules_shared_and_converts_in_place():
    model = _trained_dlrm(True)
    holder = nn.ModuleDict({"a": model, "b": _ebc(model)})
    out = recom_rec.quantize(holder, torch.qint8, inplace=True)
    assert out is holder and isinstance(holder["b"], QuantEBC) and holder["b"] is _ebc(holder["a"])


def test_compile_fullgraph_quantized_dlrm_matches_eager():
    model = recom_rec.quantize(_trained_dlrm(True), torch.qint8)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for b in _batches(2, seed=5):
            torch.testing.assert_close(compiled(b.dense_features, b.sparse_features),
                                       model(b.dense_features, b.sparse_features))


class ExportableDLRM(nn.Module):
    """torch.export takes tensors: the KJT goes in as (values, lengths), key order fixed."""

    def __init__(self, model: nn.Module, keys):
        super().__init__()
        self.model = model
        self.keys = list(keys)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.model(dense, KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths))


def _inputs(b):
    return b.dense_features, b.sparse_features.values(), b.sparse_features.lengths()


def _exported(model, example):
    batch = torch.export.Dim("batch", min=2, max=4096)
    n_values = torch.export.Dim("n_values", min=2, max=4096 * 26)
    with torch.no_grad():
        return torch.export.export(ExportableDLRM(model, KEYS), _inputs(example),
                                   dynamic_shapes=({0: batch}, {0: n_values}, {0: 26 * batch}))


def test_export_quantized_dlrm(tmp_path):
    model = recom_rec.quantize(_trained_dlrm(True), torch.quint4x2)
    ep = _exported(model, _batches(1, seed=7)[0])
    assert "recom_rec.quantized_pooled_lookup" in str(ep.graph)
    path = tmp_path / "qdlrm.pt2"
    torch.export.save(ep, str(path))
    loaded = torch.export.load(str(path))
    with torch.no_grad():
        for size in (5, 16, 33):
            b = _batches(1, batch_size=size, seed=size)[0]
            expected = model(b.dense_features, b.sparse_features)
            torch.testing.assert_close(ep.module()(*_inputs(b)), expected)
            torch.testing.assert_close(loaded.module()(*_inputs(b)), expected)


_RUN_PACKAGE = textwrap.dedent("""
    import sys, torch
    import recom_rec  # registers recom_rec::quantized_pooled_lookup, which the package calls
    runner = torch._inductor.aoti_load_package(sys.argv[1])
    inputs = [[t.to(sys.argv[4]) for t in args] for args in torch.load(sys.argv[2])]
    torch.save([runner(*args).cpu() for args in inputs], sys.argv[3])
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_aot_inductor_package_runs_in_a_fresh_process(tmp_path):
    model = recom_rec.quantize(_trained_dlrm(True), torch.qint8)
    ep = _exported(model, _batches(1, seed=7)[0])
    # The package's C++ wrapper must share the loading process's libstdc++. A compiler that links
    # its own copy in statically (our GPU image's CXX=/opt/gcc/bin/g++) gives the wrapper a second,
    # uninitialised std::locale, and the load crashes in std::regex (docs/quantized.md); the
    # system's g++ links the shared one.
    with torch._inductor.config.patch({"cpp.cxx": (shutil.which("g++") or "g++",)}):
        package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "qdlrm.pt2"))
    batches = [_batches(1, batch_size=size, seed=size)[0] for size in (4, 16, 40)]
    torch.save([tuple(t.cpu() for t in _inputs(b)) for b in batches], tmp_path / "inputs.pt")
    script = tmp_path / "run.py"
    script.write_text(_RUN_PACKAGE)
    result = subprocess.run([sys.executable, "-X", "faulthandler", str(script), package, str(tmp_path / "inputs.pt"),
                             str(tmp_path / "outputs.pt"), str(DEVICE)], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = torch.load(tmp_path / "outputs.pt")
    with torch.no_grad():
        for b, out in zip(batches, outputs):
            torch.testing.assert_close(out.to(DEVICE), model(b.dense_features, b.sparse_features))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU (RECOM_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("batch_size", [1, 16, 64])
def test_cuda_graph_replay_of_quantized_dlrm(batch_size):
    """The quantized DLRM's forward is captured once and replayed on new inputs (no host syncs:
    validation off), equal to eager."""
    model = recom_rec.quantize(_trained_dlrm(True), torch.quint4x2, validate_inputs=False)
    wrapper = ExportableDLRM(model, KEYS)
    batches = _batches(4, batch_size=batch_size, seed=batch_size)
    static = [t.clone() for t in _inputs(batches[0])]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):  # Triton compiles and the key-order cache fills outside the graph
            wrapper(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = wrapper(*static)
    for b in batches[1:]:
        for s, t in zip(static, _inputs(b)):
            s.copy_(t)
        graph.replay()
        with torch.no_grad():
            torch.testing.assert_close(out, model(b.dense_features, b.sparse_features), rtol=0, atol=0)
