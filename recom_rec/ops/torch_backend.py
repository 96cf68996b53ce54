"""The pure-torch backend of the fused lookup: vectorised over all tables at once.

It runs on any device (it is the CPU path, and a fallback on CUDA). Every table of a group is
served by the same few gathers and one ``index_add_`` over the flat buffer, never by a loop over
tables. Accumulation is in fp32 whatever the weight dtype.
"""
from typing import List, Optional

import torch

from .jagged import Lookups, element_indices, expand_lookups, feature_dims, lookup_scale
from .layout import META_DIM, META_ELEM_BASE, META_OUT_COL, META_ROW_BASE


def _uniform_dim(feature_meta: torch.Tensor) -> int:
    """The common dim when every feature has the same dim and they sit side by side in the
    output (the fast path: rows can be gathered as ``[n, D]`` blocks); otherwise 0."""
    dims = feature_meta[:, META_DIM]
    if dims.numel() == 0:
        return 0
    d = int(dims[0])
    cols = feature_meta[:, META_OUT_COL]
    expected = torch.arange(dims.numel(), device=cols.device) * d
    if bool((dims == d).all()) and bool((cols == expected).all()):
        return d
    return 0


def _row_starts(lookups: Lookups, feature_meta: torch.Tensor) -> torch.Tensor:
    # (index_select: about twice as fast as indexing with a tensor on the CPU, v61)
    dims = feature_meta[:, META_DIM].index_select(0, lookups.feature)
    return feature_meta[:, META_ELEM_BASE].index_select(0, lookups.feature) + lookups.ids * dims


def _dim_runs(lookups: Lookups, feature_meta: torch.Tensor):
    """Mixed dims: for each distinct dim ``d``, ``(d, features, lookups)``: the group's features of
    that dim and the indices of their lookups. Rows of one dim then move as ``[m, d]`` blocks
    (one gather, one row-wise ``index_add_``) instead of element by element (with _rows_at and
    jagged's one-pass bags, a CPU forward of 520 columns of dims 4-32 went from 50-70 to 19-21 ms,
    docs/perf-notes.md v23)."""
    dims = feature_meta[:, META_DIM]
    dim_of_lookup = dims.index_select(0, lookups.feature)
    for d in torch.unique(dims).tolist():
        at = torch.nonzero(dim_of_lookup == d).flatten()
        yield int(d), torch.nonzero(dims == d).flatten(), at


def _rows_at(flat: torch.Tensor, starts: torch.Tensor, d: int) -> torch.Tensor:
    """The ``[m, d]`` rows of ``flat`` starting at element offsets ``starts``: one row-wise
    ``index_select`` from a read-only view whose row i is ``flat[i:i + d]`` (tables of one dim need
    not start at multiples of it). Indexing ``flat`` with an ``[m, d]`` element index instead took
    ~19 ns an element (7.5 of 24 ms a CPU forward with 520 columns, perf-notes v23)."""
    windows = torch.as_strided(flat, (max(flat.numel() - d + 1, 0), d), (1, 1))
    return windows.index_select(0, starts)


def _block(base: torch.Tensor, d: int) -> torch.Tensor:
    """Element indices ``[m, d]`` of rows starting at ``base``."""
    return base[:, None] + torch.arange(d, device=base.device)


def forward(
    flat: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    batch_size: int,
    total_dim: int,
) -> torch.Tensor:
    out = torch.zeros(batch_size, total_dim, dtype=torch.float32, device=flat.device)
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return out
    lookups = expand_lookups(values, offsets, feature_meta, key_index, batch_size)
    scale = lookup_scale(lookups, per_sample_weights)
    d = _uniform_dim(feature_meta)
    if d:
        rows = flat.view(-1, d).index_select(0, _row_starts(lookups, feature_meta) // d).to(torch.float32)
        num_features = feature_meta.shape[0]
        out.view(batch_size * num_features, d).index_add_(
            0, lookups.bag * num_features + lookups.feature, rows * scale[:, None]
        )
        return out
    starts = _row_starts(lookups, feature_meta)
    local = torch.empty(feature_meta.shape[0], dtype=torch.int64, device=flat.device)
    for d, features, at in _dim_runs(lookups, feature_meta):
        if at.numel() == 0:
            continue
        # Pool each dim's features side by side in [B, features, d], then place their columns.
        nf = features.numel()
        local[features] = torch.arange(nf, device=flat.device)
        rows = _rows_at(flat, starts.index_select(0, at), d).to(torch.float32) * scale.index_select(0, at)[:, None]
        pooled = torch.zeros(batch_size * nf, d, dtype=torch.float32, device=flat.device)
        pooled.index_add_(0, lookups.bag.index_select(0, at) * nf
                          + local.index_select(0, lookups.feature.index_select(0, at)), rows)
        cols = _block(feature_meta[features, META_OUT_COL], d).flatten()
        out.index_copy_(1, cols, pooled.view(batch_size, nf * d))  # (distinct columns)
    return out


def backward(
    grad_output: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    batch_size: int,
    total_numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dense gradient of the flat buffer (``[total_numel]``, in the weights' dtype)."""
    grad = torch.zeros(total_numel, dtype=torch.float32, device=grad_output.device)
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return grad.to(dtype)
    grad_output = grad_output.to(torch.float32).contiguous()
    lookups = expand_lookups(values, offsets, feature_meta, key_index, batch_size)
    scale = lookup_scale(lookups, per_sample_weights)
    total_dim = grad_output.shape[1]
    d = _uniform_dim(feature_meta)
    if d:
        num_features = feature_meta.shape[0]
        rows = grad_output.view(batch_size * num_features, d)[lookups.bag * num_features + lookups.feature]
        grad.view(-1, d).index_add_(0, _row_starts(lookups, feature_meta) // d, rows * scale[:, None])
        return grad.to(dtype)
    starts = _row_starts(lookups, feature_meta)
    out_at = lookups.bag * total_dim + feature_meta[lookups.feature, META_OUT_COL]
    for d, _, at in _dim_runs(lookups, feature_meta):
        if at.numel() == 0:
            continue
        rows = _rows_at(grad_output.view(-1), out_at[at], d) * scale[at, None]
        grad.index_add_(0, _block(starts[at], d).flatten(), rows.flatten())
    return grad.to(dtype)


def per_sample_weights_grad(
    grad_output: torch.Tensor,
    flat: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    batch_size: int,
) -> torch.Tensor:
    """d loss / d per_sample_weights[i] = sum over the features reading value i of
    <grad of its bag, its row> (times 1/L for mean pooling)."""
    grad = torch.zeros(values.numel(), dtype=torch.float32, device=grad_output.device)
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return grad
    grad_output = grad_output.to(torch.float32).contiguous()
    lookups = expand_lookups(values, offsets, feature_meta, key_index, batch_size)
    total_dim = grad_output.shape[1]
    lookup, col = element_indices(lookups, feature_dims(feature_meta))
    src = _row_starts(lookups, feature_meta)[lookup] + col
    out_at = lookups.bag[lookup] * total_dim + feature_meta[lookups.feature[lookup], META_OUT_COL] + col
    products = flat[src].to(torch.float32) * grad_output.view(-1)[out_at]
    per_lookup = torch.zeros(lookups.ids.numel(), dtype=torch.float32, device=grad.device)
    per_lookup.index_add_(0, lookup, products)
    grad.index_add_(0, lookups.position, per_lookup * lookups.pool_scale)
    return grad


def fused_update(
    grad_output: torch.Tensor,
    flat: torch.Tensor,
    states: List[torch.Tensor],
    state_is_row: List[bool],
    hyper: torch.Tensor,
    step: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    batch_size: int,
    max_dim: int,
    kind: int,
    num_lookups: int = -1,
    num_rows: int = -1,  # the group's rows (the kernels size their row keys by it; unused here)
) -> None:
    """Backward with the optimizer fused in: sums the gradient of each touched row (duplicates
    first, as fbgemm's exact optimizers do), then updates those rows and their state in place."""
    from ..optim.rows import update_rows

    if feature_meta.shape[0] == 0 or batch_size == 0:
        return
    grad_output = grad_output.to(torch.float32).contiguous()
    lookups = expand_lookups(values, offsets, feature_meta, key_index, batch_size, num_lookups)
    if lookups.ids.numel() == 0:
        return
    scale = lookup_scale(lookups, per_sample_weights)
    row_key = feature_meta[lookups.feature, META_ROW_BASE] + lookups.ids
    rows, inverse = torch.unique(row_key, sorted=True, return_inverse=True)
    num_rows, total_dim = rows.numel(), grad_output.shape[1]
    feature_of_row = torch.empty(num_rows, dtype=torch.int64, device=flat.device).scatter_(0, inverse, lookups.feature)
    ids = rows - feature_meta[feature_of_row, META_ROW_BASE]
    d = _uniform_dim(feature_meta)
    if d:
        # Every table has dim d: whole-row gathers and scatters (much faster than per element).
        num_features = feature_meta.shape[0]
        contributions = grad_output.view(-1, d)[lookups.bag * num_features + lookups.feature] * scale[:, None]
        grads = torch.zeros(num_rows, d, dtype=torch.float32, device=flat.device).index_add_(0, inverse, contributions)
        at = feature_meta[feature_of_row, META_ELEM_BASE] // d + ids
        dims = torch.full((num_rows,), d, dtype=torch.int64, device=flat.device)
        mask = torch.ones(num_rows, d, dtype=torch.bool, device=flat.device)
        old_states = [s[rows] if is_row else s.view(-1, d).index_select(0, at).to(torch.float32)
                      for s, is_row in zip(states, state_is_row)]
        new_weights, new_states = update_rows(
            kind, flat.view(-1, d).index_select(0, at).to(torch.float32), grads, mask, dims, old_states, hyper, step
        )
        flat.view(-1, d).index_copy_(0, at, new_weights.to(flat.dtype))
        for s, is_row, new in zip(states, state_is_row, new_states):
            if is_row:
                s[rows] = new
            else:
                s.view(-1, d).index_copy_(0, at, new.to(s.dtype))
        return
    lookup, col = element_indices(lookups, feature_dims(feature_meta))
    out_at = lookups.bag[lookup] * total_dim + feature_meta[lookups.feature[lookup], META_OUT_COL] + col
    grads = torch.zeros(num_rows * max_dim, dtype=torch.float32, device=flat.device)
    grads.index_add_(0, inverse[lookup] * max_dim + col, grad_output.view(-1)[out_at] * scale[lookup])
    grads = grads.view(num_rows, max_dim)

    dims = feature_meta[feature_of_row, META_DIM]
    cols = torch.arange(max_dim, device=flat.device)
    mask = cols[None, :] < dims[:, None]
    elements = torch.where(mask, (feature_meta[feature_of_row, META_ELEM_BASE] + ids * dims)[:, None] + cols, 0)
    old_states = [s[rows] if is_row else s[elements].to(torch.float32)
                  for s, is_row in zip(states, state_is_row)]
    new_weights, new_states = update_rows(
        kind, flat[elements].to(torch.float32), grads, mask, dims, old_states, hyper, step
    )
    flat[elements[mask]] = new_weights[mask].to(flat.dtype)
    for s, is_row, new in zip(states, state_is_row, new_states):
        if is_row:
            s[rows] = new
        else:
            s[elements[mask]] = new[mask].to(s.dtype)
