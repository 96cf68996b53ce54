"""Random quantized groups for the quantized-lookup tests: tables of mixed row types and dims
packed as the module packs them, and KJT inputs with empty bags and shared tables."""
import itertools
from dataclasses import dataclass
from typing import List, Optional

import torch

from recom_rec.quant.layout import buffer_bytes, pack_quant_tables, quant_feature_meta
from recom_rec.quant.rows import RowType, pack_rows, quantize_rows

ALL_KINDS = [RowType.INT8, RowType.INT4, RowType.INT2, RowType.FP16, RowType.FP8, RowType.FP32]


@dataclass
class QuantCase:
    flat: torch.Tensor
    floats: List[torch.Tensor]
    slots: list
    meta: torch.Tensor
    key_index: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]
    batch_size: int
    total_dim: int
    max_dim: int
    row_alignment: int


def random_case(seed: int, weighted: bool, kinds=ALL_KINDS, num_tables: int = 5, batch_size: int = 6,
                max_len: int = 5, row_alignment: int = 16, pooling: Optional[int] = None) -> QuantCase:
    g = torch.Generator().manual_seed(seed)
    kinds = [kinds[int(torch.randint(len(kinds), (1,), generator=g))] for _ in range(num_tables)]
    dims = [8 * int(torch.randint(1, 7, (1,), generator=g)) for _ in range(num_tables)]
    rows = [int(torch.randint(1, 20, (1,), generator=g)) for _ in range(num_tables)]
    slots = pack_quant_tables([f"t{i}" for i in range(num_tables)], rows, dims, kinds, row_alignment)
    flat = torch.zeros(buffer_bytes(slots), dtype=torch.uint8)
    floats = []
    for s in slots:
        w = torch.randn(s.num_embeddings, s.embedding_dim, generator=g) * 3
        floats.append(w)
        elements, scale_bias = quantize_rows(w, s.kind)
        pack_rows(elements, scale_bias, s.rows_of(flat))
    # Features: one per table, plus one feature that reads two tables and a table read by two features.
    tables = list(range(num_tables)) + [0]
    keys = [f"f{i}" for i in range(num_tables)]
    feature_keys = list(range(num_tables)) + [num_tables - 1]  # last key also read by table 0
    poolings = [pooling if pooling is not None else int(torch.randint(2, (1,), generator=g)) for _ in tables]
    dims_out = [dims[t] for t in tables]
    cols = list(itertools.accumulate([0] + dims_out))[:-1]
    # Output columns in a permuted order (the module's output order need not be the feature order).
    perm = torch.randperm(len(tables), generator=g).tolist()
    cols_perm, col = [0] * len(tables), 0
    for f in perm:
        cols_perm[f] = col
        col += dims_out[f]
    meta = quant_feature_meta(slots, tables, cols_perm, poolings)
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch_size,), generator=g)
    lengths[::3] = 0  # empty bags
    # Key k's ids must be valid for every table that reads it.
    limit = [min(rows[t] for t, k in zip(tables, feature_keys) if k == key) for key in range(len(keys))]
    values = torch.cat([torch.randint(0, limit[k], (int(lengths[k * batch_size:(k + 1) * batch_size].sum()),),
                                      generator=g) for k in range(len(keys))])
    weights = torch.rand(values.numel(), generator=g) * 2 - 0.5 if weighted else None
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return QuantCase(flat, floats, slots, meta, torch.tensor(feature_keys), values, offsets, weights, batch_size,
                     sum(dims_out), max(dims), row_alignment)
