"""A bad id or bad lengths are raised by the module that ran the batch (on its next call, or by its
``check_inputs()``), and by no other: several modules and models in one process, one thread per
request stream, CUDA streams and graph replays, compiled, scripted and exported modules, float and
quantized. The torch backend raises in the call itself; the kernel backends report from the
kernels without a sync (ops/input_check.py)."""
import gc
import threading

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS

QUANT_BACKENDS = ["torch"] + (["triton"] if DEVICE.type == "cuda" or recom_rec.ops.backends.triton_interpreting()
                              else [])
MESSAGE = r"feature 'items' \(table 'item_table'\): id 50 at batch index 1"


def _tables():
    return [EmbeddingBagConfig(name="user_table", embedding_dim=4, num_embeddings=20, feature_names=["users"]),
            EmbeddingBagConfig(name="item_table", embedding_dim=8, num_embeddings=30, feature_names=["items"])]


def _module(kind: str, backend: str, weight_dtype: torch.dtype = torch.qint8) -> nn.Module:
    ebc = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE, backend=backend if kind == "float" else "torch")
    if kind == "float":
        return ebc
    ebc.qconfig = torch.quantization.QConfig(
        activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
        weight=torch.quantization.PlaceholderObserver.with_args(dtype=weight_dtype))
    return recom_rec.quant.EmbeddingBagCollection.from_float(ebc, backend=backend)


def _kjt(item: int = 3) -> KeyedJaggedTensor:
    """Batch 2; the second bag of 'items' reads ``item`` (50 is past the table's 30 rows)."""
    return KeyedJaggedTensor.from_lengths_sync(keys=["users", "items"], values=torch.tensor([1, 2, 5, 7, item]),
                                               lengths=torch.tensor([1, 1, 2, 1])).to(DEVICE)


def _handle(module, kjt):
    """What a request handler does: the forward, then the batch's own check."""
    out = module(kjt)
    module.check_inputs()
    return out


class _Model(nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        self.head = nn.Linear(12, 1, device=DEVICE)

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values())

    def check_inputs(self):
        self.ebc.check_inputs()


def _cases():
    return ([("float", b) for b in KERNEL_BACKENDS] + [("quantized", b) for b in QUANT_BACKENDS])


@pytest.mark.parametrize("kind, backend", _cases())
def test_a_bad_batch_is_raised_by_its_own_module_and_model_only(kind, backend):
    a, b = _module(kind, backend), _module(kind, backend)
    model_a, model_b = _Model(_module(kind, backend)), _Model(_module(kind, backend))
    with torch.no_grad():
        for bad, others in ((a, (b, model_a, model_b)), (model_b, (a, b, model_a))):
            with pytest.raises(ValueError, match=MESSAGE):
                bad(_kjt(50))  # the torch backend raises here
                for other in others:  # the kernels' report is not theirs
                    _handle(other, _kjt())
                bad.check_inputs()
            for module in (a, b, model_a, model_b):  # raised once, and nothing else pending
                _handle(module, _kjt())


@pytest.mark.parametrize("kind, backend", _cases())
def test_a_bad_batch_is_raised_by_the_module_s_next_call(kind, backend):
    a, b = _module(kind, backend), _module(kind, backend)
    with torch.no_grad():
        with pytest.raises(ValueError, match=MESSAGE):
            a(_kjt(50))
            b(_kjt())
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()  # the next call raises what the kernels have reported by then
            a(_kjt())
        _handle(a, _kjt())
        _handle(b, _kjt())


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_freed_module_leaves_its_report_to_no_one(backend):
    """A module built where a freed one lay (same sizes: often the same addresses) starts clean."""
    for _ in range(3):
        a = _module("float", backend)
        with torch.no_grad():
            try:
                a(_kjt(50))
            except ValueError:
                pass  # the torch backend
        del a
        gc.collect()
        b = _module("float", backend)
        with torch.no_grad():
            _handle(b, _kjt())
            _handle(b, _kjt())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a kernel still queued when its module is freed needs a GPU "
                                                  "(the CPU's kernels have run when the call returns)")
@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b != "torch"])
def test_a_module_freed_before_its_kernels_ran_leaves_its_report_to_no_one(backend):
    """Module A's bad batch is still queued (behind a sleeping kernel) when A is freed and B makes
    its first call: A's kernel must not report into B (whose report slot, allocated then, is the
    same size as A's freed one), and B's good batches raise nothing."""
    a = _module("float", backend)
    b = _module("float", backend)
    with torch.no_grad():
        _handle(a, _kjt())  # a's slot made and its kernels built
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 28)  # ~0.1-0.2 s of device time: a's next kernel waits behind it
        a(_kjt(50))
        del a
        gc.collect()
        b(_kjt())  # b's first call makes its slot while a's bad batch is still queued
        torch.cuda.synchronize()  # a's kernel has reported by now, wherever it reports
        _handle(b, _kjt())


@pytest.mark.parametrize("kind, backend", _cases())
def test_each_thread_raises_its_own_bad_batches_only(kind, backend):
    """One module serving three request threads (on CUDA, each with its own stream): every bad
    batch raises in its own handler, no good one does."""
    module = _module(kind, backend)
    plans = [[t == i % 3 and i % 2 == 1 for i in range(8)] for t in range(3)]  # which batches are bad
    raised = [[False] * 8 for _ in range(3)]
    failures = []
    # The Triton interpreter is not thread-safe: on the CPU the forwards take turns (the reports'
    # slots, per thread, are what is under test).
    turns = threading.Lock() if DEVICE.type == "cpu" else None

    # Every thread runs its batch, then every thread checks: each check comes after the other
    # threads' calls of the module, bad ones included.
    step = threading.Barrier(3, timeout=120)

    def serve(t):
        stream = torch.cuda.Stream() if DEVICE.type == "cuda" else None
        try:
            with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else _nothing()):
                for i, bad in enumerate(plans[t]):
                    for call in (lambda: module(_kjt(50 if bad else 3)), module.check_inputs):
                        try:
                            if turns is not None:
                                with turns:
                                    call()
                            else:
                                call()
                        except ValueError as e:
                            assert "id 50" in str(e) and not raised[t][i], e
                            raised[t][i] = True
                        step.wait()
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(e)
            step.abort()

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert raised == plans


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA streams need a GPU (RECOM_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b != "torch"])
def test_a_report_from_another_stream_of_the_thread_is_raised_once(backend):
    module = _module("float", backend)
    side = torch.cuda.Stream()
    with torch.no_grad():
        with pytest.raises(ValueError, match=MESSAGE):
            with torch.cuda.stream(side):
                module(_kjt(50))
            module(_kjt())  # raises here if the side stream's kernel has reported by then
            module.check_inputs()  # else here: it waits for both streams
        _handle(module, _kjt())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU (RECOM_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b != "torch"])
def test_a_graph_replay_s_report_is_its_module_s(backend):
    from ebc_cases import capture_forward

    a, b = _module("float", backend), _module("float", backend)
    static = _kjt()
    with torch.no_grad():
        graph, _ = capture_forward(lambda: a(static).values(), 12)
        graph.replay()
        a.check_inputs()
        static.values().copy_(_kjt(50).values())
        graph.replay()
        _handle(b, _kjt())
        with pytest.raises(ValueError, match=MESSAGE):
            a.check_inputs()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_compiled_module_s_report_is_its_own(backend):
    torch._dynamo.reset()
    a, b = _module("float", backend), _module("float", backend)
    compiled = torch.compile(a, fullgraph=True)
    with torch.no_grad():
        compiled(_kjt())
        with pytest.raises(ValueError, match=MESSAGE):
            compiled(_kjt(50))
            _handle(b, _kjt())
            a.check_inputs()
        compiled(_kjt())
        a.check_inputs()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_scripted_module_s_report_is_its_own(backend):
    a, b = _module("float", backend), _module("float", backend)
    scripted_a, scripted_b = torch.jit.script(a), torch.jit.script(b)
    with torch.no_grad():
        with pytest.raises(Exception, match=MESSAGE):
            scripted_a(_kjt(50))
            scripted_b(_kjt())
            scripted_b.check_inputs()
            scripted_a.check_inputs()
        scripted_a(_kjt())
        scripted_a.check_inputs()


def _quantized_collection(backend: str, weight_dtype: torch.dtype) -> nn.Module:
    tables = [EmbeddingConfig(name=t.name, embedding_dim=8, num_embeddings=t.num_embeddings,
                              feature_names=t.feature_names) for t in _tables()]
    ec = recom_rec.EmbeddingCollection(tables=tables, device=DEVICE)
    ec.qconfig = torch.quantization.QConfig(
        activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
        weight=torch.quantization.PlaceholderObserver.with_args(dtype=weight_dtype))
    return recom_rec.quant.EmbeddingCollection.from_float(ec, backend=backend)


def _graph_of(module: nn.Module, how: str):
    from torchrec.fx import symbolic_trace

    return torch.jit.script(module) if how == "script" else symbolic_trace(module)


_REPORTING_BACKENDS = [b for b in QUANT_BACKENDS if b != "torch"]  # (the torch backend raises in the call)


@pytest.mark.parametrize("kind, how", [("quantized collection INT4", "script"), ("quantized collection INT8", "fx"),
                                       ("float", "fx"), ("float collection", "fx")])
@pytest.mark.parametrize("backend", _REPORTING_BACKENDS)
def test_a_graph_reports_after_its_module_is_freed(kind, how, backend):
    """A graph made from a module runs under the module's id: an fx trace holds no reference to
    the module, and a quantized module with INT4 tables was once scripted through a copy of it.
    The module's reports must not go with the Python module."""
    if kind.startswith("quantized collection"):
        module = _quantized_collection(backend, torch.quint4x2 if "INT4" in kind else torch.qint8)
    elif kind == "float collection":
        module = recom_rec.EmbeddingCollection(
            tables=[EmbeddingConfig(name=t.name, embedding_dim=8, num_embeddings=t.num_embeddings,
                                    feature_names=t.feature_names) for t in _tables()], device=DEVICE, backend=backend)
    else:
        module = _module(kind, backend)
    graph = _graph_of(module, how)
    with torch.no_grad():
        graph(_kjt())  # its report slot made while the module lives
        del module
        gc.collect()
        with pytest.raises(Exception, match=MESSAGE):
            graph(_kjt(50))
            _handle(_module("float", backend), _kjt())  # a new slot: freed modules' slots are retired
            graph.check_inputs() if how == "script" else graph(_kjt())
        graph(_kjt())


class _Exportable(nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, values, lengths):
        kjt = KeyedJaggedTensor(keys=["users", "items"], values=values, lengths=lengths)
        return self.ebc(kjt).values()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_an_exported_program_raises_its_own_report_on_its_next_call(backend):
    a, b = _module("float", backend), _module("float", backend)
    good = _kjt()
    with torch.no_grad():
        exported = torch.export.export(_Exportable(a), (good.values(), good.lengths())).module()
        exported(good.values(), good.lengths())
        with pytest.raises(ValueError, match=MESSAGE):
            exported(_kjt(50).values(), good.lengths())
            _handle(b, _kjt())
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            exported(good.values(), good.lengths())
        exported(good.values(), good.lengths())
