"""Input checks of the fused lookup, with errors that name the feature and the table.

They run inside the custom op (so ``torch.compile`` keeps one graph). ``validate_inputs`` reads the
batch on the host: a device-to-host sync on CUDA, where the kernels check ids themselves instead
(ops/input_check.py) and the host checks only what it knows without the device
(``check_shapes``). Modules switch both off with ``validate_inputs=False``.
"""
from functools import lru_cache
from typing import List, Optional, Tuple

import torch

from .layout import META_NUM_EMBEDDINGS
from .segments import segment_of_each_position


# Names travel to the op as one string (a custom-op argument) joined with ASCII unit/record
# separators: no newlines or quotes for compilers that embed it in generated code, and plain
# str.join, which torch.compile folds to a constant.
_UNIT, _RECORD = "\x1f", "\x1e"


def encode_names(keys: List[str], features: List[str], tables: List[str]) -> str:
    """Packs the names an error message may need: the KJT's keys, then (feature, table) pairs.
    (Written for TorchScript too: the scripted lookup calls it; literals, not the constants.)"""
    records = ["\x1f".join(keys)]
    for i in range(len(features)):
        records.append(features[i] + "\x1f" + tables[i])
    return "\x1e".join(records)


@lru_cache(maxsize=256)
def decode_names(names: str) -> Tuple[Tuple[str, ...], Tuple[Tuple[str, str], ...]]:
    """(the KJT's keys, each feature's (feature, table)); cached: the kernels' check reads the
    key count every call."""
    first, *rest = names.split(_RECORD)
    keys = tuple(first.split(_UNIT)) if first else ()
    return keys, tuple(tuple(r.split(_UNIT, 1)) for r in rest)  # type: ignore[misc]


def _tables_reading(key: str, pairs) -> str:
    tables = [t for f, t in pairs if f == key]
    return ", ".join(repr(t) for t in tables) if tables else "no table"


def check_device(tables: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                 per_sample_weights: Optional[torch.Tensor], names: str) -> None:
    """A batch on another device than its tables: the GPU kernels would read host addresses as
    device ones (an illegal access that ends the process's CUDA context), so it is refused first,
    whatever ``validate_inputs`` says."""
    device = tables.device
    for what, tensor in (("values", values), ("offsets", offsets), ("weights", per_sample_weights)):
        if tensor is not None and tensor.device != device:
            pairs = decode_names(names)[1]  # (none from an unvalidated TorchScript module)
            named = (" (" + ", ".join(f"feature {f!r} (table {t!r})" for f, t in pairs[:4])
                     + (", ..." if len(pairs) > 4 else "") + ")") if pairs else ""
            raise ValueError(
                f"KeyedJaggedTensor {what} are on {tensor.device} but the tables{named} are on {device}: "
                f"move the batch with kjt.to({str(device)!r})"
            )


def check_integer_ids(values: torch.Tensor) -> None:
    """Ids of a float or bool dtype are refused (TorchScript compiles it: the scripted modules call it)."""
    if values.numel() > 0 and (values.is_floating_point() or values.dtype == torch.bool):
        raise ValueError("KeyedJaggedTensor values must be integer ids, got " + str(values.dtype))


def check_shapes(values: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
                 num_keys: int, batch_size: int) -> None:
    """What the host knows of a batch without reading it: shapes and dtypes."""
    if offsets.dim() != 1 or offsets.numel() != num_keys * batch_size + 1:
        raise ValueError(
            f"KeyedJaggedTensor has {offsets.numel()} offsets for {num_keys} keys and batch size "
            f"{batch_size}; expected {num_keys * batch_size + 1}"
        )
    if values.dim() != 1:
        raise ValueError(f"KeyedJaggedTensor values must be 1-D, got shape {tuple(values.shape)}")
    if per_sample_weights is not None and per_sample_weights.numel() != values.numel():
        raise ValueError(
            f"KeyedJaggedTensor has {per_sample_weights.numel()} weights for {values.numel()} values"
        )
    check_integer_ids(values)


@torch.jit.unused
def _check_bags_in_graph(num_lengths: int, bags: int) -> None:
    torch._check(num_lengths == bags, lambda: "KeyedJaggedTensor has a lengths count other than its keys' bags")


def lengths_count(lengths: Optional[torch.Tensor], offsets: Optional[torch.Tensor]) -> int:
    """How many bags a KJT's lengths (or, where it holds only those, offsets) describe: no device op."""
    if lengths is not None:
        return lengths.numel()
    if offsets is not None:
        return offsets.numel() - 1
    return 0


def check_batch_shape(num_keys: int, values: torch.Tensor, num_lengths: int, stride_per_key: List[int]) -> None:
    """What the host knows of a KJT without reading it: integer ids, and as many lengths as its
    keys have bags. (Called before the KJT's per-key lengths are summed: torchrec's sum fails on a
    lengths count that is not a multiple of the keys with a shape error that names nothing.)"""
    bags = 0
    for s in stride_per_key:
        bags += s
    if torch.jit.is_scripting():
        if num_lengths != bags:
            raise ValueError("KeyedJaggedTensor has " + str(num_lengths) + " lengths for " + str(num_keys)
                             + " keys of " + str(bags) + " bags in all")
    elif torch.compiler.is_compiling():
        _check_bags_in_graph(num_lengths, bags)
    elif num_lengths != bags:
        raise ValueError(f"KeyedJaggedTensor has {num_lengths} lengths for {num_keys} keys of {bags} bags in all "
                         f"(its batch size per key: {stride_per_key})")
    check_integer_ids(values)


def validate_inputs(
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    batch_size: int,
    names: str,
) -> None:
    keys, pairs = decode_names(names)
    check_shapes(values, offsets, per_sample_weights, len(keys), batch_size)
    num_keys = len(keys)
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    if num_keys and bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        key = keys[bad // batch_size]
        raise ValueError(
            f"feature {key!r} (table {_tables_reading(key, pairs)}): negative length at batch "
            f"index {bad % batch_size}"
        )
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != values.numel():
        # Name the first key whose bags run past the values, or the last key when they fall short.
        ends = offsets[batch_size::batch_size] if batch_size else offsets[1:]
        over = torch.nonzero(ends > values.numel())
        k = int(over[0, 0]) if over.numel() else num_keys - 1
        key = keys[k] if keys else "<none>"
        raise ValueError(
            f"KeyedJaggedTensor lengths add up to {last - first} but there are {values.numel()} "
            f"values: feature {key!r} (table {_tables_reading(key, pairs)}) is where they disagree"
        )
    if values.numel() == 0 or feature_meta.shape[0] == 0:
        return
    # Per value: the smallest table size among the features that read its key.
    key_of_value = segment_of_each_position(offsets[batch_size::batch_size] - offsets[:-1:batch_size],
                                            values.numel()) \
        if batch_size else torch.zeros(0, dtype=torch.int64, device=values.device)
    limit = torch.full((num_keys,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=values.device)
    limit.scatter_reduce_(0, key_index.to(torch.int64), feature_meta[:, META_NUM_EMBEDDINGS], "amin")
    ids = values.to(torch.int64)
    bad = (ids < 0) | (ids >= limit.index_select(0, key_of_value))
    if not bool(bad.any()):
        return
    pos = int(torch.nonzero(bad)[0, 0])
    k = int(key_of_value[pos])
    bad_id = int(ids[pos])
    batch_index = int(torch.searchsorted(offsets, torch.tensor(pos, device=offsets.device), right=True)) - 1 - k * batch_size
    for f in range(feature_meta.shape[0]):
        n = int(feature_meta[f, META_NUM_EMBEDDINGS])
        if int(key_index[f]) == k and (bad_id < 0 or bad_id >= n):
            feature, table = pairs[f]
            what = "negative" if bad_id < 0 else f"out of range for {n} rows"
            raise ValueError(
                f"feature {feature!r} (table {table!r}): id {bad_id} at batch index {batch_index} is "
                f"{what}; ids must lie in [0, {n})"
            )
    raise AssertionError("unreachable: a bad id must belong to some feature")
