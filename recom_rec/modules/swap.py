"""``recom_rec.swap_modules``: put the fused collections into an existing model."""
from typing import Dict

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC

from .embedding_collection import EmbeddingCollection
from .embedding_modules import EmbeddingBagCollection


def swap_modules(model: nn.Module, *, group_parameters: bool = False) -> nn.Module:
    """Replaces every ``torchrec.EmbeddingBagCollection`` and ``torchrec.EmbeddingCollection``
    inside ``model`` (nested, in ModuleLists/ModuleDicts, shared between parents) by a
    ``recom_rec.EmbeddingBagCollection`` / ``recom_rec.EmbeddingCollection`` with the same configs, weights, dtypes, device, ``requires_grad`` flags and
    ``apply_optimizer_in_backward`` setting; returns the model (or the new module, if ``model``
    itself is one). A module shared by several parents stays shared.

    ``group_parameters``: build the new EmbeddingBagCollections with one trainable Parameter per dtype group
    (``EmbeddingBagCollection``'s argument, for dense gradients with ``torch.optim`` over many
    tables; replace the optimizer's parameters after the swap). A module with some tables frozen,
    or trained with ``apply_optimizer_in_backward``, cannot take it (``ValueError``)."""
    converted: Dict[int, nn.Module] = {}

    def convert(old: nn.Module) -> nn.Module:
        if id(old) not in converted:
            converted[id(old)] = (_fused_copy(old, group_parameters) if isinstance(old, TorchrecEBC)
                                  else _fused_ec_copy(old))
        return converted[id(old)]

    if _is_stock(model):
        return convert(model)
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if child is not None and _is_stock(child):
                parent._modules[name] = convert(child)
    return model


def _is_stock(module: nn.Module) -> bool:
    return ((isinstance(module, TorchrecEBC) and not isinstance(module, EmbeddingBagCollection))
            or (isinstance(module, TorchrecEC) and not isinstance(module, EmbeddingCollection)))


def _fused_copy(old: TorchrecEBC, group_parameters: bool = False) -> EmbeddingBagCollection:
    weights = {name: bag.weight for name, bag in old.embedding_bags.items()}
    device = next(iter(weights.values())).device if weights else old.device
    first = next(iter(weights.values()), None)
    classes = getattr(first, "_optimizer_classes", None)
    frozen = [name for name, w in weights.items() if not w.requires_grad]
    if group_parameters and (classes or 0 < len(frozen) < len(weights)):
        why = (f"tables {frozen} are frozen and the others are not (a group trains all its tables)" if not classes
               else "its tables train with apply_optimizer_in_backward (a fused optimizer: no dense gradients)")
        raise ValueError(f"swap_modules(group_parameters=True): {why}")
    # Built on meta and filled from the old weights: no second random initialisation (the RNG
    # stream the model's user sees is unchanged) and no second copy of the tables in memory.
    new = EmbeddingBagCollection(old.embedding_bag_configs(), is_weighted=old.is_weighted(), device="meta",
                                 group_parameters=group_parameters)
    new.to_empty(device=device)
    _take_weights(new, new.embedding_bags, weights, classes, first, group_parameters, frozen)
    return new


def _fused_ec_copy(old: TorchrecEC) -> EmbeddingCollection:
    weights = {name: table.weight for name, table in old.embeddings.items()}
    device = next(iter(weights.values())).device if weights else old.device
    first = next(iter(weights.values()), None)
    new = EmbeddingCollection(old.embedding_configs(), device="meta", need_indices=old.need_indices())
    new.to_empty(device=device)
    _take_weights(new, new.embeddings, weights, getattr(first, "_optimizer_classes", None), first, False,
                  [name for name, w in weights.items() if not w.requires_grad])
    return new


def _take_weights(new: nn.Module, tables: nn.ModuleDict, weights: Dict[str, torch.Tensor], classes, first,
                  group_parameters: bool, frozen) -> None:
    """The old module's weights, dtypes, ``requires_grad`` and ``apply_optimizer_in_backward``, into ``new``."""
    dtypes = {w.dtype for w in weights.values()}
    if len(dtypes) == 1 and {p.dtype for p in new.parameters()} != dtypes:
        new.to(dtypes.pop())  # the old module was converted after construction (e.g. .half())
    with torch.no_grad():
        for name, w in weights.items():
            target = tables[name].weight
            if target.dtype != w.dtype:
                raise ValueError(f"table {name!r}: cannot carry {w.dtype} weights next to tables of "
                                 f"{target.dtype} in one fused module")
            target.copy_(w)
            if not group_parameters:
                target.requires_grad_(w.requires_grad)
    if group_parameters and frozen:  # every table frozen: so are the groups
        for p in new.parameters():
            p.requires_grad_(False)
    if classes:
        from torch.distributed.optim import _apply_optimizer_in_backward

        _apply_optimizer_in_backward(classes[-1], new.parameters(), first._optimizer_kwargs[-1])
