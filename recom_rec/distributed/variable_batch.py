"""Variable batch per feature (VBE) KJTs through the sharded EmbeddingBagCollection.

The lookup's output. After torchrec's input distribution a rank's lookup receives a KJT whose
keys have a bag count per sending rank (``stride_per_key_per_rank``: key k's bags are those of
rank 0, then rank 1, ...). fbgemm's VBE TBE (``batch_size_per_feature_per_rank``), and so every
VBE-aware output distribution of torchrec, returns them pooled as one 1-D tensor ordered by rank,
then key, then that key's bags from that rank, each bag its ``dim`` values. The fused lookup pools
a uniform batch instead (each key's bags padded with empty ones to the largest key's count,
ops/variable_batch.py) into ``[bags, columns]``, key k's bags in rows ``0..sum_r s[k][r]`` of its
columns; ``rank_major`` gathers the rank-major layout from it (each element once, so the
gather's backward is exact).

The module's output. torchrec's sharded module expands each rank's bags to its rows by the
inverse indices with fbgemm's ``batch_index_select_dim0``; ours does it with a gather
(``expand_by_inverse``), and hands torchrec's row-wise mean pooling the inverse indices in the
order it reads them (``with_inverse_indices_in``).
"""
from typing import List

import torch
from torchrec.distributed.embeddingbag import VariableBatchEmbeddingBagCollectionAwaitable, construct_output_kt
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ..ops.segments import segment_ids


def rank_major_positions(stride_per_key_per_rank: List[List[int]], key_dims: List[int], columns: int,
                         device: torch.device) -> torch.Tensor:
    """int64 positions in the flattened ``[bags, columns]`` pooled output of each element of the
    rank-major layout. ``key_dims[k]``: key k's number of columns, the keys' columns adjacent in key
    order."""
    keys = len(key_dims)
    ranks = len(stride_per_key_per_rank[0]) if keys else 0
    strides = torch.tensor(stride_per_key_per_rank, dtype=torch.int64).view(keys, ranks)
    dims = torch.tensor(key_dims, dtype=torch.int64)
    first_row = torch.cumsum(strides, 1) - strides  # [K, R]: the key's first bag from each rank
    first_col = torch.cumsum(dims, 0) - dims
    # Segments (a rank's bags of a key) in output order: rank-major, then key.
    seg_bags = strides.t().reshape(-1)
    seg_dim = dims.repeat(ranks)
    seg_row = first_row.t().reshape(-1)
    seg_col = first_col.repeat(ranks)
    seg_len = seg_bags * seg_dim
    total = int(seg_len.sum())
    # one copy to the device (each would wait for the stream)
    seg_len, seg_dim, seg_row, seg_col = torch.stack([seg_len, seg_dim, seg_row, seg_col]).to(device).unbind()
    position = torch.arange(total, device=device)
    seg = segment_ids(seg_len, position)
    within = position - (torch.cumsum(seg_len, 0) - seg_len)[seg]
    dim = seg_dim[seg]
    return (seg_row[seg] + within // dim) * columns + seg_col[seg] + within % dim


def rank_major(pooled: torch.Tensor, stride_per_key_per_rank: List[List[int]], key_dims: List[int]) -> torch.Tensor:
    """The 1-D rank-major VBE output (see the module doc) from the padded pooled ``[bags, columns]``."""
    positions = rank_major_positions(stride_per_key_per_rank, key_dims, pooled.shape[1], pooled.device)
    return pooled.reshape(-1).index_select(0, positions)


def with_inverse_indices_in(features: KeyedJaggedTensor, names: List[str]) -> KeyedJaggedTensor:
    """``features`` with its inverse indices' rows in the order of ``names`` (each among them)."""
    given, indices = features.inverse_indices()
    row = {name: i for i, name in enumerate(given)}
    missing = [name for name in names if name not in row]
    if missing:
        raise ValueError(f"the KeyedJaggedTensor's inverse_indices have no row for features {missing}")
    order = torch.tensor([row[name] for name in names], device=indices.device)
    return KeyedJaggedTensor(
        keys=features.keys(), values=features.values(), weights=features.weights_or_none(),
        lengths=features.lengths_or_none(), offsets=features.offsets_or_none(),
        stride_per_key_per_rank=features.stride_per_key_per_rank(),
        inverse_indices=(list(names), indices.index_select(0, order)))


def expand_by_inverse(pooled: torch.Tensor, indices: torch.Tensor, bags_per_feature: List[int],
                      dims: List[int]) -> torch.Tensor:
    """``[B, sum(dims)]``: each feature's columns of each output row from its bag, ``indices
    [F, B]``, in ``pooled`` (1-D: feature f's bags ``[bags_per_feature[f], dims[f]]``, one feature
    after another): what torchrec's sharded module does with fbgemm's ``batch_index_select_dim0``."""
    device = pooled.device
    dim = torch.tensor(dims, dtype=torch.int64)
    block = torch.tensor(bags_per_feature, dtype=torch.int64) * dim
    col_feature = torch.repeat_interleave(torch.arange(len(dims)), dim, output_size=sum(dims))
    col_within = torch.arange(sum(dims)) - (torch.cumsum(dim, 0) - dim)[col_feature]
    first = (torch.cumsum(block, 0) - block)[col_feature] + col_within
    first, col_feature, col_dim = torch.stack([first, col_feature, dim[col_feature]]).to(device).unbind()
    positions = first + indices.to(torch.int64).index_select(0, col_feature).t() * col_dim
    return pooled.index_select(0, positions.reshape(-1)).view(indices.shape[1], -1)


class FusedVariableBatchAwaitable(VariableBatchEmbeddingBagCollectionAwaitable):
    """torchrec's VBE output awaitable, the rows expanded by ``expand_by_inverse`` instead of
    fbgemm's ``batch_index_select_dim0`` (which a GPU build of fbgemm may lack)."""

    def _wait_impl(self) -> KeyedTensor:
        embeddings = [w.wait() for w in self._awaitables]
        names, indices = self._inverse_indices
        if self._inverse_indices_permute_indices is not None:
            indices = indices.index_select(0, self._inverse_indices_permute_indices)
        expanded = expand_by_inverse(embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings), indices,
                                     self._batch_size_per_feature_pre_a2a, self._uncombined_embedding_dims)
        for awaitable in getattr(self, "_resize_awaitables", None) or []:
            awaitable.wait()
        return construct_output_kt(embeddings=[self._permute_op(expanded)], embedding_names=self._embedding_names,
                                   embedding_dims=self._embedding_dims)


def with_fused_expansion(awaitable):
    """The sharded module's output awaitable, a VBE one expanding by ``expand_by_inverse`` (only
    the class changes: torchrec builds it inside its output dist)."""
    if type(awaitable) is VariableBatchEmbeddingBagCollectionAwaitable:
        awaitable.__class__ = FusedVariableBatchAwaitable
    return awaitable
