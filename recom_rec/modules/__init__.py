from .embedding_collection import EmbeddingCollection
from .embedding_modules import EmbeddingBagCollection
from .swap import swap_modules

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "swap_modules"]
