"""Quantized inference: ``recom_rec.quant.EmbeddingBagCollection`` and
``recom_rec.quant.EmbeddingCollection`` (torchrec's quantized modules, fused) and
``recom_rec.quantize`` (converts a trained model's embedding modules)."""
from .convert import quantize
from .embedding_collection import EmbeddingCollection
from .embedding_modules import EmbeddingBagCollection
from .torchrec_inference import register_quant_mapping

register_quant_mapping()

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "quantize"]
