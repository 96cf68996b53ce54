"""recom_rec: fused, table-batched embedding layers for torchrec models."""
from .modules import EmbeddingBagCollection, EmbeddingCollection, swap_modules
from .quant import quantize
from .tuning import tune

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "quantize", "swap_modules", "tune"]
__version__ = "0.1.0"
