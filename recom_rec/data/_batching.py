"""Row-block batching shared by the dataset readers.

Readers parse files into *chunks*: dicts of numpy arrays whose first dimension is the row.
`iter_row_batches` regroups those rows into fixed-size batches (optionally shuffled inside a
window) without caring what the columns mean; each reader then turns a batch of columns into a
`torchrec.datasets.utils.Batch`.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

Columns = Dict[str, np.ndarray]


def _num_rows(columns: Columns) -> int:
    return len(next(iter(columns.values())))


def _concat(parts: List[Columns]) -> Columns:
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _take(columns: Columns, index) -> Columns:
    return {name: array[index] for name, array in columns.items()}


def iter_row_batches(
    chunks: Iterable[Columns],
    batch_size: int,
    drop_last: bool = False,
    shuffle_buffer: Optional[int] = None,
    seed: int = 0,
) -> Iterator[Columns]:
    """Regroup row chunks into batches of exactly `batch_size` rows.

    The last, smaller batch is yielded unless `drop_last`. With `shuffle_buffer`, rows are
    gathered into windows of at least `shuffle_buffer` rows and each window is permuted before
    it is cut into batches (a block shuffle: rows only mix with rows near them in the stream,
    which keeps memory bounded on multi-GB files). Deterministic given `seed`.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if shuffle_buffer is not None and shuffle_buffer <= 0:
        raise ValueError(f"shuffle_buffer must be positive or None, got {shuffle_buffer}")
    rng = np.random.default_rng(seed) if shuffle_buffer else None
    window = max(batch_size, shuffle_buffer or 0)

    pending: List[Columns] = []
    pending_rows = 0

    def cut(columns: Columns, keep_tail: bool) -> Iterator[Columns]:
        # Yields every full batch of `columns`; the tail (< batch_size rows) is returned to
        # `pending` when more data may follow, else yielded or dropped.
        nonlocal pending, pending_rows
        n = _num_rows(columns)
        if rng is not None:
            columns = _take(columns, rng.permutation(n))
        full = n - n % batch_size
        for start in range(0, full, batch_size):
            yield _take(columns, slice(start, start + batch_size))
        tail = _take(columns, slice(full, n))
        if keep_tail:
            pending, pending_rows = ([tail], n - full) if n > full else ([], 0)
        elif n > full and not drop_last:
            yield tail

    for chunk in chunks:
        rows = _num_rows(chunk)
        if rows == 0:
            continue
        pending.append(chunk)
        pending_rows += rows
        if pending_rows >= window:
            yield from cut(_concat(pending), keep_tail=True)
    if pending_rows:
        yield from cut(_concat(pending), keep_tail=False)


def one_id_per_bag_kjt(keys: Sequence[str], ids: np.ndarray) -> KeyedJaggedTensor:
    """KJT with one id per bag from an `[batch, num_keys]` id matrix (column j = keys[j])."""
    batch, num_keys = ids.shape
    if num_keys != len(keys):
        raise ValueError(f"{num_keys} id columns for {len(keys)} keys")
    # KJT values are key-major: all bags of key 0, then all bags of key 1, ...
    values = torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1).astype(np.int64))
    lengths = torch.ones(batch * num_keys, dtype=torch.int32)
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, stride=batch)
