"""A rank's fused-optimizer state as torchrec's sharded modules present theirs.

Per table: its weight as a ShardedTensor over this rank's shards, and each optimizer state as a
ShardedTensor whose local shards are views of the state the fused kernels update, named as
torchrec's TBE-backed optimizers name them (``<table>.momentum1``, ``<table>.momentum2``). With
every rank's rows in the global layout, ``torch.distributed.checkpoint`` saves them all and loads
them into another plan or world size (plain local tensors would be taken as replicated: one rank's
rows saved, and loaded into every rank).

The layouts follow torchrec's ``EmbeddingFusedOptimizer``: a state of a row's elements is sharded
as the weight is; a row-wise state (one value a row) is 1-D, sharded by rows, and for column-wise
shards each shard's column slice keeps its own rows (the shards sorted by column offset, one after
another: ``rows x shards`` values).
"""
import copy
from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

# Our fused optimizers' state names (optim/spec.py) -> torchrec's. Adam's step count is one value
# shared by every table (kept as it is: the same on every rank).
TORCHREC_STATE_NAMES = {"sum": "momentum1", "exp_avg": "momentum1", "exp_avg_sq": "momentum2"}


def _properties(like: torch.Tensor) -> TensorProperties:
    return TensorProperties(dtype=like.dtype, layout=like.layout, requires_grad=like.requires_grad,
                            pin_memory=like.is_pinned() if like.device.type == "cpu" else False)


def _sharded(local: List[Shard], every: List[ShardMetadata], size, like: torch.Tensor, pg) -> ShardedTensor:
    """A ShardedTensor of ``size`` sharded as ``every`` (all ranks' shards), this rank's ``local``."""
    metadata = ShardedTensorMetadata(shards_metadata=every, size=torch.Size(size), tensor_properties=_properties(like))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=pg)


def _global(table, like: torch.Tensor, pg, local: List[Tuple[ShardMetadata, torch.Tensor]]) -> ShardedTensor:
    """A tensor sharded as ``table``'s weight (its global metadata), with ``local``'s shards."""
    metadata = copy.deepcopy(table.global_metadata)
    metadata.tensor_properties = _properties(like)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(tensor, meta) for meta, tensor in local], metadata, process_group=pg)


def _row_wise_layout(table) -> Tuple[Dict[Tuple, ShardMetadata], int]:
    """Each weight shard's (by offsets) 1-D shard of a row-wise state, and the state's length."""
    shards = table.global_metadata.shards_metadata
    rows, dim = table.num_embeddings, table.embedding_dim
    column_wise = table.local_cols != dim
    if column_wise and table.local_rows != rows:
        raise NotImplementedError(f"table '{table.name}': row-wise optimizer state of grid-sharded tables")
    if column_wise:
        shards = sorted(shards, key=lambda s: s.shard_offsets[1])
    layout = {}
    for k, s in enumerate(shards):
        offset = k * s.shard_sizes[0] if column_wise else s.shard_offsets[0]
        layout[tuple(s.shard_offsets)] = ShardMetadata(shard_offsets=[offset], shard_sizes=[s.shard_sizes[0]],
                                                       placement=s.placement)
    return layout, rows * (len(shards) if column_wise else 1)


def sharded_optimizer_state(tables: Sequence, weights: Sequence[torch.Tensor],
                            states: Sequence[Dict[str, torch.Tensor]], pg
                            ) -> Tuple[Dict[str, ShardedTensor], Dict[ShardedTensor, Dict[str, torch.Tensor]]]:
    """``(params, state)`` for a KeyedOptimizer over this rank's shards ``tables`` (torchrec's
    ShardedEmbeddingTable; several may be column shards of one table), their local ``weights`` and
    their fused state (``states[i]``: name -> the tensor the kernels update): params keyed
    ``<table>.weight``, each state keyed ``<table>.<torchrec's name>``."""
    by_table: "OrderedDict[str, List[int]]" = OrderedDict()
    for i, t in enumerate(tables):
        by_table.setdefault(t.name, []).append(i)
    params: Dict[str, ShardedTensor] = {}
    state: Dict[ShardedTensor, Dict[str, torch.Tensor]] = {}
    for name, members in by_table.items():
        table = tables[members[0]]
        weight = _global(table, weights[members[0]], pg,
                         [(tables[i].local_metadata, weights[i]) for i in members])
        params[f"{name}.weight"] = weight
        state[weight] = {}
        for ours, first in states[members[0]].items():
            if ours == "step":
                state[weight][f"{name}.step"] = first
                continue
            key = f"{name}.{TORCHREC_STATE_NAMES[ours]}"
            if first.dim() == 2:  # a value per element: sharded as the weight
                state[weight][key] = _global(table, first, pg,
                                             [(tables[i].local_metadata, states[i][ours]) for i in members])
            else:  # a value per row
                layout, length = _row_wise_layout(table)
                shards = [Shard(states[i][ours], layout[tuple(tables[i].local_metadata.shard_offsets)])
                          for i in members]
                state[weight][key] = _sharded(shards, list(layout.values()), [length], first, pg)
    return params, state
