"""torchrec's inference flow quantizes ours: ``torchrec.inference.modules.quantize_inference_model``
finds the modules to quantize by their type's name in its ``DEFAULT_QUANT_MAPPING``, which names
only torchrec's classes (ours would be left float, without a word). Ours are added beside them,
mapped to our quantized modules. torchrec's lower-level ``quantize_embeddings`` matches exact types
and takes ours through its ``additional_qconfig_spec_keys`` / ``additional_mapping``
(docs/quantized.md)."""
import torch
from torchrec.inference import modules as trec_inference

from ..modules.embedding_collection import EmbeddingCollection as FusedEC
from ..modules.embedding_modules import EmbeddingBagCollection as FusedEBC
from .embedding_collection import EmbeddingCollection as QuantEC
from .embedding_modules import EmbeddingBagCollection as QuantEBC


def register_quant_mapping() -> None:
    """Adds ours to torchrec's default quantization mapping (leaves an entry a user set alone)."""
    for float_cls, quant_cls in ((FusedEBC, QuantEBC), (FusedEC, QuantEC)):
        name = trec_inference.trim_torch_package_prefix_from_typename(torch.typename(float_cls))
        trec_inference.DEFAULT_QUANT_MAPPING.setdefault(name, quant_cls)
