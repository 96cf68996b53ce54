"""Pure-torch reference of the fused lookup: a plain loop over features and bags.

Slow and obviously right; the kernels are tested against it. Weighted mean pooling follows
fbgemm (``sum(w * e) / L``), which ``nn.EmbeddingBag`` does not offer.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch


def reference_pooled(
    weights: Dict[str, torch.Tensor],
    features: Sequence[Tuple[str, str, str]],
    keys: Sequence[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pooled embeddings ``[B, sum of dims]`` (fp32).

    ``features`` lists ``(feature, table, pooling)`` in output order, ``pooling`` "sum" or
    "mean"; ``keys``/``values``/``lengths`` (``[len(keys) * B]``) are the KJT's."""
    batch_size = lengths.numel() // max(len(keys), 1)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths.to(torch.int64), 0)
    columns: List[torch.Tensor] = []
    for feature, table, pooling in features:
        k = list(keys).index(feature)
        w = weights[table]
        pooled = torch.zeros(batch_size, w.shape[1], dtype=torch.float32)
        for b in range(batch_size):
            lo, hi = int(offsets[k * batch_size + b]), int(offsets[k * batch_size + b + 1])
            rows = w[values[lo:hi].long()].to(torch.float32)
            if per_sample_weights is not None:
                rows = rows * per_sample_weights[lo:hi].to(torch.float32)[:, None]
            s = rows.sum(0)
            if pooling == "mean" and hi > lo:
                s = s / (hi - lo)
            pooled[b] = s
        columns.append(pooled)
    return torch.cat(columns, dim=1) if columns else torch.zeros(batch_size, 0)
