"""``EmbeddingCollectionSharder``: torchrec's sharding of ``recom_rec.EmbeddingCollection``.

``ShardedFusedEmbeddingCollection`` is torchrec's ``ShardedEmbeddingCollection`` (sequence input
and output distributions, plans, state_dict and checkpoint layout, fused optimizer plumbing) with
one substitution: each sharding type's lookup is a ``FusedSequenceEmbeddingsLookup`` that gathers
the rank's local shards in our fused kernel, the optimizer fused into its backward. A KJT with a
batch size per feature (VBE) is padded to one batch size on the way in (empty bags: the same ids,
so the same rows) and each feature's output cut back to its own bags on the way out.
"""
from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionSharder as _TorchrecECSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from ..modules.embedding_collection import EmbeddingCollection
from ..ops.variable_batch import pad_to_uniform
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

    def input_dist(self, ctx, features):
        # A batch size per feature (VBE): each key's bags padded with empty ones to the largest
        # count, which adds no id (torchrec's sequence dists read one batch size; torchrec's own
        # module fails on such a batch); the outputs are cut back to each key's bags (_own_bags).
        if isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
            ctx.recom_bags_per_key = dict(zip(features.keys(), features.stride_per_key()))
            features = pad_to_uniform(features)
        return super().input_dist(ctx, features)

    def compute_and_output_dist(self, ctx, input):
        return _own_bags(super().compute_and_output_dist(ctx, input), ctx)

    def output_dist(self, ctx, output):
        return _own_bags(super().output_dist(ctx, output), ctx)

    @property
    def unsharded_module_type(self) -> Type[EmbeddingCollection]:
        return EmbeddingCollection


def _own_bags(awaitable, ctx):
    """The output awaitable, each feature's JaggedTensor cut back to the bags its VBE batch had
    (the padded bags are empty and last)."""
    bags: Optional[Dict[str, int]] = getattr(ctx, "recom_bags_per_key", None)
    if bags:
        def cut(out: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
            return {key: JaggedTensor(values=jt.values(), lengths=jt.lengths()[:bags[key]],
                                      weights=jt.weights_or_none()) if key in bags else jt
                    for key, jt in out.items()}

        awaitable.callbacks.append(cut)
    return awaitable


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
