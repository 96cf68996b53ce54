"""The torchrec module contract: state_dict both ways, meta construction, init rules, device
and dtype moves, copies, and what the constructor rejects."""
import copy
import io
import subprocess
import sys

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_configs import DataType

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS, make_kjt
from subprocess_env import child_env


def _tables():
    return [
        EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=50, feature_names=["u", "shared"]),
        EmbeddingBagConfig(name="item", embedding_dim=3, num_embeddings=30, feature_names=["i", "shared"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="small16", embedding_dim=5, num_embeddings=20, data_type=DataType.FP16),
    ]


def _close(a, b):
    # The fp16 table: torchrec rounds its pooled output to fp16, we keep fp32.
    torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def _kjt():
    return make_kjt(_tables(), batch_size=5, max_len=3, seed=3, is_weighted=False)


def test_state_dict_keys_shapes_and_dtypes_match_torchrec():
    ref, ours = torchrec.EmbeddingBagCollection(_tables()), recom_rec.EmbeddingBagCollection(_tables())
    a, b = ref.state_dict(), ours.state_dict()
    assert list(a) == list(b) == [f"embedding_bags.{n}.weight" for n in ("user", "item", "small16")]
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype


@pytest.mark.parametrize("direction", ["torchrec_to_ours", "ours_to_torchrec"])
def test_checkpoint_loads_both_ways(direction):
    ref, ours = torchrec.EmbeddingBagCollection(_tables()), recom_rec.EmbeddingBagCollection(_tables())
    buf = io.BytesIO()
    src, dst = (ref, ours) if direction == "torchrec_to_ours" else (ours, ref)
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst.load_state_dict(torch.load(buf))
    _close(ours(_kjt()).values(), ref(_kjt()).values())


def test_load_with_assign_repacks_the_flat_buffer():
    ref, ours = torchrec.EmbeddingBagCollection(_tables()), recom_rec.EmbeddingBagCollection(_tables())
    ours.load_state_dict(ref.state_dict(), assign=True)
    _close(ours(_kjt()).values(), ref(_kjt()).values())
    # After the repack, in-place updates of a table are seen by the fused lookup again.
    with torch.no_grad():
        ours.embedding_bags["user"].weight.add_(1.0)
        ref.embedding_bags["user"].weight.add_(1.0)
    _close(ours(_kjt()).values(), ref(_kjt()).values())


def test_optimizer_step_on_dense_gradients_matches_torchrec():
    ref, ours = torchrec.EmbeddingBagCollection(_tables()), recom_rec.EmbeddingBagCollection(_tables())
    ours.load_state_dict(ref.state_dict())
    opt_a = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        kjt = make_kjt(_tables(), 4, 3, seed=step, is_weighted=False)
        for model, opt in ((ref, opt_a), (ours, opt_b)):
            opt.zero_grad()
            model(kjt).values().pow(2).sum().backward()
            opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k].float(), v.float(), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(ours(_kjt()).values(), ref(_kjt()).values(), atol=2e-3, rtol=1e-3)


def test_meta_device_then_materialise():
    ours = recom_rec.EmbeddingBagCollection(_tables(), device="meta")
    assert ours.device.type == "meta"
    assert all(p.is_meta for p in ours.parameters())
    ours.to_empty(device="cpu")
    ours.reset_parameters()
    w = ours.embedding_bags["user"].weight
    bound = (1 / 50) ** 0.5
    assert w.device.type == "cpu" and w.abs().max() <= bound
    out = ours(_kjt())
    assert out.values().shape == (5, 8 * 2 + 3 * 2 + 5)


def test_init_fn_and_init_bounds():
    calls = []

    def init_fn(w):
        calls.append(tuple(w.shape))
        torch.nn.init.constant_(w, 0.25)

    tables = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["a"], init_fn=init_fn),
              EmbeddingBagConfig(name="b", embedding_dim=2, num_embeddings=1000, feature_names=["b"],
                                 weight_init_min=0.5, weight_init_max=0.6)]
    ours = recom_rec.EmbeddingBagCollection(tables)
    assert calls == [(10, 4)]
    assert torch.all(ours.embedding_bags["a"].weight == 0.25)
    b = ours.embedding_bags["b"].weight
    assert b.min() >= 0.5 and b.max() <= 0.6
    ours.reset_parameters()
    assert calls == [(10, 4), (10, 4)]


def test_accessors_and_defaults():
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10)]
    ours = recom_rec.EmbeddingBagCollection(tables, is_weighted=True)
    assert ours.is_weighted() is True
    assert ours.embedding_bag_configs() is tables
    assert tables[0].feature_names == ["t"]
    bag = ours.embedding_bags["t"]
    assert isinstance(bag, torch.nn.EmbeddingBag) and bag.mode == "sum"
    assert isinstance(bag.weight, torch.nn.Parameter) and bag.weight.is_leaf


def test_rejects_what_torchrec_rejects():
    dup = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
           EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["b"])]
    with pytest.raises(ValueError, match="Duplicate table name t"):
        recom_rec.EmbeddingBagCollection(dup)
    with pytest.raises(ValueError, match="Unsupported pooling type"):
        recom_rec.EmbeddingBagCollection([EmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=10, pooling=PoolingType.NONE)])
    with pytest.raises(ValueError, match="unknown backend"):
        recom_rec.EmbeddingBagCollection(_tables(), backend="cuda-please")


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2])
def test_integer_data_types_give_fp16_tables_as_torchrec(data_type):
    """A table configured for its quantized type (INT8, INT4, ...) is an fp16 table until the model
    is quantized, as in torchrec's module (the config carries the type on to ``from_float``)."""
    def tables():
        return [EmbeddingBagConfig(name="q", embedding_dim=4, num_embeddings=10, feature_names=["f"],
                                   data_type=data_type),
                EmbeddingBagConfig(name="p", embedding_dim=4, num_embeddings=10, feature_names=["g"])]

    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables(), device=DEVICE)
    ours = recom_rec.EmbeddingBagCollection(tables(), device=DEVICE)
    assert ours.embedding_bags["q"].weight.dtype == ref.embedding_bags["q"].weight.dtype == torch.float16
    assert ours.embedding_bag_configs()[0].data_type == data_type
    ours.load_state_dict(ref.state_dict())
    kjt = make_kjt(tables(), batch_size=4, max_len=3, seed=1, is_weighted=False).to(DEVICE)
    _close(ours(kjt).values(), ref(kjt).values().float())


@pytest.mark.parametrize("collection", ["bags", "sequence"])
def test_functional_call_reads_the_weights_it_is_given(collection):
    """torch.func.functional_call with substituted table weights (torch.func's way to run a module
    on other parameters) reads those weights and differentiates against them, as torchrec's module
    does; afterwards the module reads its own again. With a fused optimizer, whose update would go
    to a copy, it is refused."""
    if collection == "bags":
        tables, kjt = _tables(), _kjt()
        make = (torchrec.EmbeddingBagCollection, recom_rec.EmbeddingBagCollection)

        def values(out):
            return out.values()
    else:
        tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=4, num_embeddings=20, feature_names=[f"f{i}"])
                  for i in range(2)]
        kjt = make_kjt(tables, batch_size=4, max_len=3, seed=5, is_weighted=False)
        make = (torchrec.EmbeddingCollection, recom_rec.EmbeddingCollection)

        def values(out):
            return torch.cat([out[k].values() for k in sorted(out)])

    kjt = kjt.to(DEVICE)
    ref, ours = make[0](tables=tables, device=DEVICE), make[1](tables=tables, device=DEVICE)
    ours.load_state_dict(ref.state_dict())
    own = values(ours(kjt)).detach()
    given = {k: (torch.rand_like(v) - 0.5).requires_grad_(True) for k, v in ref.named_parameters()}
    want = values(torch.func.functional_call(ref, given, (kjt,)))
    got = values(torch.func.functional_call(ours, given, (kjt,)))
    _close(got, want)
    grads = torch.autograd.grad(got.float().pow(2).sum(), list(given.values()))
    want_grads = torch.autograd.grad(want.float().pow(2).sum(), list(given.values()))
    for g, w in zip(grads, want_grads):
        _close(g.float(), w.float())
    assert torch.equal(values(ours(kjt)).detach(), own)
    ours.enable_fused_optimizer("sgd", lr=0.1)
    with pytest.raises(ValueError, match="substituted"):
        torch.func.functional_call(ours, given, (kjt,))


def test_dtype_conversion_and_deepcopy_keep_one_flat_buffer():
    ours = recom_rec.EmbeddingBagCollection(_tables())
    expected = ours(_kjt()).values()
    clone = copy.deepcopy(ours)
    with torch.no_grad():
        clone.embedding_bags["user"].weight.zero_()
    # The copy's tables still view the copy's flat buffer, and the original is untouched.
    assert not torch.equal(clone(_kjt()).values(), expected)
    torch.testing.assert_close(ours(_kjt()).values(), expected)
    ours.double()
    assert ours.embedding_bags["user"].weight.dtype == torch.float64
    with torch.no_grad():
        ours.embedding_bags["user"].weight.mul_(0.0)
        ours.embedding_bags["item"].weight.mul_(0.0)
        ours.embedding_bags["small16"].weight.mul_(0.0)
    assert not ours(_kjt()).values().any()


def test_pickle_whole_module_round_trip():
    ours = recom_rec.EmbeddingBagCollection(_tables())
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(_kjt()).values(), ours(_kjt()).values())
    with torch.no_grad():
        loaded.embedding_bags["item"].weight.fill_(1.0)
    out = loaded(_kjt())
    assert torch.all(out["i"][:, :] >= 0)


def test_bf16_tables_pool_in_fp32():
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"],
                                 data_type=DataType.BF16)]
    ours = recom_rec.EmbeddingBagCollection(tables)
    assert ours.embedding_bags["t"].weight.dtype == torch.bfloat16
    with torch.no_grad():
        ours.embedding_bags["t"].weight.fill_(1.0 / 3.0)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1] * 300), torch.tensor([300]))
    got = ours(kjt).values()
    assert got.dtype == torch.float32
    one_third = torch.tensor(1.0 / 3.0, dtype=torch.bfloat16).float()
    torch.testing.assert_close(got, torch.full((1, 4), 300 * float(one_third)), rtol=1e-6, atol=1e-5)


def test_ids_from_a_finished_functorch_transform_pool_like_plain_ids():
    """A KJT whose values were made inside a torch.func transform that has since returned (a
    "dead" functorch wrapper) pools and differentiates as the same ids in a plain tensor."""
    leaked = []

    def loss(x):
        leaked.append((x * 0 + torch.tensor([1.0, 3.0, 0.0, 2.0])).to(torch.int64))
        return x.sum()

    torch.func.grad(loss)(torch.ones(4))
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"])]
    module = recom_rec.EmbeddingBagCollection(tables)
    lengths = torch.tensor([2, 2])
    wrapped = module(KeyedJaggedTensor.from_lengths_sync(["f"], leaked[0], lengths)).values()
    wrapped.sum().backward()
    grad = module.embedding_bags["t"].weight.grad.clone()
    module.embedding_bags["t"].weight.grad = None
    plain = module(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 3, 0, 2]), lengths)).values()
    plain.sum().backward()
    assert torch.equal(wrapped, plain)
    assert torch.equal(grad, module.embedding_bags["t"].weight.grad)


def _last_line_of(code: str, *args: str) -> str:
    """The last line a fresh Python process running ``code`` prints (it must exit 0)."""
    out = subprocess.run([sys.executable, "-c", code, *args], env=child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


_FIRST_CALL = """
import sys, torch, recom_rec, recom_rec.quant
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType
dev = torch.device("cuda")
kind = sys.argv[1]
if kind == "ec":
    m = recom_rec.EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=20,
                                                       feature_names=["f"])], device=dev)
else:
    dtype = DataType.INT8 if kind == "quant" else DataType.FP32
    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=20, feature_names=["f"], data_type=dtype)]
    m = (recom_rec.quant.EmbeddingBagCollection(tables, False, dev) if kind == "quant"
         else recom_rec.EmbeddingBagCollection(tables, device=dev))
kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3], device=dev), torch.tensor([2, 1], device=dev))
before = set(sys.modules)
with torch.no_grad():
    m(kjt)
print(sorted(n for n in set(sys.modules) - before if n.startswith("recom_rec.kernels")))
"""


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GPU kernels' modules load on a GPU (RECOM_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("kind", ["ebc", "ec", "quant"])
def test_the_first_call_imports_no_kernel_module(kind):
    # Construction imports the kernels the module runs: their Triton @jit decorators tokenize their
    # sources (~70 ms of the H200 host's time, perf-notes v47), which the first call would pay.
    assert _last_line_of(_FIRST_CALL, kind) == "[]"


_BUILT_ON_THE_CPU = """
import torch
started = []
if not torch.cuda.is_available():  # a CPU build: a GPU is simulated, and starting CUDA is recorded
    torch.cuda.is_available = lambda: True
    torch.cuda._lazy_init = lambda: started.append(True)
import recom_rec, recom_rec.quant
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_configs import DataType
bag = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=20, feature_names=["f"])]
recom_rec.EmbeddingBagCollection(bag)
recom_rec.EmbeddingBagCollection(bag, device=torch.device("meta"))
recom_rec.EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=20, feature_names=["f"])])
recom_rec.quant.EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=20,
                                                           feature_names=["f"], data_type=DataType.INT8)],
                                       False, torch.device("cpu"))
print("cuda started:", bool(started) or torch.cuda.is_initialized())
"""


def test_a_module_built_on_the_cpu_or_meta_does_not_start_cuda():
    # Loading the kernels at construction must not create a CUDA context: a process that builds its
    # model on the CPU and then forks workers that use CUDA would fail. (Without a GPU the child
    # simulates one whose start is recorded: the H200 run found the extension's load starting it.)
    assert _last_line_of(_BUILT_ON_THE_CPU) == "cuda started: False"


def _as_views(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The same batch with its values, offsets and weights held as strided views (as a KJT sliced
    out of a wider tensor holds them)."""
    def view(t):
        return None if t is None else torch.stack([t, torch.zeros_like(t)], 1)[:, 0]

    out = KeyedJaggedTensor(keys=kjt.keys(), values=view(kjt.values()), weights=view(kjt.weights_or_none()),
                            offsets=view(kjt.offsets()))
    assert not out.values().is_contiguous() and not out.offsets().is_contiguous()
    return out


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("kind", ["bags weighted", "bags fused", "sequence", "quantized"])
def test_a_batch_held_as_views_reads_as_its_dense_copy(backend, kind):
    """A KJT whose tensors are strided views gives what its dense copy gives (the kernels index the
    batch densely: they read views as such; v50: the Triton forward pooled the wrong ids)."""
    weighted = kind == "bags weighted"
    if kind == "sequence":
        tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=30, feature_names=[f"f{i}"])
                  for i in range(2)]
    else:
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4 * (i + 1), num_embeddings=30,
                                     feature_names=[f"f{i}"]) for i in range(2)]

    def build():
        torch.manual_seed(0)
        if kind == "sequence":
            return recom_rec.EmbeddingCollection(tables=tables, device=DEVICE, backend=backend)
        module = recom_rec.EmbeddingBagCollection(tables, is_weighted=weighted, device=DEVICE, backend=backend)
        if kind == "bags fused":
            module.enable_fused_optimizer("sgd", lr=0.5)
        if kind == "quantized":
            module = recom_rec.quant.EmbeddingBagCollection.from_float(
                _with_qconfig(module), backend=backend if backend != "cuda" else "auto")
        return module

    def values(out):
        return torch.cat([jt.values() for jt in out.values()]) if isinstance(out, dict) else out.values()

    dense = make_kjt(tables, batch_size=5, max_len=4, seed=2, is_weighted=weighted).to(DEVICE)
    results = []
    for kjt in (dense, _as_views(dense)):
        module = build()
        out = values(module(kjt))
        if kind != "quantized":
            out.float().pow(2).sum().backward()
            out = (out, *(p.grad if p.grad is not None else p.detach().clone() for p in module.parameters()))
        results.append(out)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _with_qconfig(module):
    from torch import quantization as tq
    from torchrec.modules.embedding_configs import QuantConfig

    module.qconfig = QuantConfig(activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
                                 weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8))
    return module


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int32])
def test_narrow_integer_ids_read_as_int64_ids(backend, dtype):
    """Ids of a narrower integer type (torchrec's module takes them) pool and train as their int64
    values do (the CUDA kernels take int32 or int64: narrower ones are widened)."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"])
              for i in range(2)]
    kjt = make_kjt(tables, batch_size=6, max_len=4, seed=4, is_weighted=False).to(DEVICE)
    narrow = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().to(dtype), lengths=kjt.lengths())
    results = []
    for batch in (kjt, narrow):
        torch.manual_seed(0)
        module = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
        out = module(batch).values()
        out.pow(2).sum().backward()
        results.append((out, *(p.grad for p in module.parameters())))
    for a, b in zip(*results):
        if backend == "torch" and DEVICE.type == "cuda":  # index_add_'s atomics: a sum's order varies by run
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(a, b)
