"""``EmbeddingBagCollectionSharder``: torchrec's sharding of ``recom_rec.EmbeddingBagCollection``.

``ShardedFusedEmbeddingBagCollection`` is torchrec's ``ShardedEmbeddingBagCollection`` (input
distribution, output distribution, sharding plans, state_dict hooks, fused optimizer plumbing)
with one substitution: each sharding type's lookup is a ``FusedPooledEmbeddingsLookup`` that
pools all of the rank's local shards in our fused kernel. With ``ps_url`` the sharder also offers
the parameter-server tier as a compute kernel (``ps_placement``), which the planner picks for
tables that do not fit in HBM.
"""
from typing import Any, Dict, List, Optional, Type

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder as _TorchrecEBCSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.modules.embedding_configs import PoolingType
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..modules.embedding_modules import EmbeddingBagCollection
from .gloo_reduce_scatter import for_gloo
from .lookup import FusedPooledEmbeddingsLookup
from .ps_placement import PS_KERNEL, ps_enabled, ps_fused_params
from .variable_batch import with_fused_expansion, with_inverse_indices_in


def _unwrap(lookup: nn.Module) -> nn.Module:
    while isinstance(lookup, DistributedDataParallel):
        lookup = lookup.module
    return lookup


class ShardedFusedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """A sharded ``recom_rec.EmbeddingBagCollection``: torchrec's module, our lookups."""

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        module_fqn: Optional[str] = None,
        backend: Optional[str] = None,
    ) -> None:
        if module.is_weighted():
            row_wise = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
            bad = [c.name for c in module.embedding_bag_configs()
                   if c.pooling == PoolingType.MEAN and table_name_to_parameter_sharding[c.name].sharding_type in row_wise]
            if bad:
                raise ValueError(
                    f"recom_rec: weighted MEAN tables {bad} cannot be sharded row-wise: torchrec's row-wise "
                    "mean pooling divides weighted bags by their sum of weights, our kernel (fbgemm's "
                    "rule) by their length; shard them table-wise or column-wise")
        # Read by _create_lookups and reset_parameters, which the parent's __init__ calls.
        object.__setattr__(self, "_recom_backend", backend or getattr(module, "backend", "auto"))
        # Parameter-server shards are not in the state_dict (their store holds them, as for the
        # unsharded module's PS tables); a weight loaded for one is written into its store.
        object.__setattr__(self, "_ps_table_names", {name for name, ps in table_name_to_parameter_sharding.items()
                                                     if ps.compute_kernel == PS_KERNEL})
        super().__init__(
            module=module,
            table_name_to_parameter_sharding=table_name_to_parameter_sharding,
            env=env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        # Start from the unsharded module's weights (torchrec only copies them off the CPU).
        if getattr(module, "device", torch.device("meta")).type != "meta":
            weights = {c.name: module.embedding_bags[c.name].weight.detach()
                       for c in module.embedding_bag_configs()}
            for lookup in self._lookups:
                _unwrap(lookup).copy_from_unsharded(weights)
        if self._ps_table_names:
            self._register_load_state_dict_pre_hook(_load_ps_shards, with_module=True)

    def _create_lookups(self) -> None:
        for sharding_type, sharding in zip(self._sharding_types, self._embedding_shardings):
            if isinstance(sharding, DpPooledEmbeddingSharding):
                configs, pg = sharding._grouped_embedding_configs, sharding._env.process_group
            elif isinstance(sharding, TwRwPooledEmbeddingSharding):
                configs, pg = sharding._grouped_embedding_configs_per_rank[sharding._rank], sharding._pg
            elif hasattr(sharding, "_grouped_embedding_configs"):  # TW, CW, TWCW, RW
                configs, pg = sharding._grouped_embedding_configs, sharding._pg
            else:
                raise ValueError(f"recom_rec: sharding {type(sharding).__name__} ({sharding_type}) is not supported")
            self._lookups.append(FusedPooledEmbeddingsLookup(
                configs, device=self._device, pg=pg, sharding_type=sharding_type,
                backend=self._recom_backend,
            ))

    def _create_output_dist(self) -> None:
        super()._create_output_dist()
        for output_dist in self._output_dists:
            for_gloo(output_dist)

    def input_dist(self, ctx, features):
        # torchrec's row-wise mean pooling of a VBE batch (its divisor, from the bag lengths) reads
        # the inverse indices' rows in its features' sharded order whenever they hold as many
        # features, whatever order they name them in (torchrec 1.6 - 1.8): give it them in that order.
        if (self._has_mean_pooling_callback and isinstance(features, KeyedJaggedTensor)
                and features.variable_stride_per_key() and features.inverse_indices_or_none() is not None):
            features = with_inverse_indices_in(features, self._sharded_feature_order())
        return super().input_dist(ctx, features)

    def output_dist(self, ctx, output):
        return with_fused_expansion(super().output_dist(ctx, output))

    def compute_and_output_dist(self, ctx, input):
        return with_fused_expansion(super().compute_and_output_dist(ctx, input))

    def _sharded_feature_order(self) -> List[str]:
        """The features in the order the shardings read them, each once."""
        names = [f for sharding in self._embedding_shardings for f in sharding.feature_names()]
        return list(dict.fromkeys(names))

    def check_inputs(self) -> None:
        """Waits for this rank's lookups (queued by this thread) and raises the input error their
        kernels reported, naming the feature and the table (with this rank's rows of it), as the
        unsharded module's ``check_inputs()``. A rank raises the errors of the lookups it ran: with
        table-wise sharding, the ids its tables received from every rank's batch."""
        for lookup in self._lookups:
            _unwrap(lookup).check_inputs()

    def ps_tiers(self):
        """The parameter-server tiers of this rank's shards (``recom_rec.ps.flush`` and
        ``tiers_of`` find them through this: torchrec keeps the lookups in a plain list)."""
        from ..ps import tiers_of

        return [t for lookup in self._lookups for t in tiers_of(_unwrap(lookup))]

    def reset_parameters(self) -> None:
        # Parameter-server shards have no weight here: their never-seen rows come from the tier's
        # deterministic init rule (recom_rec.ps), the others from the unsharded module's weights.
        configs = self._embedding_bag_configs
        self._embedding_bag_configs = [c for c in configs if c.name not in self._ps_table_names]
        try:
            super().reset_parameters()
        finally:
            self._embedding_bag_configs = configs

    @property
    def unsharded_module_type(self) -> Type[EmbeddingBagCollection]:
        return EmbeddingBagCollection


def _shard_region(value, r0: int, c0: int, rows: int, cols: int, key: str) -> torch.Tensor:
    """The ``[rows, cols]`` block at (r0, c0) of a loaded weight: a full tensor, or a
    ShardedTensor one of whose local shards covers it."""
    if isinstance(value, ShardedTensor):
        for shard in value.local_shards():
            (sr, sc), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            if sr <= r0 and sc <= c0 and r0 + rows <= sr + nr and c0 + cols <= sc + nc:
                return shard.tensor[r0 - sr:r0 - sr + rows, c0 - sc:c0 - sc + cols]
        raise ValueError(f"{key}: no local shard of the loaded ShardedTensor covers rows {r0}..{r0 + rows} x "
                         f"columns {c0}..{c0 + cols} of this rank's parameter-server shard; load a full "
                         "tensor (e.g. an unsharded checkpoint) for it")
    return value[r0:r0 + rows, c0:c0 + cols]


def _load_ps_shards(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                    error_msgs) -> None:
    for lookup in module._lookups:
        lookup = _unwrap(lookup)
        for i, table, r0, c0, rows, cols in lookup.ps_shards():
            key = f"{prefix}embedding_bags.{table}.weight"
            if key in state_dict:
                lookup.load_ps_shard(i, _shard_region(state_dict[key], r0, c0, rows, cols, key))
    for table in module._ps_table_names:
        state_dict.pop(f"{prefix}embedding_bags.{table}.weight", None)


class EmbeddingBagCollectionSharder(_TorchrecEBCSharder):
    """torchrec ``ModuleSharder`` for ``recom_rec.EmbeddingBagCollection``.

    Sharding types: data-parallel, table-wise, column-wise, table-column-wise, row-wise and
    table-row-wise, on every device (torchrec's stock sharder offers row-wise only on CUDA).
    Compute kernels: ``fused`` (the optimizer in ``fused_params`` / ``apply_optimizer_in_backward``
    runs in our backward) and ``dense`` (plain gradients); data-parallel tables are ``dense``.

    ``fused_params`` as torchrec's sharders take them, e.g.
    ``{"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}``; supported optimizers:
    EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM.

    ``ps_url`` (e.g. ``"memory://tier"`` or ``"redis://host:6379/0?prefix=model"``) adds the
    parameter-server tier as a compute kernel (``customized_kernel`` in plans) for every sharding
    type but data-parallel: a shard planned on it keeps ``ps_cache_load_factor`` of its rows in a
    cache in HBM (it must hold a batch's distinct ids) and all of them in the store. The planner
    (``recom_rec.distributed.planner``) estimates it so that it is chosen for tables that do not
    fit in HBM.
    """

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        backend: Optional[str] = None,
        ps_url: Optional[str] = None,
        ps_cache_load_factor: float = 0.2,
        ps_eviction: str = "lru",
    ) -> None:
        if ps_url is not None:
            fused_params = {**(fused_params or {}), **ps_fused_params(ps_url, ps_cache_load_factor, ps_eviction)}
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._backend = backend

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ShardedFusedEmbeddingBagCollection:
        return ShardedFusedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            backend=self._backend,
        )

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [
            ShardingType.DATA_PARALLEL.value,
            ShardingType.TABLE_WISE.value,
            ShardingType.COLUMN_WISE.value,
            ShardingType.TABLE_COLUMN_WISE.value,
            ShardingType.ROW_WISE.value,
            ShardingType.TABLE_ROW_WISE.value,
        ]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return [EmbeddingComputeKernel.DENSE.value]
        kernels = [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]
        return kernels + [PS_KERNEL] if ps_enabled(self.fused_params) else kernels

    @property
    def module_type(self) -> Type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    @property
    def sharded_module_type(self) -> Type[ShardedFusedEmbeddingBagCollection]:
        return ShardedFusedEmbeddingBagCollection
