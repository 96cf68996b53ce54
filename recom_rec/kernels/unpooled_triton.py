"""Triton kernels of the unpooled lookup (``recom_rec.EmbeddingCollection``): one embedding row per
id, every feature of every table of a group in one launch.

The output is one ``[M, dim]`` fp32 block (all tables of an EmbeddingCollection share one dim):
feature f's ids fill rows ``[out_start[f], out_start[f + 1])`` in their order in the KJT's values,
from ``value_start[f]`` (``segments``, built by ops/unpooled_embedding.py). A program covers
BLOCK_R output rows and BLOCK_D columns; a row finds its feature by a binary search of
``out_start`` (F + 1 words, in L1).

The backward reuses the pooled lookup's piece kernels (pooled_triton.py): only the expansion
differs: an output row is one lookup whose gradient row is its own row of ``grad_output``.
"""
import torch
import triton
import triton.language as tl

from ..ops.layout import META_WIDTH
from .grid_math import cdiv, next_power_of_2
from .pooled_triton import _report, plan_sorted_lookups, run_backward

# segments' rows (ops/unpooled_embedding.py)
SEG_OUT, SEG_VALUE, SEG_BAG, SEG_STRIDE = 0, 1, 2, 3


@triton.jit
def _rows_feature(seg_ptr, r, num_features, SEARCH_STEPS: tl.constexpr):
    """The feature of each output row ``r``: the last f with out_start[f] <= r (features without
    ids share their start with the next one and are passed over)."""
    lo = tl.zeros(r.shape, tl.int64)
    hi = tl.zeros(r.shape, tl.int64) + num_features - 1
    for _ in tl.static_range(SEARCH_STEPS):
        searching = lo < hi
        mid = (lo + hi + 1) // 2
        up = tl.load(seg_ptr + mid, mask=searching, other=0) <= r
        lo = tl.where(searching & up, mid, lo)
        hi = tl.where(searching & (up == 0), mid - 1, hi)
    return lo


@triton.jit
def _row_lookup(values_ptr, seg_ptr, meta_ptr, r, live, num_features, seg_stride,
                META_W: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Each output row's (feature, position in values, id, the table's rows, row key); an id outside
    its table reads row 0 of it (reported by the forward)."""
    f = _rows_feature(seg_ptr, r, num_features, SEARCH_STEPS)
    pos = tl.load(seg_ptr + seg_stride + f, mask=live, other=0) + r - tl.load(seg_ptr + f, mask=live, other=0)
    idx = tl.load(values_ptr + pos, mask=live, other=0).to(tl.int64)
    rows = tl.load(meta_ptr + f * META_W + 4, mask=live, other=1)
    row_base = tl.load(meta_ptr + f * META_W + 5, mask=live, other=0)
    bad = live & ((idx < 0) | (idx >= rows))
    return f, pos, idx, rows, row_base + tl.where(bad, 0, idx), bad


@triton.jit
def _report_bad_id(claim_ptr, report_ptr, seg_ptr, offsets_ptr, bad, f, pos, idx, rows, seg_stride, num_values,
                   BLOCK_R: tl.constexpr):
    """Reports the block's first bad id with its batch index: the bag of its key holding ``pos`` (a
    binary search of the key's offsets, only in a program that met one)."""
    lane = tl.arange(0, BLOCK_R)
    first = tl.min(tl.where(bad, lane, BLOCK_R), axis=0)
    pick = lane == first
    feature = tl.sum(tl.where(pick, f, 0), axis=0)
    at = tl.sum(tl.where(pick, pos, 0), axis=0)
    bag0 = tl.load(seg_ptr + 2 * seg_stride + feature)
    lo = bag0
    hi = bag0 + tl.load(seg_ptr + 3 * seg_stride + feature) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(offsets_ptr + mid).to(tl.int64) <= at:
            lo = mid
        else:
            hi = mid - 1
    _report(claim_ptr, report_ptr, tl.full([], 1, tl.int64), feature, lo - bag0,
            tl.sum(tl.where(pick, idx, 0), axis=0), tl.sum(tl.where(pick, rows, 0), axis=0), num_values)


@triton.jit
def _unpooled_forward_kernel(
    flat_ptr, values_ptr, seg_ptr, meta_ptr, offsets_ptr, out_ptr, claim_ptr, report_ptr,
    num_outputs, num_features, seg_stride, dim, num_values,
    META_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    REPORT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < num_outputs
    f, pos, idx, rows, key, bad = _row_lookup(values_ptr, seg_ptr, meta_ptr, r, live, num_features, seg_stride,
                                              META_W, SEARCH_STEPS)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = live[:, None] & (d[None, :] < dim)
    row = tl.load(flat_ptr + key[:, None] * dim + d[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + r[:, None] * dim + d[None, :], row.to(tl.float32), mask=mask)
    if REPORT:
        if tl.program_id(1) == 0:
            if tl.max(bad.to(tl.int32), axis=0) > 0:
                _report_bad_id(claim_ptr, report_ptr, seg_ptr, offsets_ptr, bad, f, pos, idx, rows, seg_stride,
                               num_values, BLOCK_R)


@triton.jit
def _unpooled_expand_kernel(
    values_ptr, seg_ptr, meta_ptr, row_key_ptr, src_ptr, scale_ptr, feature_ptr,
    num_outputs, num_features, seg_stride, dim,
    META_W: tl.constexpr, BLOCK_R: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """The backward's lookups: output row r reads row key ``row_base + id`` and its gradient is
    ``grad_output[r]``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < num_outputs
    f, pos, idx, rows, key, bad = _row_lookup(values_ptr, seg_ptr, meta_ptr, r, live, num_features, seg_stride,
                                              META_W, SEARCH_STEPS)
    tl.store(row_key_ptr + r, key.to(row_key_ptr.dtype.element_ty), mask=live)
    tl.store(src_ptr + r, r * dim, mask=live)
    tl.store(scale_ptr + r, tl.full([BLOCK_R], 1.0, tl.float32), mask=live)
    tl.store(feature_ptr + r, f.to(tl.int32), mask=live)


def _search_steps(num_features: int) -> int:
    return max(1, num_features.bit_length())


def _forward_block(dim: int):
    """(rows, columns) a program covers: a row's columns in one or a few 128-wide blocks, ~4k
    elements a program."""
    block_d = min(next_power_of_2(dim), 128)
    return max(1, 4096 // block_d), block_d


def forward(flat, values, segments, feature_meta, offsets, num_outputs, dim, check=None):
    out = torch.empty(num_outputs, dim, dtype=torch.float32, device=flat.device)
    num_features = feature_meta.shape[0]
    if num_outputs == 0 or num_features == 0:
        return out
    block_r, block_d = _forward_block(dim)
    report = check is not None
    _unpooled_forward_kernel[(cdiv(num_outputs, block_r), cdiv(dim, block_d))](
        flat, values, segments, feature_meta, offsets, out,
        check.claim if report else out, check.words if report else out,
        num_outputs, num_features, segments.shape[1], dim, values.numel(),
        META_W=META_WIDTH, BLOCK_R=block_r, BLOCK_D=block_d, SEARCH_STEPS=_search_steps(num_features),
        REPORT=report, num_warps=4,
    )
    return out


def _planner(segments, num_outputs, dim):
    """run_backward's planner for unpooled lookups (its pooled arguments are unused)."""

    def plan(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, row_count, total_dim,
             num_lookups):
        device = values.device
        n = num_outputs
        row_key = torch.empty(n, dtype=torch.int32 if row_count < 2**31 else torch.int64, device=device)
        src = torch.empty(n, dtype=torch.int64, device=device)
        scale = torch.empty(n, dtype=torch.float32, device=device)
        feature = torch.empty(n, dtype=torch.int32, device=device)
        if n:
            block_r = 512
            _unpooled_expand_kernel[(cdiv(n, block_r),)](
                values, segments, feature_meta, row_key, src, scale, feature,
                n, feature_meta.shape[0], segments.shape[1], dim,
                META_W=META_WIDTH, BLOCK_R=block_r, SEARCH_STEPS=_search_steps(feature_meta.shape[0]), num_warps=4,
            )
        sorted_key, order = torch.sort(row_key, stable=True)
        return plan_sorted_lookups(sorted_key, order, src, scale, feature)

    return plan


def _run(grad_output, out, states, hyper, step, values, segments, feature_meta, dim, num_rows, opt):
    num_outputs = grad_output.shape[0]
    if num_outputs == 0 or feature_meta.shape[0] == 0:
        return
    run_backward(grad_output.contiguous(), out, states, hyper, step, values, None, None, feature_meta, None, 0, dim,
                 num_rows, opt, num_outputs, planner=_planner(segments, num_outputs, dim))


def backward(grad_output, values, segments, feature_meta, total_numel, dtype, dim, num_rows=-1):
    grad = torch.zeros(total_numel, dtype=dtype, device=grad_output.device)
    _run(grad_output, grad, [], None, None, values, segments, feature_meta, dim, num_rows, -1)
    return grad


def fused_update(grad_output, flat, states, hyper, step, values, segments, feature_meta, dim, kind, num_rows=-1):
    _run(grad_output, flat, states, hyper, step, values, segments, feature_meta, dim, num_rows, kind)
