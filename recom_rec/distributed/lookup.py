"""The per-rank lookup of a sharded ``recom_rec.EmbeddingBagCollection``.

torchrec's ``ShardedEmbeddingBagCollection`` runs, per sharding type, an input distribution
(KJT all-to-all), a *lookup* over the rank's local shards, and an output distribution (pooled
all-to-all / reduce-scatter). ``FusedPooledEmbeddingsLookup`` replaces torchrec's
``GroupedPooledEmbeddingsLookup``: it builds one local ``recom_rec.EmbeddingBagCollection`` whose
"tables" are the rank's shards (table-wise: whole tables; column-wise: column slices; row-wise:
row blocks, whose ids torchrec's bucketization already made local), so every local shard of a
rank is pooled by one fused launch (one per weight dtype), with the optimizer fused into the
backward when the plan's compute kernel is ``FUSED``. Shards planned with the parameter-server
kernel (``ps_placement.PS_KERNEL``) go into a local module of their own whose tables are
PS-backed (a cache in the fused buffer, rows in the store); like the unsharded module's PS tables
they stay out of ``state_dict`` (the store holds them: ``recom_rec.ps.flush``), and loading a
weight for them writes it into the store.
"""
import re
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_kernel import get_state_dict
from torchrec.distributed.embedding_types import (
    BaseEmbeddingLookup,
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..modules.embedding_collection import EmbeddingCollection
from ..modules.embedding_modules import EmbeddingBagCollection
from ..ops.variable_batch import pad_to_uniform
from ..optim.keyed import FusedEmbeddingOptimizer
from .optimizer_state import sharded_optimizer_state
from .ps_placement import PS_KERNEL, ps_config, shard_table_name
from .variable_batch import rank_major

# fbgemm's EmbOptimType names -> our fused optimizers (recom_rec.optim.spec).
_EMB_OPT_TO_OURS = {
    "EXACT_SGD": "sgd",
    "SGD": "sgd",
    "EXACT_ADAGRAD": "adagrad",
    "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad",
    "ROWWISE_ADAGRAD": "rowwise_adagrad",
    "ADAM": "adam",
}


def optimizer_from_fused_params(fused_params: Optional[Dict[str, Any]]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """torchrec ``fused_params`` (``{"optimizer": EmbOptimType.X, "learning_rate": ...}`` from a
    sharder, or ``{"optimizer": ..., "lr": ...}`` from ``apply_optimizer_in_backward``) -> the name
    and keyword arguments of ``EmbeddingBagCollection.enable_fused_optimizer``; None without an
    optimizer."""
    if not fused_params or fused_params.get("optimizer") is None:
        return None
    opt = fused_params["optimizer"]
    key = getattr(opt, "name", str(opt)).upper().split(".")[-1]
    if key not in _EMB_OPT_TO_OURS:
        raise ValueError(
            f"recom_rec's sharded EmbeddingBagCollection cannot fuse optimizer {opt}; supported: "
            f"{', '.join(sorted(_EMB_OPT_TO_OURS))} (EmbOptimType names)"
        )
    name = _EMB_OPT_TO_OURS[key]
    kw: Dict[str, Any] = {}
    lr = fused_params.get("learning_rate", fused_params.get("lr"))
    if lr is not None:
        kw["lr"] = float(lr)
    if name != "sgd" and fused_params.get("eps") is not None:
        kw["eps"] = float(fused_params["eps"])
    if fused_params.get("weight_decay"):
        kw["weight_decay"] = float(fused_params["weight_decay"])
    if name == "adam":
        if "betas" in fused_params:
            kw["betas"] = tuple(float(b) for b in fused_params["betas"])
        elif "beta1" in fused_params or "beta2" in fused_params:
            kw["betas"] = (float(fused_params.get("beta1", 0.9)), float(fused_params.get("beta2", 0.999)))
    if name in ("adagrad", "rowwise_adagrad") and fused_params.get("initial_accumulator_value"):
        kw["initial_accumulator_value"] = float(fused_params["initial_accumulator_value"])
    return name, kw


def _fused_key(fp: Optional[Dict[str, Any]]) -> str:
    o = optimizer_from_fused_params(fp)
    return "" if o is None else f"{o[0]}:{sorted(o[1].items())}"


def _shard_label(table: ShardedEmbeddingTable, row: int, col: int) -> str:
    """The table as an input error names it on this rank: with the rows (and columns) it holds
    when it holds part of them; ids in the error are then the shard's, counted from its first row."""
    label = repr(table.name)
    parts = []
    if table.local_rows != table.num_embeddings:
        parts.append(f"rows {row}-{row + table.local_rows - 1} of {table.num_embeddings} on this rank, "
                     f"ids counted from row {row}")
    if table.local_cols != table.embedding_dim:
        parts.append(f"columns {col}-{col + table.local_cols - 1}")
    return label + (f", {'; '.join(parts)}" if parts else "")


class _RankShards(EmbeddingBagCollection):
    """A rank's shards of one kernel kind: a row-wise shard of a table with fewer rows than ranks
    holds none."""

    _allows_empty_tables = True


class FusedPooledEmbeddingsLookup(BaseEmbeddingLookup[KeyedJaggedTensor, torch.Tensor]):
    """A drop-in for torchrec's ``GroupedPooledEmbeddingsLookup`` backed by
    ``recom_rec.EmbeddingBagCollection``.

    Input: the rank's KJT after the input distribution, keys = the grouped configs' features in
    order. Output: ``[batch, sum of local shard dims]`` in torchrec's column order.
    """

    def __init__(
        self,
        grouped_configs: List[GroupedEmbeddingConfig],
        device: Optional[torch.device],
        pg: Optional[dist.ProcessGroup],
        sharding_type: Optional[str] = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.grouped_configs = grouped_configs
        self._pg = pg
        self._sharding_type = sharding_type
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._device = device
        self._tables: List[ShardedEmbeddingTable] = [t for g in grouped_configs for t in g.embedding_tables]
        kernels = [g.compute_kernel for g in grouped_configs for _ in g.embedding_tables]
        fused = [g.fused_params for g in grouped_configs for _ in g.embedding_tables]
        weighted = {g.is_weighted for g in grouped_configs}
        if len(weighted) > 1:
            raise ValueError("mixed weighted and unweighted tables in one lookup")
        self._is_weighted = bool(weighted and weighted.pop())
        # torchrec's all-to-all backward divides the embeddings' gradients by the world size
        # (gradient division, to match DDP's averaging); the per-id weights' gradient is scaled
        # back up, as torchrec's lookups do (data-parallel tables have no all-to-all).
        self._weight_grad_scale = 1
        if (self._is_weighted and sharding_type != ShardingType.DATA_PARALLEL.value and pg is not None
                and get_gradient_division()):
            self._weight_grad_scale = dist.get_world_size(pg)
        sum_pooling = sharding_type in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)

        # Positional, unique feature names: several column shards of one table on a rank read
        # the same feature twice, which torchrec's KJT carries as two keys of the same name.
        self._local_keys: List[str] = []
        self._key_dims: List[int] = [t.local_cols for t in self._tables for _ in t.feature_names]
        table_features: List[List[str]] = []
        # What an input error says instead of the local names: the feature, and the table with
        # this rank's share of it.
        self._error_names: Dict[str, str] = {}
        for t in self._tables:
            names = []
            for feature in t.feature_names:
                names.append(f"f{len(self._local_keys)}")
                self._local_keys.append(names[-1])
                self._error_names[names[-1]] = feature
            table_features.append(names)

        # Tables sharing (compute kernel, optimizer) go into one local module (one launch per
        # weight dtype); a lookup normally has exactly one.
        buckets: "OrderedDict[Tuple[str, str, int], List[int]]" = OrderedDict()
        config_of = [c for c, g in enumerate(grouped_configs) for _ in g.embedding_tables]
        for i, t in enumerate(self._tables):
            fused_key = _fused_key(fused[i]) if kernels[i] == EmbeddingComputeKernel.FUSED else ""
            buckets.setdefault((str(kernels[i]), fused_key, self._bucket_of_config(config_of[i])), []).append(i)
        self._local_modules = nn.ModuleList()
        self._table_slot: List[Tuple[int, str]] = [(-1, "")] * len(self._tables)
        col_sources: List[int] = []
        out_start, col = [], 0
        for t in self._tables:
            out_start.append(col)
            col += t.local_cols * len(t.feature_names)
        self._fused_optimizers = nn.ModuleList()
        self._ps_tables: List[int] = []  # indices of the shards in the parameter-server tier
        for b, ((kernel, _, _), members) in enumerate(buckets.items()):
            configs = []
            in_ps = kernel == str(EmbeddingComputeKernel(PS_KERNEL))  # bucket keys hold str(enum)
            ps = {}
            for i in members:
                t = self._tables[i]
                name = f"t{i}"
                if in_ps:
                    name = shard_table_name(t.name, *self._offsets(i))
                    ps[name] = ps_config(fused[i], t.local_rows)
                    self._ps_tables.append(i)
                self._table_slot[i] = (b, name)
                self._error_names[name] = _shard_label(t, *self._offsets(i))
                configs.append(self._local_config(t, name, table_features[i], sum_pooling))
                for j in range(len(t.feature_names)):
                    col_sources.extend(range(out_start[i] + j * t.local_cols,
                                             out_start[i] + (j + 1) * t.local_cols))
            module = self._local_module(configs, device, backend, ps)
            fuses = kernel == str(EmbeddingComputeKernel.FUSED) or in_ps
            opt = optimizer_from_fused_params(fused[members[0]]) if fuses else None
            if opt is not None:
                inner = module.enable_fused_optimizer(opt[0], **opt[1])
                # Keyed as torchrec's fused TBEs key theirs ("<table>.weight"; the sharded
                # module prefixes "embedding_bags."), the weight and the state as ShardedTensors
                # over this rank's shards (optimizer_state.py). Parameter-server shards take part
                # for their hyper-parameters (lr schedules) but bring no state: theirs travels
                # with each row through the store, and the cache's per-slot state is not a table
                # tensor a checkpoint could hold.
                weights = [module._table_modules()[self._table_slot[i][1]].weight for i in members]
                if in_ps:
                    params, state = {}, {}
                    for i, p in zip(members, weights):
                        key = f"{self._tables[i].name}.weight"
                        params[key if key not in params else f"{key}.shard{i}"] = p
                else:
                    params, state = sharded_optimizer_state([self._tables[i] for i in members], weights,
                                                            [inner.state[p] for p in weights], self._pg)
                self._fused_optimizers.append(_FusedOptimizerHolder(
                    FusedEmbeddingOptimizer(inner.spec, params, state, module._fused_hyper)))
            if fuses:
                for i in members:
                    p = module._table_modules()[self._table_slot[i][1]].weight
                    # torchrec's convention: tables updated in the backward are left out of
                    # dense optimizers (in_backward_optimizer_filter).
                    p._in_backward_optimizers = [EmptyFusedOptimizer()]
            self._local_modules.append(module)
        total = len(col_sources)
        perm = None
        if len(buckets) > 1:
            perm = torch.empty(total, dtype=torch.int64)
            perm[torch.tensor(col_sources, dtype=torch.int64)] = torch.arange(total)
            perm = perm.to(device)
        self.register_buffer("_output_columns", perm, persistent=False)
        # What torchrec's sharded managed-collision module reads of a lookup's kernels.
        self._emb_modules: List[_EvictionView] = []
        first = 0
        for config in grouped_configs:
            self._emb_modules.append(_EvictionView(self, config, list(range(first, first + len(config.embedding_tables)))))
            first += len(config.embedding_tables)
        self.register_buffer("_dummy_embs_tensor", torch.empty([0], dtype=torch.float32, device=device,
                                                                 requires_grad=True), persistent=False)

    def _bucket_of_config(self, config: int) -> int:
        """Grouped configs whose tables may share a local module (given one kernel and optimizer): all."""
        return 0

    def _local_config(self, t: ShardedEmbeddingTable, name: str, features: List[str], sum_pooling: bool):
        """The local module's config of shard ``t``."""
        return EmbeddingBagConfig(
            num_embeddings=t.local_rows, embedding_dim=t.local_cols, name=name, feature_names=features,
            data_type=t.data_type, pooling=PoolingType.SUM if sum_pooling else t.pooling,
            # the global table's init range (as torchrec's TBEs), not the shard's
            weight_init_min=t.get_weight_init_min(), weight_init_max=t.get_weight_init_max(),
        )

    def _local_module(self, configs, device: torch.device, backend: str, ps: Dict[str, Any]) -> nn.Module:
        return _RankShards(configs, is_weighted=self._is_weighted, device=device, backend=backend, ps=ps or None)

    # ------------------------------------------------------------------ torchrec lookup API
    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """``[batch, columns]``; for a KJT with a batch size per key per rank (VBE), the 1-D
        rank-major layout of fbgemm's VBE TBE (distributed/variable_batch.py)."""
        variable_batch = sparse_features.variable_stride_per_key()
        if len(self._local_modules) == 0:
            if variable_batch:
                return self._dummy_embs_tensor
            return self._dummy_embs_tensor.view(sparse_features.stride(), 0)
        keys = sparse_features.keys()
        if len(keys) != len(self._local_keys):
            raise ValueError(f"lookup expected {len(self._local_keys)} features, got keys {keys}")
        weights = sparse_features.weights_or_none() if self._is_weighted else None
        if weights is not None and self._weight_grad_scale != 1 and weights.requires_grad:
            weights = _ScaleGradient.apply(weights, self._weight_grad_scale)
        if variable_batch:
            # each key's bags (rank after rank) padded with empty bags to the largest key's count
            uniform = pad_to_uniform(sparse_features)
            lengths, offsets, stride = None, uniform.offsets(), uniform.stride()  # (the padding makes offsets)
        else:
            lengths, offsets = sparse_features.lengths_or_none(), sparse_features.offsets_or_none()
            stride = sparse_features.stride()
        kjt = KeyedJaggedTensor(keys=self._local_keys, values=sparse_features.values(), weights=weights,
                                lengths=lengths, offsets=offsets, stride=stride)
        try:
            outs = [m(kjt).values() for m in self._local_modules]
        except ValueError as e:  # an input error, reported by this rank's kernels for this call or the last
            raise ValueError(self._global_names(str(e))) from None
        pooled = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1).index_select(1, self._output_columns)
        if variable_batch:
            return rank_major(pooled, sparse_features.stride_per_key_per_rank(), self._key_dims)
        return pooled

    def check_inputs(self) -> None:
        """Waits for this rank's lookups queued by this thread and raises the input error their
        kernels reported (``recom_rec.EmbeddingBagCollection.check_inputs``), in the global names."""
        try:
            for m in self._local_modules:
                m.check_inputs()
        except ValueError as e:
            raise ValueError(self._global_names(str(e))) from None

    def _global_names(self, message: str) -> str:
        def name(match: "re.Match") -> str:
            feature, table = match.group(1), match.group(2)
            return (f"feature '{self._error_names.get(feature, feature)}' "
                    f"(table {self._error_names.get(table, repr(table))})")

        return re.sub(r"feature '([^']*)' \(table '([^']*)'\)", name, message)

    def local_weight(self, i: int) -> nn.Parameter:
        b, name = self._table_slot[i]
        return self._local_modules[b]._table_modules()[name].weight

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
        """torchrec's lookup convention: ``<table>.weight`` -> a ShardedTensor of this rank's
        shards (a plain tensor for data-parallel tables)."""
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()  # type: ignore[attr-defined]
        kept = [i for i in range(len(self._tables)) if i not in self._ps_tables]
        params = [self.local_weight(i) if keep_vars else self.local_weight(i).detach() for i in kept]
        return get_state_dict([self._tables[i] for i in kept], params, self._pg, destination, prefix)

    def named_parameters_by_table(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """(table name, the local shard's Parameter); the sharded module registers these as
        ``embedding_bags.<table>.weight``, so dense optimizers update the very tensors the
        fused kernel reads. Several column shards of one table on this rank are yielded as one
        ``TableBatchedEmbeddingSlice`` over their (adjacent) storage, as torchrec does."""
        shards: "OrderedDict[str, List[int]]" = OrderedDict()
        for i, t in enumerate(self._tables):
            if i not in self._ps_tables:  # a cache, not the shard: no Parameter to expose
                shards.setdefault(t.name, []).append(i)
        for name, members in shards.items():
            if len(members) == 1:
                yield name, self.local_weight(members[0])
            else:
                yield name, self._spanning_slice(name, members)

    def _spanning_slice(self, name: str, members: List[int]) -> TableBatchedEmbeddingSlice:
        buckets = {self._table_slot[i][0] for i in members}
        module = self._local_modules[self._table_slot[members[0]][0]]
        located = []
        for i in members:
            local = self._table_slot[i][1]
            for group in module._groups:
                for slot in group.slots:
                    if slot.name == local:
                        located.append((group, slot))
        groups = {id(g) for g, _ in located}
        contiguous = all(b.elem_base == a.elem_base + a.numel for (_, a), (_, b) in zip(located, located[1:]))
        if len(buckets) != 1 or len(groups) != 1 or not contiguous:
            raise ValueError(f"recom_rec: the column shards of table {name!r} on this rank are not adjacent in "
                             "one buffer; give them the same compute kernel and optimizer")
        if self._tables[members[0]].compute_kernel == EmbeddingComputeKernel.DENSE:
            raise ValueError(f"recom_rec: table {name!r} has several column shards on one rank with the dense "
                             "kernel (dense optimizers would not see their gradients); use the fused kernel "
                             "or one shard per rank")
        first, last = located[0][1], located[-1][1]
        weight = TableBatchedEmbeddingSlice(
            data=module._flat(located[0][0]), start_offset=first.elem_base, end_offset=last.elem_base + last.numel,
            num_embeddings=-1, embedding_dim=first.embedding_dim,
        )
        # fused shards (dense ones were refused above): kept out of dense optimizers, as torchrec
        # marks its slices (in_backward_optimizer_filter); unmarked, a user's dense optimizer took it
        weight._in_backward_optimizers = [EmptyFusedOptimizer()]
        return weight

    def _offsets(self, i: int) -> Tuple[int, int]:
        """(first row, first column) of local shard ``i`` in its table."""
        t = self._tables[i]
        if t.local_metadata is not None:
            return int(t.local_metadata.shard_offsets[0]), int(t.local_metadata.shard_offsets[1])
        return 0, 0

    def copy_from_unsharded(self, weights: Dict[str, torch.Tensor]) -> None:
        """Fills the local shards from the full tables (``weights[name]`` is ``[rows, dim]``);
        parameter-server shards are written into their store."""
        with torch.no_grad():
            for i, t in enumerate(self._tables):
                full = weights[t.name]
                r0, c0 = self._offsets(i)
                shard = full[r0:r0 + t.local_rows, c0:c0 + t.local_cols]
                if i in self._ps_tables:
                    self.load_ps_shard(i, shard)
                else:
                    self.local_weight(i).copy_(shard)

    def ps_shards(self) -> List[Tuple[int, str, int, int, int, int]]:
        """(index, table, first row, first column, rows, columns) of the parameter-server shards."""
        return [(i, self._tables[i].name, *self._offsets(i), self._tables[i].local_rows, self._tables[i].local_cols)
                for i in self._ps_tables]

    def load_ps_shard(self, i: int, weight: torch.Tensor) -> None:
        """Writes ``weight`` (the shard's ``[rows, columns]``) into the shard's store."""
        b, name = self._table_slot[i]
        module = self._local_modules[b]
        module.load_state_dict({f"{module._TABLES_ATTR}.{name}.weight": weight}, strict=False)

    def flush(self) -> None:
        pass

    def purge(self) -> None:
        pass

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return CombinedOptimizer([("", h.fused_optimizer) for h in self._fused_optimizers])


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: int) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class _EvictionView:
    """One grouped config of a lookup as torchrec's sharded managed-collision module sees a
    kernel (torchrec's ``BatchedFusedEmbeddingBag``): ``_config.embedding_tables``, and
    ``_emb_module.reset_embedding_weight_momentum`` for the rows whose slot the managed-collision
    module gave to a new id. That call resets our fused optimizer's state of those rows (every
    optimizer; fbgemm resets row-wise Adagrad only); torchrec then re-initialises their weights."""

    def __init__(self, lookup: "FusedPooledEmbeddingsLookup", config: GroupedEmbeddingConfig,
                 members: List[int]) -> None:
        self._config = config
        self._emb_module = self
        self._lookup = lookup
        self._members = members  # the lookup's shard index of each of the config's tables

    def reset_embedding_weight_momentum(self, pruned_indices: torch.Tensor, pruned_indices_offsets: torch.Tensor,
                                        logical_table_ids: torch.Tensor, buffer_ids: torch.Tensor) -> None:
        bounds = pruned_indices_offsets.tolist()
        for k, t in enumerate(logical_table_ids.tolist()):
            b, name = self._lookup._table_slot[self._members[t]]
            self._lookup._local_modules[b].reset_optimizer_rows(name, pruned_indices[bounds[k]:bounds[k + 1]])


class _FusedOptimizerHolder(nn.Module, FusedOptimizerModule):
    """Carries one local module's fused optimizer where torchrec's sharded module looks for
    fused optimizers (``FusedOptimizerModule`` submodules of each lookup)."""

    def __init__(self, optimizer: KeyedOptimizer) -> None:
        super().__init__()
        self._optimizer = optimizer

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._optimizer


class _RankSequenceShards(EmbeddingCollection):
    """A rank's shards of one kernel kind, unpooled (a row-wise shard may hold no rows)."""

    _allows_empty_tables = True


class FusedSequenceEmbeddingsLookup(FusedPooledEmbeddingsLookup):
    """A drop-in for torchrec's sequence ``GroupedEmbeddingsLookup`` backed by
    ``recom_rec.EmbeddingCollection``: each grouped config's local shards (one width, one dtype) gathered
    by one fused launch, the optimizer fused into the backward.

    Input: the rank's KJT after the input distribution, keys = the grouped configs' features in
    order. Output, as torchrec's: per grouped config its ids' rows in the KJT's value order,
    flattened, the configs one after another (1-D; what the sequence output distribution sends)."""

    def _bucket_of_config(self, config: int) -> int:
        return config  # a local module per grouped config: its rows are the config's output

    def _local_config(self, t: ShardedEmbeddingTable, name: str, features: List[str], sum_pooling: bool):
        return EmbeddingConfig(num_embeddings=t.local_rows, embedding_dim=t.local_cols, name=name,
                               feature_names=features, data_type=t.data_type,
                               weight_init_min=t.get_weight_init_min(), weight_init_max=t.get_weight_init_max())

    def _local_module(self, configs, device: torch.device, backend: str, ps: Dict[str, Any]) -> nn.Module:
        if ps:
            raise ValueError("recom_rec: sequence (EmbeddingCollection) shards cannot live in the parameter-server tier")
        return _RankSequenceShards(configs, device=device, backend=backend)

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if len(self._local_modules) == 0:
            return self._dummy_embs_tensor
        keys = sparse_features.keys()
        if len(keys) != len(self._local_keys):
            raise ValueError(f"lookup expected {len(self._local_keys)} features, got keys {keys}")
        kjt = KeyedJaggedTensor(
            keys=self._local_keys, values=sparse_features.values(), lengths=sparse_features.lengths_or_none(),
            offsets=sparse_features.offsets_or_none(), stride=sparse_features.stride(),
            length_per_key=sparse_features.length_per_key(), offset_per_key=sparse_features.offset_per_key(),
        )
        try:
            outs = [m.rows_in_feature_order(kjt).view(-1) for m in self._local_modules]
        except ValueError as e:  # an input error, reported by this rank's kernels for this call or the last
            raise ValueError(self._global_names(str(e))) from None
        return outs[0] if len(outs) == 1 else torch.cat(outs)
