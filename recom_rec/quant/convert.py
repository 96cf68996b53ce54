"""Float -> quantized: ``recom_rec.quantize`` (every EmbeddingBagCollection and EmbeddingCollection
in a trained model, as torchrec's ``quantize_embeddings``)."""
import copy
from typing import Dict, Optional

import torch
from torch import nn
from torch import quantization as tq
from torchrec.modules.embedding_configs import QuantConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC

from ..modules.embedding_collection import EmbeddingCollection as FusedEC
from ..modules.embedding_modules import EmbeddingBagCollection as FusedEBC
from .embedding_collection import EmbeddingCollection as QuantEC
from .embedding_modules import EmbeddingBagCollection as QuantEBC


def quantize(
    model: nn.Module,
    dtype: torch.dtype = torch.qint8,
    *,
    output_dtype: torch.dtype = torch.float,
    per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None,
    inplace: bool = False,
    backend: str = "auto",
    validate_inputs: bool = True,
) -> nn.Module:
    """Replaces every float EmbeddingBagCollection in ``model`` (torchrec's and
    ``recom_rec.EmbeddingBagCollection``; nested, shared ones stay shared) by a
    ``recom_rec.quant.EmbeddingBagCollection``, and every float EmbeddingCollection by a
    ``recom_rec.quant.EmbeddingCollection``, as torchrec's ``quantize_embeddings`` does with
    its own quantized modules. ``dtype`` is torchrec's weight dtype: ``torch.qint8`` / ``quint8``
    (INT8 rows), ``torch.quint4x2`` (INT4), ``torch.quint2x4`` (INT2), ``torch.float8_e4m3fn``
    (fbgemm's FP8 rows, torchrec >= 1.7), ``torch.half`` (FP16), ``torch.float`` (FP32);
    ``per_table_weight_dtype`` overrides it per table; ``output_dtype`` is the output's.
    Returns the model (or the new module, if ``model`` itself is one of those modules)."""
    if not inplace:
        model = copy.deepcopy(model)
    qconfig = QuantConfig(
        activation=tq.PlaceholderObserver.with_args(dtype=output_dtype),
        weight=tq.PlaceholderObserver.with_args(dtype=dtype),
        per_table_weight_dtype=per_table_weight_dtype,
    )
    converted: Dict[int, nn.Module] = {}

    def convert(old: nn.Module) -> nn.Module:
        if id(old) not in converted:
            old.qconfig = qconfig
            try:
                cls = QuantEBC if isinstance(old, TorchrecEBC) else QuantEC
                converted[id(old)] = cls.from_float(old, backend=backend, validate_inputs=validate_inputs)
            finally:
                del old.qconfig
        return converted[id(old)]

    def is_float_ebc(m: nn.Module) -> bool:
        return isinstance(m, (TorchrecEBC, FusedEBC, TorchrecEC, FusedEC))

    if is_float_ebc(model):
        return convert(model)
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and is_float_ebc(child):
                parent._modules[name] = convert(child)
    return model
