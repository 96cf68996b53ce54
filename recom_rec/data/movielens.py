"""MovieLens-1M ratings as torchrec batches for DeepFM-style click-through models.

Two on-disk forms are read:

* the real ML-1M directory: `ratings.dat` (`UserID::MovieID::Rating::Timestamp`), `users.dat`
  (`UserID::Gender::Age::Occupation::Zip-code`), `movies.dat` (`MovieID::Title::Genres`,
  genres pipe-separated), latin-1 encoded. Users and movies (small) are loaded into memory and
  joined onto ratings, which are streamed in chunks;
* the already-joined CSV with a header, as in `shared/data/movielens_sample.csv`
  (`user_id,movie_id,rating,timestamp,title,genres,gender,age,occupation,zip`).

Features (keys of the `sparse_features` KJT, in this order):

* `user_id`, `movie_id`: the integer id modulo the table's hash size. With the default sizes
  (6041 and 3953, one more than ML-1M's largest ids) this is the identity on ML-1M.
* `zip`: a stable hash of the zip-code string (blake2b-64 of `"zip=<code>"`, modulo the hash
  size; never Python's per-process randomized `hash()`). The default 16384 rows hold ML-1M's
  3439 distinct zip codes with some collisions, which are harmless for a feature this sparse.
* `gender`, `age`, `occupation`, `genres`: closed vocabularies fixed by the ML-1M README
  (2 genders, 7 age buckets, 21 occupations, 18 genres) map to ids 1..V in the README's
  order; id 0 is reserved for a value outside the vocabulary. No pass over the data is
  needed, and ids are identical across runs and files.
* `genres` is multi-hot: one id per genre of the movie (duplicates removed), each weighted
  1 / (number of genres), so a SUM-pooled bag is the mean of its genre embeddings. The KJT
  therefore carries weights for every key: 1.0 for the single-id keys.

Dense features: one column, the rating timestamp scaled linearly to [0, 1] over ML-1M's time
span (`ML1M_TIMESTAMP_RANGE`, clipped outside it); torchrec models expect a dense input.

Label: 1.0 when rating >= 4, else 0.0 (the binarisation DeepCTR uses for DeepFM on ML-1M).
"""
from __future__ import annotations

import csv
import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ._batching import iter_row_batches
from ._text import PathLike, open_text, open_text_for_write

MOVIELENS_SPARSE_NAMES: Tuple[str, ...] = (
    "user_id", "movie_id", "gender", "age", "occupation", "zip", "genres",
)
# Closed vocabularies from the ML-1M README; a value's id is its position + 1.
ML1M_GENDERS: Tuple[str, ...] = ("F", "M")
ML1M_AGES: Tuple[str, ...] = ("1", "18", "25", "35", "45", "50", "56")
ML1M_OCCUPATIONS: Tuple[str, ...] = tuple(str(i) for i in range(21))
ML1M_GENRES: Tuple[str, ...] = (
    "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
    "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi",
    "Thriller", "War", "Western",
)
VOCABULARIES: Dict[str, Tuple[str, ...]] = {
    "gender": ML1M_GENDERS,
    "age": ML1M_AGES,
    "occupation": ML1M_OCCUPATIONS,
    "genres": ML1M_GENRES,
}
MOVIELENS_HASH_SIZES: Dict[str, int] = {
    "user_id": 6041,
    "movie_id": 3953,
    "gender": len(ML1M_GENDERS) + 1,
    "age": len(ML1M_AGES) + 1,
    "occupation": len(ML1M_OCCUPATIONS) + 1,
    "zip": 16384,
    "genres": len(ML1M_GENRES) + 1,
}
# First and last rating timestamps in ML-1M (2000-04-25 .. 2003-02-28), for the dense feature.
ML1M_TIMESTAMP_RANGE: Tuple[int, int] = (956703932, 1046454590)
POSITIVE_RATING = 4
NUM_DENSE = 1
DEFAULT_CHUNK_ROWS = 65536
ML1M_ENCODING = "latin-1"

_VOCAB_IDS: Dict[str, Dict[str, int]] = {
    key: {value: i + 1 for i, value in enumerate(vocab)} for key, vocab in VOCABULARIES.items()
}
# Widest genre bag stored per row (every genre at most once).
_GENRE_SLOTS = len(ML1M_GENRES)
_SINGLE_KEYS = MOVIELENS_SPARSE_NAMES[:-1]


@dataclass(frozen=True)
class MovieLensRating:
    """One rating joined with its user and movie (all categorical values as strings)."""

    user_id: str
    movie_id: str
    rating: int
    timestamp: int
    title: str
    genres: Tuple[str, ...]
    gender: str
    age: str
    occupation: str
    zip: str


# ---------------------------------------------------------------------------------------------
# Reading


def _split_dat(line: str, fields: int, path: Path, number: int) -> List[str]:
    parts = line.rstrip("\r\n").split("::")
    if len(parts) != fields:
        raise ValueError(f"{path}:{number}: expected {fields} '::'-separated fields, got {len(parts)}")
    return parts


def _read_ml1m_users(path: Path) -> Dict[str, Tuple[str, str, str, str]]:
    users = {}
    with open_text(path, ML1M_ENCODING) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                user_id, gender, age, occupation, zip_code = _split_dat(line, 5, path, number)
                users[user_id] = (gender, age, occupation, zip_code)
    return users


def _read_ml1m_movies(path: Path) -> Dict[str, Tuple[str, Tuple[str, ...]]]:
    movies = {}
    with open_text(path, ML1M_ENCODING) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                movie_id, title, genres = _split_dat(line, 3, path, number)
                movies[movie_id] = (title, tuple(g for g in genres.split("|") if g))
    return movies


def _iter_ml1m_directory(directory: Path) -> Iterator[MovieLensRating]:
    users = _read_ml1m_users(directory / "users.dat")
    movies = _read_ml1m_movies(directory / "movies.dat")
    ratings_path = directory / "ratings.dat"
    with open_text(ratings_path, ML1M_ENCODING) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            user_id, movie_id, rating, timestamp = _split_dat(line, 4, ratings_path, number)
            if user_id not in users:
                raise ValueError(f"{ratings_path}:{number}: user {user_id} not in users.dat")
            if movie_id not in movies:
                raise ValueError(f"{ratings_path}:{number}: movie {movie_id} not in movies.dat")
            gender, age, occupation, zip_code = users[user_id]
            title, genres = movies[movie_id]
            yield MovieLensRating(
                user_id, movie_id, int(rating), int(timestamp), title, genres,
                gender, age, occupation, zip_code,
            )


_CSV_COLUMNS = (
    "user_id", "movie_id", "rating", "timestamp", "title", "genres",
    "gender", "age", "occupation", "zip",
)


def _iter_joined_csv(path: Path) -> Iterator[MovieLensRating]:
    with open_text(path, ML1M_ENCODING) as f:
        reader = csv.DictReader(f)
        missing = [c for c in _CSV_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: joined MovieLens CSV lacks columns {missing}")
        for row in reader:
            yield MovieLensRating(
                row["user_id"], row["movie_id"], int(row["rating"]), int(row["timestamp"]),
                row["title"], tuple(g for g in row["genres"].split("|") if g),
                row["gender"], row["age"], row["occupation"], row["zip"],
            )


def iter_movielens_ratings(path: PathLike) -> Iterator[MovieLensRating]:
    """Joined ratings from an ML-1M directory (with `ratings.dat`, `users.dat`, `movies.dat`)
    or from a joined CSV file with a header (plain or gzip), in file order."""
    path = Path(path)
    if path.is_dir():
        return _iter_ml1m_directory(path)
    if not path.exists():
        raise FileNotFoundError(f"MovieLens data not found: {path}")
    return _iter_joined_csv(path)


# ---------------------------------------------------------------------------------------------
# Encoding


def stable_hash(key: str, value: str, size: int) -> int:
    """Deterministic id in [0, size) for a string value of feature `key` (blake2b, 64 bits)."""
    digest = hashlib.blake2b(f"{key}={value}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % size


def _resolve_hash_sizes(hash_sizes: Optional[Mapping[str, int]]) -> Dict[str, int]:
    sizes = dict(MOVIELENS_HASH_SIZES)
    if hash_sizes:
        unknown = set(hash_sizes) - set(sizes)
        if unknown:
            raise ValueError(f"unknown MovieLens features {sorted(unknown)}")
        sizes.update({k: int(v) for k, v in hash_sizes.items()})
    for key, vocab in VOCABULARIES.items():
        if sizes[key] < len(vocab) + 1:
            raise ValueError(
                f"hash size of {key!r} must be at least {len(vocab) + 1} (vocabulary + unknown)"
            )
    if min(sizes.values()) <= 0:
        raise ValueError(f"hash sizes must be positive, got {sizes}")
    return sizes


def _encode_genres(genres: Sequence[str]) -> List[int]:
    ids = [_VOCAB_IDS["genres"].get(g, 0) for g in genres]
    return list(dict.fromkeys(ids))[:_GENRE_SLOTS]  # dedupe, keep first-seen order


def encode_ratings(ratings: Sequence[MovieLensRating], hash_sizes: Mapping[str, int]) -> Dict[str, np.ndarray]:
    """Ratings -> columns: `ids` [n, 6] int64 (single-id keys in `MOVIELENS_SPARSE_NAMES`
    order), `genres` [n, 18] int64 padded with -1, `dense` [n, 1] float32, `labels` [n] float32."""
    n = len(ratings)
    ids = np.empty((n, len(_SINGLE_KEYS)), dtype=np.int64)
    genres = np.full((n, _GENRE_SLOTS), -1, dtype=np.int64)
    timestamps = np.empty(n, dtype=np.float64)
    labels = np.empty(n, dtype=np.float32)
    user_size, movie_size, zip_size = (hash_sizes[k] for k in ("user_id", "movie_id", "zip"))
    for i, r in enumerate(ratings):
        ids[i] = (
            int(r.user_id) % user_size,
            int(r.movie_id) % movie_size,
            _VOCAB_IDS["gender"].get(r.gender, 0),
            _VOCAB_IDS["age"].get(r.age, 0),
            _VOCAB_IDS["occupation"].get(r.occupation, 0),
            stable_hash("zip", r.zip, zip_size),
        )
        genre_ids = _encode_genres(r.genres)
        genres[i, : len(genre_ids)] = genre_ids
        timestamps[i] = r.timestamp
        labels[i] = 1.0 if r.rating >= POSITIVE_RATING else 0.0
    start, end = ML1M_TIMESTAMP_RANGE
    dense = np.clip((timestamps - start) / (end - start), 0.0, 1.0).astype(np.float32)
    return {"ids": ids, "genres": genres, "dense": dense[:, None], "labels": labels}


def _sparse_features(ids: np.ndarray, genres: np.ndarray) -> KeyedJaggedTensor:
    batch = len(ids)
    genre_lengths = (genres >= 0).sum(axis=1)
    genre_values = genres[genres >= 0]  # row-major: bag by bag
    genre_weights = np.repeat(1.0 / np.maximum(genre_lengths, 1), genre_lengths)
    values = np.concatenate([ids.T.reshape(-1), genre_values])
    lengths = np.concatenate([np.ones(ids.size, dtype=np.int64), genre_lengths])
    weights = np.concatenate([np.ones(ids.size), genre_weights]).astype(np.float32)
    return KeyedJaggedTensor(
        keys=list(MOVIELENS_SPARSE_NAMES),
        values=torch.from_numpy(values.astype(np.int64)),
        lengths=torch.from_numpy(lengths.astype(np.int32)),
        weights=torch.from_numpy(weights),
        stride=batch,
    )


def movielens_batch(columns: Mapping[str, np.ndarray]) -> Batch:
    """Encoded columns (see `encode_ratings`) -> `Batch`."""
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(columns["dense"])),
        sparse_features=_sparse_features(columns["ids"], columns["genres"]),
        labels=torch.from_numpy(np.ascontiguousarray(columns["labels"])),
    )


# ---------------------------------------------------------------------------------------------
# Batches


def _encoded_chunks(
    ratings: Iterable[MovieLensRating], sizes: Mapping[str, int], chunk_rows: int
) -> Iterator[Dict[str, np.ndarray]]:
    ratings = iter(ratings)
    while True:
        block = list(itertools.islice(ratings, chunk_rows))
        if not block:
            return
        yield encode_ratings(block, sizes)


def _batches(
    ratings: Iterable[MovieLensRating],
    batch_size: int,
    sizes: Mapping[str, int],
    drop_last: bool,
    shuffle_buffer: Optional[int],
    seed: int,
    chunk_rows: int,
) -> Iterator[Batch]:
    chunks = _encoded_chunks(ratings, sizes, chunk_rows)
    for columns in iter_row_batches(chunks, batch_size, drop_last, shuffle_buffer, seed):
        yield movielens_batch(columns)


def movielens_batches(
    path: PathLike,
    batch_size: int,
    hash_sizes: Optional[Mapping[str, int]] = None,
    drop_last: bool = False,
    shuffle_buffer: Optional[int] = None,
    seed: int = 0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> Iterator[Batch]:
    """Stream MovieLens ratings (ML-1M directory or joined CSV) as `Batch`es.

    `dense_features` [B, 1] float32 (scaled timestamp), `sparse_features` a weighted KJT with
    keys `MOVIELENS_SPARSE_NAMES` (one id per bag, except multi-hot `genres`), `labels` [B]
    float32 (rating >= 4). `hash_sizes` overrides entries of `MOVIELENS_HASH_SIZES`.
    `shuffle_buffer` shuffles rows within windows of that many rows.
    """
    sizes = _resolve_hash_sizes(hash_sizes)
    return _batches(
        iter_movielens_ratings(path), batch_size, sizes, drop_last, shuffle_buffer, seed, chunk_rows
    )


class MovieLensIterDataset(IterableDataset):
    """`IterableDataset` of MovieLens `Batch`es (see `movielens_batches`); use it with
    `DataLoader(dataset, batch_size=None)`. With several workers, chunks of `chunk_rows`
    ratings are dealt round-robin to workers, each shuffling with `seed + worker_id`."""

    def __init__(
        self,
        path: PathLike,
        batch_size: int,
        hash_sizes: Optional[Mapping[str, int]] = None,
        drop_last: bool = False,
        shuffle_buffer: Optional[int] = None,
        seed: int = 0,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        super().__init__()
        self.path = path
        self.batch_size = batch_size
        self.hash_sizes = _resolve_hash_sizes(hash_sizes)
        self.drop_last = drop_last
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.chunk_rows = chunk_rows

    def __iter__(self) -> Iterator[Batch]:
        ratings: Iterable[MovieLensRating] = iter_movielens_ratings(self.path)
        seed = self.seed
        worker = get_worker_info()
        if worker is not None and worker.num_workers > 1:
            ratings = _worker_share(ratings, self.chunk_rows, worker.id, worker.num_workers)
            seed += worker.id
        return _batches(
            ratings, self.batch_size, self.hash_sizes, self.drop_last, self.shuffle_buffer,
            seed, self.chunk_rows,
        )


def _worker_share(
    ratings: Iterable[MovieLensRating], chunk_rows: int, worker_id: int, num_workers: int
) -> Iterator[MovieLensRating]:
    """The ratings of every `num_workers`-th chunk of `chunk_rows`, starting at `worker_id`."""
    for index, rating in enumerate(ratings):
        if (index // chunk_rows) % num_workers == worker_id:
            yield rating


def movielens_table_configs(
    embedding_dim: int,
    hash_sizes: Optional[Mapping[str, int]] = None,
    pooling: PoolingType = PoolingType.SUM,
) -> List[EmbeddingBagConfig]:
    """One `EmbeddingBagConfig` per MovieLens feature (table `t_<key>`, feature `<key>`),
    sized by `hash_sizes` (defaults `MOVIELENS_HASH_SIZES`). With SUM pooling in an
    `EmbeddingBagCollection(..., is_weighted=True)` the weighted `genres` bag is the mean of
    its genre embeddings (an unweighted collection ignores KJT weights and sums them)."""
    sizes = _resolve_hash_sizes(hash_sizes)
    return [
        EmbeddingBagConfig(
            name=f"t_{key}",
            embedding_dim=embedding_dim,
            num_embeddings=sizes[key],
            feature_names=[key],
            pooling=pooling,
        )
        for key in MOVIELENS_SPARSE_NAMES
    ]


# ---------------------------------------------------------------------------------------------
# Writing (tests, examples)

UserRow = Tuple[int, str, int, int, str]  # user_id, gender, age, occupation, zip
MovieRow = Tuple[int, str, Union[str, Sequence[str]]]  # movie_id, title, genres
RatingRow = Tuple[int, int, int, int]  # user_id, movie_id, rating, timestamp


def write_movielens_1m(
    directory: PathLike,
    ratings: Iterable[RatingRow],
    users: Iterable[UserRow],
    movies: Iterable[MovieRow],
) -> Path:
    """Write `ratings.dat`, `users.dat` and `movies.dat` in the ML-1M format (`::`-separated,
    latin-1; genres given as a list are pipe-joined) into `directory`; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open_text_for_write(directory / "users.dat", ML1M_ENCODING) as f:
        for user in users:
            f.write("::".join(str(v) for v in user) + "\n")
    with open_text_for_write(directory / "movies.dat", ML1M_ENCODING) as f:
        for movie_id, title, genres in movies:
            genre_text = genres if isinstance(genres, str) else "|".join(genres)
            f.write(f"{movie_id}::{title}::{genre_text}\n")
    with open_text_for_write(directory / "ratings.dat", ML1M_ENCODING) as f:
        for rating in ratings:
            f.write("::".join(str(v) for v in rating) + "\n")
    return directory
