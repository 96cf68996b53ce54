"""Quantized inference: ``recom_rec.quant.EmbeddingBagCollection`` (torchrec's quantized EBC,
fused) and ``recom_rec.quantize`` (converts a trained model's EmbeddingBagCollections)."""
from .convert import quantize
from .embedding_modules import EmbeddingBagCollection

__all__ = ["EmbeddingBagCollection", "quantize"]
