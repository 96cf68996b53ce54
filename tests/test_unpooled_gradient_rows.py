"""The EmbeddingCollection's eager backward reads each output row's gradient where autograd left it
(ops/unpooled_embedding._gradient_rows): the row-key kernel writes where each row's gradient
starts (unpooled_triton.backward_rows, and the CUDA extension's on a GPU) from each feature's start and stride, the same rows as torch
ops over them (_torch_rows), and they hold each feature's gradient (a zero row for a feature
without one). Also the cached arange that gives the backward's one-id bags their offsets."""
import random

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE
from recom_rec.kernels import unpooled_triton
from recom_rec.ops import unpooled_torch
from recom_rec.ops.backends import triton_interpreting
from recom_rec.ops.layout import META_NUM_EMBEDDINGS, META_ROW_BASE, META_WIDTH
from recom_rec.ops.segments import segment_ids
from recom_rec.ops.unpooled_embedding import _ARANGES, _arange_prefix, _gradient_rows, segments_for

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda" and not triton_interpreting(),
                                reason="the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")


def _group(rng, num_features, counts):
    """A group's ids, segments and feature metadata for features of ``counts`` ids."""
    rows = [rng.randint(1, 40) for _ in range(num_features)]
    values = torch.tensor([rng.randrange(rows[f]) for f in range(num_features) for _ in range(counts[f])],
                          dtype=torch.int64)
    strides = [rng.randint(1, 8) for _ in range(num_features)]  # bags per key (variable batch)
    starts = [sum(counts[:f]) for f in range(num_features)]
    segments = segments_for(list(range(num_features)), counts, starts, strides, DEVICE)
    meta = torch.zeros(num_features, META_WIDTH, dtype=torch.int64)
    meta[:, META_NUM_EMBEDDINGS] = torch.tensor(rows)
    meta[:, META_ROW_BASE] = torch.tensor([sum(rows[:f]) for f in range(num_features)])
    return values.to(DEVICE), segments, meta.to(DEVICE)


def _gradients(rng, counts, dim):
    """Each feature's gradient as autograd may leave it: a view of one block (split outputs), a
    tensor of its own, a strided one, none; and the block the rows should read."""
    block = torch.randn(sum(counts), dim, device=DEVICE)
    grads, want, first = [], [], 0
    for n in counts:
        kind = rng.choice(["view", "view", "own", "strided", "none"])
        if kind == "view":
            g = block[first:first + n]
        elif kind == "own":
            g = torch.randn(n, dim, device=DEVICE)
        elif kind == "strided":
            g = torch.randn(n, dim + 3, device=DEVICE)[:, 1:dim + 1]
        else:
            g = None
        grads.append(g)
        want.append(g if g is not None else torch.zeros(n, dim, device=DEVICE))
        first += n
    return grads, torch.cat(want)


def _torch_rows(table, total):
    """Row r of feature f at ``start[f] + r * stride[f]`` (``table``: int64 ``[3, F]``, each
    feature's start, stride and rows), by torch ops: the kernel's reference."""
    row = torch.arange(total, dtype=torch.int64, device=table.device)
    feature = segment_ids(table[2], row)
    return table[0][feature] + row * table[1][feature]


def _read(base, rows, held, dim):
    """The gradient rows ``rows`` name (in elements from ``base``'s start), read from the tensors
    holding them."""
    out = []
    for r in rows.tolist():
        at = base.data_ptr() + 4 * r
        t = next(t for t in held if t.data_ptr() <= at < t.data_ptr() + 4 * t.numel())
        start = (at - t.data_ptr()) // 4
        out.append(t.reshape(-1)[start:start + dim])
    return torch.stack(out)


def _backward_rows(impl, values, segments, meta, total, table):
    """(row keys, gradient rows) by Triton's kernel or the CUDA extension's (csrc/lookup/unpooled.cu)."""
    if impl == "triton":
        return unpooled_triton.backward_rows(values, segments, meta, total, table)
    from recom_rec.kernels import cuda_ext

    if impl == "cuda-host":  # the tables in host memory, as the eager EmbeddingCollection's backward passes them
        segments, table = segments.cpu(), table.cpu()
    return tuple(cuda_ext.extension().unpooled_row_keys(values, segments, meta, total, table, None, None, None))


@pytest.mark.parametrize("impl", ["triton"] + (["cuda", "cuda-host"] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("seed", range(10))
def test_kernel_rows_equal_the_torch_rows(impl, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dim = rng.choice([1, 3, 4, 6, 8, 16, 33])
    num_features = 80 if seed == 1 else rng.randint(1, 12)  # (seed 1: a table past the launch parameters)
    for batch in (1, 7, 60):  # several batches of one group
        counts = [0 if rng.random() < 0.25 else rng.randint(1, 3 * batch) for _ in range(num_features)]
        if seed == 0 and batch == 60:
            counts[0] = 1500  # more rows than a program's block
        total = sum(counts)
        if total == 0:
            continue
        values, segments, meta = _group(rng, num_features, counts)
        grads, want = _gradients(rng, counts, dim)

        base, found, held = _gradient_rows(grads, counts, dim, DEVICE)
        assert found.num_outputs == total
        keys, rows = _backward_rows(impl, values, segments, meta, total, found.table)
        # torch ops over the same starts and strides, features found by their sizes
        sizes = torch.tensor([counts], dtype=torch.int64, device=DEVICE)
        assert torch.equal(rows, _torch_rows(torch.cat([found.table, sizes]), total))
        assert torch.equal(keys, unpooled_torch.row_keys(values, segments, meta, total))
        assert torch.equal(_read(base, rows, held, dim), want)

        # any starts and strides, 64-bit
        table = torch.stack([torch.randint(-(1 << 40), 1 << 40, (num_features,)),
                             torch.randint(0, 2, (num_features,)) * dim]).to(DEVICE)
        _, rows = _backward_rows(impl, values, segments, meta, total, table)
        assert torch.equal(rows, _torch_rows(torch.cat([table, sizes]), total))


def test_the_module_backward_takes_the_kernel_rows(monkeypatch):
    """(not the torch ops of a whole block: a regression there would only cost host time)"""
    calls = []
    kernel = unpooled_triton.backward_rows
    monkeypatch.setattr(unpooled_triton, "backward_rows", lambda *a: calls.append(1) or kernel(*a))
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20, feature_names=[f"f{i}", f"g{i}"])
              for i in range(2)]
    module = recom_rec.EmbeddingCollection(tables=tables, device=DEVICE, backend="triton")
    module.enable_fused_optimizer("sgd", lr=0.1)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "g0", "f1", "g1"], values=torch.arange(10) % 20,
                                              lengths=torch.tensor([1, 2, 0, 1, 0, 0, 3, 3])).to(DEVICE)
    out = module(kjt)
    sum(jt.values().sum() for name, jt in out.items() if name != "g0").backward()  # g0 without a gradient
    assert calls == [1]


def test_cached_arange_slices_equal_arange():
    for dtype in (torch.int64, torch.int32):
        for n in (0, 1, 5, 3, 1000, 17, 4097, 2, 4097):
            got = _arange_prefix(n, DEVICE, dtype)
            assert got.dtype == dtype and torch.equal(got, torch.arange(n, dtype=dtype, device=DEVICE))
    shorter, longer = _arange_prefix(10, DEVICE, torch.int64), _arange_prefix(4000, DEVICE, torch.int64)
    assert shorter.data_ptr() == longer.data_ptr()  # one buffer until a longer one is asked for


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA graph capture")
def test_no_cached_arange_while_capturing():
    """(a replay would read the cached buffer after a growth had dropped it)"""
    before = dict(_ARANGES)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _arange_prefix(1 << 22, DEVICE, torch.int64)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, torch.arange(1 << 22, device=DEVICE))
    assert _ARANGES.keys() == before.keys() and all(_ARANGES[k] is v for k, v in before.items())
