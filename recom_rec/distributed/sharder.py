"""``EmbeddingBagCollectionSharder``: torchrec's sharding of ``recom_rec.EmbeddingBagCollection``.

``ShardedFusedEmbeddingBagCollection`` is torchrec's ``ShardedEmbeddingBagCollection`` (input
distribution, output distribution, sharding plans, state_dict hooks, fused optimizer plumbing)
with one substitution: each sharding type's lookup is a ``FusedPooledEmbeddingsLookup`` that
pools all of the rank's local shards in our fused kernel.
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
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType

from ..modules.embedding_modules import EmbeddingBagCollection
from .lookup import FusedPooledEmbeddingsLookup


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
        # Read by _create_lookups, which the parent's __init__ calls.
        object.__setattr__(self, "_recom_backend", backend or getattr(module, "backend", "auto"))
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

    @property
    def unsharded_module_type(self) -> Type[EmbeddingBagCollection]:
        return EmbeddingBagCollection


class EmbeddingBagCollectionSharder(_TorchrecEBCSharder):
    """torchrec ``ModuleSharder`` for ``recom_rec.EmbeddingBagCollection``.

    Sharding types: data-parallel, table-wise, column-wise, table-column-wise, row-wise and
    table-row-wise, on every device (torchrec's stock sharder offers row-wise only on CUDA).
    Compute kernels: ``fused`` (the optimizer in ``fused_params`` / ``apply_optimizer_in_backward``
    runs in our backward) and ``dense`` (plain gradients); data-parallel tables are ``dense``.

    ``fused_params`` as torchrec's sharders take them, e.g.
    ``{"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}``; supported optimizers:
    EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM.
    """

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        backend: Optional[str] = None,
    ) -> None:
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
        return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]

    @property
    def module_type(self) -> Type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    @property
    def sharded_module_type(self) -> Type[ShardedFusedEmbeddingBagCollection]:
        return ShardedFusedEmbeddingBagCollection
