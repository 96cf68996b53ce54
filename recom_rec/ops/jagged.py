"""Vectorised expansion of a KeyedJaggedTensor into one entry per (feature, value) lookup.

The pure-torch backend uses it: it turns the jagged input into flat arrays (which feature, which
bag, which id, which scale) without a Python loop over tables.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from .layout import META_DIM, META_POOLING, POOLING_MEAN


@dataclass
class Lookups:
    feature: torch.Tensor  # [n] int64, row of feature_meta
    position: torch.Tensor  # [n] int64, index into values / per_sample_weights
    bag: torch.Tensor  # [n] int64, batch index b
    ids: torch.Tensor  # [n] int64
    pool_scale: torch.Tensor  # [n] fp32, 1/L for mean pooling, 1 for sum (no sample weight)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def expand_lookups(
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    batch_size: int,
    num_lookups: int = -1,
) -> Lookups:
    """Lists every lookup of every output feature.

    ``num_lookups``, when the caller knows it (every KJT key read by exactly one feature: it is
    the number of values), spares a device-to-host sync.

    ``offsets`` is the KJT's ``[num_keys * B + 1]`` offsets, ``key_index[f]`` the KJT key that
    output feature ``f`` reads. A key read by two features (a feature shared by two tables) is
    listed once per feature."""
    device = values.device
    offsets = offsets.to(torch.int64)
    key_index = key_index.to(torch.int64)
    # (gathers by index_select: on the CPU about twice as fast as indexing with a tensor, v61)
    lo = offsets.index_select(0, key_index * batch_size)
    hi = offsets.index_select(0, (key_index + 1) * batch_size)
    counts = hi - lo
    num_features = feature_meta.shape[0]
    feature = torch.repeat_interleave(torch.arange(num_features, device=device), counts,
                                      output_size=num_lookups if num_lookups >= 0 else None)
    n = feature.numel()
    within = torch.arange(n, device=device) - _exclusive_cumsum(counts).index_select(0, feature)
    position = lo.index_select(0, feature) + within
    # Each value's bag, one pass over the values (a binary search of the offsets per lookup cost
    # 3 ms of a 26 ms CPU forward with 520 columns); sizes that do not add up raise here.
    bag_lengths = offsets[1:] - offsets[:-1]
    value_bag = torch.repeat_interleave(torch.arange(bag_lengths.numel(), device=device), bag_lengths,
                                        output_size=values.numel())
    global_bag = value_bag.index_select(0, position)
    bag = global_bag - key_index.index_select(0, feature) * batch_size
    ids = values.index_select(0, position).to(torch.int64)
    lengths = bag_lengths.index_select(0, global_bag).to(torch.float32)
    is_mean = feature_meta[:, META_POOLING].index_select(0, feature) == POOLING_MEAN
    pool_scale = torch.where(is_mean, 1.0 / lengths.clamp_min(1.0), torch.ones_like(lengths))
    return Lookups(feature, position, bag, ids, pool_scale)


def element_indices(lookups: Lookups, dims: torch.Tensor):
    """Expands lookups of mixed dims to one entry per embedding element.

    Returns ``(lookup, d)``: for each element, which lookup it belongs to and its column."""
    per_lookup = dims[lookups.feature]
    lookup = torch.repeat_interleave(torch.arange(per_lookup.numel(), device=dims.device), per_lookup)
    d = torch.arange(lookup.numel(), device=dims.device) - _exclusive_cumsum(per_lookup)[lookup]
    return lookup, d


def lookup_scale(lookups: Lookups, per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """The factor each looked-up row is multiplied by: sample weight times 1/L for mean."""
    if per_sample_weights is None:
        return lookups.pool_scale
    return lookups.pool_scale * per_sample_weights[lookups.position].to(torch.float32)


def feature_dims(feature_meta: torch.Tensor) -> torch.Tensor:
    return feature_meta[:, META_DIM]
