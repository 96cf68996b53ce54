"""``EmbeddingCollectionSharder``: torchrec's sharding of ``recom_rec.EmbeddingCollection``.

``ShardedFusedEmbeddingCollection`` is torchrec's ``ShardedEmbeddingCollection`` (sequence input
and output distributions, plans, state_dict and checkpoint layout, fused optimizer plumbing) with
one substitution: each sharding type's lookup is a ``FusedSequenceEmbeddingsLookup`` that gathers
the rank's local shards in our fused kernel, the optimizer fused into its backward.
"""
from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionSharder as _TorchrecECSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType

from ..modules.embedding_collection import EmbeddingCollection
from .lookup import FusedSequenceEmbeddingsLookup
from .sharder import _unwrap


class ShardedFusedEmbeddingCollection(ShardedEmbeddingCollection):
    """A sharded ``recom_rec.EmbeddingCollection``: torchrec's module, our lookups."""

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        module_fqn: Optional[str] = None,
        backend: Optional[str] = None,
    ) -> None:
        # Read by _create_lookups, which the parent's __init__ calls.
        object.__setattr__(self, "_recom_backend", backend or getattr(module, "backend", "auto"))
        super().__init__(module=module, table_name_to_parameter_sharding=table_name_to_parameter_sharding, env=env,
                         fused_params=fused_params, device=device, qcomm_codecs_registry=qcomm_codecs_registry,
                         module_fqn=module_fqn)

    def _create_lookups(self) -> None:
        for sharding_type, sharding in self._sharding_type_to_sharding.items():
            configs = getattr(sharding, "_grouped_embedding_configs", None)
            if configs is None:
                raise ValueError(f"recom_rec: sharding {type(sharding).__name__} ({sharding_type}) is not supported")
            pg = sharding._env.process_group if sharding_type == ShardingType.DATA_PARALLEL.value else sharding._pg
            self._lookups.append(FusedSequenceEmbeddingsLookup(
                configs, device=self._device, pg=pg, sharding_type=sharding_type, backend=self._recom_backend))

    def check_inputs(self) -> None:
        """Waits for this rank's lookups (queued by this thread) and raises the input error their
        kernels reported, naming the feature and the table (as the unsharded module's)."""
        for lookup in self._lookups:
            _unwrap(lookup).check_inputs()

    @property
    def unsharded_module_type(self) -> Type[EmbeddingCollection]:
        return EmbeddingCollection


class EmbeddingCollectionSharder(_TorchrecECSharder):
    """torchrec ``ModuleSharder`` for ``recom_rec.EmbeddingCollection``.

    Sharding types as torchrec's sharder of the module: data-parallel, table-wise, column-wise and
    row-wise. Compute kernels: ``fused`` (the optimizer in ``fused_params`` or
    ``apply_optimizer_in_backward`` runs in our backward) and ``dense`` (plain gradients);
    data-parallel tables are ``dense``. ``fused_params`` as torchrec's, e.g.
    ``{"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}``; optimizers EXACT_SGD,
    EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM.
    """

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
                 backend: Optional[str] = None) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._backend = backend

    def shard(self, module: EmbeddingCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None
              ) -> ShardedFusedEmbeddingCollection:
        return ShardedFusedEmbeddingCollection(
            module=module, table_name_to_parameter_sharding=params, env=env, fused_params=self.fused_params,
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            backend=self._backend)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [ShardingType.DATA_PARALLEL.value, ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value,
                ShardingType.ROW_WISE.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return [EmbeddingComputeKernel.DENSE.value]
        return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]

    @property
    def module_type(self) -> Type[EmbeddingCollection]:
        return EmbeddingCollection

    @property
    def sharded_module_type(self) -> Type[ShardedFusedEmbeddingCollection]:
        return ShardedFusedEmbeddingCollection
