"""recom_rec: fused, table-batched embedding layers for torchrec models."""
from .modules import EmbeddingBagCollection, swap_modules

__all__ = ["EmbeddingBagCollection", "swap_modules"]
__version__ = "0.1.0"
