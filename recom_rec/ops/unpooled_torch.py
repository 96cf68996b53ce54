"""The pure-torch unpooled lookup (``recom_rec.EmbeddingCollection``): the CPU path and the reference
of kernels/unpooled_triton.py. Vectorised over every feature and table of a group at once.

A group's tables share one dim ``d`` (an EmbeddingCollection requires it), so a row key (the
table's row base + id) is also the row of the flat buffer viewed ``[-1, d]``.
"""
from typing import List, Tuple

import torch

from .layout import META_NUM_EMBEDDINGS, META_ROW_BASE
from .validation import decode_names

# segments' rows (ops/unpooled_embedding.py)
SEG_OUT, SEG_VALUE, SEG_BAG, SEG_STRIDE = 0, 1, 2, 3


def lookups(values: torch.Tensor, segments: torch.Tensor, feature_meta: torch.Tensor,
            num_outputs: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each output row's (feature, position in values, id)."""
    num_features = feature_meta.shape[0]
    out_start = segments[SEG_OUT]
    counts = out_start[1:num_features + 1] - out_start[:num_features]
    device = values.device
    feature = torch.repeat_interleave(torch.arange(num_features, device=device), counts, output_size=num_outputs)
    position = segments[SEG_VALUE][feature] + torch.arange(num_outputs, device=device) - out_start[feature]
    return feature, position, values[position].to(torch.int64)


def row_keys(values: torch.Tensor, segments: torch.Tensor, feature_meta: torch.Tensor,
             num_outputs: int) -> torch.Tensor:
    feature, _, ids = lookups(values, segments, feature_meta, num_outputs)
    return feature_meta[feature, META_ROW_BASE] + ids


def validate_ids(values: torch.Tensor, offsets: torch.Tensor, segments: torch.Tensor, feature_meta: torch.Tensor,
                 num_outputs: int, names: str) -> None:
    """Raises a ValueError naming the feature, table and batch index of the first negative length
    among the features' bags, or else of the first id outside its table."""
    _check_lengths_not_negative(offsets, segments, feature_meta.shape[0], names)
    feature, position, ids = lookups(values, segments, feature_meta, num_outputs)
    limit = feature_meta[feature, META_NUM_EMBEDDINGS]
    bad = (ids < 0) | (ids >= limit)
    if not bool(bad.any()):
        return
    at = int(torch.nonzero(bad)[0, 0])
    f, pos, bad_id, n = int(feature[at]), int(position[at]), int(ids[at]), int(limit[at])
    first_bag, bags = int(segments[SEG_BAG, f]), int(segments[SEG_STRIDE, f])
    bag_offsets = offsets[first_bag:first_bag + bags + 1].to(torch.int64)
    batch_index = int(torch.searchsorted(bag_offsets, torch.tensor([pos], device=bag_offsets.device),
                                         right=True)[0]) - 1
    name, table = decode_names(names)[1][f]
    what = "negative" if bad_id < 0 else f"out of range for {n} rows"
    raise ValueError(f"feature {name!r} (table {table!r}): id {bad_id} at batch index {batch_index} is {what}; "
                     f"ids must lie in [0, {n})")


def _check_lengths_not_negative(offsets: torch.Tensor, segments: torch.Tensor, num_features: int, names: str) -> None:
    """A negative length leaves a key's lengths adding up (its values are still gathered in order)
    while its JaggedTensor's lengths would be wrong: refused, naming the first feature reading it."""
    lengths = offsets[1:] - offsets[:-1]
    if not bool((lengths < 0).any()):
        return
    bad = torch.nonzero(lengths < 0).flatten().tolist()
    first_bag, bags = segments[SEG_BAG, :num_features].tolist(), segments[SEG_STRIDE, :num_features].tolist()
    pairs = decode_names(names)[1]
    for b in bad:
        for f in range(num_features):
            if first_bag[f] <= b < first_bag[f] + bags[f]:
                name, table = pairs[f]
                raise ValueError(f"feature {name!r} (table {table!r}): negative length at batch index "
                                 f"{b - first_bag[f]}")


def forward(flat: torch.Tensor, values: torch.Tensor, segments: torch.Tensor, feature_meta: torch.Tensor,
            num_outputs: int, dim: int) -> torch.Tensor:
    if num_outputs == 0:
        return torch.zeros(0, dim, dtype=torch.float32, device=flat.device)
    keys = row_keys(values, segments, feature_meta, num_outputs)
    return flat.view(-1, dim).index_select(0, keys).to(torch.float32)


def backward(grad_output: torch.Tensor, values: torch.Tensor, segments: torch.Tensor, feature_meta: torch.Tensor,
             total_numel: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense gradient of the flat buffer (``[total_numel]``, in the weights' dtype), summed in fp32."""
    grad = torch.zeros(total_numel, dtype=torch.float32, device=grad_output.device)
    num_outputs = grad_output.shape[0]
    if num_outputs:
        keys = row_keys(values, segments, feature_meta, num_outputs)
        grad.view(-1, dim).index_add_(0, keys, grad_output.to(torch.float32))
    return grad.to(dtype)


def fused_update(grad_output: torch.Tensor, flat: torch.Tensor, states: List[torch.Tensor],
                 state_is_row: List[bool], hyper: torch.Tensor, step: torch.Tensor, values: torch.Tensor,
                 segments: torch.Tensor, feature_meta: torch.Tensor, dim: int, kind: int) -> None:
    """The optimizer fused into the backward: each touched row's gradients summed (duplicates
    first, as fbgemm's exact optimizers), then the row and its state updated in place."""
    from ..optim.rows import update_rows

    num_outputs = grad_output.shape[0]
    if num_outputs == 0:
        return
    keys = row_keys(values, segments, feature_meta, num_outputs)
    rows, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    grads = torch.zeros(rows.numel(), dim, dtype=torch.float32, device=flat.device)
    grads.index_add_(0, inverse, grad_output.to(torch.float32))
    table = flat.view(-1, dim)
    dims = torch.full((rows.numel(),), dim, dtype=torch.int64, device=flat.device)
    mask = torch.ones(rows.numel(), dim, dtype=torch.bool, device=flat.device)
    old_states = [s[rows] if is_row else s.view(-1, dim).index_select(0, rows).to(torch.float32)
                  for s, is_row in zip(states, state_is_row)]
    new_weights, new_states = update_rows(kind, table.index_select(0, rows).to(torch.float32), grads, mask, dims,
                                          old_states, hyper, step)
    table.index_copy_(0, rows, new_weights.to(flat.dtype))
    for s, is_row, new in zip(states, state_is_row, new_states):
        if is_row:
            s[rows] = new
        else:
            s.view(-1, dim).index_copy_(0, rows, new.to(s.dtype))

