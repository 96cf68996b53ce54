"""The fused kernels (torch and Triton backends) against the pure-torch reference, including
what torchrec's stock module cannot do (weighted mean pooling, bf16 tables)."""
import pytest
import torch
from hypothesis import given, settings
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS, SLOW_ON_CPU, Case, cases, make_kjt
from torchrec import EmbeddingBagConfig, PoolingType
from recom_rec.ops.reference import reference_pooled

SMALL = dict(max_tables=6, max_dim=40, max_rows=300, max_batch=5, max_len=5)
TOL = {DataType.FP32: 1e-5, DataType.FP16: 1e-3, DataType.BF16: 1e-3}


def _reference(module, kjt, table_configs):
    weights = {name: bag.weight.detach().cpu() for name, bag in module.embedding_bags.items()}
    features = [(f, t.name, "mean" if t.pooling.value == "MEAN" else "sum")
                for t in table_configs for f in t.feature_names]
    return reference_pooled(weights, features, kjt.keys(), kjt.values().cpu(), kjt.lengths().cpu(),
                            kjt.weights_or_none().cpu() if module.is_weighted() and kjt.weights_or_none() is not None else None)


def _check_forward_backward(case, backend):
    module = recom_rec.EmbeddingBagCollection(case.fresh_tables(), is_weighted=case.is_weighted,
                                              device=DEVICE, backend=backend)
    kjt = case.kjt.to(DEVICE)
    if case.is_weighted:
        kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                weights=kjt.weights().clone().requires_grad_(True))
    out = module(kjt).values()
    tol = max(TOL[t.data_type] for t in case.tables)
    expected = _reference(module, case.kjt, module.embedding_bag_configs())
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)

    # Gradients: the reference's autograd through the same formula.
    ref_weights = {n: b.weight.detach().cpu().float().requires_grad_(True) for n, b in module.embedding_bags.items()}
    psw = case.kjt.weights().clone().float().requires_grad_(True) if case.is_weighted else None
    features = [(f, t.name, "mean" if t.pooling.value == "MEAN" else "sum")
                for t in module.embedding_bag_configs() for f in t.feature_names]
    ref_out = reference_pooled(ref_weights, features, case.kjt.keys(), case.kjt.values(), case.kjt.lengths(), psw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (ref_out * g).sum().backward()
    (out * g.to(DEVICE)).sum().backward()
    for name, bag in module.embedding_bags.items():
        torch.testing.assert_close(bag.weight.grad.cpu().float(), ref_weights[name].grad,
                                   atol=tol * 10, rtol=tol * 10, msg=lambda m: f"table {name}: {m}")
    if case.is_weighted:
        torch.testing.assert_close(kjt.weights().grad.cpu(), psw.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_random_cases_against_reference(backend):
    @settings(max_examples=15)
    @given(case=cases(**SMALL, allow_mean_weighted=True,
                      data_types=(DataType.FP32, DataType.FP16, DataType.BF16)))
    def run(case):
        _check_forward_backward(case, backend)
    run()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dims", [[3], [17, 3, 1], [16, 16, 16], [1, 128, 5, 64]])
@pytest.mark.parametrize("weighted", [False, True])
def test_mixed_dims_and_empty_bags(backend, dims, weighted):
    from torchrec import EmbeddingBagConfig, PoolingType
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=11 + i,
                                 feature_names=[f"f{i}"], pooling=[PoolingType.SUM, PoolingType.MEAN][i % 2])
              for i, d in enumerate(dims)]
    kjt = make_kjt(tables, batch_size=4, max_len=3, seed=sum(dims), is_weighted=weighted, zero_fraction=0.5)
    from ebc_cases import Case
    _check_forward_backward(Case(tables, kjt, weighted), backend)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_batch_of_one_with_a_group_at_an_odd_column(backend, weighted):
    # Two dtype groups: the fp16 group's columns start at column 3. With one sample, its slice of
    # the output gradient is contiguous but starts 12 bytes in, so a kernel reading gradient rows
    # 4-wide must check the address, not just the dims (a random case hit this on the H100).
    from torchrec import EmbeddingBagConfig, PoolingType
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=3, num_embeddings=7, feature_names=["f0"]),
              EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=9, feature_names=["f1"],
                                 data_type=DataType.FP16, pooling=PoolingType.MEAN),
              EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=5, feature_names=["f2", "f3"],
                                 data_type=DataType.FP16)]
    kjt = make_kjt(tables, batch_size=1, max_len=6, seed=3, is_weighted=weighted, zero_fraction=0.0)
    from ebc_cases import Case
    _check_forward_backward(Case(tables, kjt, weighted), backend)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_one_id_in_all(backend, weighted, batch_size):
    # A launch passing 1 for an integer argument (the values' count here) makes it a constexpr in a
    # compiled Triton kernel: the input check's report must compile with it (a random case hit this
    # on the H100; the interpreter does not specialise).
    tables = [EmbeddingBagConfig(name="t", embedding_dim=5, num_embeddings=4, feature_names=["f"],
                                 pooling=PoolingType.MEAN)]
    lengths = torch.zeros(batch_size, dtype=torch.int64)
    lengths[-1] = 1
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([2]), lengths,
                                              weights=torch.tensor([0.5]) if weighted else None)
    _check_forward_backward(Case(tables, kjt, weighted), backend)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_all_bags_empty(backend):
    from torchrec import EmbeddingBagConfig, PoolingType
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"],
                                 pooling=PoolingType.MEAN)]
    module = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    out = module(kjt.to(DEVICE)).values()
    assert out.shape == (3, 4) and not out.any()
    out.sum().backward()
    assert not module.embedding_bags["t"].weight.grad.any()


@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b != "torch"])
@SLOW_ON_CPU
def test_one_row_read_more_often_than_a_planning_block_holds(backend):
    # ~2,700 lookups of a single row next to a table of ordinary rows: whole blocks of the backward's
    # planning kernel lie inside one row's run, so they find the row's start by the shared search.
    from torchrec import EmbeddingBagConfig
    # The cold table's rows sort first, so the hot run starts at an arbitrary position.
    tables = [EmbeddingBagConfig(name="cold", embedding_dim=8, num_embeddings=5000, feature_names=["c"]),
              EmbeddingBagConfig(name="hot", embedding_dim=8, num_embeddings=1, feature_names=["h"])]
    kjt = make_kjt(tables, batch_size=600, max_len=8, seed=11, is_weighted=False, zero_fraction=0.0).to(DEVICE)
    grads = {}
    for b in ("torch", backend):
        m = recom_rec.EmbeddingBagCollection([EmbeddingBagConfig(**{**vars(t), "feature_names": list(t.feature_names)})
                                              for t in tables], device=DEVICE, backend=b)
        out = m(kjt).values()
        out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float32)).view(out.shape).to(DEVICE))
        grads[b] = [m.embedding_bags[t.name].weight.grad for t in tables]
    assert (kjt["h"].lengths().sum()) > 2 * 1024
    for a, b in zip(grads["torch"], grads[backend]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dims", [[4, 16], [100, 3]])
def test_hot_rows_longer_than_a_chunk(dims):
    # Tables of 2 and 3 rows read thousands of times: each row's run of lookups spans several of
    # the backward kernel's chunks, so its gradient is assembled from chunk partials.
    from torchrec import EmbeddingBagConfig
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=2 + i, feature_names=[f"f{i}"])
              for i, d in enumerate(dims)]
    kjt = make_kjt(tables, batch_size=300, max_len=8, seed=5, is_weighted=True, zero_fraction=0.0).to(DEVICE)
    grads = {}
    for backend in KERNEL_BACKENDS:
        m = recom_rec.EmbeddingBagCollection([EmbeddingBagConfig(**{**vars(t), "feature_names": list(t.feature_names)})
                                              for t in tables], is_weighted=True, device=DEVICE, backend=backend)
        with torch.no_grad():
            for i, t in enumerate(tables):
                m.embedding_bags[t.name].weight.copy_(torch.arange(t.num_embeddings * t.embedding_dim,
                                                                   dtype=torch.float32).view(t.num_embeddings, -1) / 7)
        out = m(kjt).values()
        out.backward(torch.sin(torch.arange(out.numel(), dtype=torch.float32)).view(out.shape).to(DEVICE))
        grads[backend] = [m.embedding_bags[t.name].weight.grad for t in tables]
    for backend in KERNEL_BACKENDS[1:]:
        for a, b in zip(grads["torch"], grads[backend]):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dims", [(256, 8), (132, 516), (1024, 12), (1028, 100), (17, 388)])
def test_wide_rows_and_long_bags_against_reference(backend, dims):
    """The CUDA forward's multi-chunk lanes (dims above 128: 2 or 4 float4 chunks a lane, above
    512: several passes; the backward's 8-chunk lanes up to 1024) and rows of long bags, mixed with narrow and unaligned tables; empty bags,
    sum and mean, sample weights, both half types."""
    for weighted, data_type in ((False, DataType.FP32), (True, DataType.FP16), (False, DataType.BF16)):
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=50, feature_names=[f"f{i}"],
                                     pooling=PoolingType.MEAN if i % 2 else PoolingType.SUM, data_type=data_type)
                  for i, d in enumerate(dims)]
        kjt = make_kjt(tables, 3, 37, seed=sum(dims), is_weighted=weighted)
        case = Case(tables, kjt, weighted)
        _check_forward_backward(case, backend)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA kernels run on a GPU (CI compiles them: test_kernels_compile)")
@pytest.mark.parametrize("dims,batch", [((4, 8, 16, 64, 128), 9), ((3, 17, 128), 9), ((200, 8), 9), ((1024, 12), 9),
                                        ((696, 579, 12), 9), ((20, 36, 68, 100, 124), 45)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_every_cuda_forward_launch_gives_the_reference_and_the_same_bits(dims, batch, index_dtype):
    """Each launch the tuner may pick (feature- or bag-major, 8 or 4 rows in flight a lane, bag-major
    in rounds) on mixed dims with empty, short and long bags (up to 40 ids: several 4- and 8-row
    steps and their tails), sum and mean, sample weights, fp32 and bf16 rows: the reference's sums,
    and the same bits from every launch (the sums' order is the bag's). Dims whose 16-byte chunks
    are not a power of two leave some of a group's lanes idle, and at batch 45 each table's bags
    take several blocks (8 bags a block at a group's widest dim of 124). Dims 696 and 579 take the
    rounds kernel's deeper passes of wide rows (3 rows of 4 chunks, then 8 of 2; an odd dim's
    realigned passes at 8 rows)."""
    from recom_rec.kernels import pooled_cuda, selection

    for weighted, data_type in ((False, DataType.FP32), (True, DataType.FP32), (False, DataType.BF16)):
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=300, feature_names=[f"f{i}"],
                                     pooling=PoolingType.MEAN if i % 2 else PoolingType.SUM, data_type=data_type)
                  for i, d in enumerate(dims)]
        kjt = make_kjt(tables, batch, 40, seed=sum(dims), is_weighted=weighted, index_dtype=index_dtype)
        module = recom_rec.EmbeddingBagCollection(Case(tables, kjt, weighted).fresh_tables(), is_weighted=weighted,
                                                  device=DEVICE, backend="auto")
        expected = _reference(module, kjt, module.embedding_bag_configs())
        launches = pooled_cuda.forward_launches(pooled_cuda.ForwardLaunchShape(0, len(dims), batch, sum(dims), max(dims),
                                                                               1, torch.float32, index_dtype, weighted))
        assert len(launches) == (6 if max(dims) <= 128 else 4)
        outs = {}
        try:
            for launch in launches:
                selection.force_forward(selection.CUDA + launch)
                with torch.no_grad():
                    outs[launch] = module(kjt.to(DEVICE)).values().cpu()
        finally:
            selection.force_forward(None)
        tol = TOL[data_type]
        for launch, out in outs.items():
            torch.testing.assert_close(out, expected, atol=tol, rtol=tol, msg=lambda m: f"{launch}: {m}")
            assert torch.equal(out, outs["features"]), launch


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA kernels run on a GPU (CI compiles them: test_kernels_compile)")
@pytest.mark.parametrize("dim", [5, 12, 100, 101, 127, 128, 232, 233, 497, 600, 601, 1024])
@pytest.mark.parametrize("pad_rows", [8, 9, 10, 11])
@pytest.mark.parametrize("last", [False, True])
def test_a_row_read_at_any_alignment_gives_the_aligned_reads_bits(dim, pad_rows, last):
    """The forward reads a table's rows 16 bytes at a time from their aligned address, or from up to
    3 elements before it (a table whose base is not a multiple of 4, also last in the buffer, its
    last row read up to 3 elements past the buffer's end); rows of an odd dim, each at its own
    offset, 16 bytes at a time realigned across lanes (passes of up to 31 chunks: at dims 127 and
    497 a row's last chunk starts a pass) or, in the 4-rows launch, element by element; it stores
    the sums 16 bytes at a time or column by column (an odd output column or width). Table "c"
    holds "a"'s weights and reads "a"'s ids, its base shifted by ``pad_rows`` % 4 elements (table
    "b", one column wide, before it), at an odd output column, or last in the buffer: every launch
    must give "c" exactly "a"'s sums (sum and mean, sample weights, fp32, bf16 and fp16 rows)."""
    from recom_rec.kernels import cuda_ext, pooled_cuda, selection

    assert cuda_ext.build_error() is None  # (else every forced launch would run Triton)

    for weighted, pooling, data_type in ((False, PoolingType.SUM, DataType.FP32),
                                         (True, PoolingType.SUM, DataType.FP32),
                                         (False, PoolingType.MEAN, DataType.BF16),
                                         (True, PoolingType.MEAN, DataType.FP16)):
        layout = [("a", dim, 64), ("b", 1, pad_rows), ("c", dim, 64), ("d", 3, 8)]
        if last:
            layout = layout[:2] + layout[3:] + layout[2:3]
        tables = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=rows, feature_names=[n], pooling=pooling,
                                     data_type=data_type) for n, d, rows in layout]
        g = torch.Generator().manual_seed(dim + pad_rows)
        batch = 9
        lengths = torch.randint(0, 41, (batch,), generator=g)
        lengths[0] = 0
        ids = torch.randint(0, 64, (int(lengths.sum()),), generator=g)
        other = {n: torch.randint(0, rows, (batch,), generator=g) for n, _, rows in layout if n in "bd"}
        by_key = {"a": (ids, lengths), "c": (ids, lengths), "b": (other["b"], torch.ones(batch, dtype=torch.long)),
                  "d": (other["d"], torch.ones(batch, dtype=torch.long))}
        keys = [n for n, _, _ in layout]
        values = torch.cat([by_key[k][0] for k in keys])
        weights = None
        if weighted:  # "c" weighs its ids as "a" does
            drawn = {k: torch.rand(by_key[k][0].numel(), generator=g) for k in keys}
            drawn["c"] = drawn["a"]
            weights = torch.cat([drawn[k] for k in keys])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, weights=weights,
                                                  lengths=torch.cat([by_key[k][1] for k in keys]))
        module = recom_rec.EmbeddingBagCollection(Case(tables, kjt, weighted).fresh_tables(), is_weighted=weighted,
                                                  device=DEVICE, backend="auto")
        state = module.state_dict()
        state["embedding_bags.c.weight"] = state["embedding_bags.a.weight"].clone()
        module.load_state_dict(state)
        launches = pooled_cuda.forward_launches(pooled_cuda.ForwardLaunchShape(0, 4, batch, 2 * dim + 4, dim, 1,
                                                                               torch.float32, torch.int64, weighted))
        try:
            for launch in launches:
                selection.force_forward(selection.CUDA + launch)
                with torch.no_grad():
                    out = module(kjt.to(DEVICE))
                assert torch.equal(out["c"], out["a"]), (launch, weighted, data_type)
        finally:
            selection.force_forward(None)
