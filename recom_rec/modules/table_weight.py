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
    """Shared between a collection and its tables: set when a table's weight Parameter is
    replaced (``load_state_dict(assign=True)``, ``table.weight = nn.Parameter(...)``), so the
    collection re-packs its flat buffer before the next lookup. Deep copies keep the sharing
    because ``copy.deepcopy`` memoises the object."""

    __slots__ = ("stale",)

    def __init__(self) -> None:
        self.stale = False


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


class TableEmbedding(_FlatTableWeight, nn.Embedding):
    """A table of ``recom_rec.EmbeddingCollection``."""

    def __init__(self, weight_view: torch.Tensor, link: FlatLink) -> None:
        rows, dim = weight_view.shape
        super().__init__(rows, dim, _weight=weight_view)
        self._flat_link = link
