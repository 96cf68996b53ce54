from .embedding_modules import EmbeddingBagCollection

__all__ = ["EmbeddingBagCollection"]
