"""The fused pooled-embedding lookup as torch custom ops.

``recom_rec::pooled_embedding_forward`` pools every feature of a group of tables from one flat
weight buffer in a single kernel; its autograd formula calls ``pooled_embedding_backward`` (dense
gradient of the flat buffer, split into per-table views) and, when the KJT weights require grad,
``pooled_embedding_weights_backward``. Being custom ops with fake implementations, they keep
``torch.compile(fullgraph=True)`` in one graph and work on meta/fake tensors.
"""
import warnings
from functools import lru_cache
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import torch_backend
from .expand_bags import Expansion, eager_expand_bags
from .backends import resolve_backend
from .input_check import kernel_report
from .plan import FusedStep, GroupPlan, LookupPlan, group_states
from .validation import check_device, check_shapes, decode_names, validate_inputs

@lru_cache(maxsize=None)
def _triton():
    from ..kernels import pooled_triton

    return pooled_triton


@lru_cache(maxsize=None)
def _cuda():
    from ..kernels import pooled_cuda

    return pooled_cuda


def _impl(backend: str, device: torch.device, phase: str = "backward", num_features: int = 0,
          total_dim: int = 0, max_dim: int = 0):
    """The module implementing forward / backward / fused_update for this backend and device.
    ``auto`` on a GPU: the forward kernels measured per shape (kernels/selection.py), the backward
    on the CUDA kernels where they build."""
    resolved = resolve_backend(backend, device)
    if backend == "auto" and resolved == "triton":
        if phase == "forward":
            return _selection()
        resolved = "cuda" if _cuda_builds() else "triton"
    if resolved == "cuda":
        return _cuda()
    if resolved == "triton":
        return _triton()
    return torch_backend


@lru_cache(maxsize=None)
def _selection():
    from ..kernels import selection

    return selection


def load_kernels(backend: str) -> None:
    """Imports the GPU kernels ``backend`` would run (and loads the CUDA extension for ``auto`` and
    ``cuda``) where a GPU can run them. Their Triton ``@jit`` decorators read and tokenize their
    sources: ~70 ms of call 1 on the H200's host (perf-notes v47), which a module's construction
    pays instead (issue 51: the first call)."""
    if backend == "torch" or not torch.cuda.is_available():
        return
    if backend == "auto":
        _selection()  # (imports the Triton and CUDA backends too)
    elif backend == "triton":
        _triton()
    # The extension's load asks the GPU's architecture, which starts CUDA: a module built on the CPU
    # or meta must not (a process that then forks CUDA workers would fail); its first call loads it.
    if not torch.cuda.is_initialized():
        return
    if backend in ("auto", "cuda"):
        _cuda_builds()
    from ..kernels.launch_tuner import load_decisions

    load_decisions(torch.device("cuda", torch.cuda.current_device()))


@lru_cache(maxsize=None)
def _cuda_builds() -> bool:
    """Whether "auto" may use the CUDA kernels: their extension builds (or is cached) here."""
    error = _cuda().build_error()
    if error:
        warnings.warn(f"recom_rec: backend='auto' runs the Triton kernels only; the CUDA kernels are "
                      f"unavailable ({error})")
    return error is None


@torch.library.custom_op("recom_rec::pooled_embedding_forward", mutates_args=())
def pooled_embedding_forward(
    weights: List[Tensor],
    flat: Tensor,
    values: Tensor,
    offsets: Tensor,
    per_sample_weights: Optional[Tensor],
    feature_meta: Tensor,
    key_index: Tensor,
    batch_size: int,
    total_dim: int,
    max_dim: int,
    backend: str,
    validate: bool,
    names: str,
    optimizer: int,
    state1: Optional[Tensor],
    state2: Optional[Tensor],
    state1_is_row: bool,
    hyper: Optional[Tensor],
    step: Optional[Tensor],
    num_lookups: int,
    num_rows: int = -1,
    report_id: int = 0,
) -> Tensor:
    """Pooled embeddings ``[batch_size, total_dim]`` (fp32) of every feature of a group.

    ``weights`` are the per-table parameters (views of ``flat``), passed only so autograd can
    route gradients to them; the lookup itself reads ``flat``. With ``optimizer >= 0`` (an
    ``optim.spec`` kind) the backward updates ``flat`` and the optimizer states in place instead
    of returning gradients. ``report_id`` is the module's (input_check): the GPU kernels' input
    reports go to its slots."""
    return _forward_impl(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                         total_dim, max_dim, backend, validate, names, report_id)


def _forward_impl(flat, values, offsets, per_sample_weights, feature_meta, keys, batch_size, total_dim, max_dim,
                  backend, validate, names, report_id):
    check_device(flat, values, offsets, per_sample_weights, names)
    impl = _impl(backend, flat.device, "forward", feature_meta.shape[0], total_dim, max_dim)
    if impl is torch_backend:
        if validate:
            validate_inputs(values, offsets, per_sample_weights, feature_meta, keys, batch_size, names)
        return torch_backend.forward(
            flat, values, offsets, per_sample_weights, feature_meta, keys, batch_size, total_dim
        )
    check = None
    if validate:
        # The kernels check ids and bags as they read them and report without a sync
        # (input_check); the host checks what it knows without reading the batch.
        check_shapes(values, offsets, per_sample_weights, len(decode_names(names)[0]), batch_size)
        check = kernel_report(flat, names, report_id)
    return impl.forward(flat, values, offsets, per_sample_weights, feature_meta, keys, batch_size, total_dim, max_dim,
                        check=check)



@pooled_embedding_forward.register_fake
def _(weights, flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
      total_dim, max_dim, backend, validate, names, optimizer, state1, state2, state1_is_row, hyper, step,
      num_lookups, num_rows=-1, report_id=0):
    return flat.new_empty((batch_size, total_dim), dtype=torch.float32)


@torch.library.custom_op("recom_rec::pooled_embedding_backward", mutates_args=())
def pooled_embedding_backward(
    grad_output: Tensor,
    values: Tensor,
    offsets: Tensor,
    per_sample_weights: Optional[Tensor],
    feature_meta: Tensor,
    key_index: Tensor,
    batch_size: int,
    total_numel: int,
    max_dim: int,
    dtype: torch.dtype,
    backend: str,
    num_lookups: int,
    num_rows: int = -1,
) -> Tensor:
    """Dense gradient ``[total_numel]`` of the flat weight buffer, in the weights' dtype."""
    return _backward_impl(grad_output, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                          total_numel, max_dim, dtype, backend, num_lookups, num_rows)


def _backward_impl(grad_output, values, offsets, per_sample_weights, feature_meta, keys, batch_size, total_numel,
                   max_dim, dtype, backend, num_lookups, num_rows=-1, grad_rows=None):
    """``grad_rows`` (the kernel backends only): see kernels/pooled_triton.run_backward."""
    impl = _impl(backend, grad_output.device)
    if impl is not torch_backend:
        return impl.backward(
            grad_output, values, offsets, per_sample_weights, feature_meta, keys, batch_size,
            total_numel, dtype, max_dim, num_lookups, num_rows, grad_rows=grad_rows,
        )
    assert grad_rows is None, "the torch backend reads one gradient block"
    return torch_backend.backward(
        grad_output, values, offsets, per_sample_weights, feature_meta, keys, batch_size, total_numel, dtype
    )


@pooled_embedding_backward.register_fake
def _(grad_output, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
      total_numel, max_dim, dtype, backend, num_lookups, num_rows=-1):
    return grad_output.new_empty((total_numel,), dtype=dtype)


@torch.library.custom_op("recom_rec::pooled_embedding_weights_backward", mutates_args=())
def pooled_embedding_weights_backward(
    grad_output: Tensor,
    flat: Tensor,
    values: Tensor,
    offsets: Tensor,
    feature_meta: Tensor,
    key_index: Tensor,
    batch_size: int,
) -> Tensor:
    """Gradient of the KJT's per-sample weights (e.g. learnable position weights)."""
    return torch_backend.per_sample_weights_grad(
        grad_output, flat, values, offsets, feature_meta, key_index, batch_size
    )


@pooled_embedding_weights_backward.register_fake
def _(grad_output, flat, values, offsets, feature_meta, key_index, batch_size):
    return grad_output.new_empty((values.shape[0],), dtype=torch.float32)


@torch.library.custom_op(
    "recom_rec::fused_embedding_update", mutates_args=("flat", "state1", "state2")
)
def fused_embedding_update(
    grad_output: Tensor,
    flat: Tensor,
    state1: Optional[Tensor],
    state2: Optional[Tensor],
    state1_is_row: bool,
    hyper: Tensor,
    step: Tensor,
    values: Tensor,
    offsets: Tensor,
    per_sample_weights: Optional[Tensor],
    feature_meta: Tensor,
    key_index: Tensor,
    batch_size: int,
    max_dim: int,
    optimizer: int,
    backend: str,
    num_lookups: int,
    num_rows: int = -1,
) -> None:
    """The backward with the optimizer fused in: updates the touched rows of ``flat`` and their
    optimizer state in place (duplicate ids summed first). ``step`` (Adam's bias correction) is
    counted by the module's forward, as fbgemm counts its iterations."""
    _fused_update_impl(grad_output, flat, state1, state2, state1_is_row, hyper, step, values, offsets,
                       per_sample_weights, feature_meta, key_index, batch_size, max_dim, optimizer, backend,
                       num_lookups, num_rows)


def _fused_update_impl(grad_output, flat, state1, state2, state1_is_row, hyper, step, values, offsets,
                       per_sample_weights, feature_meta, keys, batch_size, max_dim, optimizer, backend, num_lookups,
                       num_rows=-1, grad_rows=None):
    """``grad_rows`` (the kernel backends only): see kernels/pooled_triton.run_backward."""
    impl = _impl(backend, flat.device)
    states = [t for t in (state1, state2) if t is not None]
    extra = {} if grad_rows is None else {"grad_rows": grad_rows}
    impl.fused_update(
        grad_output, flat, states, [state1_is_row, False][:len(states)], hyper, step, values, offsets,
        per_sample_weights, feature_meta, keys, batch_size, max_dim, optimizer, num_lookups, num_rows, **extra,
    )


@fused_embedding_update.register_fake
def _(grad_output, flat, state1, state2, state1_is_row, hyper, step, values, offsets,
      per_sample_weights, feature_meta, key_index, batch_size, max_dim, optimizer, backend, num_lookups, num_rows=-1):
    return None


def _setup_context(ctx, inputs, output):
    (weights, flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
     total_dim, max_dim, backend, validate, names, optimizer, state1, state2, state1_is_row,
     hyper, step, num_lookups, num_rows, _report_id) = inputs
    ctx.num_lookups, ctx.num_rows = num_lookups, num_rows
    ctx.optimizer = optimizer
    ctx.state1_is_row = state1_is_row
    # The weights' values are needed only for the sample weights' gradient; otherwise the backward
    # only writes into the buffer (and the optimizer state). Holding those by reference rather than
    # saving them lets one graph use the module twice (a fused update bumps their versions, which
    # would fail a saved tensor's check in the other use's backward).
    weights_needed = per_sample_weights is not None and per_sample_weights.requires_grad
    ctx.save_for_backward(flat if weights_needed else None, values, offsets, per_sample_weights, feature_meta,
                          key_index)
    ctx.flat, ctx.states = flat, (state1, state2)
    # Read, not saved: the step counter and the hyper-parameters change in place between steps
    # (an lr scheduler, the next forward), and several groups share them.
    ctx.hyper, ctx.step = hyper, step
    # The tables' Parameters only give the shapes of their gradients (views of one flat gradient).
    ctx.tables = list(weights)
    ctx.batch_size = batch_size
    ctx.max_dim = max_dim
    ctx.backend = backend
    ctx.flat_numel = flat.shape[0]
    ctx.flat_dtype = flat.dtype


def _wants_grad(flag) -> bool:
    # For a Tensor[] input, autograd reports one flag per element.
    return any(flag) if isinstance(flag, (list, tuple)) else bool(flag)


def table_grad_views(grad_flat: Tensor, runs: List[Tuple[int, int, int, List[int]]]) -> List[Tensor]:
    """The tables' gradients as views of the group's flat gradient (layout.table_runs): one
    ``split_with_sizes`` per run of equal-width tables, not a slice and a view per table (a third
    of the host time, docs/perf-notes.md "Dense gradients v2"). Being views that nothing else
    holds, autograd's AccumulateGrad takes them as the tables' ``.grad`` without a copy."""
    grads: List[Tensor] = []
    for start, end, dim, rows in runs:
        grads.extend(grad_flat[start:end].view(-1, dim).split_with_sizes(rows))
    return grads


def _grads(ctx, grad_output, wants_weights: bool, wants_psw: bool, as_ops: bool):
    """The backward of the lookup: (per-table weight gradients or None, per-sample-weight gradient
    or None). With a fused optimizer it updates the tables and their state in place instead.
    ``as_ops``: call the registered custom ops (traced graphs) rather than their bodies (eager)."""
    saved_flat, values, offsets, per_sample_weights, feature_meta, key_index = ctx.saved_tensors
    flat = saved_flat if saved_flat is not None else ctx.flat
    (state1, state2), hyper, step = ctx.states, ctx.hyper, ctx.step
    grad_psw = None
    if per_sample_weights is not None and wants_psw:  # before a fused update changes the rows it reads
        args = (grad_output, flat, values, offsets, feature_meta, key_index, ctx.batch_size)
        grad_psw = (pooled_embedding_weights_backward(*args) if as_ops
                    else torch_backend.per_sample_weights_grad(*args)).to(per_sample_weights.dtype)
    grad_weights = None
    if ctx.optimizer >= 0 and ctx.tables and wants_weights:
        # The optimizer runs here; the tables get no .grad (as with fbgemm's fused TBE).
        args = (grad_output, flat, state1, state2, ctx.state1_is_row, hyper, step, values, offsets,
                per_sample_weights, feature_meta, key_index, ctx.batch_size, ctx.max_dim,
                ctx.optimizer, ctx.backend, ctx.num_lookups, ctx.num_rows)
        if as_ops:
            fused_embedding_update(*args)
        else:
            _fused_update_impl(*args)
            # As the custom op's in-place contract does: a graph that saved these sees the update.
            torch.autograd.graph.increment_version([t for t in (flat, state1, state2) if t is not None])
    elif ctx.tables and wants_weights:
        args = (grad_output, values, offsets, per_sample_weights, feature_meta, key_index,
                ctx.batch_size, ctx.flat_numel, ctx.max_dim, ctx.flat_dtype, ctx.backend, ctx.num_lookups,
                ctx.num_rows)
        grad_flat = pooled_embedding_backward(*args) if as_ops else _backward_impl(*args)
        runs = getattr(ctx, "table_runs", None)
        if runs is not None and ctx.tables[0].dim() == 2:
            grad_weights = table_grad_views(grad_flat, runs)
        else:
            # The registered op's formula (no plan records in its schema): one C++ call makes
            # every table's view from the tables' shapes. A group's own Parameter (the module's
            # group_parameters: 1-D, the flat buffer) gets the flat gradient whole.
            grad_weights = list(torch._C._nn.unflatten_dense_tensors(grad_flat, ctx.tables))
    return grad_weights, grad_psw


def _backward(ctx, grad_output):
    grad_weights, grad_psw = _grads(ctx, grad_output, _wants_grad(ctx.needs_input_grad[0]),
                                    _wants_grad(ctx.needs_input_grad[4]), as_ops=True)
    # One entry per input (autograd checks the structure; the Tensor[] input gets a list).
    if grad_weights is None:
        grad_weights = [None] * len(ctx.tables)
    return (grad_weights, None, None, None, grad_psw) + (None,) * 17


pooled_embedding_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- eager fast path ----------------------------------------------------------------------------
# torch.library's Python custom-op layers (argument defaults, pytree flattening, alias checks,
# redispatch) cost ~0.3-0.6 ms of host time per call on the H100 machine, more than the kernels of
# a small batch (docs/perf-notes.md, v7). In plain eager mode the lookup runs the same bodies
# through a torch.autograd.Function; compiled, traced, fake/meta and dispatch-mode code keeps the
# registered ops.
class _EagerLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim,
                max_dim, backend, validate, names, optimizer, state1, state2, state1_is_row, hyper, step,
                num_lookups, num_rows, report_id, table_runs, expansion, *weights):
        out = _forward_impl(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                            total_dim, max_dim, backend, validate, names, report_id)
        _setup_context(ctx, (list(weights), flat, values, offsets, per_sample_weights, feature_meta, key_index,
                             batch_size, total_dim, max_dim, backend, validate, names, optimizer, state1, state2,
                             state1_is_row, hyper, step, num_lookups, num_rows, report_id), out)
        ctx.table_runs = table_runs
        # (held, not saved: the KJT's inverse indices and the module's columns are not changed in place)
        ctx.expansion = expansion
        if expansion is None:
            return out
        out, ctx.moved = expansion.forward(out, owned=True)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.expansion is not None:
            grad_output = ctx.expansion.backward(grad_output, ctx.batch_size, ctx.moved)
        # needs_input_grad is per input of forward(): the weights come last, the sample weights 4th.
        grad_weights, grad_psw = _grads(ctx, grad_output.contiguous(), any(ctx.needs_input_grad[23:]),
                                        ctx.needs_input_grad[3], as_ops=False)
        if grad_weights is None:
            grad_weights = [None] * len(ctx.tables)
        return (None, None, None, grad_psw) + (None,) * 19 + tuple(grad_weights)


_PLAIN_TYPES = frozenset((type(None), torch.Tensor, torch.nn.Parameter))


# torch.autograd.Function.apply's Python layer looks at every argument for functorch's dead
# wrappers (~0.7 us an argument, and each table is one: 0.7 ms a step with 1000 tables). The eager
# lookup runs only outside functorch transforms (_eager_ok) and its weights are the module's own
# Parameters, so it calls the C apply under that layer and unwraps only the batch's arguments.
_eager_apply = super(torch.autograd.Function, _EagerLookup).apply


def _eager_ok(weights: List[Tensor], *tensors: Optional[Tensor]) -> bool:
    """Whether the lookup may skip the registered op: plain eager tensors on a real device, no
    compile, trace, dispatch or function mode, no functorch transform."""
    if torch.compiler.is_compiling() or torch.jit.is_scripting() or torch._C._len_torch_dispatch_stack() or \
            torch._C._len_torch_function_stack() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    if tensors[0].device.type == "meta":
        return False
    # The types in C-level passes (a Python call per tensor cost ~0.6 us each).
    return _PLAIN_TYPES.issuperset(map(type, tensors)) and _PLAIN_TYPES.issuperset(map(type, weights))


class JaggedBatch(NamedTuple):
    """A KJT's tensors as the kernels read them."""

    values: Tensor
    offsets: Tensor
    per_sample_weights: Optional[Tensor]
    batch_size: int


class KeyRouting(NamedTuple):
    """Which KJT key each of a group's features reads, for one key order."""

    key_index: Tensor  # int64, one entry per feature of the group
    names: str  # validation.encode_names(...), or "" when inputs are not validated
    num_lookups: int  # values read in all (-1: unknown, the kernels count them)


def op_arguments(flat: Tensor, feature_meta: Tensor, batch: JaggedBatch, routing: KeyRouting, group: GroupPlan,
                 plan: LookupPlan, fused: Optional[FusedStep], group_index: int) -> tuple:
    """The records spelled out as ``pooled_embedding_forward``'s arguments after ``weights``."""
    state1, state2 = group_states(fused, group_index)
    return (flat, batch.values, batch.offsets, batch.per_sample_weights, feature_meta, routing.key_index,
            batch.batch_size, group.total_dim, group.max_dim, plan.backend, plan.validate, routing.names,
            fused.kind if fused is not None else -1, state1, state2,
            fused.state1_is_row if fused is not None else False,
            fused.hyper if fused is not None else None, fused.step if fused is not None else None,
            routing.num_lookups, group.num_rows, plan.report_id)


def pooled_lookup(weights: List[Tensor], flat: Tensor, feature_meta: Tensor, batch: JaggedBatch,
                  routing: KeyRouting, group: GroupPlan, plan: LookupPlan, fused: Optional[FusedStep] = None,
                  group_index: int = 0, expansion: Optional[Expansion] = None) -> Tensor:
    """``pooled_embedding_forward`` with its autograd formula for one group: through the registered
    op when traced or compiled, else through the same bodies at eager cost (see _EagerLookup).
    ``weights`` are what autograd differentiates against (the group's tables, or one anchor
    tensor with a fused optimizer). ``expansion`` (a variable batch's, of the group's whole
    output: ops/variable_batch.eager_expansion) runs inside the eager lookup's autograd node, or
    after the registered op in a node of its own."""
    args = op_arguments(flat, feature_meta, batch, routing, group, plan, fused, group_index)
    # The op's tensor arguments, flat first (op_arguments' positions 0-5, 13, 14, 16, 17).
    if _eager_ok(weights, *args[:6], args[13], args[14], args[16], args[17]):
        # Only the batch's tensors can be a finished functorch transform's (dead) wrappers: the
        # others are the module's own. Unwrapping just them, not all 20 arguments, saves a few us
        # a call (perf-notes v23).
        return _eager_apply(flat, *_unwrap_batch(batch), *args[4:], group.table_runs, expansion, *weights)
    out = pooled_embedding_forward(weights, *args)
    if expansion is None:
        return out
    return eager_expand_bags(out, expansion.inverse, expansion.col_feature, expansion.dims_gcd, expansion.check)


def _unwrap_batch(batch: JaggedBatch) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    unwrap = torch._C._functorch.unwrap_if_dead
    psw = batch.per_sample_weights
    return unwrap(batch.values), unwrap(batch.offsets), None if psw is None else unwrap(psw)
