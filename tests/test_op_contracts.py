"""Every recom_rec op a module's forward and backward dispatch passes torch.library.opcheck on the
arguments the module gave it: its schema (what it mutates), its autograd registration, its fake
kernel against the real one (shapes, dtypes, strides, devices) and AOTDispatcher tracing with
static and dynamic shapes, which is what torch.compile and torch.export rely on. The calls are
recorded from real modules (EBC, EC, variable batch, fused optimizers, the quantized EBC and EC), on
every kernel backend."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS


class _RecordOps(TorchDispatchMode):
    """The recom_rec ops dispatched inside it, each with a copy of its arguments as given."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "recom_rec":
            self.calls.append((func, _copied(args), _copied(kwargs)))
        return func(*args, **kwargs)


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _kjt(keys, lengths, rows, **extra):
    lengths = torch.tensor(lengths)
    values = torch.arange(int(lengths.sum())) % rows
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, **extra).to(DEVICE)


def _bag_module(backend, fused, weighted):
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4 * i + 4, num_embeddings=11, feature_names=[f"f{i}"])
              for i in range(3)]
    ebc = recom_rec.EmbeddingBagCollection(tables, is_weighted=weighted, device=DEVICE, backend=backend)
    if fused:
        ebc.enable_fused_optimizer(fused, lr=0.1)
    return ebc


def _run_bags(backend, fused=None, weighted=False, variable_batch=False):
    ebc = _bag_module(backend, fused, weighted)
    keys = ["f0", "f1", "f2"]
    if variable_batch:  # feature f1 at 2 bags of the 4 rows
        kjt = _kjt(keys, [2, 0, 1, 3, 1, 2, 0, 1, 1, 2], 11, stride_per_key_per_rank=[[4], [2], [4]],
                   inverse_indices=(keys, torch.tensor([[0, 1, 2, 3], [0, 1, 1, 0], [0, 1, 2, 3]])))
    else:
        kjt = _kjt(keys, [2, 0, 1, 3, 1, 2, 0, 1, 1, 2, 0, 3], 11)
        if weighted:  # "grad": the sample weights take a gradient too
            weights = torch.rand(kjt.values().numel(), device=DEVICE).requires_grad_(weighted == "grad")
            kjt = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(), weights=weights)
    out = ebc(kjt).values()
    (out * torch.arange(out.numel(), device=DEVICE).view_as(out)).sum().backward()


def _run_sequence(backend, fused=None):
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=13, feature_names=[f"f{i}"])
              for i in range(2)]
    ec = recom_rec.EmbeddingCollection(tables, device=DEVICE, backend=backend)
    if fused:
        ec.enable_fused_optimizer(fused, lr=0.1)
    out = ec(_kjt(["f0", "f1"], [2, 0, 3, 1, 1, 2], 13))
    sum(jt.values().pow(2).sum() for jt in out.values()).backward()


def _run_quantized(backend, sequence):
    from torch import quantization as tq
    from torchrec.modules.embedding_configs import QuantConfig

    config = EmbeddingConfig if sequence else EmbeddingBagConfig
    tables = [config(name=f"t{i}", embedding_dim=8, num_embeddings=13, feature_names=[f"f{i}"]) for i in range(2)]
    float_module = (recom_rec.EmbeddingCollection if sequence else recom_rec.EmbeddingBagCollection)(tables,
                                                                                                       device=DEVICE)
    float_module.qconfig = QuantConfig(activation=tq.PlaceholderObserver.with_args(dtype=torch.float16),
                                       weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8),
                                       per_table_weight_dtype={"t1": torch.quint4x2})
    quant = recom_rec.quant.EmbeddingCollection if sequence else recom_rec.quant.EmbeddingBagCollection
    # (the quantized modules have no CUDA C++ backend: "cuda" is the GPU's default there)
    module = quant.from_float(float_module, backend=backend if backend in ("torch", "triton") else "auto")
    with torch.no_grad():
        module(_kjt(["f0", "f1"], [2, 0, 3, 1, 1, 2], 13))


CASES = {
    "bags": lambda b: _run_bags(b),
    "bags weighted": lambda b: _run_bags(b, weighted=True),
    "bags weighted, weights' gradient": lambda b: _run_bags(b, weighted="grad"),
    "bags fused rowwise_adagrad": lambda b: _run_bags(b, fused="rowwise_adagrad"),
    "bags variable batch": lambda b: _run_bags(b, variable_batch=True),
    "bags variable batch fused sgd": lambda b: _run_bags(b, fused="sgd", variable_batch=True),
    "sequence": lambda b: _run_sequence(b),
    "sequence fused adam": lambda b: _run_sequence(b, fused="adam"),
    "quantized bags": lambda b: _run_quantized(b, sequence=False),
    "quantized sequence": lambda b: _run_quantized(b, sequence=True),
}


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_ops_a_module_dispatches_pass_opcheck(backend, case):
    # A dispatch mode makes the module take its registered ops (its eager shortcut skips them).
    with _RecordOps() as recorded:
        CASES[case](backend)
    assert recorded.calls, "no recom_rec op was dispatched"
    for func, args, kwargs in recorded.calls:
        results = torch.library.opcheck(func, args, kwargs)
        assert set(results.values()) == {"SUCCESS"}, (func, results)
