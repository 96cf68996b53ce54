"""``recom_rec.swap_modules``: put the fused EmbeddingBagCollection into an existing model."""
from typing import Dict

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC

from .embedding_modules import EmbeddingBagCollection


def swap_modules(model: nn.Module) -> nn.Module:
    """Replaces every ``torchrec.EmbeddingBagCollection`` inside ``model`` (nested, in
    ModuleLists/ModuleDicts, shared between parents) by a ``recom_rec.EmbeddingBagCollection``
    with the same configs, weights, dtypes, device, ``requires_grad`` flags and
    ``apply_optimizer_in_backward`` setting; returns the model (or the new module, if ``model``
    itself is one). A module shared by several parents stays shared."""
    converted: Dict[int, EmbeddingBagCollection] = {}

    def convert(old: TorchrecEBC) -> EmbeddingBagCollection:
        if id(old) not in converted:
            converted[id(old)] = _fused_copy(old)
        return converted[id(old)]

    if _is_stock(model):
        return convert(model)
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if child is not None and _is_stock(child):
                parent._modules[name] = convert(child)
    return model


def _is_stock(module: nn.Module) -> bool:
    return isinstance(module, TorchrecEBC) and not isinstance(module, EmbeddingBagCollection)


def _fused_copy(old: TorchrecEBC) -> EmbeddingBagCollection:
    weights = {name: bag.weight for name, bag in old.embedding_bags.items()}
    device = next(iter(weights.values())).device if weights else old.device
    # Built on meta and filled from the old weights: no second random initialisation (the RNG
    # stream the model's user sees is unchanged) and no second copy of the tables in memory.
    new = EmbeddingBagCollection(old.embedding_bag_configs(), is_weighted=old.is_weighted(), device="meta")
    new.to_empty(device=device)
    dtypes = {w.dtype for w in weights.values()}
    if len(dtypes) == 1 and {p.dtype for p in new.parameters()} != dtypes:
        new.to(dtypes.pop())  # the old module was converted after construction (e.g. .half())
    with torch.no_grad():
        for name, w in weights.items():
            target = new.embedding_bags[name].weight
            if target.dtype != w.dtype:
                raise ValueError(f"table {name!r}: cannot carry {w.dtype} weights next to tables of "
                                 f"{target.dtype} in one fused module")
            target.copy_(w)
            target.requires_grad_(w.requires_grad)
    first = next(iter(weights.values()), None)
    classes = getattr(first, "_optimizer_classes", None)
    if classes:
        from torch.distributed.optim import _apply_optimizer_in_backward

        _apply_optimizer_in_backward(classes[-1], new.parameters(), first._optimizer_kwargs[-1])
    return new
