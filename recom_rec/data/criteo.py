"""Criteo click logs as torchrec batches: a streaming reader, a writer and a synthetic generator.

Two on-disk forms are read:

* the real Criteo form (Kaggle Display Advertising Challenge, Terabyte): tab-separated, no
  header, `label \\t I1..I13 \\t C1..C26`, optionally gzip-compressed;
* the comma-separated form with a header line, as in `shared/data/criteo_sample.csv`.

The form is sniffed from the first line (a tab means the real form; a first field `label`
means a header), so file names do not matter. Files are streamed in chunks of rows.

Preprocessing follows the DLRM reference (facebookresearch/dlrm, `data_utils.py`):

* dense `I1..I13`: missing -> 0, negative -> 0, then `log(x + 1)`;
* categorical `C1..C26`: the hex string is a 32-bit hash, parsed as an integer and reduced
  modulo the table's hash size (`num_embeddings`). A missing value becomes id 0. Id 0 is
  therefore shared by "missing" and by every value whose hash is a multiple of the table
  size; DLRM makes the same choice (it treats a missing value as the hash 0).
"""
from __future__ import annotations

import csv
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch

from ._batching import iter_row_batches, one_id_per_bag_kjt
from ._text import PathLike, open_text, open_text_for_write

# Criteo Kaggle categorical cardinalities, C1..C26, from the DLRM reference preprocessing.
CRITEO_KAGGLE_CARDINALITIES: Tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
DENSE_NAMES: Tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
SPARSE_NAMES: Tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
LABEL_NAME = "label"
NUM_DENSE = len(DENSE_NAMES)
NUM_SPARSE = len(SPARSE_NAMES)
NUM_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE

# Raw categorical value standing for "missing" before hashing (real hashes are >= 0).
MISSING_CATEGORICAL = -1
DEFAULT_CHUNK_ROWS = 65536

Paths = Union[PathLike, Sequence[PathLike]]


def criteo_hash_sizes(max_rows: Optional[int] = None) -> List[int]:
    """Per-table hash sizes C1..C26: the Kaggle cardinalities, each capped at `max_rows`."""
    if max_rows is None:
        return list(CRITEO_KAGGLE_CARDINALITIES)
    if max_rows <= 0:
        raise ValueError(f"max_rows must be positive, got {max_rows}")
    return [min(c, max_rows) for c in CRITEO_KAGGLE_CARDINALITIES]


def _resolve_hash_sizes(
    hash_sizes: Optional[Sequence[int]], max_rows: Optional[int]
) -> List[int]:
    if hash_sizes is None:
        return criteo_hash_sizes(max_rows)
    sizes = [int(s) for s in hash_sizes]
    if len(sizes) != NUM_SPARSE:
        raise ValueError(f"expected {NUM_SPARSE} hash sizes (C1..C26), got {len(sizes)}")
    if min(sizes) <= 0:
        raise ValueError(f"hash sizes must be positive, got {sizes}")
    if max_rows is not None:
        sizes = [min(s, max_rows) for s in sizes]
    return sizes


# ---------------------------------------------------------------------------------------------
# Parsing


@dataclass
class CriteoChunk:
    """Raw rows as parsed, before preprocessing.

    labels: [n] float32 (0 or 1); dense: [n, 13] float64 with NaN for missing;
    categorical: [n, 26] int64 hashes with `MISSING_CATEGORICAL` (-1) for missing.
    """

    labels: np.ndarray
    dense: np.ndarray
    categorical: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def _column_order(first_row: List[str]) -> Tuple[bool, List[int]]:
    """(has_header, indices of label, I1..I13, C1..C26 in each row)."""
    if first_row and first_row[0].strip() == LABEL_NAME:
        position = {name.strip(): i for i, name in enumerate(first_row)}
        wanted = (LABEL_NAME,) + DENSE_NAMES + SPARSE_NAMES
        missing = [name for name in wanted if name not in position]
        if missing:
            raise ValueError(f"Criteo header lacks columns {missing}")
        return True, [position[name] for name in wanted]
    return False, list(range(NUM_COLUMNS))


def _parse_rows(rows: List[List[str]], order: List[int], width: int, first_row: int) -> CriteoChunk:
    for offset, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(
                f"data row {first_row + offset}: expected {width} fields, got {len(row)}"
            )
    columns = list(zip(*rows))
    labels = np.array([float(v) for v in columns[order[0]]], dtype=np.float32)
    dense = np.empty((len(rows), NUM_DENSE), dtype=np.float64)
    for j in range(NUM_DENSE):
        dense[:, j] = [float(v) if v else math.nan for v in columns[order[1 + j]]]
    categorical = np.empty((len(rows), NUM_SPARSE), dtype=np.int64)
    for j in range(NUM_SPARSE):
        categorical[:, j] = [
            int(v, 16) if v else MISSING_CATEGORICAL for v in columns[order[1 + NUM_DENSE + j]]
        ]
    return CriteoChunk(labels=labels, dense=dense, categorical=categorical)


def iter_criteo_chunks(
    path: PathLike,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    shard: int = 0,
    num_shards: int = 1,
) -> Iterator[CriteoChunk]:
    """Stream one Criteo file (TSV or CSV-with-header, plain or gzip) as raw chunks of at most
    `chunk_rows` rows. Blank lines are skipped; a row with the wrong field count raises.

    With `num_shards` > 1 only chunks number `shard`, `shard + num_shards`, ... are parsed and
    yielded (the others are read past unparsed), so parallel readers split the parsing work.
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= shard < num_shards, got {shard}, {num_shards}")
    with open_text(path) as f:
        first_line = f.readline()
        if not first_line.strip():
            return
        delimiter = "\t" if "\t" in first_line else ","
        # Real Criteo files never quote fields; QUOTE_NONE keeps a stray '"' from swallowing
        # the following lines.
        quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
        reader = csv.reader(itertools.chain([first_line], f), delimiter=delimiter, quoting=quoting)
        first_row = next(reader)
        has_header, order = _column_order(first_row)
        width = len(first_row)
        if not has_header and width != NUM_COLUMNS:
            raise ValueError(
                f"{path}: expected {NUM_COLUMNS} fields (label, I1..I13, C1..C26), got {width}"
            )
        leading = [] if has_header else [first_row]
        rows = (row for row in itertools.chain(leading, reader) if row)  # skip blank lines
        row_number = 1
        for index in itertools.count():
            block = list(itertools.islice(rows, chunk_rows))
            if not block:
                return
            if index % num_shards == shard:
                yield _parse_rows(block, order, width, row_number)
            row_number += len(block)


# ---------------------------------------------------------------------------------------------
# Preprocessing


def preprocess_dense(raw: np.ndarray) -> np.ndarray:
    """DLRM dense transform: missing (NaN) and negative values -> 0, then log(x + 1); float32."""
    clean = np.nan_to_num(np.asarray(raw, dtype=np.float64), nan=0.0)
    return np.log1p(np.maximum(clean, 0.0)).astype(np.float32)


def hash_categorical(raw: np.ndarray, hash_sizes: Sequence[int]) -> np.ndarray:
    """Raw 32-bit hashes [n, tables] -> ids modulo each table's size; missing (-1) -> id 0."""
    raw = np.asarray(raw, dtype=np.int64)
    sizes = np.asarray(hash_sizes, dtype=np.int64)
    return np.where(raw == MISSING_CATEGORICAL, 0, raw % sizes)


def batch_from_arrays(
    dense: np.ndarray, ids: np.ndarray, labels: np.ndarray, keys: Sequence[str] = SPARSE_NAMES
) -> Batch:
    """Preprocessed arrays (dense [B, 13] float32, ids [B, 26] int64, labels [B]) -> Batch."""
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse_features=one_id_per_bag_kjt(keys, ids),
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
    )


# ---------------------------------------------------------------------------------------------
# Batches


def _as_path_list(paths: Paths) -> List[PathLike]:
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        return [paths]  # type: ignore[list-item]
    return list(paths)  # type: ignore[arg-type]


def _preprocessed_chunks(chunks: Iterable[CriteoChunk], hash_sizes: Sequence[int]):
    for chunk in chunks:
        yield {
            "dense": preprocess_dense(chunk.dense),
            "ids": hash_categorical(chunk.categorical, hash_sizes),
            "labels": chunk.labels,
        }


def _batches_from_chunks(
    chunks: Iterable[CriteoChunk],
    batch_size: int,
    hash_sizes: Sequence[int],
    drop_last: bool,
    shuffle_buffer: Optional[int],
    seed: int,
) -> Iterator[Batch]:
    for columns in iter_row_batches(
        _preprocessed_chunks(chunks, hash_sizes), batch_size, drop_last, shuffle_buffer, seed
    ):
        yield batch_from_arrays(columns["dense"], columns["ids"], columns["labels"])


def criteo_batches(
    paths: Paths,
    batch_size: int,
    hash_sizes: Optional[Sequence[int]] = None,
    max_rows: Optional[int] = None,
    drop_last: bool = False,
    shuffle_buffer: Optional[int] = None,
    seed: int = 0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> Iterator[Batch]:
    """Stream Criteo files as `torchrec.datasets.utils.Batch` objects.

    Each batch has `dense_features` [B, 13] float32 (log-transformed), `sparse_features` a KJT
    with keys C1..C26 and exactly one id per bag, and `labels` [B] float32. Files are read in
    the given order. `hash_sizes` (26 ints) defaults to the Kaggle cardinalities; `max_rows`
    caps every table. `shuffle_buffer` shuffles rows within windows of that many rows.
    """
    sizes = _resolve_hash_sizes(hash_sizes, max_rows)
    chunks = (c for p in _as_path_list(paths) for c in iter_criteo_chunks(p, chunk_rows))
    return _batches_from_chunks(chunks, batch_size, sizes, drop_last, shuffle_buffer, seed)


class CriteoIterDataset(IterableDataset):
    """`IterableDataset` of Criteo `Batch`es (see `criteo_batches`); use it with
    `DataLoader(dataset, batch_size=None)` since it already batches.

    With several DataLoader workers, each file's chunks of `chunk_rows` rows are dealt
    round-robin to workers (every worker reads the files but parses and batches only its share,
    see `iter_criteo_chunks`), and each worker shuffles with `seed + worker_id`.
    """

    def __init__(
        self,
        paths: Paths,
        batch_size: int,
        hash_sizes: Optional[Sequence[int]] = None,
        max_rows: Optional[int] = None,
        drop_last: bool = False,
        shuffle_buffer: Optional[int] = None,
        seed: int = 0,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        super().__init__()
        self.paths = _as_path_list(paths)
        self.batch_size = batch_size
        self.hash_sizes = _resolve_hash_sizes(hash_sizes, max_rows)
        self.drop_last = drop_last
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.chunk_rows = chunk_rows

    def __iter__(self) -> Iterator[Batch]:
        worker = get_worker_info()
        shard, num_shards = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        chunks = (
            c
            for p in self.paths
            for c in iter_criteo_chunks(p, self.chunk_rows, shard, num_shards)
        )
        seed = self.seed + shard
        return _batches_from_chunks(
            chunks, self.batch_size, self.hash_sizes, self.drop_last, self.shuffle_buffer, seed
        )


# ---------------------------------------------------------------------------------------------
# Writing (tests, examples)

DenseValue = Optional[Union[int, float]]
CategoricalValue = Optional[Union[int, str]]
CriteoRow = Tuple[int, Sequence[DenseValue], Sequence[CategoricalValue]]


def _format_dense(value: DenseValue) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # Criteo writes integer counts without a decimal point
    return str(value)


def _format_categorical(value: CategoricalValue) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return f"{value & 0xFFFFFFFF:08x}"


def write_criteo_tsv(path: PathLike, rows: Iterable[CriteoRow]) -> int:
    """Write rows in the real Criteo form (tab-separated, no header; gzip if `path` ends in
    `.gz`). A row is `(label, 13 dense values, 26 categorical values)`; None is missing, ints
    for categoricals are written as 8-digit hex. Returns the number of rows written."""
    count = 0
    with open_text_for_write(path) as f:
        for label, dense, categorical in rows:
            if len(dense) != NUM_DENSE or len(categorical) != NUM_SPARSE:
                raise ValueError(
                    f"row {count}: need {NUM_DENSE} dense and {NUM_SPARSE} categorical values"
                )
            fields = [str(int(label))]
            fields += [_format_dense(v) for v in dense]
            fields += [_format_categorical(v) for v in categorical]
            f.write("\t".join(fields) + "\n")
            count += 1
    return count


# ---------------------------------------------------------------------------------------------
# Synthetic data

_ZIPF_EXACT_HEAD = 4096


def truncated_zipf(rng: np.random.Generator, a: float, n: int, size: int) -> np.ndarray:
    """`size` ids in [0, n) with P(id = k - 1) proportional to k**-a (Zipf truncated to n).

    The first 4096 ranks are sampled exactly from their probabilities; the rest of the tail
    uses the continuous power law between rank + 0.5 boundaries (inverse CDF, then rounding),
    so any table size costs O(size) without a table of n probabilities.
    """
    if a <= 0:
        raise ValueError(f"zipf exponent must be positive, got {a}")
    if n <= 0:
        raise ValueError(f"table size must be positive, got {n}")
    head = min(n, _ZIPF_EXACT_HEAD)
    head_weights = np.arange(1, head + 1, dtype=np.float64) ** -a
    lo, hi = head + 0.5, n + 0.5
    s = 1.0 - a
    if n > head:
        tail_mass = math.log(hi / lo) if abs(s) < 1e-12 else (hi**s - lo**s) / s
    else:
        tail_mass = 0.0
    head_cdf = np.cumsum(head_weights)
    total = head_cdf[-1] + tail_mass

    u = rng.random(size) * total
    ranks = np.searchsorted(head_cdf, u, side="right") + 1  # 1-based ranks in the head
    in_tail = u >= head_cdf[-1]
    if in_tail.any():
        v = (u[in_tail] - head_cdf[-1]) / tail_mass
        if abs(s) < 1e-12:
            x = lo * (hi / lo) ** v
        else:
            x = (lo**s + v * (hi**s - lo**s)) ** (1.0 / s)
        ranks[in_tail] = np.clip(np.floor(x + 0.5), head + 1, n).astype(np.int64)
    return (ranks - 1).astype(np.int64)


def _id_effect(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random value in [-1, 1) per (id, salt): a multiplicative integer hash,
    so the label function needs no per-id table even for 10M-row tables."""
    x = (ids.astype(np.uint64) + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0


def synthetic_criteo_batches(
    num_batches: int,
    batch_size: int,
    hash_sizes: Optional[Sequence[int]] = None,
    zipf_a: Optional[float] = 1.05,
    seed: int = 0,
    signal_seed: int = 0,
) -> Iterator[Batch]:
    """Criteo-shaped batches with a learnable signal.

    Dense features are log(x + 1) of non-negative counts (like preprocessed Criteo); ids per
    table are Zipf(`zipf_a`)-distributed over [0, hash size), so low ids are hot, or uniform
    when `zipf_a` is None. The click probability is sigmoid of a fixed function of four dense
    features and the ids of four tables (chosen, with its weights, by `signal_seed`, so data
    drawn with different `seed`s, e.g. train and eval, share one labelling function); a model
    that learns it reaches AUC well above 0.5. About a quarter of labels are 1, as in Criteo.
    Output is deterministic given (`seed`, `signal_seed`). `hash_sizes` defaults to the Kaggle
    cardinalities; its length sets the number of tables (keys C1..Cn).
    """
    sizes = list(CRITEO_KAGGLE_CARDINALITIES) if hash_sizes is None else [int(s) for s in hash_sizes]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"hash sizes must be a non-empty list of positive ints, got {sizes}")
    keys = [f"C{i}" for i in range(1, len(sizes) + 1)]

    signal = np.random.default_rng([signal_seed, 0x5167A1])
    signal_dense = signal.choice(NUM_DENSE, size=4, replace=False)
    dense_weights = signal.normal(0.0, 1.0, size=4)
    signal_tables = signal.choice(len(sizes), size=min(4, len(sizes)), replace=False)
    table_salts = signal.integers(0, 2**31, size=len(signal_tables))
    # Per-feature scale of the underlying counts, so columns differ like real Criteo ones.
    count_scales = signal.uniform(0.5, 3.0, size=NUM_DENSE)

    rng = np.random.default_rng([seed, 0xC217E0])
    for _ in range(num_batches):
        latent = rng.normal(0.0, 1.0, size=(batch_size, NUM_DENSE))
        # Counts are a monotone function of the latent, so the signal survives log(x + 1).
        counts = np.floor(np.exp(count_scales * latent + count_scales))
        dense = preprocess_dense(counts)
        if zipf_a is None:
            ids = np.stack([rng.integers(0, n, size=batch_size) for n in sizes], axis=1)
        else:
            ids = np.stack([truncated_zipf(rng, zipf_a, n, batch_size) for n in sizes], axis=1)

        logit = latent[:, signal_dense] @ dense_weights / 2.0
        for table, salt in zip(signal_tables, table_salts):
            logit += 1.5 * _id_effect(ids[:, table], int(salt))
        logit -= 1.8  # base rate: ~25% clicks
        labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        yield batch_from_arrays(dense, ids.astype(np.int64), labels, keys)
