"""The storage both fused collections share: tables of one dtype in one flat buffer.

``recom_rec.EmbeddingBagCollection`` and ``recom_rec.EmbeddingCollection`` keep every table of one
weight dtype in a flat 1-D buffer (a *group*: one kernel launch), each table's module holding a
leaf ``nn.Parameter`` that views its slice, so ``state_dict`` keys and shapes are torchrec's. This
mixin owns that aliasing (device moves, copies, replaced Parameters, checkpoints), the settings
the lookup reads from the module's plan, and the fused optimizer's state, which lives in flat
buffers beside the weights.

A subclass sets ``_TABLES_ATTR`` (the ``nn.ModuleDict`` of table modules: ``embedding_bags`` or
``embeddings``), ``_table_configs()`` and ``_make_table()``, builds ``self._groups`` and calls
``_build_flat_tables``.
"""
import copy
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..ops.backends import check_backend
from ..ops.input_check import keep_reports, new_report_id
from ..ops.layout import TableSlot
from ..ops.plan import FusedStep
from ..ops.step_counter import count_step
from ..ops.tracing import fx_tracing
from ..optim.keyed import FusedEmbeddingOptimizer
from ..optim.spec import spec_from_optimizer
from .table_weight import watch_parameters


class TableGroup:
    """Tables sharing a dtype: one flat buffer, one kernel launch. ``tables`` index the module's
    configs; ``slots`` place them in the buffer."""

    def __init__(self, index: int, dtype: torch.dtype, tables: List[int], slots: List[TableSlot]) -> None:
        self.index = index
        self.dtype = dtype
        self.tables = tables
        self.slots = slots
        self.total_numel = sum(s.numel for s in slots)
        self.max_dim = max((s.embedding_dim for s in slots), default=1)

    @property
    def flat_name(self) -> str:
        return f"_flat_weights_{self.index}"

    @property
    def meta_name(self) -> str:
        return f"_feature_meta_{self.index}"


class FlatTables:
    """Mixin of the fused collections (see the module docstring); placed before torchrec's class."""

    _TABLES_ATTR = "embedding_bags"
    _groups: List[TableGroup]

    def _table_modules(self) -> nn.ModuleDict:
        return getattr(self, self._TABLES_ATTR)

    def _table_configs(self) -> Sequence[Any]:
        raise NotImplementedError

    def _make_table(self, view: torch.Tensor, config: Any) -> nn.Module:
        """The table's module, its ``weight`` a Parameter viewing ``view`` (its slice of the buffer)."""
        raise NotImplementedError

    def _build_flat_tables(self, device: torch.device) -> None:
        """Allocates each group's buffer and the table modules viewing it (in config order, as
        torchrec's ``state_dict`` has them)."""
        configs = self._table_configs()
        tables: Dict[int, nn.Module] = {}
        self._host_index_buffers: Dict[str, torch.Tensor] = {}
        for group in self._groups:
            flat = torch.empty(group.total_numel, dtype=group.dtype, device=device)
            self._set_flat(group, flat)
            for slot, i in zip(group.slots, group.tables):
                view = flat[slot.elem_base:slot.elem_base + slot.numel].view(slot.num_embeddings, slot.embedding_dim)
                tables[i] = self._make_table(view, configs[i])
        modules = self._table_modules()
        for i, config in enumerate(configs):
            modules[config.name] = tables[i]
        self._hold_table_parameters()
        self._freeze_tables()

    def _autograd_inputs(self, group: "TableGroup") -> List[torch.Tensor]:
        """What the lookup op differentiates against: the tables' Parameters for dense
        gradients; with a fused optimizer just one empty tensor that requires grad (the update
        happens inside the backward, and passing hundreds of Parameters through the op would
        cost more host time than the kernels)."""
        if self._fused_spec is not None:
            return [self._autograd_anchor]
        if self._group_parameters:
            return [self._flat(group)]
        return self._table_weights(group)

    def _table_weights(self, group: "TableGroup") -> List[torch.Tensor]:
        # Read from the tables' parameter dicts, held per group: `embedding_bags[name].weight`
        # goes through two nn.Module.__getattr__ calls and a ModuleDict lookup (~2.8 us a table,
        # 2.8 ms a forward with 1000 tables); a dict read is ~0.03 us and still sees a replaced
        # Parameter.
        return [params["weight"] for params in self._table_parameters[group.index]]

    def _prepare_lookup(self) -> None:
        """Before an eager or traced lookup: the flat tables refreshed; an fx trace keeps the
        module's input reports (the graph runs under its id and may outlive it), an eager call
        syncs the optimizer-in-backward settings."""
        self._refresh_flat_tables()
        if not torch.compiler.is_compiling():
            if fx_tracing():
                keep_reports(self._plan.report_id)
            else:
                self._sync_optimizer_in_backward()

    def _refresh_flat_tables(self) -> None:
        """Before a lookup: the flat buffer is re-packed where a replaced Parameter left it stale,
        and the tables' parameter dicts are held again where they were replaced wholesale (a
        non-strict torch.export trace leaves the table modules new dicts: the held ones would keep
        its fake tensors). One identity check a forward: the dicts are replaced all together."""
        # (dict reads: nn.Module.__getattr__ and the ModuleDict would cost microseconds a forward)
        first = self._modules[self._TABLES_ATTR]._modules[self._groups[0].slots[0].name] if self._groups else None
        if first is not None and first._parameters is not self._table_parameters[0][0]:
            self._hold_table_parameters()
            self._flat_link.stale = True
        if self._flat_link.stale:
            self._repack_flat_buffers()

    def _lookup_flats(self) -> List[torch.Tensor]:
        """The flat buffers a lookup reads: the groups' own, unless a table's weight was set in its
        parameter dict since the last check (see _flats_of_current_weights)."""
        flats = [self._flat(g) for g in self._groups]
        if self._flat_link.swapped and not (torch.compiler.is_compiling() or fx_tracing()):
            flats = self._flats_of_current_weights(flats)
        return flats

    def _flats_of_current_weights(self, flats: List[torch.Tensor]) -> List[torch.Tensor]:
        """The lookup reads the weights the tables hold now. Weights that view the group's buffer
        (the module's own) read it; weights substituted for a call (``torch.func.functional_call``)
        are packed into a buffer for that call (the module keeps its own: they come back when the
        call ends); a trace's tensors (torch.export's fakes) are left as they are. Once every
        table holds its own weight again the check stops."""
        out, own = [], True
        for group, flat in zip(self._groups, flats):
            weights = self._table_weights(group)
            if not all(type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta" for t in [flat, *weights]):
                out.append(flat)  # tracing tensors: the trace's own consistent state
                own = False
                continue
            storage = flat.untyped_storage().data_ptr()
            if all(w.untyped_storage().data_ptr() == storage for w in weights):
                out.append(flat)
                continue
            own = False
            if self._fused_spec is not None:
                raise ValueError("the tables' weights were substituted (torch.func.functional_call?) while a fused "
                                 "optimizer is enabled: its update would go to a copy; call it without the fused "
                                 "optimizer")
            out.append(torch.cat([w.reshape(-1).to(group.dtype) for w in weights]))
        if own:
            self._flat_link.swapped = False
        return out

    def _hold_table_parameters(self) -> None:
        tables = self._table_modules()
        for group in self._groups:  # (a dict replaced wholesale is watched again)
            for s in group.slots:
                watch_parameters(tables[s.name], self._flat_link)
        self._table_parameters: List[List[Dict[str, Any]]] = [
            [tables[s.name]._parameters for s in group.slots] for group in self._groups]

    def _flat(self, group: "TableGroup") -> torch.Tensor:
        return getattr(self, group.flat_name)

    def _set_flat(self, group: "TableGroup", flat: torch.Tensor) -> None:
        """The group's flat buffer: a non-persistent buffer, or with group_parameters the group's
        Parameter (kept out of state_dict: the tables' keys hold its values). An existing
        Parameter keeps its identity (an optimizer holds it), as nn.Module._apply does."""
        if not self._group_parameters:
            self.register_buffer(group.flat_name, flat, persistent=False)
            return
        old = self._parameters.get(group.flat_name)
        if old is not None and torch._has_compatible_shallow_copy_type(old, flat):
            old.data = flat
        else:
            self._parameters[group.flat_name] = nn.Parameter(flat, requires_grad=old is None or old.requires_grad)

    def _freeze_tables(self) -> None:
        """With group_parameters the tables' Parameters view the group's and are not trained on
        their own."""
        if self._group_parameters:
            for group in self._groups:
                for w in self._table_weights(group):
                    w.requires_grad_(False)

    def _repack_flat_buffers(self) -> None:
        """Re-establishes "every table weight views the flat buffer" after a Parameter was
        replaced: copies the current weights into a fresh buffer and re-points them at it."""
        with torch.no_grad():
            for group in self._groups:
                weights = self._table_weights(group)
                dtype, device = weights[0].dtype, weights[0].device
                flat = torch.cat([w.detach().reshape(-1).to(dtype) for w in weights]) if weights else \
                    torch.empty(0, dtype=group.dtype, device=device)
                for w, slot in zip(weights, group.slots):
                    w.data = flat[slot.elem_base:slot.elem_base + slot.numel].view_as(w)
                self._set_flat(group, flat)
                setattr(self, group.meta_name, getattr(self, group.meta_name).to(device))
        self._freeze_tables()
        self._flat_link.stale = False
        self._flat_link.swapped = False  # every table's weight views the new buffer

    def _apply(self, fn, recurse=True):
        # nn.Module._apply would convert each table's Parameter on its own and break the
        # aliasing with the flat buffer: convert the buffer once and re-point the views.
        for group in self._groups:
            old_flat = self._flat(group)
            with torch.no_grad():  # as nn.Module._apply: a Parameter's conversion is not differentiated
                new_flat = fn(old_flat)
            if isinstance(new_flat, nn.Parameter):  # fn of a Parameter (group_parameters): its data
                new_flat = new_flat.detach()
            for w, slot in zip(self._table_weights(group), group.slots):
                view = new_flat[slot.elem_base:slot.elem_base + slot.numel].view(slot.num_embeddings, slot.embedding_dim)
                bag = self._table_modules()[slot.name]
                if torch._has_compatible_shallow_copy_type(w, view):
                    w.data = view
                else:  # e.g. meta -> cpu: the Parameter object itself must be replaced
                    bag._parameters["weight"] = nn.Parameter(view, requires_grad=w.requires_grad)
                if w.grad is not None:
                    bag.weight.grad = fn(w.grad)
            if self._group_parameters:
                grad = old_flat.grad
                self._set_flat(group, new_flat)
                if grad is not None:
                    self._flat(group).grad = fn(grad)
            else:
                self._buffers[group.flat_name] = new_flat
        if self._fused_spec is not None:
            # .data swaps keep the tensors the KeyedOptimizer holds (param group, "step").
            device = self._flat(self._groups[0]).device if self._groups else self._device
            self._fused_hyper.data = self._fused_hyper.data.to(device)
            self._fused_step.data = self._fused_step.data.to(device)
            self._autograd_anchor = torch.zeros(0, device=device, requires_grad=True)
            for group in self._groups:
                for name, _ in self._fused_spec.state_names():
                    key = f"_optimizer_{name}_{group.index}"
                    self._buffers[key] = fn(self._buffers[key])
                self._bind_optimizer_state_views(group)
        # Index metadata is not data: never let fn touch it (to_empty would fill it with
        # garbage, .half() must not apply); rebuild it from its host copy on the new device.
        device = self._flat(self._groups[0]).device if self._groups else self._device
        for name, host in self._host_index_buffers.items():
            self._buffers[name] = host.to(device)
        self._device = device
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # apply_optimizer_in_backward is otherwise picked up at the first forward: a checkpoint
        # loaded before it must find the fused optimizer's state buffers (tables load after us).
        self._sync_optimizer_in_backward()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # Checkpoints without fused-optimizer state (torchrec's own) load strictly too; the groups'
        # Parameters (group_parameters) load through the tables' keys.
        flats = {prefix + g.flat_name for g in self._groups} if self._group_parameters else set()
        missing_keys[:] = [k for k in missing_keys if k != prefix + "fused_optimizer_step" and k not in flats]
        if self._fused_spec is None:
            # Optimizer state for a module without a fused optimizer yet: nothing to put it in.
            dropped = [k for k in unexpected_keys if k == prefix + "fused_optimizer_step"]
            if dropped:
                warnings.warn("fused_optimizer_step ignored: enable the fused optimizer before "
                              "load_state_dict to restore it")
                unexpected_keys[:] = [k for k in unexpected_keys if k not in dropped]

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._group_parameters:  # the tables' keys hold the groups' values, as torchrec's state_dict
            for group in self._groups:
                destination.pop(prefix + group.flat_name, None)

    def __deepcopy__(self, memo):
        # copy.deepcopy clones each Parameter on its own (Parameter.__deepcopy__), which would
        # leave the copy's tables detached from the copy's flat buffer: copy, then repack.
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        new._hold_table_parameters()
        new._repack_flat_buffers()
        new._plan = new._plan._replace(report_id=new_report_id(new))
        return new

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._plan = self._plan._replace(report_id=new_report_id(self))  # a module unpickled twice is two modules

    def _scripted_flats(self) -> List[torch.Tensor]:
        flats: List[torch.Tensor] = []
        if hasattr(self, "_flat_weights_0"):
            flats.append(self._flat_weights_0)
        if hasattr(self, "_flat_weights_1"):
            flats.append(self._flat_weights_1)
        if hasattr(self, "_flat_weights_2"):
            flats.append(self._flat_weights_2)
        return flats

    def _scripted_metas(self) -> List[torch.Tensor]:
        metas: List[torch.Tensor] = []
        if hasattr(self, "_feature_meta_0"):
            metas.append(self._feature_meta_0)
        if hasattr(self, "_feature_meta_1"):
            metas.append(self._feature_meta_1)
        if hasattr(self, "_feature_meta_2"):
            metas.append(self._feature_meta_2)
        return metas

    # Settings the lookup reads from the plan; changing them re-plans.
    @property
    def backend(self) -> str:
        return self._plan.backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._plan = self._plan._replace(backend=check_backend(value))

    @property
    def validate_inputs(self) -> bool:
        return self._plan.validate

    @validate_inputs.setter
    def validate_inputs(self, value: bool) -> None:
        self._plan = self._plan._replace(validate=bool(value))

    @torch.jit.export
    def check_inputs(self) -> None:
        """Waits for the kernels this thread queued for this module and raises the input error
        they reported (see ``validate_inputs``), if any: the synchronous form of the GPU check, for
        a request handler, the end of a run or debugging a data pipeline batch by batch. Other
        modules' and other threads' reports stay theirs."""
        torch.ops.recom_rec.check_input_reports(self._plan.report_id)

    # ----------------------------------------------------------------------------- fused training
    def enable_fused_optimizer(self, optimizer: Any, **kwargs: Any) -> FusedEmbeddingOptimizer:
        """Fuses ``optimizer`` into the backward: each batch's touched rows are updated in place
        (duplicate ids summed first) and the tables get no ``.grad``. ``optimizer`` is a class
        (``torch.optim.SGD``/``Adagrad``/``Adam``/``AdamW``, ``torchrec.optim.RowWiseAdagrad``)
        or a name (``"sgd"``, ``"adagrad"``, ``"rowwise_adagrad"``, ``"adam"``, ``"adamw"``);
        ``kwargs`` are its constructor's. torchrec's ``apply_optimizer_in_backward`` on this
        module's parameters does the same. Returns ``self.fused_optimizer``."""
        spec = spec_from_optimizer(optimizer, kwargs)
        device = self._device
        self._fused_spec = spec
        self._fused_hyper = spec.hyper_tensor(device)
        self._fused_step = torch.zeros(1, dtype=torch.int64, device=device)
        self._autograd_anchor = torch.zeros(0, device=device, requires_grad=True)
        # Saved with the module's checkpoint (Adam's bias correction depends on it).
        self.register_buffer("fused_optimizer_step", self._fused_step)
        state: Dict[nn.Parameter, Dict[str, torch.Tensor]] = {}
        for group in self._groups:
            for name, kind in spec.state_names():
                size = sum(s.num_embeddings for s in group.slots) if kind == "row" else group.total_numel
                flat_state = torch.full((size,), spec.initial_value(name), dtype=torch.float32, device=device)
                self.register_buffer(f"_optimizer_{name}_{group.index}", flat_state, persistent=False)
            self._bind_optimizer_state_views(group)
            for slot in group.slots:
                bag = self._table_modules()[slot.name]
                state[bag.weight] = {name: bag._buffers[f"optimizer_{name}"] for name, _ in spec.state_names()}
                if spec.kind == 3:  # Adam: the bias correction's step count
                    state[bag.weight]["step"] = self._fused_step
        params = {f"{self._TABLES_ATTR}.{name}.weight": bag.weight for name, bag in self._table_modules().items()}
        self._fused_optimizer = FusedEmbeddingOptimizer(spec, params, state, self._fused_hyper)
        return self._fused_optimizer

    def _fused_step_for_forward(self, count_in_lookup: bool = False) -> Optional[FusedStep]:
        """The fused optimizer's step for this forward's backward (None without one, or without
        grad). A training forward counts one optimizer step (as fbgemm counts iterations); the
        backward's Adam bias correction reads it. ``count_in_lookup``: the lookup counts it
        (FusedStep.count_in_lookup), else it is counted here."""
        spec = self._fused_spec
        if spec is None or not torch.is_grad_enabled():
            return None
        if self.training and not count_in_lookup:
            count_step(self._fused_step)
        return FusedStep(spec.kind, [self._optimizer_states(g) for g in self._groups],
                         any(kind == "row" for _, kind in spec.state_names()), self._fused_hyper, self._fused_step,
                         self.training and count_in_lookup)

    def _bind_optimizer_state_views(self, group: "TableGroup") -> None:
        """Per-table views of the group's flat optimizer state, as persistent buffers of the
        table modules (so the state is saved and restored with the module's checkpoint)."""
        for name, kind in self._fused_spec.state_names():
            flat_state = getattr(self, f"_optimizer_{name}_{group.index}")
            for slot in group.slots:
                if kind == "row":
                    view = flat_state[slot.row_base:slot.row_base + slot.num_embeddings]
                else:
                    view = flat_state[slot.elem_base:slot.elem_base + slot.numel].view(
                        slot.num_embeddings, slot.embedding_dim)
                buffers = self._table_modules()[slot.name]._buffers
                existing = buffers.get(f"optimizer_{name}")
                if existing is not None and torch._has_compatible_shallow_copy_type(existing, view):
                    existing.data = view  # keep the object the KeyedOptimizer's state refers to
                else:
                    buffers[f"optimizer_{name}"] = view

    def reset_optimizer_rows(self, table: str, rows: torch.Tensor) -> None:
        """Puts the fused optimizer's state of ``rows`` of ``table`` back to its initial value
        (e.g. slots a managed-collision module gave to new ids); nothing without a fused optimizer."""
        if self._fused_spec is None:
            return
        bag = self._table_modules()[table]
        rows = rows.to(device=bag.weight.device, dtype=torch.int64)
        with torch.no_grad():
            for name, _ in self._fused_spec.state_names():
                bag._buffers[f"optimizer_{name}"][rows] = self._fused_spec.initial_value(name)

    def _optimizer_states(self, group: "TableGroup") -> List[torch.Tensor]:
        return [getattr(self, f"_optimizer_{name}_{group.index}") for name, _ in self._fused_spec.state_names()]

    @property
    def fused_optimizer(self) -> Optional[FusedEmbeddingOptimizer]:
        """The fused optimizer as a torchrec ``KeyedOptimizer`` (None until one is enabled)."""
        return self._fused_optimizer

    def _sync_optimizer_in_backward(self) -> None:
        """Picks up ``apply_optimizer_in_backward(cls, module.parameters(), kwargs)``."""
        if not self._groups or not self._groups[0].slots:
            return
        first = self._table_parameters[0][0]["weight"]  # a dict read: this runs every forward
        classes = getattr(first, "_optimizer_classes", None)
        if not classes:
            return
        marker = (id(classes), len(classes))
        if marker == self._seen_in_backward:
            return
        configs = []
        for name, bag in self._table_modules().items():
            cls = getattr(bag.weight, "_optimizer_classes", None)
            kw = getattr(bag.weight, "_optimizer_kwargs", None)
            if not cls:
                raise ValueError(f"apply_optimizer_in_backward was applied to some tables but not to {name!r}; "
                                 "a fused module applies one optimizer to all its tables")
            configs.append((name, cls[-1], kw[-1]))
        _, cls0, kw0 = configs[0]
        for name, cls, kw in configs[1:]:
            if cls is not cls0 or kw != kw0:
                raise ValueError(f"table {name!r} asks for {cls.__name__}({kw}) but {configs[0][0]!r} for "
                                 f"{cls0.__name__}({kw0}); a fused module applies one optimizer to all its tables")
        self.enable_fused_optimizer(cls0, **kw0)
        self._seen_in_backward = marker
    @property
    def device(self) -> torch.device:
        return self._device

