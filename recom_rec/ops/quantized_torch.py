"""The quantized lookup in vectorised torch (any device; the CPU path of
``recom_rec::quantized_pooled_lookup``).

Every lookup's row is dequantized at once (per row type), then bags are summed position by
position: step j adds the j-th row of every bag that has one, so each bag takes its rows in input
order with fbgemm's arithmetic (see quant/reference.py) and the result equals fbgemm's bit for bit.
"""
from typing import Optional

import torch

from ..quant.layout import (QMETA_BYTE_BASE, QMETA_DIM, QMETA_OUT_COL, QMETA_POOLING, QMETA_ROW_BYTES,
                            QMETA_ROW_TYPE)
from ..quant.reference import fma
from ..quant.rows import SCALE_BIAS_BYTES, RowType, data_bytes, scale_bias_of, unpack_elements


def _gather_bytes(flat: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    return flat[starts[:, None] + torch.arange(width, device=flat.device)]


def forward(flat: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
            feature_meta: torch.Tensor, key_index: torch.Tensor, batch_size: int, total_dim: int, max_dim: int,
            output_dtype: torch.dtype) -> torch.Tensor:
    device = flat.device
    num_features = feature_meta.shape[0]
    out = torch.zeros(batch_size * total_dim, dtype=torch.float32, device=device)
    if num_features == 0 or batch_size == 0:
        return out.view(batch_size, total_dim).to(output_dtype)
    offsets = offsets.to(torch.int64)
    key_index = key_index.to(torch.int64)
    # Every lookup: its feature, its slot (feature, bag), its place in its bag.
    bag_lo = offsets[key_index[:, None] * batch_size + torch.arange(batch_size, device=device)]  # [F, B]
    bag_hi = offsets[key_index[:, None] * batch_size + torch.arange(1, batch_size + 1, device=device)]
    lengths = (bag_hi - bag_lo).reshape(-1)
    slot = torch.repeat_interleave(torch.arange(num_features * batch_size, device=device), lengths)
    n = slot.numel()
    first = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(n, device=device) - first[slot]
    position = bag_lo.reshape(-1)[slot] + within
    feature = slot // batch_size
    meta = feature_meta[feature]
    dim, kind = meta[:, QMETA_DIM], meta[:, QMETA_ROW_TYPE]
    row_start = meta[:, QMETA_BYTE_BASE] + values[position].to(torch.int64) * meta[:, QMETA_ROW_BYTES]
    weight = (per_sample_weights[position].to(torch.float32) if per_sample_weights is not None
              else torch.ones(n, dtype=torch.float32, device=device))

    # Dequantize: elements [n, max_dim] (codes for INT rows), and each row's scale, bias (0 for float rows).
    elements = torch.zeros(n, max_dim, dtype=torch.float32, device=device)
    scale = weight.clone()
    bias = torch.zeros(n, dtype=torch.float32, device=device)
    for k in torch.unique(kind).tolist():
        k = RowType(k)
        for d in torch.unique(dim[kind == int(k)]).tolist():
            sel = torch.nonzero((kind == int(k)) & (dim == d)).squeeze(1)
            start = row_start[sel]
            if k.has_scale_bias:
                s, b = scale_bias_of(_gather_bytes(flat, start, SCALE_BIAS_BYTES))
                scale[sel] = s * weight[sel]
                bias[sel] = b * weight[sel]
                start = start + SCALE_BIAS_BYTES
            elements[sel, :d] = unpack_elements(_gather_bytes(flat, start, data_bytes(k, d)), k, d)

    # Pool in input order: step j adds every bag's j-th row (fma(scale, q, acc + bias)).
    acc = torch.zeros(num_features * batch_size, max_dim, dtype=torch.float32, device=device)
    longest = int(lengths.max()) if n else 0
    for j in range(longest):
        sel = torch.nonzero(within == j).squeeze(1)
        s = slot[sel]
        acc[s] = fma(scale[sel, None], elements[sel], acc[s] + bias[sel, None])
    fmeta = feature_meta.to(device)
    is_mean = (fmeta[:, QMETA_POOLING] == 1).repeat_interleave(batch_size)
    inv = torch.where(lengths > 0, 1.0 / lengths.clamp_min(1).to(torch.float32), torch.zeros_like(lengths, dtype=torch.float32))
    acc = torch.where(is_mean[:, None], acc * inv[:, None], acc)

    # Scatter [F * B, max_dim] into [B, total_dim] at each feature's columns.
    d = torch.arange(max_dim, device=device)
    fdim = fmeta[:, QMETA_DIM]
    col = fmeta[:, QMETA_OUT_COL][:, None] + d  # [F, max_dim]
    b = torch.arange(batch_size, device=device)
    dst = b[None, :, None] * total_dim + col[:, None, :]  # [F, B, max_dim]
    live = (d[None, :] < fdim[:, None])[:, None, :].expand(-1, batch_size, -1)
    out[dst[live]] = acc.view(num_features, batch_size, max_dim)[live]
    return out.view(batch_size, total_dim).to(output_dtype)
