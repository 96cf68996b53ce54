"""A float EmbeddingBagCollection's (or EmbeddingCollection's) quantized counterpart's constructor
arguments (what ``from_float`` builds the quantized module from)."""
import copy
from typing import Any, Dict

import torch
from torch import nn
from torchrec.quant import embedding_modules as trec_quant

from .rows import quantize_rows, row_type


def quantized_module_args(module: nn.Module) -> Dict[str, Any]:
    """The constructor arguments of the quantized module ``from_float`` builds from a float
    EmbeddingBagCollection or EmbeddingCollection (torchrec's or ours) with a ``qconfig``: torchrec's table data types,
    pruning, and module attributes, and the rows quantized by fbgemm's quantizers."""
    pooled = hasattr(module, "embedding_bag_configs")
    kind = "EmbeddingBagCollection" if pooled else "EmbeddingCollection"
    if not hasattr(module, "qconfig"):
        raise ValueError(f"{kind} input float module must have qconfig defined")
    if getattr(module, "_ps", None) is not None:
        raise ValueError("an EmbeddingBagCollection with parameter-server tables holds only a cache of their rows; "
                         "it cannot be quantized (load the full tables into a module without ps=... first)")
    pruning: Dict[str, int] = getattr(module, trec_quant.MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT, {})
    configs = copy.deepcopy(module.embedding_bag_configs() if pooled else module.embedding_configs())
    tables = module.embedding_bags if pooled else module.embeddings
    trec_quant._update_embedding_configs(configs, module.qconfig, pruning)
    weights = {}
    device = torch.device("cpu")
    for config in configs:
        w = tables[config.name].weight
        device = w.device
        if config.name in pruning:
            w = w[:pruning[config.name]]
        if not w.is_meta:
            weights[config.name] = quantize_rows(w, row_type(config.data_type, config.name))
    args: Dict[str, Any] = dict(is_weighted=module.is_weighted()) if pooled else dict(need_indices=module.need_indices())
    return dict(
        args,
        tables=configs,
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
