from .embedding_modules import EmbeddingBagCollection
from .swap import swap_modules

__all__ = ["EmbeddingBagCollection", "swap_modules"]
