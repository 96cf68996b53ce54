"""The CUDA C++ backend (``backend="cuda"``): the kernels of csrc/lookup/kernels.cuh, through
the extension cuda_ext loads (built at install time, else on first use).

Forward: the CUDA kernel, launched feature-major or bag-major, with 8 or (rows of at most 128
columns) 4 rows in flight a lane, whichever measured faster for the launch's shape
(launch_tuner.LaunchOrderTuner; every launch gives the same bits). Backward: the planning
(expand, a CUB sort, plan: the Triton backend's kernels ported, one host call), then the CUDA
piece and split-row kernels.
Both backends cut a row's lookups into the same pieces and sum each piece in input order
(deterministic). A split row's partial sums are added in piece order here, except a hot row whose
chain of dependent loads for one group would pass LONG_ROW_LOADS (csrc/lookup/kernels.cuh:
more than 512 / 32 / 16 pieces at 1 / 4 / 8 float4 a lane): a block adds each slice of it, its
groups fixed ranges of the slice's pieces, then their sums in group order, and the slices' sums
in slice order (still the same bits from run to run); the Triton kernel adds them in tiles. So the
two backends agree on such rows to rounding, not bit for bit.

A group the CUDA kernels do not cover (a dim above ``MAX_DIM``, a weight buffer that is not
16-byte aligned) runs on the Triton backend instead.
"""
from collections import namedtuple
import functools

import torch

from ..ops.gradient_layout import aligned_gradient
from . import cuda_ext, pooled_triton
from .launch_tuner import MAX_BAG_MAJOR_FEATURES, ForwardLaunchShape, LaunchOrderTuner

build_error = cuda_ext.build_error  # the ops ask the backend whether it can run here
MAX_DIM = 1024  # the backward kernels' widest variant: 8 float4 accumulators per lane x 32 lanes
# The backward's path per shape: every row through the pieces, or rows of one lookup in the batch
# finished in bag order by their own kernel (plan_backward's bitmap, singleton_update in the
# source); and the piece kernels' lanes a piece: enough for the group's widest row at one float4
# a lane ("widest"), the fewest that hold it in four float4 each (4 lanes at dim 64 instead of
# 16: four times the pieces in flight; 500 tables of rows read about once updated 11% faster,
# perf-notes v20), or in a group of mixed widths each piece at the fewest lanes of its own row, a
# launch of the piece kernel per lane class ("by width": mixed's piece kernels 10% faster, v35;
# rows past 512 columns a class of their own at eight float4 a lane, and the narrower ones no
# longer at the widest row's shape: drawn groups of dims 4-1013 trained 2.1-2.4x faster, v55).
# Every path gives the same bits. None wins everywhere (H100: singletons on many-500, many-1000
# and mixed, pieces on dlrm-kaggle's one-id bags and on zipf, whose rows repeat), so the first
# backward launches of a shape measure them (launch_tuner; tests and tools force one with
# BACKWARD_PATH_TUNER.force). Singletons need a bitmap of the group's rows: at most
# BITMAP_MAX_ROWS (64 MB).
BITMAP_MAX_ROWS = 1 << 29
WIDEST, FEWEST, BY_WIDTH = "widest", "fewest", "by width"  # the piece kernels' lanes
BACKWARD_PATHS = {"pieces": (False, WIDEST), "singletons": (True, WIDEST),  # name: (singletons, lanes)
                  "pieces/fewest lanes": (False, FEWEST), "singletons/fewest lanes": (True, FEWEST),
                  "pieces/lanes by width": (False, BY_WIDTH), "singletons/lanes by width": (True, BY_WIDTH)}
# Rows up to this wide take one float4 a lane by default, so four a lane is another launch; at
# 16 columns or fewer it would be one lane a piece.
FEWEST_LANES_DIMS = (17, 128)
BY_WIDTH_MAX_DIM = MAX_DIM  # rows past 512 columns: their own class, at the widest pieces' shape


def backward_paths(shape) -> tuple:
    """The backward paths worth measuring for a BackwardShape: singletons where their grid and
    bitmap fit, lanes by width where the group's rows differ in width (some feature narrower than
    the widest) and its widest row takes more than one lane, fewest lanes where it is another
    launch. The order breaks near-ties (launch_tuner.decide): lanes by width before fewest lanes,
    which it equals on the widest rows and beats on the narrower ones but for its partition
    (mixed: 2.33 against 2.58 ms of piece kernels, plus 0.11 ms of partition, v35)."""
    names = ("pieces", "singletons") if shape.singletons_ok else ("pieces",)
    lanes = ()
    mixed_widths = shape.total_dim < shape.num_features * shape.max_dim
    if mixed_widths and FEWEST_LANES_DIMS[0] <= shape.max_dim <= BY_WIDTH_MAX_DIM:
        lanes += ("lanes by width",)
    if FEWEST_LANES_DIMS[0] <= shape.max_dim <= FEWEST_LANES_DIMS[1]:
        lanes += ("fewest lanes",)
    return names + tuple(f"{n}/{lane}" for lane in lanes for n in names)


def fewest_piece_lanes(max_dim: int) -> int:
    """Lanes a piece at four float4 each (piece_update's ``lanes``): a power of two."""
    return 1 << max(0, (max_dim + 15) // 16 - 1).bit_length()


def piece_lanes(mode: str, max_dim: int) -> int:
    """piece_update's ``lanes`` for a BACKWARD_PATHS lanes mode: 0 sizes the pieces by the widest
    row, -1 each by its own row's width."""
    return {WIDEST: 0, FEWEST: fewest_piece_lanes(max_dim), BY_WIDTH: -1}[mode]


BACKWARD_PATH_TUNER = LaunchOrderTuner(names={n: n for n in BACKWARD_PATHS}, candidates=backward_paths,
                                       default="pieces", cache_name="backward_path")
# The forward's launches by name: (bag_major, rows in flight a lane, rounds). See
# pooled_forward_kernel in the source: the two orders; 4 rows in flight (more blocks an SM) where
# rows take one 16-byte chunk a lane, which wins on short bags and loses on long bags of narrow
# rows; bag-major in 2 or 4 rounds, a share of the features at a time, so that fewer tables' rows
# compete for L2 where the whole grid would run at once.
FORWARD_LAUNCHES = {"features": (False, 8, 1), "bags": (True, 8, 1), "features/4 rows": (False, 4, 1),
                    "bags/4 rows": (True, 4, 1), "bags/2 rounds": (True, 8, 2), "bags/4 rounds": (True, 8, 4)}
FOUR_ROWS_MAX_DIM = 128  # one float4 chunk a lane at 32 lanes


def forward_launches(shape) -> tuple:
    """The forward launches worth measuring for a ForwardLaunchShape: bag-major only where the
    features fit the grid's y axis, 4 rows in flight only where it builds a different kernel,
    rounds only where there are features to share out."""
    names = ("features", "bags") if shape.num_features <= MAX_BAG_MAJOR_FEATURES else ("features",)
    if shape.max_dim <= FOUR_ROWS_MAX_DIM:
        names += tuple(f"{n}/4 rows" for n in names)
    if shape.num_features >= 2:
        names += ("bags/2 rounds", "bags/4 rounds")
    return names


# The forward's launch per shape, measured on its first launches.
FORWARD_ORDER_TUNER = LaunchOrderTuner(names={n: n for n in FORWARD_LAUNCHES}, candidates=forward_launches,
                                       default="features", cache_name="forward_order")


def supports(flat: torch.Tensor, max_dim: int) -> bool:
    """Whether the CUDA backward kernels cover this group (else the Triton backend runs it)."""
    return supports_forward(flat) and max_dim <= MAX_DIM


def supports_forward(flat: torch.Tensor) -> bool:
    """Whether the CUDA forward kernel covers this group: any dim (wide rows take several passes
    of four 16-byte chunks a lane), a 16-byte aligned weight buffer."""
    return flat.is_cuda and flat.data_ptr() % 16 == 0


def forward_args(values, offsets, per_sample_weights, feature_meta, key_index):
    """The forward kernel's inputs in the types it takes (offsets in the values' dtype, fp32 sample
    weights, int64 keys); loads the extension first (cuda_ext)."""
    cuda_ext.extension()
    values = _wide_ids(values)
    if offsets.dtype != values.dtype:
        offsets = offsets.to(values.dtype)
    psw = None if per_sample_weights is None else per_sample_weights.to(torch.float32).contiguous()
    return (values.contiguous(), offsets.contiguous(), psw, feature_meta.contiguous(), _int64_keys(key_index))


def _wide_ids(values):
    """The kernels take int32 or int64 ids (and offsets of their type): other integer types (int8,
    int16, uint8, which torchrec's module accepts; unsigned 16-64 bits) are widened, not refused."""
    if values.dtype in (torch.int32, torch.int64):
        return values
    return values.to(torch.int32 if values.dtype in (torch.int8, torch.int16, torch.uint8) else torch.int64)


def _int64_keys(key_index):
    """The keys as the kernels take them: the module's own routing is int64 already (no op to
    dispatch on the hot path then)."""
    return key_index.contiguous() if key_index.dtype == torch.int64 else key_index.to(torch.int64).contiguous()


def forward_launch(flat, values, offsets, psw, feature_meta, key_index, batch_size, total_dim, max_dim, launch,
                   check=None):
    """One forward launch (a FORWARD_LAUNCHES name), on forward_args' inputs; ``check``: an
    input_check.KernelReport the kernel reports bad ids and bags to (clamped either way)."""
    bag_major, rows, rounds = FORWARD_LAUNCHES[launch]
    return cuda_ext.extension().pooled_forward(flat, values, offsets, psw, feature_meta, key_index, batch_size,
                                               total_dim, max_dim, bag_major, rows, rounds,
                                               None if check is None else check.claim,
                                               None if check is None else check.words)


def forward(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim,
            check=None):
    if not supports_forward(flat):
        return pooled_triton.forward(flat, values, offsets, per_sample_weights, feature_meta, key_index,
                                     batch_size, total_dim, max_dim, check=check)
    # The arguments (and a first use's build) are ready before a timed trial's first event.
    args = forward_args(values, offsets, per_sample_weights, feature_meta, key_index)
    shape = ForwardLaunchShape.of(flat, values, per_sample_weights, feature_meta, batch_size, total_dim, max_dim)
    return FORWARD_ORDER_TUNER.launch(
        shape, lambda launch: forward_launch(flat, *args, batch_size, total_dim, max_dim, launch, check), flat.device)


# What a backward's timing depends on (BACKWARD_PATH_TUNER's key): a forward's shape, the optimizer
# and whether the singletons' kernel can take the group.
BackwardShape = namedtuple("BackwardShape", ForwardLaunchShape._fields + ("optimizer", "singletons_ok"))


def _cuda_plan(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, row_count, total_dim,
               num_lookups, singles=False, zeros_into=None):
    """pooled_triton._triton_plan in one call to the extension: the expand and plan kernels ported,
    and a CUB sort of just the key bits the rows need (torch.sort: all 32/64 bits, 64-bit order).
    Without sample weights the sort carries each lookup's (feature, bag) packed in 32 bits, so
    the piece kernel computes its gradient row instead of gathering it through the sort's order
    (the plan's last item: the batch size it is packed with, or 0 when it carries indices).
    ``zeros_into``: the dense backward's gradient buffer (uninitialised), which gets its zeros
    here, outside the rows the lookups touch (the pieces then write those)."""
    key_index = _int64_keys(key_index)
    positional, feature_base, n = pooled_triton.lookup_bases(offsets, key_index, batch_size, num_lookups,
                                                             values.numel())
    values = _wide_ids(values)
    if offsets.dtype != values.dtype:
        offsets = offsets.to(values.dtype)
    psw = None if per_sample_weights is None else per_sample_weights.to(torch.float32).contiguous()
    packed = psw is None and feature_meta.shape[0] * batch_size < 2**31 - 1
    values, offsets, feature_meta = values.contiguous(), offsets.contiguous(), feature_meta.contiguous()
    ext = cuda_ext.extension()
    plan = ext.plan_backward(values, offsets, psw, feature_meta, key_index,
                             None if positional else feature_base.contiguous(), batch_size, total_dim, n,
                             max(1, (row_count - 1).bit_length()), row_count >= 2**31, packed,
                             (row_count + 31) // 32 if singles else 0,
                             (row_count + 31) // 32 if zeros_into is not None else 0)
    if zeros_into is not None:
        ext.zero_untouched_rows(zeros_into, plan[-1], feature_meta)
    # the last item: what singleton_update needs (None: every row went to the pieces)
    singletons = (values, offsets, psw, key_index, batch_size) if singles else None
    return (*plan, batch_size if packed else 0, singletons)


def _cuda_pieces(plan, grad_output, feature_meta, n, partials, partial_stride, out, state1, state2, hyper, step,
                 opt, max_dim, lanes=WIDEST, grad_rows=None):
    """The piece and split-row kernels on a _cuda_plan, then the rows of one lookup. ``grad_rows``:
    see run_backward (a packed plan's)."""
    row_key, order, src, scale, feature, pieces, split_rows, counts, bag_scale, multi, _, packed_batch, singles = plan
    if packed_batch > 0 and grad_rows is None:
        # 16-byte gradient reads for the aligned rows (gradient_layout). A packed plan's pieces
        # compute each lookup's gradient row from its feature and bag, so they follow the padded
        # meta; an unpacked plan's rows were computed at the output's own columns.
        grad_output, feature_meta = aligned_gradient(grad_output, feature_meta)
    ext = cuda_ext.extension()
    ext.piece_update(row_key, order, src, scale, feature, bag_scale, packed_batch, grad_output, feature_meta, pieces,
                     split_rows, counts, n, partials, partial_stride, out, state1, state2, hyper, step, opt, max_dim,
                     piece_lanes(lanes, max_dim), grad_rows)
    if singles is not None:
        values, offsets, psw, key_index, batch_size = singles
        ext.singleton_update(values, offsets, psw, feature_meta, key_index, multi, grad_output, batch_size, out,
                             state1, state2, hyper, step, opt, max_dim, grad_rows)


def _run_backward(out, states, hyper, step, grad_output, values, offsets, per_sample_weights, feature_meta,
                  key_index, batch_size, max_dim, num_rows, opt, num_lookups, zeros=False, grad_rows=None) -> None:
    """pooled_triton.run_backward with the CUDA planning and piece kernels where they cover ``out``,
    on the path BACKWARD_PATH_TUNER picks for the shape. ``zeros``: ``out`` is the dense backward's
    uninitialised gradient, zeroed outside the touched rows after the plan (see backward).
    ``grad_rows``: see pooled_triton.run_backward."""
    cuda = supports(out, max_dim)

    def run(path: str):
        singles, lanes = BACKWARD_PATHS[path]
        pooled_triton.run_backward(grad_output, out, states, hyper, step, values, offsets, per_sample_weights,
                                    feature_meta, key_index, batch_size, max_dim, num_rows, opt, num_lookups,
                                    pieces=functools.partial(_cuda_pieces, lanes=lanes, grad_rows=grad_rows)
                                    if cuda else None,
                                    planner=functools.partial(_cuda_plan, singles=singles,
                                                              zeros_into=out if zeros else None) if cuda else None,
                                    grad_rows=grad_rows)

    if not cuda:
        return run("pieces")
    shape = _backward_shape(out, feature_meta.shape[0], batch_size, grad_output.shape[1], max_dim, values.numel(),
                            values.dtype, per_sample_weights is not None, opt, num_rows)
    return BACKWARD_PATH_TUNER.launch(shape, run, out.device)


def _backward_shape(out, num_features, batch_size, total_dim, max_dim, num_lookups, index_dtype, weighted, opt,
                    num_rows) -> BackwardShape:
    """BACKWARD_PATH_TUNER's key for a backward into ``out``."""
    rows = num_rows if num_rows >= 0 else out.numel()
    # singletons need a bitmap of the rows and put the features on the grid's y axis
    singletons_ok = rows <= BITMAP_MAX_ROWS and num_features <= 65535
    shape = ForwardLaunchShape.of_sizes(out, num_features, batch_size, total_dim, max_dim, num_lookups, index_dtype,
                                        weighted)
    if opt < 0:  # a dense backward's ``out`` is a new gradient buffer each step: its address is no model's
        shape = shape._replace(weights_at=0)
    return BackwardShape(*shape, opt, singletons_ok)


def unpooled_backward(ext, out, states, hyper, step, grad, grad_table, values, segments, feature_meta, num_outputs,
                      dim, num_rows, offsets, whole_meta, first_key, opt, zero_untouched=False) -> None:
    """The eager unpooled backward (ops/unpooled_embedding._EagerLookup) in one extension call
    (csrc/lookup/unpooled_backward.cu): the chain _as_pooled -> _run_backward runs, bags of one id
    over the group's ``num_rows`` rows of ``dim`` (``whole_meta``, ``first_key``, ``offsets``
    0..num_outputs), on the path BACKWARD_PATH_TUNER picks for that chain's shape. ``grad`` and
    ``grad_table``: the gradient rows (unpooled_embedding._gradient_rows). ``out``: the flat buffer
    (``opt`` >= 0) or the dense gradient (``zero_untouched``: uninitialised, zeroed outside the
    touched rows). The caller checked ``supports(out, dim)``."""
    state1 = states[0] if len(states) > 0 else None
    state2 = states[1] if len(states) > 1 else None

    def run(path: str):
        singles, lanes = BACKWARD_PATHS[path]
        ext.unpooled_backward(values, segments, feature_meta, num_outputs, grad_table, grad, offsets, whole_meta,
                              first_key, out, state1, state2, hyper, step, opt, dim, num_rows, singles,
                              piece_lanes(lanes, dim), zero_untouched)

    # the chain's key: one feature of num_outputs one-id bags, int64 row keys, no sample weights
    shape = _backward_shape(out, 1, num_outputs, dim, dim, num_outputs, torch.int64, False, opt, num_rows)
    return BACKWARD_PATH_TUNER.launch(shape, run, out.device)


def backward(grad_output, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_numel,
             dtype, max_dim, num_lookups=-1, num_rows=-1, grad_rows=None):
    """The dense gradient of the group's flat buffer. Each element is written once where the
    plan can mark the touched rows in a bitmap (the group's rows known, at most BITMAP_MAX_ROWS):
    zeros outside those rows, then the rows' sums. Else the buffer is zeroed whole first."""
    empty = feature_meta.shape[0] == 0 or batch_size == 0
    grad = torch.empty(total_numel, dtype=dtype, device=grad_output.device)
    # the CUDA kernels' own condition (_run_backward's), so that they are the ones to write the zeros
    once = not empty and supports(grad, max_dim) and 0 <= num_rows <= BITMAP_MAX_ROWS
    if not once:
        grad.zero_()
    if empty:
        return grad
    _run_backward(grad, [], None, None, grad_output, values, offsets, per_sample_weights, feature_meta, key_index,
                  batch_size, max_dim, num_rows, -1, num_lookups, zeros=once, grad_rows=grad_rows)
    return grad


def fused_update(grad_output, flat, states, state_is_row, hyper, step, values, offsets, per_sample_weights,
                 feature_meta, key_index, batch_size, max_dim, kind, num_lookups=-1, num_rows=-1,
                 grad_rows=None) -> None:
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return
    _run_backward(flat, states, hyper, step, grad_output, values, offsets, per_sample_weights, feature_meta,
                  key_index, batch_size, max_dim, num_rows, kind, num_lookups, grad_rows=grad_rows)
