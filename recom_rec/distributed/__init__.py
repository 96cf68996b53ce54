"""torchrec DistributedModelParallel support for ``recom_rec.EmbeddingBagCollection``."""
from .lookup import FusedPooledEmbeddingsLookup, optimizer_from_fused_params
from .sharder import EmbeddingBagCollectionSharder, ShardedFusedEmbeddingBagCollection

__all__ = [
    "EmbeddingBagCollectionSharder",
    "FusedPooledEmbeddingsLookup",
    "ShardedFusedEmbeddingBagCollection",
    "optimizer_from_fused_params",
]
