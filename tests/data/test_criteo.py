"""Criteo reader, writer and synthetic generator."""
import csv
import gzip
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchrec.datasets.utils import Batch

from recom_rec.data import (
    CRITEO_KAGGLE_CARDINALITIES,
    DENSE_NAMES,
    SPARSE_NAMES,
    CriteoIterDataset,
    criteo_batches,
    criteo_hash_sizes,
    iter_criteo_chunks,
    synthetic_criteo_batches,
    truncated_zipf,
    write_criteo_tsv,
)

SMALL_SIZES = [min(c, 1000) for c in CRITEO_KAGGLE_CARDINALITIES]


def read_sample_rows(path):
    """The sample parsed independently of the reader: list of dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def expected_dense(text):
    """DLRM transform written out by hand: missing/negative -> 0, then log(x + 1)."""
    value = float(text) if text else 0.0
    return math.log(max(value, 0.0) + 1.0)


def expected_id(text, size):
    return int(text, 16) % size if text else 0


def concat(batches):
    """All rows of a list of batches: dense [N, 13], ids [N, 26], labels [N]."""
    dense = torch.cat([b.dense_features for b in batches]).numpy()
    labels = torch.cat([b.labels for b in batches]).numpy()
    ids = np.concatenate([batch_ids(b) for b in batches])
    return dense, ids, labels


def batch_ids(batch):
    """[B, 26] id matrix of a batch; also checks the one-id-per-bag layout."""
    kjt = batch.sparse_features
    assert kjt.keys() == list(SPARSE_NAMES)
    assert torch.all(kjt.lengths() == 1)
    return np.stack([kjt[key].values().numpy() for key in SPARSE_NAMES], axis=1)


def random_rows(rng, n):
    rows = []
    for _ in range(n):
        dense = [
            None if rng.random() < 0.2 else int(rng.integers(-3, 100_000)) for _ in DENSE_NAMES
        ]
        cats = [
            None if rng.random() < 0.2 else int(rng.integers(0, 2**32)) for _ in SPARSE_NAMES
        ]
        rows.append((int(rng.integers(0, 2)), dense, cats))
    return rows


def expected_arrays(rows, sizes):
    dense = np.array(
        [[math.log(max(v or 0, 0) + 1) for v in d] for _, d, _ in rows], dtype=np.float32
    )
    ids = np.array(
        [[0 if v is None else v % s for v, s in zip(c, sizes)] for _, _, c in rows],
        dtype=np.int64,
    )
    labels = np.array([label for label, _, _ in rows], dtype=np.float32)
    return dense, ids, labels


# --- the shared sample (CSV with a header) ---------------------------------------------------


def test_sample_shapes_and_labels(criteo_sample):
    batches = list(criteo_batches(criteo_sample, batch_size=64, max_rows=1000))
    assert [len(b.labels) for b in batches] == [64, 64, 64, 8]
    for b in batches:
        assert isinstance(b, Batch)
        assert b.dense_features.dtype == torch.float32
        assert b.dense_features.shape == (len(b.labels), 13)
        assert b.labels.dtype == torch.float32
        assert b.sparse_features.stride() == len(b.labels)
    rows = read_sample_rows(criteo_sample)
    dense, ids, labels = concat(batches)
    assert set(np.unique(labels)) == {0.0, 1.0}
    np.testing.assert_array_equal(labels, [float(r["label"]) for r in rows])
    assert labels.sum() == 49  # positives in the sample, counted by hand


def test_sample_first_rows_known_values(criteo_sample):
    rows = read_sample_rows(criteo_sample)
    dense, ids, labels = concat(list(criteo_batches(criteo_sample, 200, max_rows=1000)))
    # Row 0: I1 missing, I3 = 260.0, C1 = 05db9164, C19 missing. Row 1: I2 = -1 (negative).
    assert dense[0, 0] == 0.0
    assert dense[0, 2] == pytest.approx(math.log(261.0))
    assert ids[0, 0] == 0x05DB9164 % 1000 == 98275684 % 1000
    assert ids[0, 18] == 0
    assert dense[1, 1] == 0.0
    assert dense[1, 4] == pytest.approx(math.log(30252.0))
    assert ids[1, 0] == 0x68FD1E64 % 1000
    for r in range(5):
        for j, name in enumerate(DENSE_NAMES):
            assert dense[r, j] == pytest.approx(expected_dense(rows[r][name]), rel=1e-6)
        for j, name in enumerate(SPARSE_NAMES):
            assert ids[r, j] == expected_id(rows[r][name], SMALL_SIZES[j])


def test_sample_whole_file_matches_independent_parse(criteo_sample):
    rows = read_sample_rows(criteo_sample)
    sizes = [97 + 10 * j for j in range(26)]  # user-given sizes, all different
    dense, ids, _ = concat(list(criteo_batches(criteo_sample, 50, hash_sizes=sizes)))
    want_dense = [[expected_dense(r[n]) for n in DENSE_NAMES] for r in rows]
    want_ids = [[expected_id(r[n], s) for n, s in zip(SPARSE_NAMES, sizes)] for r in rows]
    np.testing.assert_allclose(dense, want_dense, rtol=1e-6)
    np.testing.assert_array_equal(ids, want_ids)
    assert (dense >= 0).all()
    missing = np.array([[r[n] == "" for n in SPARSE_NAMES] for r in rows])
    assert missing.sum() == 573  # empty categoricals in the sample
    assert (ids[missing] == 0).all()


def test_sample_as_tsv_and_gz_reads_the_same(criteo_sample, tmp_path):
    rows = read_sample_rows(criteo_sample)
    as_tuples = [
        (
            int(r["label"]),
            [float(r[n]) if r[n] else None for n in DENSE_NAMES],
            [r[n] or None for n in SPARSE_NAMES],
        )
        for r in rows
    ]
    tsv, gz = tmp_path / "day_0", tmp_path / "day_0.gz"
    assert write_criteo_tsv(tsv, as_tuples) == 200
    write_criteo_tsv(gz, as_tuples)
    assert "\t" in tsv.read_text().splitlines()[0] and "," not in tsv.read_text()
    assert gzip.open(gz, "rt").read() == tsv.read_text()
    want = concat(list(criteo_batches(criteo_sample, 64, max_rows=1000)))
    for path in (tsv, gz):
        got = concat(list(criteo_batches(path, 64, max_rows=1000)))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


# --- generated real-format files -------------------------------------------------------------


def test_generated_tsv_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    rows = random_rows(rng, 300)
    path = tmp_path / "train.txt"
    write_criteo_tsv(path, rows)
    sizes = criteo_hash_sizes()
    got = concat(list(criteo_batches(path, 128)))
    for g, w in zip(got, expected_arrays(rows, sizes)):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    ids = got[1]
    assert ((ids >= 0) & (ids < np.array(sizes))).all()


def test_gz_detected_by_content_and_multiple_files(tmp_path):
    rng = np.random.default_rng(1)
    first, second = random_rows(rng, 70), random_rows(rng, 50)
    write_criteo_tsv(tmp_path / "a.gz", first)
    (tmp_path / "a.gz").rename(tmp_path / "a_compressed.bin")  # no .gz suffix any more
    write_criteo_tsv(tmp_path / "b.tsv", second)
    paths = [tmp_path / "a_compressed.bin", tmp_path / "b.tsv"]
    got = concat(list(criteo_batches(paths, 32, max_rows=500)))
    want = expected_arrays(first + second, criteo_hash_sizes(500))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_chunk_boundaries_do_not_change_batches(tmp_path):
    path = tmp_path / "t.tsv"
    write_criteo_tsv(path, random_rows(np.random.default_rng(2), 101))
    whole = list(criteo_batches(path, 10, max_rows=100))
    pieces = list(criteo_batches(path, 10, max_rows=100, chunk_rows=7))
    assert [len(b.labels) for b in pieces] == [10] * 10 + [1]
    for a, b in zip(whole, pieces):
        torch.testing.assert_close(a.dense_features, b.dense_features)
        np.testing.assert_array_equal(batch_ids(a), batch_ids(b))
    assert sum(len(c) for c in iter_criteo_chunks(path, chunk_rows=7)) == 101
    # Shards take every third chunk: together the whole file, each chunk once, in order.
    shards = [list(iter_criteo_chunks(path, 7, shard=s, num_shards=3)) for s in range(3)]
    assert [len(c) for c in shards[1]] == [7, 7, 7, 7, 7]  # chunks 1, 4, 7, 10, 13
    dealt = [shards[i % 3][i // 3] for i in range(15)]
    all_ids = np.concatenate([c.categorical for c in iter_criteo_chunks(path, 7)])
    np.testing.assert_array_equal(np.concatenate([c.categorical for c in dealt]), all_ids)


@pytest.mark.parametrize("drop_last, sizes", [(False, [32, 32, 32, 4]), (True, [32, 32, 32])])
def test_drop_last(tmp_path, drop_last, sizes):
    path = tmp_path / "t.tsv"
    write_criteo_tsv(path, random_rows(np.random.default_rng(3), 100))
    batches = list(criteo_batches(path, 32, max_rows=100, drop_last=drop_last))
    assert [len(b.labels) for b in batches] == sizes
    assert [b.dense_features.shape[0] for b in batches] == sizes
    assert [b.sparse_features.stride() for b in batches] == sizes


def test_shuffle_buffer_permutes_rows_deterministically(tmp_path):
    path = tmp_path / "t.tsv"
    rows = random_rows(np.random.default_rng(4), 250)
    write_criteo_tsv(path, rows)
    plain = concat(list(criteo_batches(path, 25, max_rows=100)))
    shuffled = [
        concat(list(criteo_batches(path, 25, max_rows=100, shuffle_buffer=100, seed=s)))
        for s in (7, 7, 8)
    ]
    for g, w in zip(shuffled[0], shuffled[1]):
        np.testing.assert_array_equal(g, w)
    assert not np.array_equal(shuffled[0][1], plain[1])
    assert not np.array_equal(shuffled[0][1], shuffled[2][1])

    def row_set(arrays):
        dense, ids, labels = arrays
        return sorted(map(tuple, np.concatenate([dense, ids, labels[:, None]], axis=1).tolist()))

    assert row_set(shuffled[0]) == row_set(plain)


def test_iter_dataset_with_dataloader(tmp_path):
    path = tmp_path / "t.tsv"
    write_criteo_tsv(path, random_rows(np.random.default_rng(5), 90))
    dataset = CriteoIterDataset(path, batch_size=16, max_rows=100, chunk_rows=20)
    direct = concat(list(criteo_batches(path, 16, max_rows=100)))
    loaded = concat(list(DataLoader(dataset, batch_size=None)))
    for g, w in zip(loaded, direct):
        np.testing.assert_array_equal(g, w)
    # Two workers split the chunks: together they see every row exactly once.
    two = concat(list(DataLoader(dataset, batch_size=None, num_workers=2)))
    assert sorted(two[2].tolist()) == sorted(direct[2].tolist())
    assert sorted(map(tuple, two[1].tolist())) == sorted(map(tuple, direct[1].tolist()))


def test_bad_files_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(criteo_batches(tmp_path / "absent.tsv", 8))
    short = tmp_path / "short.tsv"
    short.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="expected 40 fields"):
        list(criteo_batches(short, 8))
    ragged = tmp_path / "ragged.tsv"
    write_criteo_tsv(ragged, random_rows(np.random.default_rng(6), 3))
    with open(ragged, "a") as f:
        f.write("0\t1\n")
    with pytest.raises(ValueError, match="data row 4"):
        list(criteo_batches(ragged, 8))
    with pytest.raises(ValueError, match="26 hash sizes"):
        criteo_batches(short, 8, hash_sizes=[10] * 25)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 1),
            st.lists(st.one_of(st.none(), st.integers(-(2**31), 2**31)), min_size=13, max_size=13),
            st.lists(st.one_of(st.none(), st.integers(0, 2**32 - 1)), min_size=26, max_size=26),
        ),
        min_size=1,
        max_size=20,
    ),
    st.integers(1, 10_000),
)
def test_round_trip_property(tmp_path_factory, rows, max_rows):
    path = tmp_path_factory.mktemp("prop") / "rows.tsv"
    write_criteo_tsv(path, rows)
    got = concat(list(criteo_batches(path, 7, max_rows=max_rows)))
    want = expected_arrays(rows, criteo_hash_sizes(max_rows))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    assert (got[1] < max_rows).all()


# --- synthetic generator ---------------------------------------------------------------------


def test_synthetic_shapes_ranges_and_determinism():
    sizes = [3, 10, 1000, 5_000_000]
    a = list(synthetic_criteo_batches(3, 256, sizes, seed=11))
    b = list(synthetic_criteo_batches(3, 256, sizes, seed=11))
    c = list(synthetic_criteo_batches(3, 256, sizes, seed=12))
    assert len(a) == 3
    for x, y in zip(a, b):
        torch.testing.assert_close(x.dense_features, y.dense_features, rtol=0, atol=0)
        torch.testing.assert_close(x.labels, y.labels, rtol=0, atol=0)
        assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
    assert not torch.equal(a[0].sparse_features.values(), c[0].sparse_features.values())
    for batch in a + c:
        kjt = batch.sparse_features
        assert kjt.keys() == ["C1", "C2", "C3", "C4"]
        assert batch.dense_features.shape == (256, 13) and batch.labels.shape == (256,)
        assert (batch.dense_features >= 0).all()
        assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
        for key, size in zip(kjt.keys(), sizes):
            ids = kjt[key].values()
            assert torch.all(kjt[key].lengths() == 1)
            assert ids.min() >= 0 and ids.max() < size
    default = next(synthetic_criteo_batches(1, 64))
    assert default.sparse_features.keys() == list(SPARSE_NAMES)
    positive_rate = torch.cat([x.labels for x in a]).mean().item()
    assert 0.15 < positive_rate < 0.40


def test_zipf_skew_matches_the_truncated_law():
    rng = np.random.default_rng(0)
    n, a, draws = 1000, 1.05, 200_000
    ids = truncated_zipf(rng, a, n, draws)
    assert ids.min() >= 0 and ids.max() < n
    counts = np.bincount(ids, minlength=n)
    pmf = np.arange(1, n + 1) ** -a
    pmf /= pmf.sum()
    # The hottest ids are the most frequent, at the frequencies of the law.
    np.testing.assert_allclose(counts[:5] / draws, pmf[:5], rtol=0.05)
    assert counts[0] > 20 * draws / n  # far above uniform
    assert counts[:10].sum() > 0.3 * draws
    # Beyond the exact head (4096 ranks) the continuous tail keeps the law's mass.
    big = truncated_zipf(rng, a, 10_000_000, draws)
    assert big.max() < 10_000_000 and big.max() > 4096
    k = np.arange(1, 10_000_001, dtype=np.float64)
    big_pmf = k**-a / (k**-a).sum()
    assert (big >= 4096).mean() == pytest.approx(big_pmf[4096:].sum(), rel=0.03)
    assert (big == 0).mean() == pytest.approx(big_pmf[0], rel=0.05)


def test_uniform_option_is_flat():
    batches = list(synthetic_criteo_batches(10, 1000, [50] * 26, zipf_a=None, seed=3))
    ids = np.concatenate([b.sparse_features["C1"].values().numpy() for b in batches])
    counts = np.bincount(ids, minlength=50)
    assert counts.max() < 2 * counts.min()


def _auc(scores, labels):
    """Mann-Whitney AUC (no ties expected in float scores)."""
    order = np.argsort(scores)
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels == 1
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return (ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def test_synthetic_signal_is_learnable():
    import torchrec

    torch.manual_seed(0)
    sizes = [200] * 26
    tables = [
        torchrec.EmbeddingBagConfig(
            name=f"t_{k}", embedding_dim=4, num_embeddings=s, feature_names=[k]
        )
        for k, s in zip(SPARSE_NAMES, sizes)
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=tables)
    head = torch.nn.Linear(13 + 26 * 4, 1)
    opt = torch.optim.Adam(list(ebc.parameters()) + list(head.parameters()), lr=0.02)

    def logits(batch):
        pooled = ebc(batch.sparse_features).values()
        return head(torch.cat([batch.dense_features, pooled], dim=1)).squeeze(1)

    for batch in synthetic_criteo_batches(150, 512, sizes, seed=0):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(batch), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Held-out data: another seed, same labelling function.
    with torch.no_grad():
        held_out = list(synthetic_criteo_batches(4, 2048, sizes, seed=1))
        scores = torch.cat([logits(b) for b in held_out]).numpy()
    labels = torch.cat([b.labels for b in held_out]).numpy()
    assert _auc(scores, labels) > 0.65
