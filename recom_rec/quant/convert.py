"""Float -> quantized: ``from_float``'s arguments, and ``recom_rec.quantize`` (every
EmbeddingBagCollection in a trained model, as torchrec's ``quantize_embeddings``)."""
import copy
from typing import Any, Dict, Optional

import torch
from torch import nn
from torch import quantization as tq
from torchrec.modules.embedding_configs import QuantConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC
from torchrec.quant import embedding_modules as trec_quant

from ..modules.embedding_modules import EmbeddingBagCollection as FusedEBC
from .rows import quantize_rows, row_type


def quantized_module_args(module: nn.Module) -> Dict[str, Any]:
    """The constructor arguments of the quantized module ``from_float`` builds from a float
    EmbeddingBagCollection (torchrec's or ours) with a ``qconfig``: torchrec's table data types,
    pruning, and module attributes, and the rows quantized by fbgemm's quantizers."""
    if not hasattr(module, "qconfig"):
        raise ValueError("EmbeddingBagCollection input float module must have qconfig defined")
    if getattr(module, "_ps", None) is not None:
        raise ValueError("an EmbeddingBagCollection with parameter-server tables holds only a cache of their rows; "
                         "it cannot be quantized (load the full tables into a module without ps=... first)")
    pruning: Dict[str, int] = getattr(module, trec_quant.MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT, {})
    configs = copy.deepcopy(module.embedding_bag_configs())
    trec_quant._update_embedding_configs(configs, module.qconfig, pruning)
    weights = {}
    device = torch.device("cpu")
    for config in configs:
        w = module.embedding_bags[config.name].weight
        device = w.device
        if config.name in pruning:
            w = w[:pruning[config.name]]
        if not w.is_meta:
            weights[config.name] = quantize_rows(w, row_type(config.data_type, config.name))
    return dict(
        tables=configs,
        is_weighted=module.is_weighted(),
        device=device,
        output_dtype=module.qconfig.activation().dtype,
        table_name_to_quantized_weights=weights or None,
        register_tbes=getattr(module, trec_quant.MODULE_ATTR_REGISTER_TBES_BOOL, False),
        quant_state_dict_split_scale_bias=getattr(module, trec_quant.MODULE_ATTR_QUANT_STATE_DICT_SPLIT_SCALE_BIAS,
                                                  False),
        row_alignment=getattr(module, trec_quant.MODULE_ATTR_ROW_ALIGNMENT_INT, trec_quant.DEFAULT_ROW_ALIGNMENT),
        # (the attribute is newer than torchrec 1.6; its name is the same)
        cache_features_order=getattr(module, getattr(trec_quant, "MODULE_ATTR_CACHE_FEATURES_ORDER",
                                                     "__cache_features_order"), False),
    )


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
    ``recom_rec.quant.EmbeddingBagCollection``, as torchrec's ``quantize_embeddings`` does with
    its own quantized module. ``dtype`` is torchrec's weight dtype: ``torch.qint8`` / ``quint8``
    (INT8 rows), ``torch.quint4x2`` (INT4), ``torch.quint2x4`` (INT2), ``torch.float8_e4m3fn``
    (fbgemm's FP8 rows, torchrec >= 1.7), ``torch.half`` (FP16), ``torch.float`` (FP32);
    ``per_table_weight_dtype`` overrides it per table; ``output_dtype`` is the pooled output's.
    Returns the model (or the new module, if ``model`` itself is an EmbeddingBagCollection)."""
    from .embedding_modules import EmbeddingBagCollection as QuantEBC

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
                converted[id(old)] = QuantEBC.from_float(old, backend=backend, validate_inputs=validate_inputs)
            finally:
                del old.qconfig
        return converted[id(old)]

    def is_float_ebc(m: nn.Module) -> bool:
        return isinstance(m, (TorchrecEBC, FusedEBC))

    if is_float_ebc(model):
        return convert(model)
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and is_float_ebc(child):
                parent._modules[name] = convert(child)
    return model
