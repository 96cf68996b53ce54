"""Variable batch per feature (torchrec's VBE KJTs: ``stride_per_key_per_rank``, ``inverse_indices``)
through the fused lookup.

A VBE KJT gives each key its own number of bags ``s_f``; its ``inverse_indices`` ``[F, B]`` say
which of key f's bags each of the B output rows takes. The fused kernel pools a uniform batch, so
each key's bags are padded with empty bags up to ``S = max s_f`` (only the offsets change, one
gather from the KJT's own, kernels/pad_offsets_triton.py: the values, weights and so the rows read
stay the KJT's), the kernel pools ``[S, total_dim]``, and
each feature's columns take their rows by ``inverse_indices`` (one kernel, ops/expand_bags.py, as
torchrec's module does with fbgemm's ``group_index_select_dim0``). The gather's backward adds each output row's
gradient to its bag, which the kernel's backward then spreads to the bag's ids; padded bags are
empty and take nothing. (Written for TorchScript too: the scripted module calls these.)
"""
import math
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..kernels import cuda_ext
from .expand_bags import Expansion, eager_expand_bags  # (and registers recom_rec::expand_bags)
from .input_check import kernel_report
from .pooled_embedding import _cuda_builds, _eager_ok
from .validation import check_batch_shape, lengths_count


def uniform_batch(features: KeyedJaggedTensor, output_features: List[str],
                  expand_uniform: bool = True) -> Tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
    """(the KJT the fused lookup pools, the ``[F, B]`` bag of each output row or None): a KJT with a
    batch size per feature is padded to a uniform one (it needs its inverse indices); a uniform KJT
    carrying inverse indices is pooled as it is and, with ``expand_uniform`` (torchrec's float
    module; its quantized module ignores them), expanded by them."""
    rows: Optional[torch.Tensor] = None
    variable = features.variable_stride_per_key()
    if variable:
        # (what the host knows, before the padding: a lengths count other than the keys' bags failed
        # there with a bare shape error)
        check_batch_shape(len(features.keys()), features.values(),
                          lengths_count(features.lengths_or_none(), features.offsets_or_none()),
                          features.stride_per_key())
    if variable or (expand_uniform and features.inverse_indices_or_none() is not None):
        rows = output_rows(features, output_features)
        if variable:
            if rows is None:
                raise ValueError("a KeyedJaggedTensor with a batch size per feature (stride_per_key_per_rank) "
                                 "needs its inverse_indices: they say which bag each output row takes")
            features = pad_to_uniform(features)
    return features, rows


def pad_to_uniform(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``features`` with every key's bags padded (empty bags at its end) to the largest key's count."""
    strides: List[int] = features.stride_per_key()
    width = max(strides) if strides else 0
    offsets = features.offsets()
    # Each key's first bag and bag count from the host's strides: the device gets one small int64
    # tensor, [first; strides] (_device_ints: no sync), and the padded offsets are one gather.
    first: List[int] = []
    bags = 0
    for s in strides:
        first.append(bags)
        bags += s
    per_key = _device_ints(first + strides, offsets.device)
    if torch.jit.is_scripting():
        padded = padded_offsets(offsets, per_key, width, bags)
    elif torch.compiler.is_compiling():
        padded = padded_offsets(offsets, per_key, width, bags)
    elif offsets.is_cuda and _eager_ok([], offsets, per_key):  # one launch, not the torch version's five
        ext = cuda_ext.loaded()  # (its C++ call costs the host less than Triton's launch: perf-notes v64)
        if ext is not None:
            padded = ext.pad_offsets(offsets.contiguous(), per_key, width, bags)
        else:
            padded = _pad_offsets_triton().pad_offsets(offsets, per_key, width, bags)
    else:
        padded = padded_offsets(offsets, per_key, width, bags)
    return KeyedJaggedTensor(keys=features.keys(), values=features.values(), weights=features.weights_or_none(),
                             offsets=padded, stride=width)


def padded_offsets(offsets: torch.Tensor, per_key: torch.Tensor, width: int, bags: int) -> torch.Tensor:
    """The padded offsets, ``[K * width + 1]`` in ``offsets``' dtype: position ``k * width + i`` is
    ``offsets[first[k] + min(i, s_k)]`` (key k's bags end at its last bag's end), the last one
    ``offsets[bags]``; ``per_key``: int64 ``[first; strides]`` (``2 * K``). (torch ops: the CPU,
    TorchScript and torch.compile; eager CUDA runs the same in kernels/pad_offsets_triton.py.)"""
    per_key = per_key.view(2, per_key.shape[0] // 2)
    i = torch.arange(width, dtype=torch.int64, device=offsets.device)
    source = per_key[0].unsqueeze(1) + torch.minimum(i.unsqueeze(0), per_key[1].unsqueeze(1))
    return torch.cat([offsets.index_select(0, source.reshape(-1)), offsets.narrow(0, bags, 1)])


@lru_cache(maxsize=None)
def _pad_offsets_triton():
    from ..kernels import pad_offsets_triton

    return pad_offsets_triton


def output_rows(features: KeyedJaggedTensor, output_features: List[str]) -> Optional[torch.Tensor]:
    """``[F, B]`` int64: the bag (row of the pooled ``[S, total_dim]``) each of the B output rows
    takes for each of the output's features (``output_features``, in column order), from the KJT's
    inverse indices (None without them)."""
    inverse: Optional[Tuple[List[str], torch.Tensor]] = features.inverse_indices_or_none()
    if inverse is None:
        return None
    names, indices = inverse
    where: Dict[str, int] = {}
    for i in range(len(names)):
        where[names[i]] = i
    order_list: List[int] = []
    in_order = len(output_features) == indices.shape[0]
    for f in output_features:
        name = f.split("@")[0]
        if name not in where:
            raise ValueError("the KeyedJaggedTensor's inverse_indices have no row for feature " + name)
        if where[name] != len(order_list):
            in_order = False
        order_list.append(where[name])
    if in_order:  # the inverse indices' rows already in the output's feature order: no gather
        return indices.to(torch.int64)
    return indices.index_select(0, _device_ints(order_list, indices.device)).to(torch.int64)


def check_inverse_indices(features: KeyedJaggedTensor, rows: Optional[torch.Tensor],
                          output_features: List[str]) -> None:
    """Raises a ValueError naming the first output feature whose inverse indices (``rows``,
    output_rows') send an output row to a bag its key does not have in this batch: each must lie in
    ``[0, s_f)``. Eager CPU tensors only (it reads them on the host): on a GPU the expansion's
    kernels read bag 0 instead, without a sync; compiled code is not checked."""
    if rows is None or rows.is_cuda or torch.compiler.is_compiling():
        return
    keys = features.keys()
    strides = features.stride_per_key() if features.variable_stride_per_key() else [features.stride()] * len(keys)
    stride_of = dict(zip(keys, strides))
    # (a key the KJT lacks is the lookup's error to name: no limit here)
    bags = [stride_of.get(name.split("@")[0], rows.shape[1] + 2 ** 62) for name in output_features]
    bad = ((rows < 0) | (rows >= torch.tensor(bags).unsqueeze(1))).nonzero()
    if bad.numel():
        f, b = int(bad[0, 0]), int(bad[0, 1])
        key = output_features[f].split("@")[0]
        raise ValueError(f"KeyedJaggedTensor inverse_indices of feature {key!r} send output row {b} to bag "
                         f"{int(rows[f, b])}, but the feature has {bags[f]} bags in this batch: each must lie in "
                         f"[0, {bags[f]})")


def expand_rows(pooled: torch.Tensor, inverse: torch.Tensor, output_dims: List[int],
                backend: str = "triton") -> torch.Tensor:
    """Each output element from its bag's row, ``pooled[inverse[feature(c), b], c]`` (ops/expand_bags.py).
    Eagerly on a GPU with ``backend`` "auto" or "cuda", where the CUDA extension builds, its kernels
    run it (a C++ launch instead of Triton's Python one: the VBE step is host-bound)."""
    inverse = inverse.to(pooled.device)
    if torch.jit.is_scripting():
        col_feature = _column_features(output_dims, pooled.device)
    elif torch.compiler.is_compiling():
        col_feature = _column_features(output_dims, pooled.device)
    else:
        out = _eager_expand_rows(pooled, inverse, output_dims, backend, None)
        if out is not None:
            return out
        col_feature = _cached_column_features(output_dims, pooled.device)[0]
    return torch.ops.recom_rec.expand_bags(pooled, inverse, col_feature)


def expand_rows_checked(pooled: torch.Tensor, inverse: torch.Tensor, output_dims: List[int], backend: str,
                        check: Optional[Tuple[torch.Tensor, object]]) -> torch.Tensor:
    """``expand_rows`` with the GPU's input check (``check``: inverse_check's) where it runs eagerly."""
    if check is None or torch.compiler.is_compiling():
        return expand_rows(pooled, inverse, output_dims, backend)
    out = _eager_expand_rows(pooled, inverse.to(pooled.device), output_dims, backend, check)
    return out if out is not None else expand_rows(pooled, inverse, output_dims, backend)


def _eager_expand_rows(pooled: torch.Tensor, inverse: torch.Tensor, output_dims: List[int], backend: str,
                       check) -> Optional[torch.Tensor]:
    """The expansion through the eager Function (the same bodies without the op's layers), or None
    where the registered op must run it (a transform or dispatch mode is active)."""
    expansion = eager_expansion(inverse, output_dims, backend, check, pooled)
    if expansion is None:
        return None
    return eager_expand_bags(pooled, expansion.inverse, expansion.col_feature, expansion.dims_gcd, check)


def eager_expansion(inverse: torch.Tensor, output_dims: List[int], backend: str, check,
                    pooled_like: torch.Tensor, features: Optional[KeyedJaggedTensor] = None,
                    output_features: Optional[List[str]] = None) -> Optional[Expansion]:
    """The arguments of an eager expansion of rows pooled on ``pooled_like``'s device (the lookup's
    output, or its flat buffer before the lookup), or None where the registered op must run it (a
    transform or dispatch mode is active). ``inverse``: output_rows'; ``check``: inverse_check's.
    With the (unpadded) ``features`` and ``output_features``, the CUDA kernels also get each output
    feature's bags (Expansion.bags: they may then expand in place)."""
    inverse = inverse.to(pooled_like.device)
    col_feature, dims_gcd = _cached_column_features(output_dims, pooled_like.device)
    if not _eager_ok([], pooled_like, inverse, col_feature):
        return None
    cuda = pooled_like.is_cuda and backend in ("auto", "cuda") and _cuda_builds()
    bags = None
    if cuda and check is not None:
        bags = check[0]  # (inverse_check's limits are these bags)
    elif cuda and features is not None and output_features is not None:
        bags = _device_ints(output_bags(features, output_features), pooled_like.device)
    return Expansion(torch._C._functorch.unwrap_if_dead(inverse), col_feature, dims_gcd if cuda else 0, check, bags)


def output_bags(features: KeyedJaggedTensor, output_features: List[str]) -> List[int]:
    """Each output feature's bags in this batch (its key's stride; a key the KJT lacks is the
    lookup's error, raised before an expansion: 2**62 here, no limit)."""
    keys = features.keys()
    strides = features.stride_per_key() if features.variable_stride_per_key() else [features.stride()] * len(keys)
    stride_of = dict(zip(keys, strides))
    return [stride_of.get(name.split("@")[0], 2 ** 62) for name in output_features]


def inverse_check(features: KeyedJaggedTensor, rows: Optional[torch.Tensor], output_features: List[str],
                  flat: torch.Tensor, names: str, report_id: int):
    """The GPU's check of the inverse indices (``rows``, output_rows'), for an eager batch on a GPU
    (elsewhere None: the CPU raises at once, check_inverse_indices): each output feature's bags in
    this batch on the device, and the report slot (input_check.kernel_report of ``flat``, ``names``
    and ``report_id``) the expansion's forward kernel reports an index outside them to. ``names``:
    validation.encode_names with a (feature, table) pair for each output feature."""
    if rows is None or not rows.is_cuda or torch.compiler.is_compiling():
        return None
    report = kernel_report(flat, names, report_id)
    if report is None:  # (a CUDA graph being captured before the slot exists)
        return None
    limits = output_bags(features, output_features)
    if rows.shape[1] and 0 in limits:  # known here: a feature without bags has no index to give a row
        key = output_features[limits.index(0)].split("@")[0]
        raise ValueError(f"KeyedJaggedTensor inverse_indices of feature {key!r} send output rows to its bags, but "
                         "the feature has 0 bags in this batch")
    return _device_ints(limits, rows.device), report


def _column_features(output_dims: List[int], device: torch.device) -> torch.Tensor:
    """Each output column's feature (int32 ``[sum(output_dims)]``)."""
    return torch.repeat_interleave(torch.arange(len(output_dims), dtype=torch.int32), torch.tensor(output_dims),
                                   output_size=sum(output_dims)).to(device)


# Per module plan's dims list (its identity, held so that the id is not reused) and device: the
# columns' features on the device, so that an eager VBE batch does not copy them there each call,
# and the dims' greatest common divisor (the CUDA kernels' 16-byte units need whole ones a feature).
_COLUMN_FEATURES: Dict[Tuple[int, torch.device], Tuple[List[int], torch.Tensor, int]] = {}


def _cached_column_features(output_dims: List[int], device: torch.device) -> Tuple[torch.Tensor, int]:
    key = (id(output_dims), device)
    hit = _COLUMN_FEATURES.get(key)
    if hit is None or hit[0] is not output_dims:
        if len(_COLUMN_FEATURES) >= 1024:
            _COLUMN_FEATURES.clear()
        hit = _COLUMN_FEATURES[key] = (output_dims, _column_features(output_dims, device),
                                       math.gcd(*output_dims) if output_dims else 0)
    return hit[1], hit[2]


def _device_ints(values: List[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``. Eager on a GPU, without a sync: cached
    (_cached_device_ints), else copied from pinned memory without blocking. TorchScript and
    torch.compile make it in their graphs as before."""
    if torch.jit.is_scripting():
        out = torch.tensor(values, dtype=torch.int64, device=device)
    elif torch.compiler.is_compiling():
        out = torch.tensor(values, dtype=torch.int64, device=device)
    else:
        out = _cached_device_ints(values, device)
    return out


# Small index tensors of the VBE path (a batch's first bags and strides, the inverse indices' feature
# order) on the device, per (values, device, stream). ``torch.tensor(values, device=cuda)`` copies
# from pageable memory and then waits for the stream (torch's blocking copy ends in a
# cudaStreamSynchronize): every VBE forward waited for all earlier GPU work. A value list seen
# before costs a dict look-up; a new one (strides change from batch to batch in training) one
# non-blocking copy from pinned memory (torch's caching host allocator keeps the host block until
# the copy has run). The stream is part of the key: an entry's copy is queued on its stream, so
# only that stream's later work is sure to see it, and only that stream uses the memory when the
# entry is dropped.
_DEVICE_INTS: Dict[Tuple[Tuple[int, ...], torch.device, int], torch.Tensor] = {}
MAX_CACHED_INTS = 1024


def _cached_device_ints(values: List[int], device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (tuple(values), device, torch._C._cuda_getCurrentRawStream(index))
    hit = _DEVICE_INTS.get(key)
    if hit is None:
        if len(_DEVICE_INTS) >= MAX_CACHED_INTS:
            _DEVICE_INTS.clear()
        host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
        hit = _DEVICE_INTS[key] = host.to(device, non_blocking=True)
    return hit
