"""The unpooled lookup's kernels, Triton's and (on a GPU) the CUDA extension's
(csrc/lookup/unpooled.cu), against the torch reference (ops/unpooled_torch.py): the forward's
rows, bit for bit, and the row keys, at random features and dims (odd ones, rows off a 16-byte
boundary), fp32/fp16/bf16 tables, int32/int64 ids, features without ids, and a bad id reported with
its feature and batch index."""
import random

import pytest
import torch

from ebc_cases import DEVICE
from recom_rec.kernels import unpooled_triton
from recom_rec.ops import unpooled_torch
from recom_rec.ops.backends import triton_interpreting
from recom_rec.ops.input_check import KernelReport
from recom_rec.ops.layout import META_DIM, META_NUM_EMBEDDINGS, META_ROW_BASE, META_WIDTH
from recom_rec.ops.unpooled_embedding import segments_for

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda" and not triton_interpreting(),
                                reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")

# "cuda-host": the extension's kernels given the batch's tables in host memory, as the eager
# EmbeddingCollection passes them (in the launch's parameters, or copied over when too many)
IMPLS = ["triton"] + (["cuda", "cuda-host"] if DEVICE.type == "cuda" else [])


def _extension():
    from recom_rec.kernels import cuda_ext

    return cuda_ext.extension()


def forward(impl, flat, values, segments, meta, offsets, total, dim, check=None):
    if impl == "triton":
        return unpooled_triton.forward(flat, values, segments, meta, offsets, total, dim, check=check)
    segments = segments.cpu() if impl == "cuda-host" else segments
    return _extension().unpooled_forward(flat, values, segments, meta, total, dim,
                                         offsets if check is not None else None,
                                         None if check is None else check.claim,
                                         None if check is None else check.words, None)


def row_keys(impl, values, segments, meta, total, offsets=None, check=None):
    if impl == "triton":
        return unpooled_triton.row_keys(values, segments, meta, total, offsets, check)
    segments = segments.cpu() if impl == "cuda-host" else segments
    return _extension().unpooled_row_keys(values, segments, meta, total, None,
                                          offsets if check is not None else None,
                                          None if check is None else check.claim,
                                          None if check is None else check.words)[0]


def _group(rng, dim, dtype, id_dtype, batch, shifted, num_features=None):
    """A group of features over tables of ``dim``: their flat buffer (``shifted``: its rows one
    element off a 16-byte boundary), KJT values and offsets, segments and metadata."""
    num_features = num_features or rng.randint(1, 6)
    rows = [rng.randint(1, 50) for _ in range(num_features)]
    lengths = [[0 if rng.random() < 0.2 else rng.randint(1, 5) for _ in range(batch)] for _ in range(num_features)]
    if rng.random() < 0.3:
        lengths[rng.randrange(num_features)] = [0] * batch  # a feature without ids
    counts = [sum(x) for x in lengths]
    values = torch.tensor([rng.randrange(rows[f]) for f in range(num_features) for _ in range(counts[f])],
                          dtype=id_dtype)
    offsets = torch.tensor([0] + [sum(sum(x) for x in lengths[:f]) + sum(lengths[f][:b + 1])
                                  for f in range(num_features) for b in range(batch)], dtype=id_dtype)
    total_rows = sum(rows)
    storage = torch.randn(total_rows * dim + 1).to(dtype)
    flat = storage[1:] if shifted else storage[:-1]
    meta = torch.zeros(num_features, META_WIDTH, dtype=torch.int64)
    meta[:, META_DIM] = dim
    meta[:, META_NUM_EMBEDDINGS] = torch.tensor(rows)
    meta[:, META_ROW_BASE] = torch.tensor([sum(rows[:f]) for f in range(num_features)])
    starts = [sum(counts[:f]) for f in range(num_features)]
    segments = segments_for(list(range(num_features)), counts, starts, [batch] * num_features, DEVICE)
    return (flat.to(DEVICE), values.to(DEVICE), offsets.to(DEVICE), segments, meta.to(DEVICE), counts, rows)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(8))
def test_forward_and_row_keys_equal_the_reference(impl, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for dim in rng.sample([1, 3, 4, 6, 8, 12, 33, 76, 128, 260], 3):
        dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        id_dtype = rng.choice([torch.int32, torch.int64])
        # seed 0: more features than a launch's parameters hold (the tables read from the device)
        flat, values, offsets, segments, meta, counts, _ = _group(rng, dim, dtype, id_dtype, rng.randint(1, 9),
                                                                  shifted=rng.random() < 0.4,
                                                                  num_features=120 if seed == 0 else None)
        total = sum(counts)
        got = forward(impl, flat, values, segments, meta, offsets, total, dim)
        want = unpooled_torch.forward(flat, values, segments, meta, total, dim)
        assert got.dtype == torch.float32 and got.shape == (total, dim)
        assert torch.equal(got, want), (dim, dtype, id_dtype)
        assert torch.equal(row_keys(impl, values, segments, meta, total),
                           unpooled_torch.row_keys(values, segments, meta, total))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kernel", ["forward", "row_keys"])
def test_a_bad_id_is_reported_with_its_feature_and_batch_index(impl, kernel):
    rng = random.Random(7)
    batch = 5
    while True:
        flat, values, offsets, segments, meta, counts, rows = _group(rng, 8, torch.float32, torch.int64, batch, False)
        if len(counts) >= 2 and counts[-1] > 0:
            break
    feature = len(counts) - 1
    position = sum(counts) - 1  # the last feature's last id: its last non-empty bag
    values[position] = rows[feature] + 3
    ends = offsets[1 + feature * batch:1 + (feature + 1) * batch].tolist()
    bag = next(b for b in range(batch) if ends[b] > position)
    check = KernelReport(DEVICE, "f,t")
    total = sum(counts)
    if kernel == "forward":
        out = forward(impl, flat, values, segments, meta, offsets, total, 8, check)
        assert torch.equal(out[position], flat[int(meta[feature, META_ROW_BASE]) * 8:][:8].float())  # row 0
    else:
        keys = row_keys(impl, values, segments, meta, total, offsets, check)
        assert int(keys[position]) == int(meta[feature, META_ROW_BASE])
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert check.words.tolist()[:6] == [1, feature, bag, rows[feature] + 3, rows[feature], values.numel()]
