"""``recom_rec.EmbeddingBagCollection``: torchrec's EmbeddingBagCollection, fused.

Same constructor, input, output, ``state_dict`` and numbers as
``torchrec.EmbeddingBagCollection``; inside, all tables with the same weight dtype live in one
flat buffer and every feature of every table is pooled by one kernel launch.
"""
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    PoolingType,
    pooling_type_to_str,
)
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection as _TorchrecEmbeddingBagCollection,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ..ops import JaggedBatch, KeyRouting, pooled_lookup
from ..ops.backends import check_backend
from ..ops.layout import (
    POOLING_MEAN,
    POOLING_SUM,
    FeatureSlot,
    TableSlot,
    feature_meta_tensor,
    pack_tables,
    table_runs,
)
from ..ops.input_check import new_report_id
from ..ops.tracing import fx_tracing
from ..ops.plan import FusedStep, GroupPlan, LookupPlan, group_states
from ..ops.pooled_embedding import load_kernels
from ..ops.validation import encode_names
from ..ops.expand_bags import Expansion
from ..ops.variable_batch import (check_inverse_indices, eager_expansion, expand_rows, expand_rows_checked,
                                  inverse_check, uniform_batch)
from ..optim.keyed import FusedEmbeddingOptimizer
from ..optim.spec import FusedOptimizerSpec
from .flat_tables import FlatTables, TableGroup
from .table_size import check_table_size
from .table_weight import FlatLink, TableEmbeddingBag

try:  # torchrec >= 1.7 accepts a TensorDict as input
    from torchrec.sparse.tensor_dict import maybe_td_to_kjt
except ImportError:  # pragma: no cover - torchrec 1.6
    def maybe_td_to_kjt(features, keys=None):  # type: ignore[misc]
        return features



_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
# One group of tables per dtype; the scripted forward reads the groups' buffers by name (three).
assert len(_DTYPES) == 3


def _table_dtype(config: EmbeddingBagConfig) -> torch.dtype:
    """The float table's dtype. As torchrec's float modules, an integer data type (INT8, INT4, ...)
    gives an fp16 table: it names the rows' type once the model is quantized (its configs carry it
    to ``from_float``). BF16 tables are bf16 here (torchrec's: fp16)."""
    return _DTYPES.get(config.data_type, torch.float16)


class _Group(TableGroup):
    """A group's tables and the pooled outputs (features) that read them."""

    def __init__(self, index: int, dtype: torch.dtype, tables: List[int], slots: List[TableSlot],
                 features: List[FeatureSlot]) -> None:
        super().__init__(index, dtype, tables, slots)
        self.features = features
        self.total_dim = sum(slots[f.table].embedding_dim for f in features)

    def plan(self) -> GroupPlan:
        return GroupPlan(
            [f.feature for f in self.features], [self.slots[f.table].name for f in self.features],
            self.total_dim, self.max_dim, sum(s.num_embeddings for s in self.slots), table_runs(self.slots),
        )


@lru_cache(maxsize=1024)
def _key_plan(keys: Tuple[str, ...], wanted: Tuple[str, ...], tables: Tuple[str, ...]) -> List[int]:
    """KJT key index of each wanted feature, or a ValueError naming what is missing."""
    position = {k: i for i, k in enumerate(keys)}
    missing = [(f, t) for f, t in zip(wanted, tables) if f not in position]
    if missing:
        listed = ", ".join(f"{f!r} (table {t!r})" for f, t in missing)
        raise ValueError(
            f"KeyedJaggedTensor is missing feature(s) {listed}; it has keys {list(keys)}"
        )
    return [position[f] for f in wanted]


@lru_cache(maxsize=256)
def _names_for(keys: Tuple[str, ...], wanted: Tuple[str, ...], tables: Tuple[str, ...]) -> str:
    # Built once per KJT key order, not per batch (it grows with the number of features).
    return encode_names(list(keys), list(wanted), list(tables))


@lru_cache(maxsize=256)
def _reads_each_key_once(keys: Tuple[str, ...], wanted: Tuple[str, ...], tables: Tuple[str, ...]) -> bool:
    return sorted(_key_plan(keys, wanted, tables)) == list(range(len(keys)))


@lru_cache(maxsize=256)
def _key_index_on(keys: Tuple[str, ...], wanted: Tuple[str, ...], tables: Tuple[str, ...],
                  device: torch.device) -> torch.Tensor:
    # A KJT's key order rarely changes between batches: keep its device copy.
    return torch.tensor(_key_plan(keys, wanted, tables), dtype=torch.int64, device=device)


@torch.fx.wrap
def _fused_lookup(
    features: KeyedJaggedTensor,
    flats: List[torch.Tensor],
    weights: List[List[torch.Tensor]],
    metas: List[torch.Tensor],
    output_columns: Optional[torch.Tensor],
    plan: LookupPlan,
    fused: Optional[FusedStep],
) -> torch.Tensor:
    """All groups' lookups, concatenated in the module's output order.

    A free function (and ``torch.fx.wrap``-ed) so that fx tracing records one call instead of
    tracing into KJT internals; torch.compile traces through it, TorchScript compiles its
    scripted branch (a traced module is scripted for inference, torchrec's path)."""
    if torch.jit.is_scripting():
        return _scripted_lookup(features, flats, weights, metas, output_columns, plan, fused)
    return _python_lookup(features, flats, weights, metas, output_columns, plan, fused)


def _concat_groups(outs: List[torch.Tensor], output_columns: Optional[torch.Tensor]) -> torch.Tensor:
    if len(outs) == 1:
        return outs[0]
    assert output_columns is not None
    return torch.cat(outs, dim=1).index_select(1, output_columns)


# The last routing per caller's (wanted, tables) objects: a KJT of thousands of keys costs ~20 us
# to compare with the last key order, against ~0.1-0.3 ms to hash it and the feature lists for
# the three caches below every call (many-4000, docs/perf-notes.md v14). Holding the lists keeps
# their ids from being reused.
_LAST_ROUTING: Dict[Tuple[int, int], tuple] = {}


def key_routing(keys: Tuple[str, ...], wanted: Sequence[str], tables: Sequence[str],
                device: torch.device) -> Tuple[torch.Tensor, bool, str]:
    """For one KJT key order: the key index of each wanted feature (on ``device``), whether the
    features read every key exactly once, and the names an input error may need (also without
    validation: a batch on another device is refused either way). Cached per key order in eager
    mode; torch.compile folds them instead. ``wanted`` and ``tables`` must not change after the
    call (a module's plan)."""
    if torch.compiler.is_compiling():
        key_index_list = _key_plan.__wrapped__(keys, tuple(wanted), tuple(tables))
        key_index = torch.tensor(key_index_list, dtype=torch.int64, device=device)
        reads_each_key_once = sorted(key_index_list) == list(range(len(keys)))
        names = encode_names(list(keys), list(wanted), list(tables))
        return key_index, reads_each_key_once, names
    last = _LAST_ROUTING.get((id(wanted), id(tables)))
    if last is not None and last[0] is wanted and last[1] is tables and last[2] == device and last[3] == keys:
        return last[4]
    wanted_t, tables_t = tuple(wanted), tuple(tables)
    key_index = _key_index_on(keys, wanted_t, tables_t, device)
    reads_each_key_once = _reads_each_key_once(keys, wanted_t, tables_t)
    names = _names_for(keys, wanted_t, tables_t)
    result = (key_index, reads_each_key_once, names)
    if len(_LAST_ROUTING) >= 4096:
        _LAST_ROUTING.clear()
    _LAST_ROUTING[(id(wanted), id(tables))] = (wanted, tables, device, keys, result)
    return result


def _python_lookup(features: KeyedJaggedTensor, flats: List[torch.Tensor], weights: List[List[torch.Tensor]],
                   metas: List[torch.Tensor], output_columns: Optional[torch.Tensor], plan: LookupPlan,
                   fused: Optional[FusedStep]) -> torch.Tensor:
    """Eager and compiled: key plans cached per key order (torch.compile folds them). A KJT with
    variable batch per feature is padded to a uniform one, its rows expanded by its inverse
    indices after the lookup (ops/variable_batch.py)."""
    unpadded = features
    features, rows = uniform_batch(features, plan.output_features)
    check = None
    if plan.validate:
        check_inverse_indices(unpadded, rows, plan.output_features)
        if rows is not None:
            check = inverse_check(unpadded, rows, plan.output_features, flats[0], _output_names(plan), plan.report_id)
    keys = tuple(features.keys())
    values = features.values()
    per_sample_weights = features.weights_or_none() if plan.is_weighted else None
    if plan.is_weighted and per_sample_weights is None:
        raise ValueError("the EmbeddingBagCollection is weighted but the KeyedJaggedTensor has no weights")
    batch = JaggedBatch(values, features.offsets(), per_sample_weights, features.stride())
    # One group's output is the module's: its expansion runs inside the lookup's autograd node.
    expansion = (_one_group_expansion(unpadded, rows, plan, check, flats[0])
                 if rows is not None and len(plan.groups) == 1 else None)
    outs: List[torch.Tensor] = []
    for g, group in enumerate(plan.groups):
        key_index, reads_each_key_once, names = key_routing(keys, group.features, group.tables, flats[g].device)
        # Every key read by exactly one feature: the lookups are the values (no sync to count them).
        routing = KeyRouting(key_index, names, values.numel() if reads_each_key_once else -1)
        outs.append(pooled_lookup(weights[g], flats[g], metas[g], batch, routing, group, plan, fused, g, expansion))
    out = _concat_groups(outs, output_columns)
    if rows is None or expansion is not None:
        return out
    return expand_rows_checked(out, rows, plan.output_dims, plan.backend, check)


def _one_group_expansion(features: KeyedJaggedTensor, rows: torch.Tensor, plan: LookupPlan, check,
                         flat: torch.Tensor) -> Optional[Expansion]:
    """A one-group module's eager expansion (ops/variable_batch.eager_expansion) of the batch
    ``features`` (unpadded), or None where it runs on its own: compiled code, transforms, dispatch
    modes."""
    if torch.compiler.is_compiling():
        return None
    return eager_expansion(rows, plan.output_dims, plan.backend, check, flat, features, plan.output_features)


# Per module plan (its output features' list, held so that the id is not reused): the names an
# inverse-index report decodes, a (feature, tables reading it) pair per output feature.
_OUTPUT_NAMES: Dict[int, Tuple[List[str], str]] = {}


def _output_names(plan: LookupPlan) -> str:
    hit = _OUTPUT_NAMES.get(id(plan.output_features))
    if hit is None or hit[0] is not plan.output_features:
        readers: Dict[str, List[str]] = {}
        for group in plan.groups:
            for feature, table in zip(group.features, group.tables):
                readers.setdefault(feature, []).append(table)
        keys = [f.split("@")[0] for f in plan.output_features]
        names = encode_names([], keys, [", ".join(dict.fromkeys(readers.get(k, []))) for k in keys])
        if len(_OUTPUT_NAMES) >= 1024:
            _OUTPUT_NAMES.clear()
        hit = _OUTPUT_NAMES[id(plan.output_features)] = (plan.output_features, names)
    return hit[1]


def _scripted_lookup(features: KeyedJaggedTensor, flats: List[torch.Tensor], weights: List[List[torch.Tensor]],
                     metas: List[torch.Tensor], output_columns: Optional[torch.Tensor], plan: LookupPlan,
                     fused: Optional[FusedStep]) -> torch.Tensor:
    """TorchScript: the same lookups through the registered op, key plans built per call (a
    variable batch per feature padded and expanded as in eager mode)."""
    features, rows = uniform_batch(features, plan.output_features)
    keys = features.keys()
    position: Dict[str, int] = {}
    for i in range(len(keys)):
        position[keys[i]] = i
    values = features.values()
    offsets = features.offsets()
    batch_size = features.stride()
    per_sample_weights: Optional[torch.Tensor] = None
    if plan.is_weighted:
        per_sample_weights = features.weights_or_none()
        if per_sample_weights is None:
            raise ValueError("the EmbeddingBagCollection is weighted but the KeyedJaggedTensor has no weights")
    outs: List[torch.Tensor] = []
    for g in range(len(plan.groups)):
        group = plan.groups[g]
        key_index_list: List[int] = []
        for f in range(len(group.features)):
            if group.features[f] not in position:
                raise ValueError("KeyedJaggedTensor is missing feature " + group.features[f] + " (table "
                                 + group.tables[f] + ")")
            key_index_list.append(position[group.features[f]])
        key_index = torch.tensor(key_index_list, dtype=torch.int64, device=flats[g].device)
        reads_each_key_once = sorted(key_index_list) == list(range(len(keys)))
        names = encode_names(keys, group.features, group.tables) if plan.validate else ""
        states = group_states(fused, g)
        outs.append(torch.ops.recom_rec.pooled_embedding_forward(
            weights[g], flats[g], values, offsets, per_sample_weights, metas[g], key_index, batch_size,
            group.total_dim, group.max_dim, plan.backend, plan.validate, names,
            fused.kind if fused is not None else -1, states[0], states[1],
            fused.state1_is_row if fused is not None else False,
            fused.hyper if fused is not None else None, fused.step if fused is not None else None,
            values.numel() if reads_each_key_once else -1, group.num_rows, plan.report_id,
        ))
    out = _concat_groups(outs, output_columns)
    return out if rows is None else expand_rows(out, rows, plan.output_dims)


_NO_PS_GRAPHS = ("recom_rec.EmbeddingBagCollection with parameter-server tables (ps=...) does not support {what}: "
                 "the tier that maps their ids to cache slots runs in Python")


class EmbeddingBagCollection(FlatTables, _TorchrecEmbeddingBagCollection):
    """A drop-in replacement for ``torchrec.EmbeddingBagCollection`` that runs all its tables
    through one fused kernel.

    It subclasses torchrec's module (so every ``isinstance(m, torchrec.EmbeddingBagCollection)``
    in torchrec accepts it: managed-collision and feature-processed wrappers, planners, utilities)
    but not its storage: torchrec's ``__init__`` is not run, this one sets the same fields.

    Args:
        tables: the ``EmbeddingBagConfig`` list, as for torchrec.
        is_weighted: whether the input KJT carries per-id weights (pooled as ``sum(w * e)``; with
            ``PoolingType.MEAN`` as ``sum(w * e) / L``, fbgemm's rule - torchrec's stock module
            rejects weighted mean pooling).
        device: where the weights live; ``"meta"`` builds the module without memory.
        backend: ``"auto"`` (on CUDA the faster of the Triton and CUDA C++ kernels per shape,
            see docs/perf-notes.md; vectorised torch on CPU), ``"triton"``, ``"cuda"`` (CUDA C++
            from csrc, built when the package is installed; compiled on first use only where no current
            build is installed) or ``"torch"``.
        validate_inputs: check every batch (ids in ``[0, num_embeddings)``, lengths adding up to
            the number of values) and raise a ``ValueError`` naming the feature and table. The
            torch backend (the CPU's) checks before the lookup. The Triton and CUDA kernels check
            each id as they read it, without a device-to-host sync: a bad id reads row 0 of its
            table (as fbgemm's default does), a bag outside the values reads nothing, and the
            error is raised by the module's next call, or at once by ``check_inputs()``. With
            ``validate_inputs=False`` (or later ``module.validate_inputs = False``) the kernels
            clamp the same way without reporting, and the torch backend leaves bad ids to torch's
            own indexing errors.
        ps: ``{table name: recom_rec.ps.PSConfig}`` - parameter-server-backed tables: their rows live
            in a store and a cache of ``cache_rows`` slots in the flat buffer (see ``recom_rec.ps``).
        group_parameters: one trainable ``nn.Parameter`` per group of tables of one dtype (the
            flat buffer, named ``_flat_weights_<group>``) instead of one per table, for dense
            gradients with a ``torch.optim`` optimizer over many tables: a backward then hands
            autograd one gradient a group, not one a table (torch's engine costs ~4-6 us a
            Parameter: 4-6 ms a step at 1000 tables). The tables' ``weight`` stay Parameters
            viewing the buffer, frozen (``requires_grad=False``), and ``state_dict`` keeps
            torchrec's keys. What this gives up: a ``.grad``, hooks and
            ``torch.autograd.grad(loss, weight)`` per table. Not with ``ps`` tables.

    Layout: tables of one dtype share a flat 1-D buffer; ``embedding_bags[name].weight`` is a leaf
    ``nn.Parameter`` viewing its slice, so ``state_dict`` keys and shapes are torchrec's and any
    ``torch.optim`` optimizer works on the dense gradients. Modify weights in place (``copy_``,
    optimizers, ``load_state_dict``); replacing a Parameter object is also handled, but assigning
    ``weight.data = ...`` detaches it from the fused buffer and is not supported.

    TorchScript (``torch.jit.script`` of the module or of its ``torchrec.fx.symbolic_trace``)
    runs inference: no fused optimizer, no parameter-server tables (docs/torchrec-compat.md).
    """

    # TorchScript compiles properties; these are Python-side only (the scripted module runs
    # inference with the settings it was scripted with, and has no fused optimizer).
    __jit_unused_properties__ = ["fused_optimizer", "backend", "validate_inputs"]
    __jit_ignored_attributes__ = ["_table_parameters"]  # the eager lookup's, Python-side only
    _plan: LookupPlan
    _allows_empty_tables = False  # (a sharded lookup's shards may hold no rows: distributed/lookup.py)

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        *,
        backend: str = "auto",
        validate_inputs: bool = True,
        ps: Optional[Dict[str, Any]] = None,
        group_parameters: bool = False,
    ) -> None:
        # torchrec's __init__ would allocate its own nn.EmbeddingBag tables: set its fields here.
        nn.Module.__init__(self)
        torch._C._log_api_usage_once(f"recom_rec.modules.{self.__class__.__name__}")
        self._is_weighted = is_weighted
        self._embedding_bag_configs = tables
        self.embedding_bags: nn.ModuleDict = nn.ModuleDict()
        self._lengths_per_embedding: List[int] = []
        self._flat_link = FlatLink()
        if group_parameters and ps:
            raise ValueError("recom_rec.EmbeddingBagCollection: group_parameters does not take parameter-server "
                             "tables (ps=...): their rows are cache slots, not trainable weights")
        self._group_parameters = group_parameters

        seen = set()
        for config in tables:
            if config.name in seen:
                raise ValueError(f"Duplicate table name {config.name}")
            seen.add(config.name)
            pooling_type_to_str(config.pooling)  # raises torchrec's error for unsupported pooling
            _table_dtype(config)
            check_table_size(config, allow_empty=self._allows_empty_tables)
            if not config.feature_names:
                config.feature_names = [config.name]
            self._lengths_per_embedding.extend(len(config.feature_names) * [config.embedding_dim])
        # No device: the default one, which a `with torch.device(...)` block sets (as torchrec's
        # tables would be created there).
        device = torch.device(device) if device is not None else torch.empty(0).device
        self._device = device
        self._embedding_names: List[str] = [
            name for names in get_embedding_names_by_table(tables) for name in names
        ]
        self._feature_names: List[List[str]] = [t.feature_names for t in tables]
        self._ps = None  # recom_rec.ps tier, when some tables are parameter-server backed
        layout_tables = tables
        if ps:
            from ..ps.tier import cache_configs  # PS tables hold cache_rows rows in the buffer
            layout_tables = cache_configs(tables, ps)
        # The index metadata is built on the host whatever the default device is (a meta
        # default device would leave it without values), then copied to `device`.
        with torch.device("cpu"):
            self._groups = self._plan_groups(layout_tables)
            self._build_storage(device)
        load_kernels(check_backend(backend))  # here, not in the first call (issue 51)
        self._plan = LookupPlan([g.plan() for g in self._groups], is_weighted, backend,
                                validate_inputs, new_report_id(self),
                                [f for names in self._feature_names for f in names], list(self._lengths_per_embedding))
        self._fused_spec: Optional[FusedOptimizerSpec] = None
        self._fused_optimizer: Optional[FusedEmbeddingOptimizer] = None
        self._seen_in_backward = None
        self.reset_parameters()
        if ps:
            from ..ps.tier import PSTier
            self._ps = PSTier(self, ps)

    # ----------------------------------------------------------------------------- layout
    def _plan_groups(self, tables: List[EmbeddingBagConfig]) -> List[_Group]:
        by_dtype: "OrderedDict[torch.dtype, List[int]]" = OrderedDict()
        for i, config in enumerate(tables):
            by_dtype.setdefault(_table_dtype(config), []).append(i)
        embedding_names = get_embedding_names_by_table(tables)
        module_col, table_first_col = 0, []
        for config in tables:
            table_first_col.append(module_col)
            module_col += config.embedding_dim * len(config.feature_names)
        groups = []
        for gi, (dtype, members) in enumerate(by_dtype.items()):
            slots = pack_tables(
                [tables[i].name for i in members],
                [tables[i].num_embeddings for i in members],
                [tables[i].embedding_dim for i in members],
            )
            features = []
            for local, i in enumerate(members):
                config = tables[i]
                pooling = POOLING_MEAN if config.pooling.value == PoolingType.MEAN.value else POOLING_SUM
                for j, feature in enumerate(config.feature_names):
                    features.append(FeatureSlot(
                        feature, embedding_names[i][j], local,
                        table_first_col[i] + j * config.embedding_dim, pooling,
                    ))
            groups.append(_Group(gi, dtype, members, slots, features))
        return groups

    def _table_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def _make_table(self, view: torch.Tensor, config: EmbeddingBagConfig) -> nn.Module:
        return TableEmbeddingBag(view, pooling_type_to_str(config.pooling), self._flat_link)

    def _build_storage(self, device: torch.device) -> None:
        configs = self._embedding_bag_configs
        self._build_flat_tables(device)
        for group in self._groups:
            cols, col = [], 0
            for f in group.features:
                cols.append(col)
                col += group.slots[f.table].embedding_dim
            meta = feature_meta_tensor(group.slots, group.features, cols)
            self._host_index_buffers[group.meta_name] = meta
            self.register_buffer(group.meta_name, meta.to(device), persistent=False)
        if len(self._groups) > 1:
            # Groups produce their columns side by side; this maps them back to table order.
            group_cols = [f.out_col + d for g in self._groups for f in g.features
                          for d in range(g.slots[f.table].embedding_dim)]
            order = torch.empty(len(group_cols), dtype=torch.int64)
            order[torch.tensor(group_cols, dtype=torch.int64)] = torch.arange(len(group_cols))
            self._host_index_buffers["_output_columns"] = order
            self.register_buffer("_output_columns", order.to(device), persistent=False)
        else:
            self._output_columns = None
        # torchrec's nn.EmbeddingBag draws normal_ at construction before init_fn runs; draw the
        # same numbers so that, under one seed, our weights equal torchrec's bit for bit.
        if device.type != "meta":
            with torch.no_grad():
                for config in configs:
                    nn.init.normal_(self.embedding_bags[config.name].weight)

    # ----------------------------------------------------------------------------- torchrec API
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pools every configured feature; returns a ``KeyedTensor`` with torchrec's keys, order
        and ``length_per_key`` (features the module does not know are ignored, as in torchrec)."""
        if torch.jit.is_scripting():
            # TorchScript (inference): the flat buffers, no fused optimizer, no parameter server.
            flats = self._scripted_flats()
            values = _fused_lookup(features, flats, [[f] for f in flats], self._scripted_metas(),
                                   self._output_columns, self._plan, None)
        else:
            values = self._lookup(features)
        return KeyedTensor(
            keys=self._embedding_names, values=values, length_per_key=self._lengths_per_embedding
        )

    @torch.jit.unused
    def _lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        features = maybe_td_to_kjt(features, None)
        self._prepare_lookup()
        if getattr(self, "_ps", None) is not None:
            if fx_tracing():
                raise ValueError(_NO_PS_GRAPHS.format(what="fx tracing"))
            features = self._ps.prepare(features)  # PS tables' ids -> cache slots
        grad = torch.is_grad_enabled()
        fused = self._fused_step_for_forward()
        flats = self._lookup_flats()
        return _fused_lookup(
            features,
            flats,
            # Never an empty list (Inductor's wrapper code generation has trouble with them);
            # without grad the op only needs *a* tensor here, and the flat buffer needs none.
            [self._autograd_inputs(g) if grad else [flat] for g, flat in zip(self._groups, flats)],
            [getattr(self, g.meta_name) for g in self._groups],
            self._output_columns,
            self._plan,
            fused,
        )

    def __prepare_scriptable__(self) -> "EmbeddingBagCollection":
        # torch.jit.script calls this first: the scripted forward has no parameter-server tier
        # (it would pool cache slots as if they were ids).
        if getattr(self, "_ps", None) is not None:
            raise ValueError(_NO_PS_GRAPHS.format(what="TorchScript"))
        return self

    # A module has one group per weight dtype (fp32, fp16, bf16): at most three. TorchScript
    # cannot look buffers up by a computed name; it resolves `hasattr` on a module statically.

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def reset_parameters(self) -> None:
        """Re-initialises every table with its config's ``init_fn`` (torchrec's rule: uniform in
        ``[weight_init_min, weight_init_max]``, by default ``±sqrt(1/num_embeddings)``)."""
        if self._device.type == "meta":
            return
        for config in self._embedding_bag_configs:
            assert config.init_fn is not None
            config.init_fn(self.embedding_bags[config.name].weight)

    def extra_repr(self) -> str:
        return (f"tables={len(self._embedding_bag_configs)}, groups={len(self._groups)}, backend={self.backend!r}"
                + (", group_parameters=True" if self._group_parameters else ""))
