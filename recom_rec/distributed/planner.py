"""Planner plugin: torchrec's ``EmbeddingShardingPlanner`` with estimates for our kernel.

torchrec's estimators model fbgemm's TBE. Ours differ where the kernels differ:

* storage: the weights (one flat buffer per dtype, no padding) plus the fused optimizer's state,
  which we keep in **fp32** whatever the weight dtype (torchrec assumes state in the weight
  dtype) and which we derive from the sharder's ``fused_params`` as well as from
  ``apply_optimizer_in_backward`` (torchrec only looks at the latter): SGD none, row-wise Adagrad
  one float per row, Adagrad one per element, Adam two per element. The input/output buffers are
  torchrec's estimate.
* perf: with the ``fused`` kernel, the forward reads each looked-up row once and the backward
  sorts the lookups, reduces each distinct row once and updates it with its state in place, the
  data movement fbgemm's fused TBE has, so torchrec's fused-kernel cost model is used for both
  our kernels, plus the optimizer state traffic of touched rows. Our ``dense`` kernel writes a
  full dense gradient of the shard, which the optimizer then reads and applies over the whole
  shard: that traffic is added to the backward.

* the parameter-server tier (``ps_placement.PS_KERNEL``, offered when the sharder has a
  ``ps_url``): HBM holds the shard's cache (``ps_cache_load_factor`` of its rows, with their
  optimizer state), host memory the whole shard when the store is the embedded ``memory://``;
  compute is the fused kernel's times ``PS_STEP_COST``, the measured cost of the tier (so the
  planner picks it only for tables that do not fit in HBM).

``build_plan(model, sharders, world_size, ...)`` builds a ``ShardingPlan`` with these estimators
and prints it.
"""
import math
from typing import Dict, List, Optional

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.shard_estimators import _get_optimizer_multipler
from torchrec.distributed.planner.types import ParameterConstraints, ShardEstimator, ShardingOption, Storage
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType

from ..modules.embedding_modules import EmbeddingBagCollection
from .lookup import optimizer_from_fused_params
from .ps_placement import PS_KERNEL, cache_rows, store_in_host_memory

# A PS-backed training step over an all-in-HBM one: 6.56 / 2.81 ms on the H100's `ps` workload
# (memory://, 5% cache; docs/perf-notes.md, "PS v2 on the H100").
PS_STEP_COST = 2.3

# fp32 optimizer-state floats per (row, element) of a shard.
_STATE_FLOATS = {"sgd": (0, 0), "rowwise_adagrad": (1, 0), "adagrad": (0, 1), "adam": (0, 2)}


def _is_ours(option: ShardingOption) -> bool:
    return isinstance(option.module[1], EmbeddingBagCollection)


def _torchrec_optimizer_class(option: ShardingOption):
    classes = getattr(option.tensor, "_optimizer_classes", [None])
    return classes[0] if classes else None


def our_optimizer(option: ShardingOption, sharder_fused_params: Optional[Dict]) -> Optional[str]:
    """Which fused optimizer our kernel will run for this option (None: no optimizer state)."""
    if option.sharding_type == ShardingType.DATA_PARALLEL.value or \
            option.compute_kernel not in (EmbeddingComputeKernel.FUSED.value, PS_KERNEL):
        return None
    cls = _torchrec_optimizer_class(option)
    if cls is not None:
        from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

        fused = {"optimizer": optimizer_type_to_emb_opt_type(cls)}
    else:
        fused = dict(sharder_fused_params or {})
    found = optimizer_from_fused_params(fused)
    return None if found is None else found[0]


def _sharder_data(sharder_data_map, kwargs):
    """The estimators' second argument: torchrec 1.8 passes ``sharder_data_map`` (name -> SharderData),
    torchrec 1.6 ``sharder_map`` (name -> ModuleSharder); both values carry ``fused_params``, and the
    base estimators take it positionally under either name."""
    return sharder_data_map if sharder_data_map is not None else kwargs.get("sharder_map")


class _CostedAsFused:
    """Our PS-tier (and, for perf, dense) options estimated by torchrec as its fused kernel, whose
    cost model it has; the kernel is restored afterwards."""

    def __init__(self, options: List[ShardingOption]) -> None:
        self.options = options
        self.kernels = [o.compute_kernel for o in options]

    def __enter__(self):
        for o in self.options:
            o.compute_kernel = EmbeddingComputeKernel.FUSED.value

    def __exit__(self, *exc):
        for o, k in zip(self.options, self.kernels):
            o.compute_kernel = k


def _device_field(compute_device: str) -> str:
    return "ddr" if compute_device == "cpu" else "hbm"


class FusedEmbeddingStorageEstimator(ShardEstimator):
    """torchrec's storage estimate, with tensor + optimizer state replaced by ours for our
    module's tables (other modules' options are left as torchrec estimates them)."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 **kwargs) -> None:
        self._topology = topology
        self._base = EmbeddingStorageEstimator(topology, constraints, **kwargs)

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map=None, **kwargs) -> None:
        sharder_data_map = _sharder_data(sharder_data_map, kwargs)
        with _CostedAsFused([o for o in sharding_options if _is_ours(o) and o.compute_kernel == PS_KERNEL]):
            self._base.estimate(sharding_options, sharder_data_map)
        field = _device_field(self._topology.compute_device)
        for option in sharding_options:
            if not _is_ours(option):
                continue
            data = sharder_data_map[option.module_type_key] if sharder_data_map else None
            fused_params = getattr(data, "fused_params", None) if data is not None else None
            ours = our_optimizer(option, fused_params)
            element = option.tensor.element_size()
            total = math.prod(option.tensor.shape)
            torchrec_multiplier = _get_optimizer_multipler(_torchrec_optimizer_class(option), option.tensor.shape)
            for shard in option.shards:
                rows, cols = shard.size
                if option.sharding_type == ShardingType.DATA_PARALLEL.value:
                    numel = total
                    rows = option.tensor.shape[0]
                else:
                    numel = rows * cols
                torchrec_tensor = numel * element
                torchrec_part = torchrec_tensor + math.ceil(torchrec_tensor * torchrec_multiplier)
                per_row, per_elem = _STATE_FLOATS.get(ours, (0, 0)) if ours else (0, 0)
                storage = shard.storage or Storage(hbm=0, ddr=0)
                if option.compute_kernel == PS_KERNEL:
                    # The cache (rows and their state) on the device; the rows and state of the
                    # whole shard in the store, as fp32 (host memory when it is memory://).
                    cached = cache_rows(fused_params or {}, rows)
                    our_part = cached * cols * element + 4 * (per_row * cached + per_elem * cached * cols)
                    if store_in_host_memory(fused_params or {}):
                        storage.ddr = int(storage.ddr + 4 * (numel + per_row * rows + per_elem * numel))
                else:
                    our_part = numel * element + 4 * (per_row * rows + per_elem * numel)
                value = max(0, getattr(storage, field) - torchrec_part) + our_part
                setattr(storage, field, int(value))
                shard.storage = storage


class FusedEmbeddingPerfEstimator(ShardEstimator):
    """torchrec's perf estimate (communication included); our module's compute is costed as
    torchrec's fused-kernel model plus the traffic our kernels add (see the module doc)."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 is_inference: bool = False) -> None:
        self._topology = topology
        self._constraints = constraints
        self._base = EmbeddingPerfEstimator(topology, constraints, is_inference)

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map=None, **kwargs) -> None:
        sharder_data_map = _sharder_data(sharder_data_map, kwargs)
        dense = [o for o in sharding_options if _is_ours(o)
                 and o.compute_kernel == EmbeddingComputeKernel.DENSE.value
                 and o.sharding_type != ShardingType.DATA_PARALLEL.value]
        dense_ids = {id(o) for o in dense}
        in_ps = [o for o in sharding_options if _is_ours(o) and o.compute_kernel == PS_KERNEL]
        # Our dense kernel's lookup is costed as the fused one, plus the dense gradient below;
        # the PS tier's as the fused one times PS_STEP_COST.
        with _CostedAsFused(dense + in_ps):
            self._base.estimate(sharding_options, sharder_data_map)
        for option in in_ps:
            for shard in option.shards:
                if shard.perf is not None:
                    shard.perf.fwd_compute *= PS_STEP_COST
                    shard.perf.bwd_compute *= PS_STEP_COST
        bw = self._topology.ddr_mem_bw if self._topology.compute_device == "cpu" else self._topology.hbm_mem_bw
        for option in sharding_options:
            if not _is_ours(option):
                continue
            data = sharder_data_map[option.module_type_key] if sharder_data_map else None
            ours = our_optimizer(option, getattr(data, "fused_params", None) if data is not None else None)
            element = option.tensor.element_size()
            lookups = option.batch_size * sum(option.input_lengths) * self._topology.world_size
            for shard in option.shards:
                if shard.perf is None:
                    continue
                rows, cols = shard.size
                if id(option) in dense_ids or option.sharding_type == ShardingType.DATA_PARALLEL.value:
                    # dense [rows, cols] gradient written, then read and applied by the optimizer
                    shard.perf.bwd_compute += 3 * rows * cols * element / bw
                elif ours:
                    per_row, per_elem = _STATE_FLOATS.get(ours, (0, 0))
                    touched = min(rows, lookups)
                    shard.perf.bwd_compute += 2 * 4 * touched * (per_row + per_elem * cols) / bw


def make_planner(
    world_size: int,
    compute_device: str = "cpu",
    batch_size: int = 512,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    hbm_cap: Optional[int] = None,
    ddr_cap: Optional[int] = None,
    local_world_size: Optional[int] = None,
) -> EmbeddingShardingPlanner:
    """An ``EmbeddingShardingPlanner`` whose estimators describe our kernel."""
    topology = Topology(world_size=world_size, compute_device=compute_device, hbm_cap=hbm_cap,
                        ddr_cap=ddr_cap, local_world_size=local_world_size)
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=batch_size, constraints=constraints,
        estimator=[FusedEmbeddingPerfEstimator(topology, constraints),
                   FusedEmbeddingStorageEstimator(topology, constraints)],
    )
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, enumerator=enumerator,
                                    constraints=constraints, debug=False)


def build_plan(
    model: nn.Module,
    sharders: List[ModuleSharder[nn.Module]],
    world_size: int,
    compute_device: str = "cpu",
    batch_size: int = 512,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    print_plan: bool = True,
    **topology_kwargs,
) -> ShardingPlan:
    """Plans ``model`` for ``world_size`` ranks with our estimators and prints the plan
    (per module: table, sharding type, compute kernel, ranks, shard sizes)."""
    planner = make_planner(world_size, compute_device, batch_size, constraints, **topology_kwargs)
    plan = planner.plan(model, sharders)
    if print_plan:
        print(format_plan(plan))
    return plan


def format_plan(plan: ShardingPlan) -> str:
    lines = [f"{'module':<12} {'table':<12} {'sharding':<16} {'kernel':<17} {'ranks':<10} shard sizes"]
    for module_path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():
            sizes = [list(s.shard_sizes) for s in ps.sharding_spec.shards] if ps.sharding_spec else []
            ranks = ",".join(str(r) for r in (ps.ranks or []))
            lines.append(f"{module_path:<12} {table:<12} {ps.sharding_type:<16} {ps.compute_kernel:<17} "
                         f"{ranks:<10} {sizes}")
    return "\n".join(lines)
