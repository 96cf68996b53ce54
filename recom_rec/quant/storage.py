"""The storage the quantized modules share: one flat byte buffer of fbgemm-layout rows, the tables'
``state_dict`` buffers as views of it, copies and device moves that keep them so, the settings
and the input reports."""
import copy
from collections import OrderedDict
from typing import List

import torch
from torch import Tensor, nn
from torchrec.tensor_types import UInt2Tensor, UInt4Tensor

from ..ops.backends import check_backend
from ..ops.input_check import new_report_id
from ..ops.quantized_lookup import OUTPUT_DTYPES, load_kernels
from .layout import QuantTableSlot
from .rows import SCALE_BIAS_BYTES, RowType, data_bytes


def bind_table_views(tables: nn.ModuleDict, slots: List[QuantTableSlot], flat: Tensor, split_scale_bias: bool) -> None:
    """(Re-)registers each table's state_dict buffers (``weight``, and with ``split_scale_bias``
    ``weight_qscale`` / ``weight_qbias``) as views of the flat buffer, as torchrec registers views of
    its TBEs' buffers; INT4 / INT2 rows wrapped in torchrec's UInt4Tensor / UInt2Tensor."""
    for s in slots:
        rows = s.rows_of(flat)
        table = tables[s.name]
        weight = rows
        if split_scale_bias:
            start = SCALE_BIAS_BYTES if s.kind.has_scale_bias else 0
            weight = rows[:, start:start + data_bytes(s.kind, s.embedding_dim)]
        if s.kind == RowType.INT4:
            weight = UInt4Tensor(weight)
        elif s.kind == RowType.INT2:
            weight = UInt2Tensor(weight)
        table.register_buffer("weight", weight)
        if split_scale_bias and s.kind.has_scale_bias:
            table.register_buffer("weight_qscale", rows[:, 0:2].view(torch.float16))
            table.register_buffer("weight_qbias", rows[:, 2:4].view(torch.float16))



class QuantizedStorage:
    """Mixin of the quantized modules (before torchrec's interface class). A subclass sets
    ``_slots``, ``_split_scale_bias``, ``_TABLES_ATTR`` (its ``nn.ModuleDict`` of tables) and
    registers the ``_flat_rows`` buffer."""

    _TABLES_ATTR = "embedding_bags"

    def _init_settings(self, device, output_dtype: torch.dtype, row_alignment: int, register_tbes: bool,
                       split_scale_bias: bool, backend: str, validate_inputs: bool) -> None:
        if output_dtype not in OUTPUT_DTYPES:
            raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, got {output_dtype}")
        if row_alignment <= 0 or row_alignment & (row_alignment - 1):
            raise ValueError(f"row_alignment must be a power of two, got {row_alignment}")
        self._output_dtype = output_dtype
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self.row_alignment = row_alignment
        self.register_tbes = register_tbes
        self._split_scale_bias = split_scale_bias
        self.backend = check_backend(backend)
        load_kernels(backend)  # here, not in the first call
        self.validate_inputs = validate_inputs
        self._report_id = new_report_id(self)

    def _bind_table_views(self) -> None:
        bind_table_views(getattr(self, self._TABLES_ATTR), self._slots, self._flat_rows, self._split_scale_bias)

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key in ("_buffers", "_modules"):
                continue
            new.__dict__[key] = copy.deepcopy(value, memo)
        new._buffers = OrderedDict((k, v.clone()) for k, v in self._buffers.items())
        new._modules = OrderedDict((k, copy.deepcopy(v, memo)) for k, v in self._modules.items())
        new._bind_table_views()
        new._report_id = new_report_id(new)
        return new

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` scripts what this returns: this module. ``torch.jit.save`` crashes
        on torchrec's UInt4Tensor / UInt2Tensor buffers (a segmentation fault, torch 2.11-2.13): a
        module with INT4 / INT2 tables is scripted without its tables' views (TorchScript's
        ``__jit_ignored_attributes__``); its scripted forward reads the flat buffer, which holds the
        same rows. (A copy with plain uint8 views was scripted before: torch writes what this
        returns into the parent being scripted, so the user's eager model then held the copy, whose
        state_dict no longer loaded into a fresh module.)"""
        if any(s.kind in (RowType.INT4, RowType.INT2) for s in self._slots):
            self.__jit_ignored_attributes__ = [self._TABLES_ATTR]
        return self

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._report_id = new_report_id(self)  # a module unpickled twice is two modules

    @torch.jit.export
    def check_inputs(self) -> None:
        """Waits for the kernels this thread queued for this module and raises the input error
        they reported (see ``validate_inputs``), if any; other modules' and threads' reports stay
        theirs."""
        torch.ops.recom_rec.check_input_reports(self._report_id)

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{s.name}: {s.kind.name} {s.num_embeddings}x{s.embedding_dim}" for s in self._slots[:8])
        more = f", ... ({len(self._slots)} tables)" if len(self._slots) > 8 else ""
        return f"output_dtype={self._output_dtype}, backend={self.backend!r}, tables=[{kinds}{more}]"
