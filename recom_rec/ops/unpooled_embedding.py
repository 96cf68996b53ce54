"""The fused unpooled lookup (``recom_rec.EmbeddingCollection``) as torch custom ops.

``recom_rec::unpooled_embedding_forward`` gathers one row per id for every feature of a group of
tables from one flat weight buffer in a single kernel (the CUDA extension's, csrc/lookup/unpooled.cu,
where it runs, else Triton's: _extension): a ``[M, dim]`` fp32 block whose rows
``[out_start[f], out_start[f + 1])`` are feature f's ids in their KJT order. Its autograd formula
calls ``unpooled_embedding_backward`` (dense gradient of the flat buffer) or, with a fused
optimizer, ``fused_unpooled_update`` (rows and optimizer state updated in place); on the kernel
backends both run the pooled lookup's backward kernels on bags of one id (``_as_pooled``).

``segments`` (int64 ``[4, F + 1]``, built per batch by ``segments_for``) says where each feature's
ids are: row 0 its first output row (plus the total), row 1 its first position in the KJT's
values, rows 2-3 its key's first bag and number of bags in the KJT's offsets (for the batch index
of an input error).
"""
from functools import lru_cache
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..kernels import cuda_ext
from . import pooled_embedding, unpooled_torch
from .backends import resolve_backend
from .input_check import _raw_stream, kernel_report
from .layout import META_DIM, META_NUM_EMBEDDINGS, META_WIDTH
from .plan import FusedStep, group_states
from .step_counter import count_step
from .pooled_embedding import _eager_ok, _wants_grad
from .validation import check_device


@lru_cache(maxsize=None)
def _triton():
    from ..kernels import unpooled_triton

    return unpooled_triton


def load_kernels(backend: str) -> None:
    """pooled_embedding.load_kernels for the unpooled lookup's kernels (and the pooled backward's,
    which the EmbeddingCollection's backward shares)."""
    pooled_embedding.load_kernels(backend)
    if backend != "torch" and torch.cuda.is_available():
        _triton()


def _on_kernels(backend: str, device: torch.device) -> bool:
    """Whether the kernels run (the CUDA extension's or Triton's, _extension); else the torch path."""
    return resolve_backend(backend, device) != "torch"


_EXTENSION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _extension(backend: str, device: torch.device):
    """The CUDA extension where it runs the unpooled kernels (csrc/lookup/unpooled.cu): backend
    "cuda", or "auto" where it builds; else None, and the Triton kernels run (backend "triton", or
    no extension here). Both give the same bits; an extension call cost a sequence step's host
    23-36 us against a Triton launch's 99-117 (perf-notes v61)."""
    if device.type != "cuda" or backend not in ("auto", "cuda"):
        return None
    if backend == "cuda":
        return cuda_ext.extension()
    ext = cuda_ext.loaded()
    if ext is None and pooled_embedding._cuda_builds():  # (a module built before CUDA started)
        ext = cuda_ext.extension()
    return ext


@torch.jit.unused
def tables_on_host(backend: str, flat: Tensor) -> bool:
    """Whether a batch's tables (segments_for, _gradient_rows) stay in host memory: the CUDA
    extension's kernels take them in their launch's parameters (csrc/lookup/unpooled.cu), without
    the pinned copy a table that cost 70-84 us of a sequence model's step (perf-notes v61). Never in
    a compiled graph, whose tables are device tensors (segments_for)."""
    if torch.compiler.is_compiling():
        return False
    return flat.dtype in _EXTENSION_DTYPES and _extension(backend, flat.device) is not None


@torch.jit.unused
def _device_table(rows: List[List[int]], device: torch.device) -> Tensor:
    """int64 ``rows`` on ``device``, copied from pinned memory without blocking: a copy from pageable
    memory waits for the stream's earlier work first (CUDA's rule), which stalled the host behind
    the forward (v49: +0.9 ms a step at batch 128)."""
    return torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)


@torch.jit.unused
def _check_in_graph(total: int, num_values: int) -> None:
    # (TorchScript does not parse a lambda; torch.compile wants the message made in its region)
    torch._check(total == num_values, lambda: "KeyedJaggedTensor lengths do not add up to its values")


def _where_lengths_disagree(length_per_key: List[int], num_values: int, keys: List[str],
                            features: List[List[str]], tables: List[List[str]]) -> str:
    """The first key whose bags run past the values, or the last key when they fall short, with the
    tables that read it."""
    k = len(keys) - 1
    end = 0
    for i in range(len(length_per_key)):
        end += length_per_key[i]
        if end > num_values:
            k = i
            break
    if k < 0:
        return ""
    reading: List[str] = []
    for g in range(len(features)):
        for i in range(len(features[g])):
            if features[g][i] == keys[k]:
                reading.append("'" + tables[g][i] + "'")
    return ": feature '" + keys[k] + "' (table " + (", ".join(reading) if len(reading) > 0 else "none") \
        + ") is where they disagree"


def check_lengths_add_up(length_per_key: List[int], num_values: int, keys: List[str], features: List[List[str]],
                         tables: List[List[str]]) -> None:
    """A ValueError where a KJT's lengths do not add up to its values, naming the feature (``keys``
    the KJT's; ``features`` and ``tables`` each group's outputs' keys and tables). Traced by
    torch.compile or export, the lengths of a KJT built in the graph are known only when it runs:
    a runtime check there (torch._check)."""
    total = sum(length_per_key)
    if torch.jit.is_scripting():
        if total != num_values:
            raise ValueError("KeyedJaggedTensor lengths add up to " + str(total) + " but there are "
                             + str(num_values) + " values"
                             + _where_lengths_disagree(length_per_key, num_values, keys, features, tables))
    elif torch.compiler.is_compiling():
        _check_in_graph(total, num_values)
    elif total != num_values:
        raise ValueError(f"KeyedJaggedTensor lengths add up to {total} but there are {num_values} values"
                         + _where_lengths_disagree(length_per_key, num_values, keys, features, tables))


def segments_for(key_index: List[int], length_per_key: List[int], offset_per_key: List[int],
                 stride_per_key: List[int], device: torch.device, on_host: bool = False) -> Tensor:
    """The ``segments`` of a batch (see the module docstring) for features reading the KJT's keys
    ``key_index``, from its per-key lengths, offsets and strides (host lists); ``on_host``: left in
    host memory in eager code, where the CUDA extension's kernels take it in their launch
    (tables_on_host). (TorchScript compiles it too: the scripted EmbeddingCollection calls it.)"""
    bag_start: List[int] = [0]
    for s in stride_per_key:
        bag_start.append(bag_start[-1] + s)
    out_start: List[int] = [0]
    value_start: List[int] = []
    first_bag: List[int] = []
    bags: List[int] = []
    for k in key_index:
        out_start.append(out_start[-1] + length_per_key[k])
        value_start.append(offset_per_key[k])
        first_bag.append(bag_start[k])
        bags.append(stride_per_key[k])
    rows = [out_start, value_start + [0], first_bag + [0], bags + [0]]
    if torch.jit.is_scripting():
        return torch.tensor(rows, dtype=torch.int64).to(device)
    if torch.compiler.is_compiling():
        return torch.tensor(rows, dtype=torch.int64, device=device)
    if on_host:
        return torch.tensor(rows, dtype=torch.int64)
    return _device_table(rows, device)


def _forward_impl(flat, values, offsets, segments, feature_meta, num_outputs, dim, backend, validate, names,
                  report_id, count: Optional[Tensor] = None):
    """``count``: the fused optimizer's step counter, plus one (in the CUDA extension's launch)."""
    check_device(flat, values, offsets, None, names)
    if not _on_kernels(backend, flat.device):
        if validate:
            unpooled_torch.validate_ids(values, offsets, segments, feature_meta, num_outputs, names)
        _count(count)
        return unpooled_torch.forward(flat, values, segments, feature_meta, num_outputs, dim)
    # The kernel checks each id as it reads it and reports without a sync (input_check).
    check = kernel_report(flat, names, report_id) if validate else None
    ext = _extension(backend, flat.device)
    if ext is not None and flat.dtype in _EXTENSION_DTYPES:
        out = ext.unpooled_forward(flat.contiguous(), values.contiguous(), segments, feature_meta, num_outputs, dim,
                                   offsets.contiguous() if check is not None else None,
                                   None if check is None else check.claim, None if check is None else check.words,
                                   count)
        if count is not None:
            torch.autograd.graph.increment_version(count)  # (as count_step)
        return out
    _count(count)
    return _triton().forward(flat, values, segments.to(flat.device), feature_meta, offsets, num_outputs, dim,
                             check=check)


def _count(step: Optional[Tensor]) -> None:
    if step is not None:
        count_step(step)


@torch.library.custom_op("recom_rec::unpooled_embedding_forward", mutates_args=())
def unpooled_embedding_forward(
    weights: List[Tensor],
    flat: Tensor,
    values: Tensor,
    offsets: Tensor,
    segments: Tensor,
    feature_meta: Tensor,
    num_outputs: int,
    dim: int,
    backend: str,
    validate: bool,
    names: str,
    optimizer: int,
    state1: Optional[Tensor],
    state2: Optional[Tensor],
    state1_is_row: bool,
    hyper: Optional[Tensor],
    step: Optional[Tensor],
    report_id: int = 0,
) -> Tensor:
    """``[num_outputs, dim]`` fp32: every id's row. ``weights`` are what autograd differentiates
    against (the tables' Parameters, or an anchor with a fused optimizer: ``optimizer >= 0``, an
    ``optim.spec`` kind, updates ``flat`` and the states in the backward)."""
    return _forward_impl(flat, values, offsets, segments, feature_meta, num_outputs, dim, backend, validate, names,
                         report_id)


@unpooled_embedding_forward.register_fake
def _(weights, flat, values, offsets, segments, feature_meta, num_outputs, dim, backend, validate, names, optimizer,
      state1, state2, state1_is_row, hyper, step, report_id=0):
    return flat.new_empty((num_outputs, dim), dtype=torch.float32)


class GradientRows(NamedTuple):
    """Where each of the eager backward's ``num_outputs`` rows has its gradient, in elements from
    the first gradient tensor's start (_gradient_rows): ``table`` (int64 ``[2, F]``, each feature's
    start and stride), from which the row-key kernel writes the rows (unpooled_triton.backward_rows)."""

    num_outputs: int
    table: Tensor


def _as_pooled(values, segments, feature_meta, num_outputs, dim, num_rows, backend: str,
               grad_rows: Optional[GradientRows] = None, eager: bool = False):
    """The unpooled backward as the pooled lookup's: each output row a bag of one id, its row key,
    looked up in one virtual table that is the group's whole buffer (all its tables share ``dim``,
    so row key k starts at element k * dim, and row-wise optimizer state is indexed by k too). The
    pooled backward's kernels (CUDA where built, with their measured paths, else Triton) then
    sum duplicate rows and apply the optimizer. Returns (values, offsets, meta, key_index, the rows
    of ``grad_rows`` or None). ``eager``: called from _EagerLookup, not from a registered op."""
    device = values.device
    ext = _extension(backend, device)
    if ext is not None:
        keys, *more = ext.unpooled_row_keys(values.contiguous(), segments, feature_meta, num_outputs,
                                            None if grad_rows is None else grad_rows.table, None, None, None)
        rows = more[0] if more else None
    elif grad_rows is not None:
        keys, rows = _triton().backward_rows(values, segments.to(device), feature_meta, num_outputs,
                                             grad_rows.table.to(device))
    else:
        keys, rows = _triton().row_keys(values, segments.to(device), feature_meta, num_outputs), None
    offsets = (_arange_prefix(num_outputs + 1, device, torch.int64) if eager
               else torch.arange(num_outputs + 1, dtype=torch.int64, device=device))
    return keys, offsets, _whole_buffer_meta(device, dim, num_rows), _first_key(device), rows


# Eager aranges (the one-id bags' offsets 0..n of every backward) as slices of one cached arange
# per (device, dtype, stream): an allocation and a launch fewer a step. The slices are only read.
# A longer one replaces the entry (doubling: a few growths in all, at most twice the longest batch's
# ids held) and drops the old buffer, which torch's caching allocator reuses only after the work
# queued so far on the stream it was made on; the stream is in the key so that no other stream
# reads it (as variable_batch._cached_device_ints). While a CUDA graph is being captured: a fresh
# arange, as a replay would read a buffer after a growth had dropped it.
_ARANGES: Dict[Tuple[torch.device, torch.dtype, int], Tensor] = {}
MAX_ARANGES = 16


def _arange_prefix(n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``torch.arange(n)`` on ``device``, in eager code, as a read-only view of a cached one."""
    stream = 0
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.arange(n, dtype=dtype, device=device)
        stream = _raw_stream(device)
    key = (device, dtype, stream)
    cached = _ARANGES.get(key)
    if cached is None or cached.numel() < n:
        if cached is None and len(_ARANGES) >= MAX_ARANGES:
            _ARANGES.clear()  # (each entry only read on its own stream: freed safely there)
        size = 1 << (max(n, 2 * cached.numel() if cached is not None else 1) - 1).bit_length()  # a power of 2
        with torch.inference_mode(False):  # (a normal tensor, whatever mode the first call runs in)
            cached = _ARANGES[key] = torch.arange(size, dtype=dtype, device=device)
    return cached[:n]


def _whole_buffer_meta(device: torch.device, dim: int, num_rows: int) -> Tensor:
    """The meta row of the group's whole buffer as one table of ``num_rows`` rows of ``dim``, made
    on ``device`` by its own kernels (a copy from pageable host memory waits for the stream, and a
    capture refuses it) and, in eager code, kept per stream as _arange_prefix's tensors (one made
    in a capture is not kept: its fills run only on the graph's replays)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = (device, dim, num_rows, _raw_stream(device) if device.type == "cuda" else 0)
    meta = None if capturing else _WHOLE_METAS.get(key)
    if meta is None:
        with torch.inference_mode(False):
            meta = torch.zeros(1, META_WIDTH, dtype=torch.int64, device=device)
            meta[0, META_DIM] = dim
            meta[0, META_NUM_EMBEDDINGS] = num_rows
        if not capturing:
            if len(_WHOLE_METAS) >= MAX_ARANGES:
                _WHOLE_METAS.clear()
            _WHOLE_METAS[key] = meta
    return meta


_WHOLE_METAS: Dict[tuple, Tensor] = {}


@lru_cache(maxsize=16)
def _first_key(device: torch.device) -> Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def _one_call(backend: str, device: torch.device, grad_rows: Optional[GradientRows], eager: bool):
    """(the CUDA extension, pooled_cuda) where the eager backward may run in one extension call
    (pooled_cuda.unpooled_backward; the caller checks that the CUDA backward covers its buffer): the
    gradient rows known, the extension running the group's kernels; else None, and _as_pooled's
    chain runs. The chain's Python and four crossings cost a host-bound sequence step tens of
    microseconds (perf-notes v63)."""
    if not eager or grad_rows is None:
        return None
    ext = _extension(backend, device)
    return None if ext is None else (ext, pooled_embedding._cuda())


def _run_one_call(one_call, out, states, hyper, step, grad_output, grad_rows: GradientRows, values, segments,
                  feature_meta, dim, opt, zero_untouched=False) -> None:
    """pooled_cuda.unpooled_backward (``one_call``: _one_call's) into ``out``, the flat buffer
    (``opt`` >= 0) or a new dense gradient (``zero_untouched``), over the group's one-id bags."""
    ext, cuda = one_call
    device, n, num_rows = out.device, grad_rows.num_outputs, out.numel() // dim
    cuda.unpooled_backward(ext, out, states, hyper, step, grad_output, grad_rows.table, values.contiguous(), segments,
                           feature_meta, n, dim, num_rows, _arange_prefix(n + 1, device, torch.int64),
                           _whole_buffer_meta(device, dim, num_rows), _first_key(device), opt, zero_untouched)


def _backward_impl(grad_output, values, segments, feature_meta, total_numel, dim, dtype, backend,
                   grad_rows: Optional[GradientRows] = None, eager: bool = False):
    """``grad_rows`` (the kernel backends only): where each output row's gradient starts, in
    elements from ``grad_output``'s start (see _gradient_rows); without it ``grad_output`` is
    ``[num_outputs, dim]``. ``eager``: see _as_pooled."""
    num_outputs = grad_output.shape[0] if grad_rows is None else grad_rows.num_outputs
    if not _on_kernels(backend, grad_output.device) or num_outputs == 0:
        return unpooled_torch.backward(grad_output, values, segments, feature_meta, total_numel, dim, dtype)
    num_rows = total_numel // dim
    one_call = _one_call(backend, grad_output.device, grad_rows, eager)
    # (a new buffer is aligned; its zeros written outside the touched rows where a bitmap holds them)
    if one_call is not None and dim <= one_call[1].MAX_DIM and num_rows <= one_call[1].BITMAP_MAX_ROWS:
        grad = torch.empty(total_numel, dtype=dtype, device=grad_output.device)
        _run_one_call(one_call, grad, [], None, None, grad_output, grad_rows, values, segments, feature_meta, dim, -1,
                      zero_untouched=True)
        return grad
    keys, offsets, meta, key_index, rows = _as_pooled(values, segments, feature_meta, num_outputs, dim, num_rows,
                                                      backend, grad_rows, eager)
    return pooled_embedding._backward_impl(grad_output, keys, offsets, None, meta, key_index, num_outputs, total_numel,
                                           dim, dtype, backend, num_outputs, num_rows, grad_rows=rows)


@torch.library.custom_op("recom_rec::unpooled_embedding_backward", mutates_args=())
def unpooled_embedding_backward(grad_output: Tensor, values: Tensor, segments: Tensor, feature_meta: Tensor,
                                total_numel: int, dim: int, dtype: torch.dtype, backend: str) -> Tensor:
    """Dense gradient ``[total_numel]`` of the flat weight buffer, in the weights' dtype."""
    return _backward_impl(grad_output, values, segments, feature_meta, total_numel, dim, dtype, backend)


@unpooled_embedding_backward.register_fake
def _(grad_output, values, segments, feature_meta, total_numel, dim, dtype, backend):
    return grad_output.new_empty((total_numel,), dtype=dtype)


def _fused_update_impl(grad_output, flat, state1, state2, state1_is_row, hyper, step, values, segments, feature_meta,
                       dim, optimizer, backend, grad_rows: Optional[GradientRows] = None, eager: bool = False):
    # (grad_rows and eager: _backward_impl's)
    num_outputs = grad_output.shape[0] if grad_rows is None else grad_rows.num_outputs
    if not _on_kernels(backend, flat.device) or num_outputs == 0:
        states = [t for t in (state1, state2) if t is not None]
        unpooled_torch.fused_update(grad_output, flat, states, [state1_is_row, False][:len(states)], hyper, step,
                                    values, segments, feature_meta, dim, optimizer)
        return
    one_call = _one_call(backend, flat.device, grad_rows, eager)
    if one_call is not None and one_call[1].supports(flat, dim):
        _run_one_call(one_call, flat, [t for t in (state1, state2) if t is not None], hyper, step, grad_output,
                      grad_rows, values, segments, feature_meta, dim, optimizer)
        return
    num_rows = flat.numel() // dim
    keys, offsets, meta, key_index, rows = _as_pooled(values, segments, feature_meta, num_outputs, dim, num_rows,
                                                      backend, grad_rows, eager)
    pooled_embedding._fused_update_impl(grad_output, flat, state1, state2, state1_is_row, hyper, step, keys, offsets,
                                        None, meta, key_index, num_outputs, dim, optimizer, backend, num_outputs,
                                        num_rows, grad_rows=rows)


@torch.library.custom_op("recom_rec::fused_unpooled_update", mutates_args=("flat", "state1", "state2"))
def fused_unpooled_update(grad_output: Tensor, flat: Tensor, state1: Optional[Tensor], state2: Optional[Tensor],
                          state1_is_row: bool, hyper: Tensor, step: Tensor, values: Tensor, segments: Tensor,
                          feature_meta: Tensor, dim: int, optimizer: int, backend: str) -> None:
    """The backward with the optimizer fused in: the touched rows of ``flat`` and their state,
    updated in place (duplicate ids summed first)."""
    _fused_update_impl(grad_output, flat, state1, state2, state1_is_row, hyper, step, values, segments, feature_meta,
                       dim, optimizer, backend)


@fused_unpooled_update.register_fake
def _(grad_output, flat, state1, state2, state1_is_row, hyper, step, values, segments, feature_meta, dim, optimizer,
      backend):
    return None


def _setup_context(ctx, inputs, output):
    (weights, flat, values, _offsets, segments, feature_meta, _num_outputs, dim, backend, _validate, _names,
     optimizer, state1, state2, state1_is_row, hyper, step, _report_id) = inputs
    ctx.save_for_backward(values, segments, feature_meta)
    # Held, not saved (as the pooled lookup's): a fused update bumps their versions, and one graph
    # may use the module twice.
    ctx.flat, ctx.states, ctx.hyper, ctx.step = flat, (state1, state2), hyper, step
    ctx.optimizer, ctx.state1_is_row, ctx.dim, ctx.backend = optimizer, state1_is_row, dim, backend
    ctx.tables = list(weights)


def _weight_grads(ctx, grad_output: Tensor, wants_weights: bool, as_ops: bool,
                  grad_rows: Optional[GradientRows] = None) -> Optional[List[Tensor]]:
    """``grad_rows``: eager only (``as_ops`` False), see _backward_impl."""
    values, segments, feature_meta = ctx.saved_tensors
    if not (ctx.tables and wants_weights):
        return None
    flat = ctx.flat
    if ctx.optimizer >= 0:
        (state1, state2) = ctx.states
        args = (grad_output, flat, state1, state2, ctx.state1_is_row, ctx.hyper, ctx.step, values, segments,
                feature_meta, ctx.dim, ctx.optimizer, ctx.backend)
        if as_ops:
            fused_unpooled_update(*args)
        else:
            _fused_update_impl(*args, grad_rows=grad_rows, eager=True)
            torch.autograd.graph.increment_version([t for t in (flat, state1, state2) if t is not None])
        return None
    args = (grad_output, values, segments, feature_meta, flat.shape[0], ctx.dim, flat.dtype, ctx.backend)
    grad_flat = unpooled_embedding_backward(*args) if as_ops else _backward_impl(*args, grad_rows=grad_rows,
                                                                                   eager=True)
    return list(torch._C._nn.unflatten_dense_tensors(grad_flat, ctx.tables))


def _backward(ctx, grad_output):
    grads = _weight_grads(ctx, grad_output.contiguous(), _wants_grad(ctx.needs_input_grad[0]), as_ops=True)
    return (grads if grads is not None else [None] * len(ctx.tables),) + (None,) * 17


unpooled_embedding_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerLookup(torch.autograd.Function):
    """The same bodies without torch.library's Python layers in plain eager mode (as the pooled
    lookup's _EagerLookup: those layers cost more host time than a small batch's kernels).
    It returns the output split by ``split_sizes`` (a piece per feature), so that its backward
    receives each feature's gradient where autograd left it: the kernels read the rows there
    (_gradient_rows) rather than a copy of them all into one block, which autograd's split would
    make (1.6 of the sequence workload's 5.9 ms training step, perf-notes v47)."""

    @staticmethod
    def forward(ctx, flat, values, offsets, segments, feature_meta, num_outputs, dim, backend, validate, names,
                optimizer, state1, state2, state1_is_row, hyper, step, report_id, split_sizes, count, *weights):
        out = _forward_impl(flat, values, offsets, segments, feature_meta, num_outputs, dim, backend, validate, names,
                            report_id, count)
        _setup_context(ctx, (list(weights), flat, values, offsets, segments, feature_meta, num_outputs, dim, backend,
                             validate, names, optimizer, state1, state2, state1_is_row, hyper, step, report_id), out)
        ctx.split_sizes = split_sizes
        ctx.segments_on_host = segments.device.type == "cpu" and flat.device.type == "cuda"  # (its tables too)
        ctx.set_materialize_grads(False)  # a feature whose output has no gradient reads one zero row
        return tuple(out.split(split_sizes))

    @staticmethod
    def backward(ctx, *grads):
        wants = any(ctx.needs_input_grad[19:])
        device = ctx.flat.device
        # Several pieces are the features (unpooled_lookup's split_sizes): the row-key kernel, which
        # finds each row's feature, writes where its gradient is (_gradient_rows). One piece: its
        # gradient is the block.
        rows = (_gradient_rows(grads, ctx.split_sizes, ctx.dim, device, ctx.segments_on_host)
                if _on_kernels(ctx.backend, device) and len(grads) > 1 else None)
        if rows is not None:
            base, grad_rows, _held = rows  # (held until the kernels are queued: copies and the zero row)
            weight_grads = _weight_grads(ctx, base, wants, as_ops=False, grad_rows=grad_rows)
        else:
            if len(grads) == 1 and grads[0] is not None:
                block = grads[0]
            else:
                block = torch.cat([g if g is not None else torch.zeros(n, ctx.dim, device=device)
                                   for g, n in zip(grads, ctx.split_sizes)])
            weight_grads = _weight_grads(ctx, block.contiguous(), wants, as_ops=False)
        return (None,) * 19 + tuple(weight_grads if weight_grads is not None else [None] * len(ctx.tables))


def _gradient_rows(grads, sizes: List[int], dim: int, device: torch.device,
                   on_host: bool = False) -> Optional[Tuple[Tensor, GradientRows, List[Tensor]]]:
    """(base, rows, held): ``rows`` says where each output row's gradient starts, in elements from
    ``base``'s first, among the group's features' gradients ``grads`` (None: a feature without one,
    which reads a zero row) of ``sizes`` rows (their id counts), as each feature's start and stride;
    ``held``, the tensors read there, which the caller keeps until the kernels are queued. None
    where the kernels cannot read them so: a gradient that is not fp32, or not 16-byte aligned
    where the rows are read 16 bytes at a time."""
    total = sum(sizes)
    present = [g for g, n in zip(grads, sizes) if g is not None and n > 0]
    if total == 0 or any(g.dtype != torch.float32 for g in present):
        return None
    pieces = [g.contiguous() for g in present]
    zero = (torch.zeros(1, dim, dtype=torch.float32, device=device)
            if any(g is None and n > 0 for g, n in zip(grads, sizes)) else None)
    held = pieces + ([zero] if zero is not None else [])
    base = held[0]
    if dim % 4 == 0 and any(t.data_ptr() % 16 for t in held):
        return None
    starts, strides, it, first = [], [], iter(pieces), 0
    for g, n in zip(grads, sizes):
        if n == 0:  # no rows to point at
            starts.append(0)
            strides.append(0)
            continue
        t, stride = (next(it), dim) if g is not None else (zero, 0)
        # the piece's first row, less its own first output row's multiple of the stride
        starts.append((t.data_ptr() - base.data_ptr()) // 4 - first * stride)
        strides.append(stride)
        first += n
    # (``on_host``: the table stays on the host, as segments_for's)
    table = torch.tensor([starts, strides], dtype=torch.int64) if on_host else _device_table([starts, strides], device)
    return base, GradientRows(total, table), held


class UnpooledBatch(NamedTuple):
    """One batch's tensors and layout as a group's lookup reads them."""

    values: Tensor
    offsets: Tensor
    segments: Tensor
    num_outputs: int


_eager_apply = super(torch.autograd.Function, _EagerLookup).apply


def unpooled_lookup(weights: List[Tensor], flat: Tensor, feature_meta: Tensor, batch: UnpooledBatch, dim: int,
                    backend: str, validate: bool, names: str, report_id: int, fused: Optional[FusedStep] = None,
                    group_index: int = 0, split_sizes: Optional[List[int]] = None) -> List[Tensor]:
    """``unpooled_embedding_forward`` with its autograd formula for one group: the registered op
    when traced or compiled, else the same bodies at eager cost. The output rows split by
    ``split_sizes``: None (one piece, the whole block) or the features' id counts (``segments``' row
    0 steps), which the eager backward relies on (_EagerLookup.backward, _gradient_rows)."""
    state1, state2 = group_states(fused, group_index)
    kind = fused.kind if fused is not None else -1
    hyper = fused.hyper if fused is not None else None
    step = fused.step if fused is not None else None
    row_state = fused.state1_is_row if fused is not None else False
    # (one count a forward: the first group's lookup makes it)
    count = step if fused is not None and fused.count_in_lookup and group_index == 0 else None
    sizes = split_sizes if split_sizes is not None else [batch.num_outputs]
    if _eager_ok(weights, flat, batch.values, batch.offsets, batch.segments, feature_meta, state1, state2, hyper, step):
        # (the C apply, as the pooled lookup's: only the batch's ids and offsets can be a finished
        # functorch transform's dead wrappers; Function.apply's Python layer checks all 18+ arguments)
        unwrap = torch._C._functorch.unwrap_if_dead
        return list(_eager_apply(flat, unwrap(batch.values), unwrap(batch.offsets), batch.segments, feature_meta,
                                 batch.num_outputs, dim, backend, validate, names, kind, state1, state2,
                                 row_state, hyper, step, report_id, sizes, count, *weights))
    _count(count)
    out = unpooled_embedding_forward(weights, flat, batch.values, batch.offsets, batch.segments, feature_meta,
                                     batch.num_outputs, dim, backend, validate, names, kind, state1, state2,
                                     row_state, hyper, step, report_id)
    return list(out.split(sizes)) if split_sizes is not None else [out]


def _row_keys_impl(values, offsets, segments, key_meta, num_outputs, backend, validate, names, report_id):
    check_device(key_meta, values, offsets, None, names)
    if not _on_kernels(backend, values.device):
        if validate:
            unpooled_torch.validate_ids(values, offsets, segments, key_meta, num_outputs, names)
        return unpooled_torch.row_keys(values, segments, key_meta, num_outputs)
    check = kernel_report(key_meta, names, report_id) if validate else None
    ext = _extension(backend, values.device)
    if ext is not None:
        return ext.unpooled_row_keys(values.contiguous(), segments, key_meta, num_outputs, None,
                                     offsets.contiguous() if check is not None else None,
                                     None if check is None else check.claim,
                                     None if check is None else check.words)[0]
    return _triton().row_keys(values, segments, key_meta, num_outputs, offsets, check)


@torch.library.custom_op("recom_rec::unpooled_row_keys", mutates_args=())
def unpooled_row_keys(values: Tensor, offsets: Tensor, segments: Tensor, key_meta: Tensor, num_outputs: int,
                      backend: str, validate: bool, names: str, report_id: int = 0) -> Tensor:
    """int64 ``[num_outputs]``: each id's row key (``key_meta``'s row base of its feature's table +
    the id; row 0 of the table for a bad id, which ``validate`` reports with its feature, table
    and batch index). The quantized EmbeddingCollection's first step."""
    return _row_keys_impl(values, offsets, segments, key_meta, num_outputs, backend, validate, names, report_id)


@unpooled_row_keys.register_fake
def _(values, offsets, segments, key_meta, num_outputs, backend, validate, names, report_id=0):
    return values.new_empty((num_outputs,), dtype=torch.int64)


def row_keys(values: Tensor, offsets: Tensor, segments: Tensor, key_meta: Tensor, num_outputs: int, backend: str,
             validate: bool, names: str, report_id: int) -> Tensor:
    """``unpooled_row_keys``: the registered op when traced or compiled, else its body."""
    if _eager_ok([], values, offsets, segments, key_meta):
        return _row_keys_impl(values, offsets, segments, key_meta, num_outputs, backend, validate, names, report_id)
    return unpooled_row_keys(values, offsets, segments, key_meta, num_outputs, backend, validate, names, report_id)
