"""MovieLens-1M reader (.dat directory and joined CSV) and its DeepFM features."""
import csv
import gzip
import hashlib

import numpy as np
import pytest
import torch
import torchrec
from torch.utils.data import DataLoader
from torchrec.datasets.utils import Batch

from recom_rec.data import (
    MOVIELENS_HASH_SIZES,
    MOVIELENS_SPARSE_NAMES,
    MovieLensIterDataset,
    iter_movielens_ratings,
    movielens_batches,
    movielens_table_configs,
    stable_hash,
    write_movielens_1m,
)

SINGLE_KEYS = ["user_id", "movie_id", "gender", "age", "occupation", "zip"]


def read_sample_rows(path):
    with open(path, newline="", encoding="latin-1") as f:
        return list(csv.DictReader(f))


def zip_id(code, size=16384):
    """The documented zip hash, written out independently of the reader."""
    digest = hashlib.blake2b(f"zip={code}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % size


def features(batches):
    """Per key: (values, lengths, weights) over all batches; labels; dense."""
    out = {}
    for key in MOVIELENS_SPARSE_NAMES:
        jts = [b.sparse_features[key] for b in batches]
        out[key] = (
            torch.cat([j.values() for j in jts]).numpy(),
            torch.cat([j.lengths() for j in jts]).numpy(),
            torch.cat([j.weights() for j in jts]).numpy(),
        )
    labels = torch.cat([b.labels for b in batches]).numpy()
    dense = torch.cat([b.dense_features for b in batches]).numpy()
    return out, labels, dense


def assert_same_batches(a, b):
    assert [len(x.labels) for x in a] == [len(y.labels) for y in b]
    fa, la, da = features(a)
    fb, lb, db = features(b)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(da, db)
    for key in MOVIELENS_SPARSE_NAMES:
        for x, y in zip(fa[key], fb[key]):
            np.testing.assert_array_equal(x, y)


def sample_as_ml1m(rows, directory):
    """Split joined sample rows back into the three ML-1M .dat files."""
    users = {r["user_id"]: (r["user_id"], r["gender"], r["age"], r["occupation"], r["zip"]) for r in rows}
    movies = {r["movie_id"]: (r["movie_id"], r["title"], r["genres"]) for r in rows}
    ratings = [(r["user_id"], r["movie_id"], r["rating"], r["timestamp"]) for r in rows]
    return write_movielens_1m(directory, ratings, users.values(), movies.values())


# --- the shared sample (joined CSV) ----------------------------------------------------------


def test_sample_shapes_labels_and_layout(movielens_sample):
    rows = read_sample_rows(movielens_sample)
    batches = list(movielens_batches(movielens_sample, batch_size=64))
    assert [len(b.labels) for b in batches] == [64, 64, 64, 8]
    for b in batches:
        assert isinstance(b, Batch)
        assert b.dense_features.shape == (len(b.labels), 1)
        assert b.dense_features.dtype == b.labels.dtype == torch.float32
        kjt = b.sparse_features
        assert kjt.keys() == list(MOVIELENS_SPARSE_NAMES)
        assert kjt.stride() == len(b.labels)
        assert kjt.weights().dtype == torch.float32
    feats, labels, dense = features(batches)
    want = [1.0 if int(r["rating"]) >= 4 else 0.0 for r in rows]
    np.testing.assert_array_equal(labels, want)
    assert labels.sum() == 113  # 65 fours + 48 fives in the sample
    assert ((dense >= 0) & (dense <= 1)).all()
    for key in SINGLE_KEYS:
        values, lengths, weights = feats[key]
        assert (lengths == 1).all() and (weights == 1).all()
        assert ((values >= 0) & (values < MOVIELENS_HASH_SIZES[key])).all()
    values, lengths, weights = feats["genres"]
    np.testing.assert_array_equal(lengths, [len(r["genres"].split("|")) for r in rows])
    assert lengths.max() == 5  # the sample's largest genre bag
    bag_sums = np.add.reduceat(weights, np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    np.testing.assert_allclose(bag_sums, 1.0, rtol=1e-6)


def test_sample_first_rows_known_values(movielens_sample):
    feats, labels, dense = features(list(movielens_batches(movielens_sample, 200)))
    # Row 0: 3299, 235, rating 4, 968035345, Ed Wood (1994), Comedy|Drama, F, 25, 4, 19119
    assert feats["user_id"][0][0] == 3299
    assert feats["movie_id"][0][0] == 235
    assert feats["gender"][0][0] == 1  # F is the first gender of the ML-1M README
    assert feats["age"][0][0] == 3  # ages 1, 18, 25, ...: 25 is the third
    assert feats["occupation"][0][0] == 5  # occupations 0..20 map to 1..21
    assert feats["zip"][0][0] == zip_id("19119") == 5196  # pinned: stable across runs
    np.testing.assert_array_equal(feats["genres"][0][:2], [5, 8])  # Comedy, Drama
    np.testing.assert_allclose(feats["genres"][2][:2], [0.5, 0.5])
    assert labels[0] == 1.0
    assert dense[0, 0] == pytest.approx((968035345 - 956703932) / (1046454590 - 956703932))
    # Row 1: 3630, 3256, rating 3, Action|Thriller, M, 18, 4, 77005
    assert labels[1] == 0.0
    assert feats["user_id"][0][1] == 3630 and feats["gender"][0][1] == 2
    assert feats["age"][0][1] == 2 and feats["zip"][0][1] == zip_id("77005")
    np.testing.assert_array_equal(feats["genres"][0][2:4], [1, 16])  # Action, Thriller


def test_stable_hash_is_pinned():
    # Fixed values: ids must not depend on the process (unlike Python's hash()).
    assert stable_hash("zip", "19119", 16384) == 5196
    assert stable_hash("zip", "02136-1522", 16384) == zip_id("02136-1522")
    assert stable_hash("zip", "19119", 16384) != stable_hash("user", "19119", 16384)


# --- the real ML-1M .dat format --------------------------------------------------------------


def test_dat_directory_reads_like_the_joined_csv(movielens_sample, tmp_path):
    rows = read_sample_rows(movielens_sample)
    directory = sample_as_ml1m(rows, tmp_path / "ml-1m")
    assert (directory / "ratings.dat").read_text().startswith("3299::235::4::968035345\n")
    assert_same_batches(
        list(movielens_batches(directory, 50)), list(movielens_batches(movielens_sample, 50))
    )


def test_dat_latin1_join_and_gzip_csv(tmp_path):
    users = [(1, "F", 1, 10, "48067"), (2, "M", 56, 16, "70072-1234")]
    movies = [
        (1, "Toy Story (1995)", ["Animation", "Children's", "Comedy"]),
        (2, "Cité des enfants perdus, La (1995)", "Adventure|Sci-Fi"),
    ]
    ratings = [(1, 1, 5, 978300760), (2, 2, 3, 978298413), (1, 2, 4, 978824291)]
    directory = write_movielens_1m(tmp_path / "ml", ratings, users, movies)
    assert "Cit\xe9".encode("latin-1") in (directory / "movies.dat").read_bytes()
    joined = list(iter_movielens_ratings(directory))
    assert [(r.user_id, r.movie_id, r.rating) for r in joined] == [("1", "1", 5), ("2", "2", 3), ("1", "2", 4)]
    assert joined[1].title == "Cité des enfants perdus, La (1995)"
    assert joined[1].genres == ("Adventure", "Sci-Fi") and joined[1].zip == "70072-1234"
    assert joined[2].gender == "F" and joined[2].age == "1"

    csv_path = tmp_path / "joined.csv.gz"
    with gzip.open(csv_path, "wt", encoding="latin-1", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "movie_id", "rating", "timestamp", "title", "genres", "gender", "age", "occupation", "zip"])
        for r in joined:
            writer.writerow([r.user_id, r.movie_id, r.rating, r.timestamp, r.title, "|".join(r.genres), r.gender, r.age, r.occupation, r.zip])
    assert list(iter_movielens_ratings(csv_path)) == joined
    from_dat = list(movielens_batches(directory, 2))
    assert_same_batches(from_dat, list(movielens_batches(csv_path, 2)))
    feats, labels, _ = features(from_dat)
    np.testing.assert_array_equal(labels, [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(feats["genres"][1], [3, 2, 2])  # bag sizes
    np.testing.assert_array_equal(feats["genres"][0], [3, 4, 5, 2, 15, 2, 15])
    np.testing.assert_array_equal(feats["age"][0], [1, 7, 1])
    np.testing.assert_array_equal(feats["occupation"][0], [11, 17, 11])


def test_unknown_values_duplicate_and_empty_genres(tmp_path):
    users = [(7, "X", 99, 30, "00000")]  # gender, age, occupation outside the vocabularies
    movies = [(5, "A (2000)", "Drama|Drama|Nonexistent"), (6, "B (2000)", "")]
    directory = write_movielens_1m(tmp_path, [(7, 5, 2, 1), (7, 6, 4, 2)], users, movies)
    feats, _, dense = features(list(movielens_batches(directory, 8)))
    for key in ("gender", "age", "occupation"):
        np.testing.assert_array_equal(feats[key][0], [0, 0])
    values, lengths, weights = feats["genres"]
    np.testing.assert_array_equal(lengths, [2, 0])  # duplicate Drama once; no genres: empty bag
    np.testing.assert_array_equal(values, [8, 0])
    np.testing.assert_allclose(weights, [0.5, 0.5])
    np.testing.assert_array_equal(dense[:, 0], [0.0, 0.0])  # before ML-1M's span: clipped


@pytest.mark.parametrize("drop_last, sizes", [(False, [64, 64, 64, 8]), (True, [64, 64, 64])])
def test_drop_last(movielens_sample, drop_last, sizes):
    batches = list(movielens_batches(movielens_sample, 64, drop_last=drop_last, chunk_rows=30))
    assert [len(b.labels) for b in batches] == sizes
    assert [b.sparse_features.stride() for b in batches] == sizes


def test_shuffle_and_dataloader(movielens_sample):
    plain = list(movielens_batches(movielens_sample, 32))
    shuffled = list(movielens_batches(movielens_sample, 32, shuffle_buffer=64, seed=1))
    again = list(MovieLensIterDataset(movielens_sample, 32, shuffle_buffer=64, seed=1))
    assert_same_batches(shuffled, again)
    fp, lp, dp = features(plain)
    fs, ls, ds = features(shuffled)
    assert not np.array_equal(fs["user_id"][0], fp["user_id"][0])
    assert sorted(zip(fs["user_id"][0], fs["movie_id"][0], ds[:, 0])) == sorted(
        zip(fp["user_id"][0], fp["movie_id"][0], dp[:, 0])
    )
    loaded = list(DataLoader(MovieLensIterDataset(movielens_sample, 32), batch_size=None))
    assert_same_batches(loaded, plain)


def test_hash_size_overrides(movielens_sample):
    feats, _, _ = features(list(movielens_batches(movielens_sample, 100, hash_sizes={"user_id": 100, "zip": 7})))
    assert feats["user_id"][0].max() < 100 and feats["zip"][0].max() < 7
    assert feats["user_id"][0][0] == 3299 % 100
    with pytest.raises(ValueError, match="at least 3"):
        movielens_batches(movielens_sample, 8, hash_sizes={"gender": 2})
    with pytest.raises(ValueError, match="unknown"):
        movielens_batches(movielens_sample, 8, hash_sizes={"rating": 5})


def test_bad_inputs_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(movielens_batches(tmp_path / "absent.csv", 8))
    directory = write_movielens_1m(tmp_path / "ml", [(9, 1, 5, 1)], [(1, "F", 1, 0, "1")], [(1, "T", "Drama")])
    with pytest.raises(ValueError, match="user 9 not in users.dat"):
        list(movielens_batches(directory, 8))
    bad = tmp_path / "bad.csv"
    bad.write_text("user_id,movie_id\n1,2\n")
    with pytest.raises(ValueError, match="lacks columns"):
        list(movielens_batches(bad, 8))


def test_table_configs_drive_a_weighted_collection(movielens_sample):
    configs = movielens_table_configs(embedding_dim=4, hash_sizes={"zip": 1000})
    assert [c.feature_names for c in configs] == [[k] for k in MOVIELENS_SPARSE_NAMES]
    sizes = dict(MOVIELENS_HASH_SIZES, zip=1000)
    assert [c.num_embeddings for c in configs] == [sizes[k] for k in MOVIELENS_SPARSE_NAMES]
    assert all(c.embedding_dim == 4 for c in configs)
    ebc = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=True)
    batch = next(iter(movielens_batches(movielens_sample, 16, hash_sizes={"zip": 1000})))
    pooled = ebc(batch.sparse_features)
    assert pooled.values().shape == (16, 4 * len(MOVIELENS_SPARSE_NAMES))
    # genres pool to the mean of the genre embeddings (row 0: Comedy, Drama).
    table = ebc.embedding_bags["t_genres"].weight
    torch.testing.assert_close(pooled["genres"][0], (table[5] + table[8]) / 2)
