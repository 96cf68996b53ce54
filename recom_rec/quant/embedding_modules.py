"""``recom_rec.quant.EmbeddingBagCollection``: torchrec's quantized EmbeddingBagCollection, fused.

Same constructor, ``from_float``, input, output and ``state_dict`` as
``torchrec.quant.embedding_modules.EmbeddingBagCollection``; inside, every table (INT8 / INT4 /
INT2 / FP8 / FP16 / FP32 rows, any pooling) lives in one flat byte buffer laid out as fbgemm's
IntN TBE lays out its tables, and one kernel launch pools every feature.
"""
import itertools
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType, pooling_type_to_str
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.tensor_types import UInt2Tensor, UInt4Tensor

from ..modules.embedding_collection import _key_index
from ..modules.embedding_modules import key_routing
from ..modules.table_size import check_table_size
from ..ops.layout import POOLING_MEAN, POOLING_SUM
from ..ops.quantized_lookup import quantized_lookup
from ..ops.validation import encode_names
from ..ops.variable_batch import (check_inverse_indices, expand_rows, expand_rows_checked, inverse_check,
                                  uniform_batch)
from .from_float import quantized_module_args
from .layout import QuantTableSlot, buffer_bytes, pack_quant_tables, quant_feature_meta
from .rows import DEFAULT_ROW_ALIGNMENT, check_dim, pack_rows, row_type
from .storage import QuantizedStorage


def _rows_of(config: EmbeddingBagConfig) -> int:
    pruned = getattr(config, "num_embeddings_post_pruning", None)
    return pruned if pruned is not None else config.num_embeddings


@torch.fx.wrap
def _quantized_lookup(features: KeyedJaggedTensor, flat: Tensor, meta: Tensor, wanted: List[str],
                      tables: List[str], widths: List[int], dims: List[int], is_weighted: bool,
                      output_dtype: torch.dtype, backend: str, validate: bool, report_id: int) -> Tensor:
    """The whole module's lookup (a free, fx-wrapped function: fx records one call). A KJT with a
    batch size per feature is padded to a uniform one and its rows expanded by its inverse
    indices after the lookup (ops/variable_batch.py); a uniform KJT's inverse indices are ignored,
    as torchrec's quantized module ignores them. TorchScript compiles its scripted branch."""
    if torch.jit.is_scripting():
        return _scripted_quantized_lookup(features, flat, meta, wanted, tables, widths, dims, is_weighted,
                                          output_dtype, backend, validate)
    return _python_quantized_lookup(features, flat, meta, wanted, tables, widths, dims, is_weighted, output_dtype,
                                    backend, validate, report_id)


def _python_quantized_lookup(features: KeyedJaggedTensor, flat: Tensor, meta: Tensor, wanted: List[str],
                             tables: List[str], widths: List[int], dims: List[int], is_weighted: bool,
                             output_dtype: torch.dtype, backend: str, validate: bool, report_id: int) -> Tensor:
    """Eager and compiled: the key plan cached per key order (key_routing)."""
    unpadded = features
    features, rows = uniform_batch(features, wanted, expand_uniform=False)
    if validate:
        check_inverse_indices(unpadded, rows, wanted)
    keys = tuple(features.keys())
    per_sample_weights = features.weights_or_none() if is_weighted else None
    if is_weighted and per_sample_weights is None:
        raise ValueError("the EmbeddingBagCollection is weighted but the KeyedJaggedTensor has no weights")
    key_index, _, names = key_routing(keys, wanted, tables, flat.device)
    total_dim, max_dim = widths
    out = quantized_lookup(flat, features.values(), features.offsets(), per_sample_weights, meta, key_index,
                           features.stride(), total_dim, max_dim, output_dtype, backend, validate, names, report_id)
    if rows is None:
        return out
    # (``names`` pairs each wanted feature, an output feature, with its table: the lookup's report slot)
    check = inverse_check(unpadded, rows, wanted, flat, names, report_id) if validate else None
    return expand_rows_checked(out, rows, dims, backend, check)


def _scripted_quantized_lookup(features: KeyedJaggedTensor, flat: Tensor, meta: Tensor, wanted: List[str],
                               tables: List[str], widths: List[int], dims: List[int], is_weighted: bool,
                               output_dtype: torch.dtype, backend: str, validate: bool) -> Tensor:
    """TorchScript: the registered op, the key plan built per call (the check on the host, as in
    any traced graph)."""
    features, rows = uniform_batch(features, wanted, False)
    keys = features.keys()
    key_index = torch.tensor(_key_index(keys, wanted, tables), dtype=torch.int64, device=flat.device)
    per_sample_weights: Optional[Tensor] = None
    if is_weighted:
        per_sample_weights = features.weights_or_none()
        if per_sample_weights is None:
            raise ValueError("the EmbeddingBagCollection is weighted but the KeyedJaggedTensor has no weights")
    names = encode_names(keys, wanted, tables) if validate else ""
    out = torch.ops.recom_rec.quantized_pooled_lookup(flat, features.values(), features.offsets(), per_sample_weights,
                                                     meta, key_index, features.stride(), widths[0], widths[1],
                                                     output_dtype, backend, validate, names)
    return out if rows is None else expand_rows(out, rows, dims)


class EmbeddingBagCollection(QuantizedStorage, EmbeddingBagCollectionInterface):
    """A drop-in replacement for ``torchrec.quant.embedding_modules.EmbeddingBagCollection``.

    Args (torchrec's): ``tables`` (``EmbeddingBagConfig`` with ``data_type`` INT8 / UINT8 / INT4 /
        INT2 / FP16 / FP32, or NFP8 for fbgemm's FP8 rows), ``is_weighted``, ``device``,
        ``output_dtype`` (fp32, fp16 or bf16), ``table_name_to_quantized_weights``
        (``{name: (elements uint8 [rows, bytes], scale_bias uint8 [rows, 4] or None)}``, as
        torchrec's ``quantize_state_dict`` makes them), ``register_tbes`` (accepted; there are no
        fbgemm TBE submodules to register, see docs/quantized.md),
        ``quant_state_dict_split_scale_bias``, ``row_alignment``, ``cache_features_order`` (the key
        order of the input is always cached).
    Args (ours): ``backend`` (``"auto"``: the Triton kernel on CUDA, vectorised torch on the CPU;
        ``"triton"``, ``"torch"``), ``validate_inputs`` (check ids and lengths every batch and
        raise a ``ValueError`` naming feature and table: before the lookup on the torch backend;
        on the Triton kernel's, as the kernel reads each id, without a device-to-host sync: a bad
        id reads row 0 of its table (as fbgemm's default does), a bag outside the values reads
        nothing, and the error is raised by the module's next call or at once by
        ``check_inputs()``; in a graph traced by ``torch.compile`` or exported, the check runs on
        the host with a sync). Unchecked, the kernel clamps the same way without reporting.

    ``embedding_bags[name].weight`` are the tables' rows in fbgemm's layout (uint8
    ``[rows, row_bytes]``: fp16 scale and bias, elements, padding; INT4 / INT2 wrapped in torchrec's
    ``UInt4Tensor`` / ``UInt2Tensor``), views of the flat buffer: ``load_state_dict`` and in-place
    writes reach the kernel; checkpoints load both ways with torchrec's module.
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool,
        device: torch.device,
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
        self._is_weighted = is_weighted
        self._embedding_bag_configs = tables
        # torchrec orders tables by pooling type (one TBE per pooling), then by config order; the
        # output, its keys and the state_dict follow that order.
        by_pooling: "OrderedDict[PoolingType, List[EmbeddingBagConfig]]" = OrderedDict()
        seen = set()
        for config in tables:
            if config.name in seen:
                raise ValueError(f"Duplicate table name {config.name}")
            seen.add(config.name)
            pooling_type_to_str(config.pooling)
            check_table_size(config)
            check_dim(row_type(config.data_type, config.name), config.embedding_dim, config.name)
            by_pooling.setdefault(config.pooling, []).append(config)
        ordered = list(itertools.chain(*by_pooling.values()))
        self._embedding_names: List[str] = list(itertools.chain(*get_embedding_names_by_table(ordered)))
        self._length_per_key: List[int] = [c.embedding_dim for c in ordered for _ in c.feature_names]
        self._slots = pack_quant_tables([c.name for c in ordered], [_rows_of(c) for c in ordered],
                                        [c.embedding_dim for c in ordered],
                                        [row_type(c.data_type, c.name) for c in ordered], row_alignment)
        feature_tables, poolings = [], []
        for t, c in enumerate(ordered):
            for _ in c.feature_names:
                feature_tables.append(t)
                poolings.append(POOLING_MEAN if c.pooling.value == PoolingType.MEAN.value else POOLING_SUM)
        out_cols = list(itertools.accumulate([0] + self._length_per_key))[:-1]
        self._host_meta = quant_feature_meta(self._slots, feature_tables, out_cols, poolings)
        # The module's own lists, never changed: the per-key-order cache knows them by identity.
        self._feature_names: List[str] = [f for c in ordered for f in c.feature_names]
        self._feature_tables: List[str] = [c.name for c in ordered for _ in c.feature_names]
        self._widths = [sum(self._length_per_key), max((c.embedding_dim for c in ordered), default=1)]

        flat = torch.zeros(buffer_bytes(self._slots), dtype=torch.uint8, device=self._device)
        self.register_buffer("_flat_rows", flat, persistent=False)
        self.register_buffer("_feature_meta", self._host_meta.to(self._device), persistent=False)
        self.embedding_bags: nn.ModuleDict = nn.ModuleDict({c.name: nn.Module() for c in ordered})
        self._bind_table_views()
        if table_name_to_quantized_weights and self._device.type != "meta":
            for s in self._slots:
                elements, scale_bias = table_name_to_quantized_weights[s.name]
                pack_rows(elements.view(torch.uint8) if isinstance(elements, (UInt4Tensor, UInt2Tensor)) else elements,
                          scale_bias, self._table_rows(s))

    # ----------------------------------------------------------------------------- storage
    def _table_rows(self, slot: QuantTableSlot) -> Tensor:
        return slot.rows_of(self._flat_rows)

    def _apply(self, fn, recurse=True):
        # Convert the flat buffer once and re-point the tables' views at it (converting each view
        # on its own would cut them off the buffer the kernel reads). Metadata is rebuilt from its
        # host copy: fn must not touch it (to_empty would fill it with garbage).
        self._buffers["_flat_rows"] = fn(self._flat_rows)
        self._device = self._flat_rows.device
        self._buffers["_feature_meta"] = self._host_meta.to(self._device)
        self._bind_table_views()
        return self

    # ----------------------------------------------------------------------------- torchrec API
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        values = _quantized_lookup(features, self._flat_rows, self._feature_meta, self._feature_names,
                                   self._feature_tables, self._widths, self._length_per_key, self._is_weighted,
                                   self._output_dtype, self.backend, self.validate_inputs, self._report_id)
        return KeyedTensor(keys=self._embedding_names, values=values, length_per_key=self._length_per_key)

    def _get_name(self) -> str:
        return "QuantizedEmbeddingBagCollection"

    @classmethod
    def from_float(cls, module: nn.Module, use_precomputed_fake_quant: bool = False,
                   **kwargs) -> "EmbeddingBagCollection":
        """Quantizes a float ``torchrec.EmbeddingBagCollection`` or ``recom_rec.EmbeddingBagCollection``
        carrying a ``qconfig`` (torchrec's ``QuantConfig``: weight dtype, per-table weight dtypes,
        activation dtype = output dtype), row by row with fbgemm's quantizers; ``kwargs`` go to the
        constructor (``backend``, ``validate_inputs``)."""
        return cls(**quantized_module_args(module), **kwargs)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted
