"""``recom_rec.EmbeddingCollection``: torchrec's EmbeddingCollection (unpooled: one embedding per id,
a ``JaggedTensor`` per feature, for sequence models), fused.

Same constructor, input, output, ``state_dict`` and numbers as ``torchrec.EmbeddingCollection``;
inside, all tables of one weight dtype live in one flat buffer (modules/flat_tables.py) and every
feature of every table is gathered by one kernel launch, its backward with the optimizer fused in.
"""
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingCollection as _TorchrecEmbeddingCollection,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from ..ops.backends import check_backend
from ..ops.input_check import new_report_id
from ..ops.layout import FeatureSlot, POOLING_SUM, feature_meta_tensor, pack_tables
from ..ops.plan import FusedStep, UnpooledGroupPlan, UnpooledPlan
from ..ops.unpooled_embedding import (UnpooledBatch, check_lengths_add_up, load_kernels, segments_for, tables_on_host,
                                      unpooled_lookup)
from ..ops.validation import check_batch_shape, encode_names, lengths_count
from ..optim.spec import FusedOptimizerSpec
from .embedding_modules import _table_dtype, maybe_td_to_kjt
from .flat_tables import FlatTables, TableGroup
from .table_size import check_sequence_tables
from .table_weight import FlatLink, TableEmbedding


class _Group(TableGroup):
    """A group's tables and the outputs (features) that read them."""

    def __init__(self, index: int, dtype: torch.dtype, tables: List[int], slots, features: List[FeatureSlot]):
        super().__init__(index, dtype, tables, slots)
        self.features = features

    def plan(self) -> UnpooledGroupPlan:
        features = [f.feature for f in self.features]
        tables = [self.slots[f.table].name for f in self.features]
        return UnpooledGroupPlan(features, tables, [f.embedding_name for f in self.features],
                                 encode_names([], features, tables), sum(s.num_embeddings for s in self.slots))


class EmbeddingCollection(FlatTables, _TorchrecEmbeddingCollection):
    """A drop-in replacement for ``torchrec.EmbeddingCollection`` that gathers all its tables'
    embeddings in one fused kernel (forward) and updates them in one fused backward.

    It subclasses torchrec's module (``isinstance`` checks in torchrec's wrappers and planners
    accept it) but not its storage: torchrec's ``__init__`` is not run, this one sets the same
    fields. Tables keep torchrec's ``embeddings[name].weight`` (an ``nn.Embedding`` whose weight
    views the flat buffer), so ``state_dict`` keys and shapes are torchrec's.

    Args:
        tables, device, need_indices: as torchrec's (every table has the same ``embedding_dim``;
            ``data_type`` FP32, FP16 or BF16 gives the weights' dtype; outputs are fp32, as
            torchrec's ``.float()``).
        use_gather_select, use_gather_select_per_sharding: accepted for torchrec's signature (its
            sharded modules' settings); the fused gather is one kernel either way.
        backend, validate_inputs: as ``recom_rec.EmbeddingBagCollection``'s. A bad id is reported
            with its feature, table and batch index (on the GPU by the module's next call or by
            ``check_inputs()``, the kernels reading row 0 meanwhile).

    The forward reads the KJT's per-key lengths on the host, as torchrec's module does (its
    ``to_dict``), to split the output into one ``JaggedTensor`` per feature.
    """

    __jit_unused_properties__ = ["fused_optimizer", "backend", "validate_inputs"]
    __jit_ignored_attributes__ = ["_table_parameters"]
    _TABLES_ATTR = "embeddings"
    _plan: UnpooledPlan
    _allows_empty_tables = False  # (a sharded lookup's row-wise shards may hold no rows: distributed/lookup.py)

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Optional[torch.device] = None,
        need_indices: bool = False,
        use_gather_select: bool = False,
        use_gather_select_per_sharding: Optional[Dict[str, bool]] = None,
        *,
        backend: str = "auto",
        validate_inputs: bool = True,
    ) -> None:
        nn.Module.__init__(self)
        torch._C._log_api_usage_once(f"recom_rec.modules.{self.__class__.__name__}")
        self.embeddings: nn.ModuleDict = nn.ModuleDict()
        self._embedding_configs = tables
        self._need_indices = need_indices
        self._use_gather_select = use_gather_select
        self._use_gather_select_per_sharding = use_gather_select_per_sharding
        self._flat_link = FlatLink()
        self._group_parameters = False
        self._embedding_dim = check_sequence_tables(tables, allow_empty=self._allows_empty_tables)
        for config in tables:
            _table_dtype(config)
        device = torch.device(device) if device is not None else torch.empty(0).device
        self._device = device
        self._embedding_names_by_table: List[List[str]] = get_embedding_names_by_table(tables)
        self._feature_names: List[List[str]] = [t.feature_names for t in tables]
        with torch.device("cpu"):  # index metadata is built on the host (see the EBC)
            self._groups = self._plan_groups(tables)
            self._build_storage(device)
        order = [(g.index, j) for t in range(len(tables)) for g in self._groups for j, f in enumerate(g.features)
                 if g.tables[f.table] == t]
        load_kernels(check_backend(backend))  # here, not in the first call (issue 51)
        self._plan = UnpooledPlan([g.plan() for g in self._groups], order, max(self._embedding_dim, 0), need_indices,
                                  backend, validate_inputs, new_report_id(self))
        self._fused_spec: Optional[FusedOptimizerSpec] = None
        self._fused_optimizer = None
        self._seen_in_backward = None

    # ----------------------------------------------------------------------------- layout
    def _plan_groups(self, tables: List[EmbeddingConfig]) -> List[_Group]:
        by_dtype: "OrderedDict[torch.dtype, List[int]]" = OrderedDict()
        for i, config in enumerate(tables):
            by_dtype.setdefault(_table_dtype(config), []).append(i)
        groups = []
        for gi, (dtype, members) in enumerate(by_dtype.items()):
            slots = pack_tables([tables[i].name for i in members], [tables[i].num_embeddings for i in members],
                                [tables[i].embedding_dim for i in members])
            features = [FeatureSlot(feature, self._embedding_names_by_table[i][j], local, 0, POOLING_SUM)
                        for local, i in enumerate(members) for j, feature in enumerate(tables[i].feature_names)]
            groups.append(_Group(gi, dtype, members, slots, features))
        return groups

    def _table_configs(self) -> List[EmbeddingConfig]:
        return self._embedding_configs

    def _make_table(self, view: torch.Tensor, config: EmbeddingConfig) -> nn.Module:
        return TableEmbedding(view, self._flat_link)

    def _build_storage(self, device: torch.device) -> None:
        self._build_flat_tables(device)
        for group in self._groups:
            meta = feature_meta_tensor(group.slots, group.features, [0] * len(group.features))
            self._host_index_buffers[group.meta_name] = meta
            self.register_buffer(group.meta_name, meta.to(device), persistent=False)
        # torchrec builds each nn.Embedding (drawing normal_) and runs its init_fn, table by table:
        # the same draws in the same order give the same weights under one seed.
        if device.type != "meta":
            with torch.no_grad():
                for config in self._embedding_configs:
                    weight = self.embeddings[config.name].weight
                    nn.init.normal_(weight)
                    if config.init_fn is not None:
                        config.init_fn(weight)

    # ----------------------------------------------------------------------------- torchrec API
    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """One ``JaggedTensor`` per configured feature (its ids' embeddings, fp32, and the
        feature's lengths; with ``need_indices`` the ids as its weights), in torchrec's order;
        features the module does not know are ignored."""
        if torch.jit.is_scripting():
            # TorchScript (inference): the flat buffers, no fused optimizer.
            flats = self._scripted_flats()
            return _collection_lookup(features, flats, [[f] for f in flats], self._scripted_metas(), self._plan, None)
        return self._lookup(features)

    @torch.jit.unused
    def _lookup(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        return _collection_lookup(maybe_td_to_kjt(features, None), *self._lookup_arguments())

    @torch.jit.unused
    def rows_in_feature_order(self, features: KeyedJaggedTensor) -> Optional[torch.Tensor]:
        """Every output's rows in one ``[ids, dim]`` tensor, outputs in the module's order, when one
        launch makes them all (one weight dtype); else None. (The sharded lookup's output.)"""
        if len(self._groups) != 1:
            return None
        features = maybe_td_to_kjt(features, None)
        return _group_rows(features, *self._lookup_arguments(), False)[0][0][0]

    def _lookup_arguments(self):
        self._prepare_lookup()
        grad = torch.is_grad_enabled()
        flats = self._lookup_flats()
        return (flats,
                [self._autograd_inputs(g) if grad else [flat] for g, flat in zip(self._groups, flats)],
                [getattr(self, g.meta_name) for g in self._groups], self._plan,
                self._fused_step_for_forward(count_in_lookup=True))

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_names_by_table(self) -> List[List[str]]:
        return self._embedding_names_by_table

    def reset_parameters(self) -> None:
        """Re-initialises every table with its config's ``init_fn``, as torchrec's module."""
        if self._device.type == "meta":
            return
        for config in self._embedding_configs:
            if config.init_fn is not None:
                config.init_fn(self.embeddings[config.name].weight)

    def extra_repr(self) -> str:
        return f"tables={len(self._embedding_configs)}, groups={len(self._groups)}, backend={self.backend!r}"


@torch.fx.wrap
def _collection_lookup(features: KeyedJaggedTensor, flats: List[torch.Tensor], weights: List[List[torch.Tensor]],
                       metas: List[torch.Tensor], plan: UnpooledPlan,
                       fused: Optional[FusedStep]) -> Dict[str, JaggedTensor]:
    """Every group's lookup, split into the module's JaggedTensors. A free function, ``fx.wrap``-ed,
    so fx records one call (the KJT's per-key lengths are read on the host); TorchScript compiles
    its scripted branch."""
    pieces, key_indices = _group_rows(features, flats, weights, metas, plan, fused, True)
    stride_per_key: List[int] = features.stride_per_key()
    lengths = features.lengths().split(stride_per_key)
    values = features.values()
    indices: List[torch.Tensor] = values.split(features.length_per_key()) if plan.need_indices else []
    out: Dict[str, JaggedTensor] = {}
    for g, j in plan.order:
        k = key_indices[g][j]
        out[plan.groups[g].embedding_names[j]] = JaggedTensor(
            values=pieces[g][j], lengths=lengths[k], weights=indices[k] if plan.need_indices else None)
    return out


def _group_rows(features: KeyedJaggedTensor, flats: List[torch.Tensor], weights: List[List[torch.Tensor]],
                metas: List[torch.Tensor], plan: UnpooledPlan, fused: Optional[FusedStep],
                by_feature: bool) -> Tuple[List[List[torch.Tensor]], List[List[int]]]:
    """Each group's rows: ``by_feature``, one ``[ids, dim]`` piece per output, else the one block of
    its outputs one after another; and the KJT key each output reads."""
    keys: List[str] = features.keys()
    values = features.values()
    stride_per_key: List[int] = features.stride_per_key()
    if plan.validate:
        check_batch_shape(len(keys), values,
                          lengths_count(features.lengths_or_none(), features.offsets_or_none()), stride_per_key)
    length_per_key: List[int] = features.length_per_key()
    if plan.validate:
        check_lengths_add_up(length_per_key, values.numel(), keys, [g.features for g in plan.groups],
                             [g.tables for g in plan.groups])
    offset_per_key: List[int] = features.offset_per_key()
    offsets = features.offsets()
    rows: List[List[torch.Tensor]] = []
    key_indices: List[List[int]] = []
    for g in range(len(plan.groups)):
        group = plan.groups[g]
        key_index = _key_index(keys, group.features, group.tables)
        segments = segments_for(key_index, length_per_key, offset_per_key, stride_per_key, flats[g].device,
                                _tables_on_host(plan.backend, flats[g]))
        group_counts = [length_per_key[k] for k in key_index]
        if torch.jit.is_scripting():
            block = torch.ops.recom_rec.unpooled_embedding_forward(
                weights[g], flats[g], values, offsets, segments, metas[g], sum(group_counts), plan.dim,
                plan.backend, plan.validate, group.names, -1, None, None, False, None, None, plan.report_id)
            group_rows = list(block.split(group_counts)) if by_feature else [block]
        else:
            group_rows = unpooled_lookup(weights[g], flats[g], metas[g],
                                         UnpooledBatch(values, offsets, segments, sum(group_counts)), plan.dim,
                                         plan.backend, plan.validate, group.names, plan.report_id, fused, g,
                                         group_counts if by_feature else None)
        rows.append(group_rows)
        key_indices.append(key_index)
    return rows, key_indices


def _tables_on_host(backend: str, flat: torch.Tensor) -> bool:
    """unpooled_embedding.tables_on_host; False in TorchScript (its lookups read device tables)."""
    if torch.jit.is_scripting():
        return False
    return tables_on_host(backend, flat)


def _key_index(keys: List[str], features: List[str], tables: List[str]) -> List[int]:
    """The KJT key each feature reads; a ValueError names the features (and tables) it lacks."""
    position: Dict[str, int] = {}
    for i in range(len(keys)):
        position[keys[i]] = i
    index: List[int] = []
    missing: List[str] = []
    for f in range(len(features)):
        if features[f] in position:
            index.append(position[features[f]])
        else:
            missing.append("'" + features[f] + "' (table '" + tables[f] + "')")
    if len(missing) > 0:
        raise ValueError("KeyedJaggedTensor is missing feature(s) " + ", ".join(missing) + "; it has keys "
                         + str(keys))
    return index
