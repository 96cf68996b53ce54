"""Static layout of a fused embedding-bag group: where each table lives in the flat weight
buffer and where each feature's pooled embedding goes in the output.

A *group* is a set of tables that share a weight dtype; all of them live in one flat 1-D buffer,
table after table, each table row-major ``[num_embeddings, embedding_dim]``. The fused kernels see
a group only through ``feature_meta``, an int64 tensor with one row per *output feature* (a
feature that feeds two tables appears twice) and these columns:
"""
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

META_DIM = 0  # embedding dim of the feature's table
META_ELEM_BASE = 1  # element offset of the table inside the flat buffer
META_OUT_COL = 2  # first output column of the feature
META_POOLING = 3  # 0 = sum, 1 = mean
META_NUM_EMBEDDINGS = 4  # rows of the table (ids must lie in [0, num_embeddings))
META_ROW_BASE = 5  # row offset of the table when all the group's rows are numbered in order
META_TABLE = 6  # index of the table within its group
META_WIDTH = 7

POOLING_SUM = 0
POOLING_MEAN = 1


@dataclass(frozen=True)
class TableSlot:
    """One table's place in its group's flat buffer."""

    name: str
    num_embeddings: int
    embedding_dim: int
    elem_base: int
    row_base: int

    @property
    def numel(self) -> int:
        return self.num_embeddings * self.embedding_dim


@dataclass(frozen=True)
class FeatureSlot:
    """One pooled output: a feature looked up in one table."""

    feature: str  # KJT key to read
    embedding_name: str  # output key (``feature@table`` when the feature feeds several tables)
    table: int  # index into the group's tables
    out_col: int  # first column in the module's full output
    pooling: int


def pack_tables(names: Sequence[str], rows: Sequence[int], dims: Sequence[int]) -> List[TableSlot]:
    """Places tables one after another in a flat buffer."""
    slots, elem, row = [], 0, 0
    for name, n, d in zip(names, rows, dims):
        slots.append(TableSlot(name, int(n), int(d), elem, row))
        elem += int(n) * int(d)
        row += int(n)
    return slots


def table_runs(slots: Sequence[TableSlot]) -> List[Tuple[int, int, int, List[int]]]:
    """The group's tables as runs of neighbours of one width: ``(first element, end element,
    width, rows of each table)``. A run's slice of the flat buffer, viewed ``[-1, width]``, splits
    into its tables with one ``split_with_sizes`` (the dense backward's per-table gradients)."""
    runs: List[Tuple[int, int, int, List[int]]] = []
    for slot in slots:
        if runs and runs[-1][2] == slot.embedding_dim and runs[-1][1] == slot.elem_base:
            start, _, dim, rows = runs[-1]
            runs[-1] = (start, slot.elem_base + slot.numel, dim, rows + [slot.num_embeddings])
        else:
            runs.append((slot.elem_base, slot.elem_base + slot.numel, slot.embedding_dim, [slot.num_embeddings]))
    return runs


def feature_meta_tensor(
    tables: Sequence[TableSlot], features: Sequence[FeatureSlot], out_cols: Sequence[int]
) -> torch.Tensor:
    """Builds the ``[F, META_WIDTH]`` int64 metadata the kernels read.

    ``out_cols`` is each feature's first column in the *group's* output (which differs from the
    module's output when tables of several dtypes are split into groups)."""
    meta = torch.zeros(len(features), META_WIDTH, dtype=torch.int64)
    for i, (f, col) in enumerate(zip(features, out_cols)):
        t = tables[f.table]
        meta[i, META_DIM] = t.embedding_dim
        meta[i, META_ELEM_BASE] = t.elem_base
        meta[i, META_OUT_COL] = col
        meta[i, META_POOLING] = f.pooling
        meta[i, META_NUM_EMBEDDINGS] = t.num_embeddings
        meta[i, META_ROW_BASE] = t.row_base
        meta[i, META_TABLE] = f.table
    return meta
