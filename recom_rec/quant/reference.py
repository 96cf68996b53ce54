"""Pure-torch reference of the quantized lookup: dequantize each looked-up row, then pool, in a
plain loop over features, bags and ids. Slow and obviously right; the kernels are tested
against it.

It follows fbgemm's arithmetic, so that its results are fbgemm's bit for bit: a bag's sum starts
at 0 and takes its rows in input order; an INT row adds, as fbgemm's CPU kernels do, ``fma(scale
* w, q, acc + bias * w)`` (``w`` the sample weight, 1 without), or, as its CUDA kernels do
(``arithmetic="cuda"``), ``fma(w, v, acc)`` with each element ``v = q * scale + bias`` rounded
once to fp16; a float row adds ``fma(w, x, acc)``; mean pooling multiplies by ``1 / L`` (fp32),
an empty bag pools to 0; the result is rounded once to the output dtype.
"""
from typing import Optional

import numpy as np
import torch

from .layout import (QMETA_BYTE_BASE, QMETA_DIM, QMETA_OUT_COL, QMETA_POOLING, QMETA_ROW_STRIDE,
                     QMETA_ROW_TYPE)
from .rows import SCALE_BIAS_BYTES, RowType, data_bytes, scale_bias_of, unpack_elements


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once (as C's fmaf): the product of two floats is exact in
    double and the double sum is rounded to float."""
    return (a.double() * b.double() + c.double()).float()


def half_of_exact(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``q * scale + bias`` rounded once to fp16, as fp32: the double sum is exact (an 8-bit q
    times an fp16 scale, plus an fp16 bias, spans fewer than 53 bits), and numpy rounds a double
    to fp16 directly (torch goes through fp32, rounding twice)."""
    exact = (q.double() * scale.double() + bias.double()).numpy()
    return torch.from_numpy(exact.astype(np.float16).astype(np.float32))


def reference_quantized_pooled(
    flat: torch.Tensor,
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    batch_size: int,
    total_dim: int,
    output_dtype: torch.dtype,
    arithmetic: str = "cpu",
) -> torch.Tensor:
    """Pooled embeddings ``[batch_size, total_dim]`` in ``output_dtype``; ``offsets`` are the
    KJT's ``[num_keys * B + 1]``, ``key_index[f]`` the KJT key feature f reads; ``arithmetic``
    "cpu" or "cuda": whose fbgemm kernels' rounding of INT rows to follow."""
    if arithmetic not in ("cpu", "cuda"):
        raise ValueError(f"arithmetic must be 'cpu' or 'cuda', got {arithmetic!r}")
    out = torch.zeros(batch_size, total_dim, dtype=torch.float32)
    meta = feature_meta.cpu().tolist()
    offsets = offsets.cpu().to(torch.int64)
    flat = flat.cpu()
    for f, (dim, base, col, pooling, _, rbytes, kind, _) in enumerate(meta):
        kind = RowType(kind)
        k = int(key_index[f])
        for b in range(batch_size):
            lo, hi = int(offsets[k * batch_size + b]), int(offsets[k * batch_size + b + 1])
            acc = torch.zeros(dim, dtype=torch.float32)
            for p in range(lo, hi):
                row = flat[base + int(values[p]) * rbytes:base + (int(values[p]) + 1) * rbytes]
                w = torch.tensor(1.0) if per_sample_weights is None else per_sample_weights[p].float().cpu()
                if kind.has_scale_bias:
                    scale, bias = scale_bias_of(row[None, :])
                    q = unpack_elements(row[None, SCALE_BIAS_BYTES:SCALE_BIAS_BYTES + data_bytes(kind, dim)], kind, dim)[0]
                    if arithmetic == "cuda":
                        acc = fma(w, half_of_exact(q, scale, bias), acc)
                    else:
                        acc = fma(scale * w, q, acc + bias * w)
                else:
                    x = unpack_elements(row[None, :data_bytes(kind, dim)], kind, dim)[0]
                    acc = fma(w, x, acc)
            if pooling == 1 and hi > lo:
                acc = acc * (torch.tensor(1.0) / (hi - lo))
            out[b, col:col + dim] = acc
    return out.to(output_dtype)
