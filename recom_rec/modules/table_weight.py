"""The per-table submodules of the fused collections.

It *is* an ``nn.EmbeddingBag`` (an ``nn.Embedding`` in the EmbeddingCollection), so code written
against torchrec's ``embedding_bags[name]`` (``embeddings[name]``) keeps working, and it can even be
called on its own; its ``weight`` is a leaf Parameter viewing the table's slice of the
collection's flat buffer.
"""
import warnings

import torch
from torch import nn


class FlatLink:
    """Shared between a collection and its tables. ``stale``: a table's weight Parameter was
    replaced (``load_state_dict(assign=True)``, ``table.weight = nn.Parameter(...)``), so the
    collection re-packs its flat buffer before the next lookup. ``swapped``: an entry of a table's
    parameter dict was set some other way (``torch.func.functional_call`` and torch.export's
    tracing swap tensors in and out there), so the next lookup checks which weights the tables
    hold. Deep copies keep the sharing because ``copy.deepcopy`` memoises the object."""

    __slots__ = ("stale", "swapped")

    def __init__(self) -> None:
        self.stale = False
        self.swapped = False


class WatchedParameters(dict):
    """A table module's ``_parameters``: setting an entry marks the collection's link ``swapped``
    (one flag, so that a lookup need not compare every table's weight every call)."""

    __slots__ = ("link",)

    def __init__(self, items, link: FlatLink) -> None:
        super().__init__(items)
        self.link = link

    def __setitem__(self, key, value) -> None:
        self.link.swapped = True
        super().__setitem__(key, value)

    def __reduce__(self):
        return WatchedParameters, (dict(self), self.link)


def watch_parameters(module: nn.Module, link: FlatLink) -> None:
    """Gives ``module`` a WatchedParameters of its parameters (unless it has one on ``link``)."""
    params = module.__dict__["_parameters"]
    if not (isinstance(params, WatchedParameters) and params.link is link):
        module.__dict__["_parameters"] = WatchedParameters(params, link)


class _FlatTableWeight:
    """What a table module viewing a collection's flat buffer needs: replacing its ``weight``
    marks the buffer stale, and checkpoints with or without fused-optimizer state load."""

    def register_parameter(self, name, param) -> None:
        super().register_parameter(name, param)
        link = self.__dict__.get("_flat_link")
        if name == "weight" and link is not None:
            link.stale = True

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # A checkpoint without fused-optimizer state (e.g. torchrec's own) still loads: the
        # state keeps its current values.
        optimizer_keys = {prefix + name for name in self._buffers if name.startswith("optimizer_")}
        missing_keys[:] = [k for k in missing_keys if k not in optimizer_keys]
        # State of a fused optimizer this module does not have (yet): nothing to put it in.
        dropped = [k for k in unexpected_keys if k.startswith(prefix + "optimizer_") and k not in optimizer_keys]
        if dropped:
            warnings.warn(f"fused-optimizer state {dropped} ignored: enable the same fused optimizer "
                          "before load_state_dict to restore it")
            unexpected_keys[:] = [k for k in unexpected_keys if k not in dropped]


class TableEmbeddingBag(_FlatTableWeight, nn.EmbeddingBag):
    """A table of ``recom_rec.EmbeddingBagCollection``."""

    def __init__(self, weight_view: torch.Tensor, mode: str, link: FlatLink) -> None:
        rows, dim = weight_view.shape
        super().__init__(rows, dim, mode=mode, include_last_offset=True, _weight=weight_view)
        self._flat_link = link
        watch_parameters(self, link)


class TableEmbedding(_FlatTableWeight, nn.Embedding):
    """A table of ``recom_rec.EmbeddingCollection``."""

    def __init__(self, weight_view: torch.Tensor, link: FlatLink) -> None:
        rows, dim = weight_view.shape
        super().__init__(rows, dim, _weight=weight_view)
        self._flat_link = link
        watch_parameters(self, link)
