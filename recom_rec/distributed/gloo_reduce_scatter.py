"""Row-wise output distribution of a variable batch (VBE) on gloo.

torchrec reduces a row-wise (and table-row-wise) VBE output with a reduce-scatter of unequal
chunks (each rank's bags), whose backward is an all-gather of unequal chunks, which gloo does not
have ("ProcessGroupGloo::allgather: invalid tensor size"). On a gloo group the output dists here
pad each rank's chunk to the largest one and reduce-scatter equal chunks (backward: an equal
all-gather), then drop the padding; the sums are the same. NCCL groups keep torchrec's collective.
"""
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm_ops import reduce_scatter_v_pooled
from torchrec.distributed.dist_data import PooledEmbeddingsAwaitable, VariableBatchPooledEmbeddingsReduceScatter
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs


class PaddedVariableBatchReduceScatter(nn.Module):
    """torchrec's ``VariableBatchPooledEmbeddingsReduceScatter`` over equal, padded chunks."""

    def __init__(self, pg: dist.ProcessGroup, codecs: Optional[QuantizedCommCodecs] = None) -> None:
        super().__init__()
        self._pg = pg
        self._codecs = codecs

    def forward(self, local_embs: torch.Tensor, batch_size_per_rank_per_feature: List[List[int]],
                embedding_dims: List[int]) -> Awaitable[torch.Tensor]:
        world = self._pg.size()
        splits = [sum(b * d for b, d in zip(sizes, embedding_dims)) for sizes in batch_size_per_rank_per_feature]
        splits = splits or [0] * world
        width = max(splits)
        padded = torch.cat([nn.functional.pad(chunk, (0, width - chunk.numel()))
                            for chunk in local_embs.split(splits)])
        mine = splits[dist.get_rank(self._pg)]
        result = PooledEmbeddingsAwaitable(reduce_scatter_v_pooled(padded, [width] * world, self._pg, self._codecs))
        result.callbacks.append(lambda reduced: reduced[:mine])
        return result


def _is_gloo(pg: dist.ProcessGroup) -> bool:
    return dist.get_backend(pg) == dist.Backend.GLOO


class GlooRwPooledEmbeddingDist(RwPooledEmbeddingDist):
    """torchrec's row-wise output dist, a VBE batch reduced over padded chunks (see the module doc)."""

    def _create_output_dist_module(self, sharding_ctx: Optional[EmbeddingShardingContext] = None) -> None:
        super()._create_output_dist_module(sharding_ctx)
        if isinstance(self._dist, VariableBatchPooledEmbeddingsReduceScatter):
            self._dist = PaddedVariableBatchReduceScatter(self._pg, self._codecs)


class GlooTwRwPooledEmbeddingDist(TwRwPooledEmbeddingDist):
    """torchrec's table-row-wise output dist, a VBE batch reduced within the host over padded chunks."""

    def _create_output_dist_modules(self, sharding_ctx: Optional[EmbeddingShardingContext] = None) -> None:
        super()._create_output_dist_modules(sharding_ctx)
        if self._variable_intra_dist is not None:
            self._variable_intra_dist = PaddedVariableBatchReduceScatter(self._intra_pg, self._intra_codecs)


def for_gloo(output_dist: nn.Module) -> nn.Module:
    """``output_dist`` (made by torchrec's sharding), its VBE reduce-scatter padded on a gloo group.
    Only the class changes: the subclasses add no state."""
    if type(output_dist) is RwPooledEmbeddingDist and _is_gloo(output_dist._pg):
        output_dist.__class__ = GlooRwPooledEmbeddingDist
    elif type(output_dist) is TwRwPooledEmbeddingDist and _is_gloo(output_dist._intra_pg):
        output_dist.__class__ = GlooTwRwPooledEmbeddingDist
    return output_dist
