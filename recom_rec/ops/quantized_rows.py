"""Rows of quantized tables by row key, ``recom_rec::quantized_rows``: the quantized
EmbeddingCollection's gather. One row per id (``[ids, dim]`` in the output dtype), read by the
quantized pooled lookup (ops/quantized_lookup.py) over bags of one row key each of a virtual table
that spans the module's byte buffer, so every row type dequantizes as fbgemm does.

The number of virtual features it takes depends on the id count (the kernel's grid takes at most
MAX_BAGS bags a feature), which a graph traced with a KJT built in it knows only when it runs: the
registered op is one opaque node there (torch.compile, export, TorchScript), and plain eager calls
skip its dispatch. The row keys were checked by the step that made them (unpooled_row_keys)."""
import torch
from torch import Tensor

from ..quant.layout import QMETA_OUT_COL
from .pooled_embedding import _eager_ok
from .quantized_lookup import quantized_lookup

# The quantized kernel's grid has the batch's blocks of bags on its y axis (at most 65535 blocks).
MAX_BAGS = 65535


def _gather(flat: Tensor, row_key: Tensor, virtual_meta: Tensor, first_key: Tensor, dim: int,
            output_dtype: torch.dtype, backend: str) -> Tensor:
    """``[ids, dim]``. Past MAX_BAGS ids the bags are spread over F virtual features side by side
    (id r is bag r // F of feature r % F, whose pooled output row r // F, columns (r % F) * dim, is
    row r of ``[ids, dim]``)."""
    num = row_key.numel()
    features = max(1, -(-num // MAX_BAGS))
    if features == 1:
        bags = torch.arange(num + 1, dtype=torch.int64, device=flat.device)
        return quantized_lookup(flat, row_key, bags, None, virtual_meta, first_key, num, dim, dim, output_dtype,
                                backend, False, "")
    batch = -(-num // features)
    padded = torch.cat([row_key, row_key.new_zeros(batch * features - num)])  # key 0: a real row, dropped after
    values = padded.view(batch, features).t().reshape(-1)  # a KJT's order: feature after feature
    bags = torch.arange(batch * features + 1, dtype=torch.int64, device=flat.device)
    meta = virtual_meta.repeat(features, 1)
    meta[:, QMETA_OUT_COL] = torch.arange(features, device=flat.device) * dim
    key_index = torch.arange(features, dtype=torch.int64, device=flat.device)
    out = quantized_lookup(flat, values, bags, None, meta, key_index, batch, features * dim, dim, output_dtype,
                           backend, False, "")
    return out.view(-1, dim)[:num]


@torch.library.custom_op("recom_rec::quantized_rows", mutates_args=())
def quantized_rows(flat: Tensor, row_key: Tensor, virtual_meta: Tensor, first_key: Tensor, dim: int,
                   output_dtype: torch.dtype, backend: str) -> Tensor:
    """``[row_key.numel(), dim]`` in ``output_dtype``: row ``row_key[i]`` of the virtual table
    ``virtual_meta`` (one quant.layout metadata row) over the byte buffer ``flat``."""
    return _gather(flat, row_key, virtual_meta, first_key, dim, output_dtype, backend)


@quantized_rows.register_fake
def _(flat, row_key, virtual_meta, first_key, dim, output_dtype, backend):
    return flat.new_empty((row_key.shape[0], dim), dtype=output_dtype)


def rows_by_key(flat: Tensor, row_key: Tensor, virtual_meta: Tensor, first_key: Tensor, dim: int,
                output_dtype: torch.dtype, backend: str) -> Tensor:
    """``quantized_rows``: the registered op when traced or compiled, else its body."""
    if _eager_ok([], flat, row_key, virtual_meta, first_key):
        return _gather(flat, row_key, virtual_meta, first_key, dim, output_dtype, backend)
    return quantized_rows(flat, row_key, virtual_meta, first_key, dim, output_dtype, backend)
