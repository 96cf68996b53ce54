"""recom_rec: fused, table-batched embedding layers for torchrec models."""
from .modules import EmbeddingBagCollection

__all__ = ["EmbeddingBagCollection"]
__version__ = "0.1.0"
