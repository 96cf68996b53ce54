"""``recom_rec.quant.EmbeddingCollection``: torchrec's quantized EmbeddingCollection (unpooled, for
serving sequence models), fused.

Same constructor, ``from_float``, input, output and ``state_dict`` as
``torchrec.quant.embedding_modules.EmbeddingCollection``. Every table lives in one flat byte buffer
in fbgemm's row layout (quant/layout.py, as the quantized EmbeddingBagCollection's). Tables of one
data type share a row stride (an EmbeddingCollection's tables share a dim), and each starts on a
whole number of its rows, so a data type's rows can be numbered as one virtual table over the
buffer: row key = the table's first byte / stride + id. A lookup is then two launches a data
type: the row keys (one kernel that also checks every id against its own table), and the
quantized pooled kernel over bags of one row key, which dequantizes exactly as for pooled
tables (fbgemm's arithmetic of the device).
"""
import itertools
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from torchrec.tensor_types import UInt2Tensor, UInt4Tensor

from ..modules.embedding_collection import _key_index
from ..modules.table_size import check_sequence_tables
from ..ops.input_check import keep_reports
from ..ops.layout import META_NUM_EMBEDDINGS, META_ROW_BASE, META_WIDTH, POOLING_SUM
from ..ops.quantized_rows import rows_by_key
from ..ops.tracing import fx_tracing
from ..ops.unpooled_embedding import check_lengths_add_up, row_keys, segments_for
from ..ops.validation import check_batch_shape, encode_names, lengths_count
from .from_float import quantized_module_args
from .layout import (
    QMETA_DIM,
    QMETA_NUM_EMBEDDINGS,
    QMETA_POOLING,
    QMETA_ROW_STRIDE,
    QMETA_ROW_TYPE,
    QMETA_WIDTH,
    buffer_bytes,
    pack_quant_tables,
)
from .rows import DEFAULT_ROW_ALIGNMENT, check_dim, pack_rows, row_type
from .storage import QuantizedStorage


class _TypeGroup(NamedTuple):
    """The tables of one data type: their features, their tables, the outputs' names, the names
    encoded for the input check, and its rows of the module's row-key metadata (``_key_meta``:
    per feature, its table's rows and first row key; ``_virtual_meta`` holds each group's one-row
    metadata of its virtual table). Plain values: an fx trace takes the groups as a constant and
    TorchScript as a module attribute; the metadata are buffers, which both read as attributes."""

    features: List[str]
    tables: List[str]
    embedding_names: List[str]
    names: str
    first_meta_row: int


class EmbeddingCollection(QuantizedStorage, EmbeddingCollectionInterface):
    """A drop-in replacement for ``torchrec.quant.embedding_modules.EmbeddingCollection``.

    Args (torchrec's): ``tables`` (``EmbeddingConfig`` of one ``embedding_dim``, ``data_type``
        INT8 / UINT8 / INT4 / INT2 / FP16 / FP32, or NFP8), ``device``, ``need_indices``,
        ``output_dtype`` (fp32, fp16 or bf16), ``table_name_to_quantized_weights``,
        ``register_tbes`` (accepted; no fbgemm TBE submodules), ``quant_state_dict_split_scale_bias``,
        ``row_alignment``, ``cache_features_order`` (accepted).
    Args (ours): ``backend``, ``validate_inputs``: as ``recom_rec.quant.EmbeddingBagCollection``'s
        (a bad id is named with its feature, table and batch index).

    The output is torchrec's: a ``JaggedTensor`` per feature in ``output_dtype``, the features
    ordered by data type (torchrec's batched tables), then table, then feature.
    """

    _TABLES_ATTR = "embeddings"
    _groups: List[_TypeGroup]  # (for TorchScript, which would take the NamedTuples for plain tuples)

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: torch.device,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Optional[Dict[str, Tuple[Tensor, Optional[Tensor]]]] = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        cache_features_order: bool = False,
        *,
        backend: str = "auto",
        validate_inputs: bool = True,
    ) -> None:
        super().__init__()
        self._init_settings(device, output_dtype, row_alignment, register_tbes, quant_state_dict_split_scale_bias,
                            backend, validate_inputs)
        self._embedding_configs = tables
        self._need_indices = need_indices
        self._embedding_dim = check_sequence_tables(tables)
        by_type: "OrderedDict[object, List[EmbeddingConfig]]" = OrderedDict()
        for config in tables:
            check_dim(row_type(config.data_type, config.name), config.embedding_dim, config.name)
            by_type.setdefault(config.data_type, []).append(config)
        # torchrec batches tables by data type: its outputs, keys and state_dict follow that order.
        ordered = list(itertools.chain(*by_type.values()))
        self._slots = pack_quant_tables([c.name for c in ordered], [c.num_embeddings for c in ordered],
                                        [c.embedding_dim for c in ordered],
                                        [row_type(c.data_type, c.name) for c in ordered], row_alignment)
        slot_of = {s.name: s for s in self._slots}
        total = buffer_bytes(self._slots)
        self._groups: List[_TypeGroup] = []
        key_metas: List[Tensor] = []
        virtual_metas: List[Tensor] = []
        for configs in by_type.values():
            stride = slot_of[configs[0].name].row_stride
            features = [f for c in configs for f in c.feature_names]
            names = [c.name for c in configs for _ in c.feature_names]
            key_meta = torch.zeros(len(features), META_WIDTH, dtype=torch.int64)
            for i, table in enumerate(names):
                key_meta[i, META_NUM_EMBEDDINGS] = slot_of[table].num_embeddings
                key_meta[i, META_ROW_BASE] = slot_of[table].byte_base // stride
            virtual = torch.zeros(1, QMETA_WIDTH, dtype=torch.int64)
            virtual[0, QMETA_DIM] = self._embedding_dim
            virtual[0, QMETA_POOLING] = POOLING_SUM
            virtual[0, QMETA_NUM_EMBEDDINGS] = total // stride
            virtual[0, QMETA_ROW_STRIDE] = stride
            virtual[0, QMETA_ROW_TYPE] = int(slot_of[configs[0].name].kind)
            self._groups.append(_TypeGroup(features, names, list(itertools.chain(*get_embedding_names_by_table(configs))),
                                           encode_names([], features, names), sum(len(m) for m in key_metas)))
            key_metas.append(key_meta)
            virtual_metas.append(virtual)
        # host copies (the metadata are rebuilt from them when the module moves)
        self._host_metas = (torch.cat(key_metas) if key_metas else torch.zeros(0, META_WIDTH, dtype=torch.int64),
                            torch.cat(virtual_metas) if virtual_metas else torch.zeros(0, QMETA_WIDTH,
                                                                                       dtype=torch.int64))
        self.register_buffer("_key_meta", self._host_metas[0].to(self._device), persistent=False)
        self.register_buffer("_virtual_meta", self._host_metas[1].to(self._device), persistent=False)
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self.register_buffer("_flat_rows", torch.zeros(total, dtype=torch.uint8, device=self._device),
                             persistent=False)
        self.register_buffer("_first_key", torch.zeros(1, dtype=torch.int64, device=self._device), persistent=False)
        self.embeddings: nn.ModuleDict = nn.ModuleDict({c.name: nn.Module() for c in ordered})
        self._bind_table_views()
        if table_name_to_quantized_weights and self._device.type != "meta":
            for s in self._slots:
                elements, scale_bias = table_name_to_quantized_weights[s.name]
                pack_rows(elements.view(torch.uint8) if isinstance(elements, (UInt4Tensor, UInt2Tensor)) else elements,
                          scale_bias, s.rows_of(self._flat_rows))

    # ----------------------------------------------------------------------------- storage
    def _apply(self, fn, recurse=True):
        # The flat buffer converted once and the tables' views re-pointed at it; metadata rebuilt
        # from its host copies (fn must not touch it), as the quantized EBC does.
        self._buffers["_flat_rows"] = fn(self._flat_rows)
        self._device = self._flat_rows.device
        self._buffers["_first_key"] = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._buffers["_key_meta"] = self._host_metas[0].to(self._device)
        self._buffers["_virtual_meta"] = self._host_metas[1].to(self._device)
        self._bind_table_views()
        return self

    # ----------------------------------------------------------------------------- torchrec API
    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        if not torch.jit.is_scripting():
            self._keep_reports_when_traced()
        return _quantized_collection_lookup(features, self._flat_rows, self._first_key, self._groups, self._key_meta,
                                            self._virtual_meta,
                                            self._embedding_dim, self._need_indices, self._output_dtype,
                                            self.backend, self.validate_inputs, self._report_id)

    @torch.jit.unused
    def _keep_reports_when_traced(self) -> None:
        if not torch.compiler.is_compiling() and fx_tracing():
            keep_reports(self._report_id)  # the graph takes the module's id and may outlive it: its reports stay

    def _get_name(self) -> str:
        return "QuantizedEmbeddingCollection"

    @classmethod
    def from_float(cls, module: nn.Module, use_precomputed_fake_quant: bool = False,
                   **kwargs) -> "EmbeddingCollection":
        """Quantizes a float ``torchrec.EmbeddingCollection`` or ``recom_rec.EmbeddingCollection``
        carrying a ``qconfig``, row by row with fbgemm's quantizers; ``kwargs`` go to the
        constructor (``backend``, ``validate_inputs``)."""
        return cls(**quantized_module_args(module), **kwargs)

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_names_by_table(self) -> List[List[str]]:
        return self._embedding_names_by_table


@torch.fx.wrap
def _quantized_collection_lookup(features: KeyedJaggedTensor, flat: Tensor, first_key: Tensor,
                                 groups: List[_TypeGroup], key_meta: Tensor, virtual_meta: Tensor, dim: int,
                                 need_indices: bool, output_dtype: torch.dtype, backend: str, validate: bool,
                                 report_id: int) -> Dict[str, JaggedTensor]:
    """Every data type's lookup, split into the module's JaggedTensors (a free, fx-wrapped function;
    TorchScript runs the registered ops)."""
    keys: List[str] = features.keys()
    values = features.values()
    stride_per_key: List[int] = features.stride_per_key()
    if validate:
        check_batch_shape(len(keys), values,
                          lengths_count(features.lengths_or_none(), features.offsets_or_none()), stride_per_key)
    offsets = features.offsets()
    length_per_key: List[int] = features.length_per_key()
    if validate:
        check_lengths_add_up(length_per_key, values.numel(), keys, [g.features for g in groups],
                             [g.tables for g in groups])
    offset_per_key: List[int] = features.offset_per_key()
    lengths = features.lengths().split(stride_per_key)
    indices: List[Tensor] = values.split(length_per_key) if need_indices else []
    out: Dict[str, JaggedTensor] = {}
    for g in range(len(groups)):
        group = groups[g]
        key_index = _key_index(keys, group.features, group.tables)
        segments = segments_for(key_index, length_per_key, offset_per_key, stride_per_key, flat.device)
        counts = [length_per_key[k] for k in key_index]
        num = sum(counts)
        metas = key_meta[group.first_meta_row:group.first_meta_row + len(group.features)]
        if torch.jit.is_scripting():  # (the registered ops)
            row_key = torch.ops.recom_rec.unpooled_row_keys(values, offsets, segments, metas, num, backend, validate,
                                                            group.names, report_id)
            rows = torch.ops.recom_rec.quantized_rows(flat, row_key, virtual_meta[g:g + 1], first_key, dim,
                                                      output_dtype, backend)
        else:
            row_key = row_keys(values, offsets, segments, metas, num, backend, validate, group.names, report_id)
            rows = rows_by_key(flat, row_key, virtual_meta[g:g + 1], first_key, dim, output_dtype, backend)
        pieces = rows.split(counts)
        for j in range(len(key_index)):
            k = key_index[j]
            out[group.embedding_names[j]] = JaggedTensor(values=pieces[j], lengths=lengths[k],
                                                         weights=indices[k] if need_indices else None)
    return out
