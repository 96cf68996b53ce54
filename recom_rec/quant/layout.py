"""Where each quantized table lives in its group's flat byte buffer, and the per-feature
metadata the quantized kernels read.

All tables of a module, whatever their row type, share one ``uint8`` buffer: table after table,
each starting on a 128-byte line (as fbgemm places them) that is also a whole number of its rows.
A table's rows are fbgemm's rows (``row_bytes``, padded to the module's ``row_alignment``) placed
``row_stride`` bytes apart: ``row_bytes`` rounded up to 16, so that the kernel reads whole aligned
words whatever the alignment (with torchrec's default alignment, 16, the two are equal).
``feature_meta`` has one int64 row per output feature with these columns (``num_embeddings`` is
in the float layout's column, so the shared input validation reads it):
"""
import math
from dataclasses import dataclass
from typing import List, Sequence

import torch

from ..ops.layout import META_NUM_EMBEDDINGS
from .rows import TABLE_ALIGNMENT, RowType, row_bytes

QMETA_DIM = 0  # embedding dim
QMETA_BYTE_BASE = 1  # first byte of the table in the flat buffer
QMETA_OUT_COL = 2  # first output column of the feature
QMETA_POOLING = 3  # 0 = sum, 1 = mean
QMETA_NUM_EMBEDDINGS = META_NUM_EMBEDDINGS  # 4: rows of the table
QMETA_ROW_STRIDE = 5  # bytes from one row to the next (a multiple of ROW_STRIDE_ALIGNMENT)
QMETA_ROW_TYPE = 6  # RowType code
QMETA_TABLE = 7  # index of the table in the group
QMETA_WIDTH = 8
ROW_STRIDE_ALIGNMENT = 16


@dataclass(frozen=True)
class QuantTableSlot:
    name: str
    num_embeddings: int
    embedding_dim: int
    kind: RowType
    row_bytes: int  # fbgemm's padded row
    row_stride: int
    byte_base: int

    @property
    def nbytes(self) -> int:
        return self.num_embeddings * self.row_stride

    def rows_of(self, flat: torch.Tensor) -> torch.Tensor:
        """The table's rows ``[num_embeddings, row_bytes]``, a view of the flat buffer."""
        table = flat[self.byte_base:self.byte_base + self.nbytes].view(self.num_embeddings, self.row_stride)
        return table[:, :self.row_bytes]


def pack_quant_tables(names: Sequence[str], rows: Sequence[int], dims: Sequence[int], kinds: Sequence[RowType],
                      row_alignment: int) -> List[QuantTableSlot]:
    slots, end = [], 0
    for name, n, d, kind in zip(names, rows, dims, kinds):
        rb = row_bytes(kind, int(d), row_alignment)
        stride = -(-rb // ROW_STRIDE_ALIGNMENT) * ROW_STRIDE_ALIGNMENT
        # A table starts on a cache line and on a whole number of its rows, so the CPU path can
        # read all tables of one row stride as one [*, row_stride] array.
        align = TABLE_ALIGNMENT * stride // math.gcd(TABLE_ALIGNMENT, stride)
        base = -(-end // align) * align
        slots.append(QuantTableSlot(name, int(n), int(d), kind, rb, stride, base))
        end = base + int(n) * stride
    return slots


def buffer_bytes(slots: Sequence[QuantTableSlot]) -> int:
    end = max((s.byte_base + s.nbytes for s in slots), default=0)
    return -(-end // TABLE_ALIGNMENT) * TABLE_ALIGNMENT


def quant_feature_meta(slots: Sequence[QuantTableSlot], tables: Sequence[int], out_cols: Sequence[int],
                       poolings: Sequence[int]) -> torch.Tensor:
    """``[F, QMETA_WIDTH]`` int64: feature f reads table ``tables[f]`` and writes its pooled row
    from column ``out_cols[f]``."""
    meta = torch.zeros(len(tables), QMETA_WIDTH, dtype=torch.int64)
    for i, (t, col, pooling) in enumerate(zip(tables, out_cols, poolings)):
        s = slots[t]
        meta[i, QMETA_DIM] = s.embedding_dim
        meta[i, QMETA_BYTE_BASE] = s.byte_base
        meta[i, QMETA_OUT_COL] = col
        meta[i, QMETA_POOLING] = pooling
        meta[i, QMETA_NUM_EMBEDDINGS] = s.num_embeddings
        meta[i, QMETA_ROW_STRIDE] = s.row_stride
        meta[i, QMETA_ROW_TYPE] = int(s.kind)
        meta[i, QMETA_TABLE] = t
    return meta
