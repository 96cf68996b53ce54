"""The quantized lookup in vectorised torch (any device; the CPU path of
``recom_rec::quantized_pooled_lookup``).

Lookups are dequantized a row format at a time (the tables of one row type, dim and row size are
read as one ``[*, row_bytes]`` array: quant/layout.py starts each table on a whole number of its
rows), then bags are summed position by position: step j adds the j-th row of every bag that has
one, so each bag takes its rows in input order with fbgemm's arithmetic (quant/reference.py) and
the result equals fbgemm's bit for bit.
"""
from typing import Optional

import torch

from ..quant.layout import (QMETA_BYTE_BASE, QMETA_DIM, QMETA_OUT_COL, QMETA_POOLING, QMETA_ROW_STRIDE,
                            QMETA_ROW_TYPE)
from ..quant.reference import fma
from ..quant.rows import SCALE_BIAS_BYTES, RowType, scale_bias_of, unpack_elements


def _rows(flat: torch.Tensor, start: torch.Tensor, rbytes: int) -> torch.Tensor:
    """``[n, rbytes]`` bytes of the rows starting at ``start``: a row gather when every start is
    a whole number of rows into the buffer, else a byte gather."""
    if bool((start % rbytes == 0).all()):
        table = flat[:flat.numel() // rbytes * rbytes].view(-1, rbytes)
        return table.index_select(0, start // rbytes)
    return flat[start[:, None] + torch.arange(rbytes, device=flat.device)]


def _output_columns(feature_meta: torch.Tensor, max_dim: int, total_dim: int) -> torch.Tensor:
    """For each output column, its place in the [F * max_dim] concatenation of padded features."""
    dims = feature_meta[:, QMETA_DIM]
    feature = torch.repeat_interleave(torch.arange(dims.numel(), device=dims.device), dims)
    within = torch.arange(feature.numel(), device=dims.device) - (torch.cumsum(dims, 0) - dims)[feature]
    source = torch.empty(total_dim, dtype=torch.int64, device=dims.device)
    source[feature_meta[feature, QMETA_OUT_COL] + within] = feature * max_dim + within
    return source


def forward(flat: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
            feature_meta: torch.Tensor, key_index: torch.Tensor, batch_size: int, total_dim: int, max_dim: int,
            output_dtype: torch.dtype) -> torch.Tensor:
    device = flat.device
    num_features = feature_meta.shape[0]
    if num_features == 0 or batch_size == 0:
        return torch.zeros(batch_size, total_dim, dtype=output_dtype, device=device)
    offsets = offsets.to(torch.int64)
    key_index = key_index.to(torch.int64)
    # Every lookup: its slot (feature, bag) and its place in its bag.
    bags = key_index[:, None] * batch_size + torch.arange(batch_size, device=device)  # [F, B]
    bag_lo = offsets[bags].reshape(-1)
    lengths = offsets[bags + 1].reshape(-1) - bag_lo
    slot = torch.repeat_interleave(torch.arange(num_features * batch_size, device=device), lengths)
    n = slot.numel()
    within = torch.arange(n, device=device) - (torch.cumsum(lengths, 0) - lengths)[slot]
    position = bag_lo[slot] + within
    feature = slot // batch_size
    ids = values[position].to(torch.int64)
    weight = per_sample_weights[position].to(torch.float32) if per_sample_weights is not None else None

    # Dequantize, one row format at a time: elements [n, max_dim] (codes for INT rows), and each
    # row's scale (sample weight folded in) and bias.
    elements = torch.zeros(n, max_dim, dtype=torch.float32, device=device)
    scale = weight.clone() if weight is not None else torch.ones(n, dtype=torch.float32, device=device)
    bias = torch.zeros(n, dtype=torch.float32, device=device)
    any_int = False
    formats = feature_meta[:, [QMETA_ROW_TYPE, QMETA_DIM, QMETA_ROW_STRIDE]]
    unique_formats, format_of_feature = torch.unique(formats, dim=0, return_inverse=True)
    format_of_lookup = format_of_feature[feature]
    for g, (kind, dim, rbytes) in enumerate(unique_formats.tolist()):
        kind = RowType(kind)
        sel = torch.nonzero(format_of_lookup == g).squeeze(1)
        rows = _rows(flat, feature_meta[feature[sel], QMETA_BYTE_BASE] + ids[sel] * rbytes, rbytes)
        if kind.has_scale_bias:
            any_int = True
            s, b = scale_bias_of(rows)
            scale[sel] = s if weight is None else s * weight[sel]
            bias[sel] = b if weight is None else b * weight[sel]
            rows = rows[:, SCALE_BIAS_BYTES:]
        elements[sel, :dim] = unpack_elements(rows, kind, dim)

    # Pool in input order: step j adds every bag's j-th row, fma(scale, q, acc + bias).
    acc = torch.zeros(num_features * batch_size, max_dim, dtype=torch.float32, device=device)
    plain_sum = weight is None and not any_int  # float rows, no weights: fma(1, x, acc) = acc + x
    for j in range(int(lengths.max()) if n else 0):
        sel = torch.nonzero(within == j).squeeze(1)
        s = slot[sel]
        before = acc[s] if j else torch.zeros((), device=device)  # every bag starts at 0
        if plain_sum:
            acc[s] = before + elements[sel]
        else:
            acc[s] = fma(scale[sel, None], elements[sel], before + bias[sel, None])
    is_mean = (feature_meta[:, QMETA_POOLING] == 1).repeat_interleave(batch_size)
    inv = 1.0 / lengths.clamp_min(1).to(torch.float32)  # fbgemm multiplies by 1/L
    acc = torch.where(is_mean[:, None], acc * inv[:, None], acc)
    # [F, B, max_dim] -> [B, F * max_dim] -> the output's columns.
    padded = acc.view(num_features, batch_size, max_dim).transpose(0, 1).reshape(batch_size, -1)
    return padded.index_select(1, _output_columns(feature_meta, max_dim, total_dim)).to(output_dtype)
