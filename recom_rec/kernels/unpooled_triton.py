"""Triton kernels of the unpooled lookup (``recom_rec.EmbeddingCollection``): one embedding row per
id, every feature of every table of a group in one launch. csrc/lookup/unpooled.cu holds the same
two for the CUDA extension, which runs them where it is loaded (ops/unpooled_embedding._extension).

The output is one ``[M, dim]`` fp32 block (all tables of an EmbeddingCollection share one dim):
feature f's ids fill rows ``[out_start[f], out_start[f + 1])`` in their order in the KJT's values,
from ``value_start[f]`` (``segments``, built by ops/unpooled_embedding.py). A program covers
BLOCK_R output rows and BLOCK_D columns; a row finds its feature by a binary search of
``out_start`` (F + 1 words, in L1).

The backward needs only each output row's row key (``row_keys``): ops/unpooled_embedding.py runs
it as the pooled lookup's backward of one-id bags over the group's whole buffer. The eager backward
also has the same kernel write where each row's gradient starts (``backward_rows``), from each
feature's start and stride: no torch ops of their own.
"""
import torch
import triton
import triton.language as tl

from ..ops.layout import META_WIDTH
from .grid_math import cdiv, next_power_of_2
from .pooled_triton import _report

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
def _report_negative_length(claim_ptr, report_ptr, seg_ptr, offsets_ptr, num_bags, num_features, seg_stride,
                            num_values, BLOCK_R: tl.constexpr):
    """Reports a bag of negative length with the first feature reading its key (csrc/lookup/unpooled.cu:
    check_lengths): a row's ids are found from its key's summed lengths, so such a bag among lengths
    that add up would pass into the output unseen. The programs read the offsets BLOCK_R bags at a
    time, a grid apart."""
    b0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    while b0 < num_bags:
        b = b0 + tl.arange(0, BLOCK_R)
        live = b < num_bags
        length = (tl.load(offsets_ptr + b + 1, mask=live, other=0).to(tl.int64)
                  - tl.load(offsets_ptr + b, mask=live, other=0).to(tl.int64))
        negative = live & (length < 0)
        if tl.max(negative.to(tl.int32), axis=0) > 0:
            first = tl.min(tl.where(negative, b, num_bags), axis=0)
            first_length = tl.sum(tl.where(b == first, length, 0), axis=0)
            f = 0
            while f < num_features:  # (the claim keeps the first report: one feature's)
                bag0 = tl.load(seg_ptr + 2 * seg_stride + f)
                if (bag0 <= first) & (first < bag0 + tl.load(seg_ptr + 3 * seg_stride + f)):
                    _report(claim_ptr, report_ptr, tl.full([], 5, tl.int64), f, first - bag0, first_length, 0,
                            num_values)
                f += 1
        b0 += tl.num_programs(0) * BLOCK_R


@triton.jit(do_not_specialize=["num_outputs", "num_values"])
def _unpooled_forward_kernel(
    flat_ptr, values_ptr, seg_ptr, meta_ptr, offsets_ptr, out_ptr, claim_ptr, report_ptr,
    num_outputs, num_features, seg_stride, dim, num_values, num_bags,
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
            _report_negative_length(claim_ptr, report_ptr, seg_ptr, offsets_ptr, num_bags, num_features, seg_stride,
                                    num_values, BLOCK_R)
            if tl.max(bad.to(tl.int32), axis=0) > 0:
                _report_bad_id(claim_ptr, report_ptr, seg_ptr, offsets_ptr, bad, f, pos, idx, rows, seg_stride,
                               num_values, BLOCK_R)


@triton.jit(do_not_specialize=["num_outputs", "num_values"])
def _row_key_kernel(
    values_ptr, seg_ptr, meta_ptr, offsets_ptr, row_key_ptr, claim_ptr, report_ptr, grad_table_ptr, grad_row_ptr,
    num_outputs, num_features, seg_stride, num_values, num_bags,
    META_W: tl.constexpr, BLOCK_R: tl.constexpr, SEARCH_STEPS: tl.constexpr, REPORT: tl.constexpr,
    GRAD_ROWS: tl.constexpr,
):
    """Each output row's row key (its table's row base + id; row 0 of the table for a bad id,
    reported with REPORT as the forward reports it). With GRAD_ROWS also where its gradient row
    starts: ``start[f] + r * stride[f]`` for row r of feature f, from ``grad_table`` (int64
    ``[2, num_features]``, rows start and stride; see backward_rows)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < num_outputs
    f, pos, idx, rows, key, bad = _row_lookup(values_ptr, seg_ptr, meta_ptr, r, live, num_features, seg_stride,
                                              META_W, SEARCH_STEPS)
    tl.store(row_key_ptr + r, key, mask=live)
    if GRAD_ROWS:
        start = tl.load(grad_table_ptr + f, mask=live, other=0)
        stride = tl.load(grad_table_ptr + num_features + f, mask=live, other=0)
        tl.store(grad_row_ptr + r, start + r * stride, mask=live)
    if REPORT:
        _report_negative_length(claim_ptr, report_ptr, seg_ptr, offsets_ptr, num_bags, num_features, seg_stride,
                                num_values, BLOCK_R)
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            _report_bad_id(claim_ptr, report_ptr, seg_ptr, offsets_ptr, bad, f, pos, idx, rows, seg_stride,
                           num_values, BLOCK_R)


def _search_steps(num_features: int) -> int:
    return max(1, num_features.bit_length())


def _forward_block(dim: int):
    """(rows, columns) a program covers: whole rows (up to 512 columns), ~1K elements a program,
    and its warps. At dim 256 on the H200 (docs/perf-notes.md, v40) 4 rows at 2 warps read 4.7
    TB/s (L2 hits included), 16-32 rows at 4-8 warps 4.3-4.6, 64 rows 3.1."""
    block_d = min(next_power_of_2(dim), 512)
    return max(1, 1024 // block_d), block_d, 2 if block_d >= 256 else 4


def forward(flat, values, segments, feature_meta, offsets, num_outputs, dim, check=None):
    out = torch.empty(num_outputs, dim, dtype=torch.float32, device=flat.device)
    num_features = feature_meta.shape[0]
    if num_outputs == 0 or num_features == 0:
        return out
    block_r, block_d, num_warps = _forward_block(dim)
    report = check is not None
    values, offsets = values.contiguous(), offsets.contiguous()  # indexed densely (a KJT may hold views)
    _unpooled_forward_kernel[(cdiv(num_outputs, block_r), cdiv(dim, block_d))](
        flat, values, segments, feature_meta, offsets, out,
        check.claim if report else out, check.words if report else out,
        num_outputs, num_features, segments.shape[1], dim, values.numel(), offsets.numel() - 1,
        META_W=META_WIDTH, BLOCK_R=block_r, BLOCK_D=block_d, SEARCH_STEPS=_search_steps(num_features),
        REPORT=report, num_warps=num_warps,
    )
    return out


def _launch_row_keys(values, segments, feature_meta, num_outputs, offsets, check, grad_table):
    keys = torch.empty(num_outputs, dtype=torch.int64, device=values.device)
    grad_rows = None if grad_table is None else torch.empty_like(keys)
    if num_outputs and feature_meta.shape[0]:
        block_r = 1024
        report = check is not None
        values = values.contiguous()  # indexed densely (a KJT may hold views)
        offsets = offsets.contiguous() if report else offsets
        _row_key_kernel[(cdiv(num_outputs, block_r),)](
            values, segments, feature_meta, offsets if report else values, keys,
            check.claim if report else keys, check.words if report else keys,
            keys if grad_table is None else grad_table, keys if grad_rows is None else grad_rows,
            num_outputs, feature_meta.shape[0], segments.shape[1], values.numel(),
            offsets.numel() - 1 if report else 0, META_W=META_WIDTH, BLOCK_R=block_r,
            SEARCH_STEPS=_search_steps(feature_meta.shape[0]), REPORT=report,
            GRAD_ROWS=grad_table is not None, num_warps=4)
    return keys, grad_rows


def row_keys(values, segments, feature_meta, num_outputs, offsets=None, check=None):
    """int64 ``[num_outputs]``: the row key each output reads (``feature_meta``'s row base + id).
    With ``check`` (an input_check.KernelReport, and the KJT's ``offsets``) bad ids are reported."""
    return _launch_row_keys(values, segments, feature_meta, num_outputs, offsets, check, None)[0]


def backward_rows(values, segments, feature_meta, num_outputs, grad_table):
    """(row keys, gradient rows), both int64 ``[num_outputs]`` from one launch: ``row_keys``, and
    where output row r of feature f has its gradient, ``grad_table[0, f] + r * grad_table[1, f]``
    (``grad_table``: int64 ``[2, F]`` on the device, each feature's start and stride; see
    ops/unpooled_embedding._gradient_rows)."""
    return _launch_row_keys(values, segments, feature_meta, num_outputs, None, None, grad_table)
