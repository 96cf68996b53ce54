"""torchrec DistributedModelParallel support for ``recom_rec.EmbeddingBagCollection`` and
``recom_rec.EmbeddingCollection``."""
from .lookup import FusedPooledEmbeddingsLookup, FusedSequenceEmbeddingsLookup, optimizer_from_fused_params
from .sequence_sharder import EmbeddingCollectionSharder, ShardedFusedEmbeddingCollection
from .sharder import EmbeddingBagCollectionSharder, ShardedFusedEmbeddingBagCollection

__all__ = [
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "FusedPooledEmbeddingsLookup",
    "FusedSequenceEmbeddingsLookup",
    "ShardedFusedEmbeddingBagCollection",
    "ShardedFusedEmbeddingCollection",
    "optimizer_from_fused_params",
]
