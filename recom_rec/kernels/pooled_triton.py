"""Triton kernels: every table of a group in one launch.

Forward: one program per (feature, block of bags). It reads the feature's row of
``feature_meta`` (dim, table base, output column, pooling), walks its bags' ids in lock-step and
accumulates rows in fp32; dims narrower than the block are masked, so tables of any dims share a
launch. The output row of each feature is written once (no atomics, no zero-fill).

Backward: an expand kernel lists every lookup (row key, gradient source, scale), torch sorts the
row keys (stable), a plan kernel cuts each row's run of lookups into pieces of at most PIECE and
appends them to a list, and a piece kernel sums each piece (lanes in lock-step) and finishes the
rows of one piece; a split-row kernel adds the pieces of longer rows. The summation order of a
row depends only on its own lookups (deterministic, no atomics on data), and nothing syncs with
the host when the number of lookups is known.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..ops.layout import META_WIDTH
from .grid_math import cdiv, next_power_of_2

# Counts that change with every batch (the bag count, the ids', the lookups'): not specialized on.
# Triton compiles a variant per value class of an integer argument (1, a multiple of 16, other),
# so ragged batches would compile again at some later step (~1 s inside a user's call) and a
# server's varied batch sizes in its first requests (v53). They are compared with and offset by;
# batch_size is also the offsets' row stride, whose loads so lose an alignment hint (a few int64
# loads a program, perf-notes v53). Model-fixed strides (total_dim, row strides) stay specialized.
BATCH_COUNTS = ["batch_size", "num_values", "last_offset"]


@triton.jit
def _bag_block(offsets_ptr, key, pid_b, batch_size, BLOCK_B: tl.constexpr):
    """A block of BLOCK_B bags of feature ``key``: their batch positions, mask, and the [start,
    end) of their ids in the KJT's values."""
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = b < batch_size
    bag = key * batch_size + b
    start = tl.load(offsets_ptr + bag, mask=b_mask, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1, mask=b_mask, other=0).to(tl.int64)
    return b, b_mask, start, end


@triton.jit
def _checked_bag_block(offsets_ptr, key, pid_b, batch_size, num_values, last_offset, claim_ptr, report_ptr,
                       REPORT: tl.constexpr, BLOCK_B: tl.constexpr):
    """``_bag_block`` under the input check (ops/input_check.py): a bag whose [start, end) leaves
    the values is empty, and is returned in ``outside``; with REPORT, program (0, 0) also reports
    lengths that do not add up to the values. Returns (b, b_mask, start, end, outside)."""
    b, b_mask, start, end = _bag_block(offsets_ptr, key, pid_b, batch_size, BLOCK_B)
    bag_ok = (start >= 0) & (start <= end) & (end <= num_values)
    if REPORT:
        if (tl.program_id(0) == 0) & (pid_b == 0):  # the lengths add up to the values
            first = tl.load(offsets_ptr).to(tl.int64)
            last = tl.load(offsets_ptr + last_offset).to(tl.int64)
            if (first != 0) | (last != num_values):
                _report(claim_ptr, report_ptr, tl.full([], 3, tl.int64), tl.full([], -1, tl.int64),
                        tl.full([], -1, tl.int64), first, last, num_values)
    return b, b_mask, tl.where(bag_ok, start, 0), tl.where(bag_ok, end, 0), b_mask & (bag_ok == 0)


@triton.jit
def _report(claim_ptr, report_ptr, kind, feature, bag, a, b, num_values):
    """The input check's report (ops/input_check.py; csrc/lookup/kernels.cuh: report_bad): written
    by the program that takes the claim, the kind last. The store casts each value to int64: a
    value can be a plain int (a kernel that specializes an argument makes it a constexpr when a
    launch passes 1)."""
    if tl.atomic_cas(claim_ptr, 0, 1) == 0:
        tl.store(report_ptr + 1, feature)
        tl.store(report_ptr + 2, bag)
        tl.store(report_ptr + 3, a)
        tl.store(report_ptr + 4, b)
        tl.store(report_ptr + 5, num_values)
        tl.store(report_ptr + 0, kind)


@triton.jit
def _report_first(claim_ptr, report_ptr, kind, flags, feature, bag, a, b, num_values, BLOCK: tl.constexpr):
    """Reports the first lane of ``flags`` (if any) with its bag and values."""
    if tl.max(flags.to(tl.int32), axis=0) > 0:
        lane = tl.arange(0, BLOCK)
        first = tl.min(tl.where(flags, lane, BLOCK), axis=0)
        pick = lane == first
        _report(claim_ptr, report_ptr, tl.full([], kind, tl.int64), feature, tl.sum(tl.where(pick, bag, 0), axis=0),
                tl.sum(tl.where(pick, a, 0), axis=0), tl.sum(tl.where(pick, b, 0), axis=0), num_values)


@triton.jit
def _report_bad_input(claim_ptr, report_ptr, values_ptr, offsets_ptr, key_index_ptr, meta_ptr, batch_size, flagged,
                      num_values, META_W: tl.constexpr, BLOCK_B: tl.constexpr):
    """After the loop: ``flagged`` marks the program's bags outside the values or holding an id
    outside the table's ``rows``; reports the first bag outside the values, else the first bad id
    of the first bag holding one. A program with no flag pays one reduction. The loop carries only
    the flags: the feature's metadata, its offsets and the bag's ids are read again here, only in
    a program with a flag (the first bad id carried through the loop cost the quantized kernel
    2-6 registers and, at dim 32, a spill)."""
    if tl.max(flagged.to(tl.int32), axis=0) > 0:
        f = tl.program_id(0)
        pid_b = tl.program_id(1)
        key = tl.load(key_index_ptr + f).to(tl.int64)
        rows = tl.load(meta_ptr + f * META_W + 4)
        b, b_mask, start, end = _bag_block(offsets_ptr, key, pid_b, batch_size, BLOCK_B)
        bag_ok = (start >= 0) & (start <= end) & (end <= num_values)
        _report_first(claim_ptr, report_ptr, 2, b_mask & (bag_ok == 0), f, b, start, end, num_values, BLOCK_B)
        lane = tl.arange(0, BLOCK_B)
        first = tl.min(tl.where(flagged & bag_ok, lane, BLOCK_B), axis=0)
        if first < BLOCK_B:
            pick = lane == first
            j = tl.sum(tl.where(pick, start, 0), axis=0)
            stop = tl.sum(tl.where(pick, end, 0), axis=0)
            while j < stop:
                idx = tl.load(values_ptr + j).to(tl.int64)
                if (idx < 0) | (idx >= rows):
                    _report(claim_ptr, report_ptr, tl.full([], 1, tl.int64), f, tl.sum(tl.where(pick, b, 0), axis=0),
                            idx, rows, num_values)
                    stop = j
                j += 1


@triton.jit(do_not_specialize=BATCH_COUNTS)
def _pooled_forward_kernel(
    flat_ptr, values_ptr, offsets_ptr, weights_ptr, meta_ptr, key_index_ptr, out_ptr,
    batch_size, total_dim, num_values, last_offset, claim_ptr, report_ptr,
    META_W: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    REPORT: tl.constexpr,
):
    """Ids outside their table read row 0, bags outside the values are empty (ops/input_check.py);
    REPORT: the first of them is reported."""
    f = tl.program_id(0)
    pid_b = tl.program_id(1)
    dim = tl.load(meta_ptr + f * META_W + 0)
    base = tl.load(meta_ptr + f * META_W + 1)
    col = tl.load(meta_ptr + f * META_W + 2)
    pooling = tl.load(meta_ptr + f * META_W + 3)
    rows = tl.load(meta_ptr + f * META_W + 4)
    key = tl.load(key_index_ptr + f).to(tl.int64)
    # flagged (REPORT): bags outside the values, then bags with a bad id
    b, b_mask, start, end, flagged = _checked_bag_block(offsets_ptr, key, pid_b, batch_size, num_values, last_offset,
                                                        claim_ptr, report_ptr, REPORT, BLOCK_B)
    length = end - start
    d = tl.arange(0, BLOCK_D)
    d_mask = d < dim

    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    max_length = tl.max(length, axis=0)
    # A while loop rather than range(): the interpreter cannot take a reduced value as a range
    # bound under numpy >= 2.3, and the compiled code is the same.
    i = 0
    while i < max_length:
        live = i < length
        idx = tl.load(values_ptr + start + i, mask=live, other=0).to(tl.int64)
        out_of_table = live & ((idx < 0) | (idx >= rows))
        if REPORT:
            flagged = flagged | out_of_table
        idx = tl.where(out_of_table, 0, idx)
        row = tl.load(
            flat_ptr + base + idx[:, None] * dim + d[None, :],
            mask=live[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + start + i, mask=live, other=0.0).to(tl.float32)
            row = row * w[:, None]
        acc += row
        i += 1
    if REPORT:
        _report_bad_input(claim_ptr, report_ptr, values_ptr, offsets_ptr, key_index_ptr, meta_ptr, batch_size, flagged,
                          num_values, META_W, BLOCK_B)
    inv_len = 1.0 / tl.maximum(length, 1).to(tl.float32)
    scale = tl.where(pooling == 1, inv_len, tl.full([BLOCK_B], 1.0, tl.float32))
    acc = acc * scale[:, None]
    tl.store(out_ptr + b[:, None] * total_dim + col + d[None, :], acc, mask=b_mask[:, None] & d_mask[None, :])


@triton.jit
def _apply_rows(
    g, row_key, dim, base, row_base, row_mask, out_ptr, state1_ptr, state2_ptr, hyper_ptr, step_ptr,
    BLOCK_D: tl.constexpr, OPT: tl.constexpr,
):
    """Writes the rows' gradient (OPT < 0) or applies the fused optimizer to them in place
    (same formulas as optim/rows.py). ``g`` is [BLOCK_R, BLOCK_D]; one row per lane; ``dim``,
    ``base``, ``row_base`` are the rows' tables' metadata (loaded once by the caller: loading
    them again here trips Triton 3.6's layout pass)."""
    d = tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (d[None, :] < dim[:, None])
    at = (base + (row_key - row_base) * dim)[:, None] + d[None, :]
    if OPT < 0:
        tl.store(out_ptr + at, g.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        w = tl.load(out_ptr + at, mask=mask, other=0.0).to(tl.float32)
        lr = tl.load(hyper_ptr + 0)
        eps = tl.load(hyper_ptr + 1)
        wd = tl.load(hyper_ptr + 4)
        decoupled = tl.load(hyper_ptr + 5)
        g = tl.where(mask, g + wd * (1.0 - decoupled) * w, 0.0)
        if OPT == 0:  # SGD
            w_new = w - lr * g
        elif OPT == 1:  # Adagrad: one accumulator per element
            acc = tl.load(state1_ptr + at, mask=mask, other=0.0) + g * g
            tl.store(state1_ptr + at, acc, mask=mask)
            w_new = w - lr * g / (tl.sqrt(acc) + eps)
        elif OPT == 2:  # row-wise Adagrad: one accumulator per row, indexed by the row key
            acc = tl.load(state1_ptr + row_key, mask=row_mask, other=0.0) + tl.sum(g * g, axis=1) / dim.to(tl.float32)
            tl.store(state1_ptr + row_key, acc, mask=row_mask)
            w_new = w - (lr / (tl.sqrt(acc) + eps))[:, None] * g  # the step a row, as fbgemm's `multiplier`
        else:  # Adam (sparse: only touched rows' moments move)
            beta1 = tl.load(hyper_ptr + 2)
            beta2 = tl.load(hyper_ptr + 3)
            t = tl.load(step_ptr).to(tl.float32)
            m = beta1 * tl.load(state1_ptr + at, mask=mask, other=0.0) + (1.0 - beta1) * g
            v = beta2 * tl.load(state2_ptr + at, mask=mask, other=0.0) + (1.0 - beta2) * g * g
            tl.store(state1_ptr + at, m, mask=mask)
            tl.store(state2_ptr + at, v, mask=mask)
            m_hat = m / (1.0 - tl.exp(t * tl.log(beta1)))
            v_hat = v / (1.0 - tl.exp(t * tl.log(beta2)))
            w_new = w - lr * (m_hat / (tl.sqrt(v_hat) + eps)) - lr * wd * decoupled * w
        tl.store(out_ptr + at, w_new.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_meta(meta_ptr, feature, lane, META_W: tl.constexpr):
    """Dim, element base and row base of each lane's table (loaded once per kernel: loading
    them again inside _apply_rows trips Triton 3.6's layout pass)."""
    dim = tl.load(meta_ptr + feature * META_W + 0, mask=lane, other=1)
    base = tl.load(meta_ptr + feature * META_W + 1, mask=lane, other=0)
    row_base = tl.load(meta_ptr + feature * META_W + 5, mask=lane, other=0)
    return dim, base, row_base


@triton.jit
def _fill_uncovered(row_key_ptr, src_ptr, scale_ptr, feature_ptr, lo, hi, row_base, col, BLOCK_V: tl.constexpr):
    """Entries [lo, hi) as a lookup of row 0 of feature 0's table at scale 0 (see _expand_kernel)."""
    c = lo
    while c < hi:
        at = c + tl.arange(0, BLOCK_V)
        live = at < hi
        tl.store(row_key_ptr + at, (tl.zeros([BLOCK_V], tl.int64) + row_base).to(row_key_ptr.dtype.element_ty),
                 mask=live)
        tl.store(src_ptr + at, tl.zeros([BLOCK_V], tl.int64) + col, mask=live)
        tl.store(scale_ptr + at, tl.zeros([BLOCK_V], tl.float32), mask=live)
        tl.store(feature_ptr + at, tl.zeros([BLOCK_V], tl.int32), mask=live)
        c += BLOCK_V


@triton.jit(do_not_specialize=BATCH_COUNTS + ["n"])
def _expand_kernel(
    values_ptr, offsets_ptr, weights_ptr, meta_ptr, key_index_ptr, feature_base_ptr,
    row_key_ptr, src_ptr, scale_ptr, feature_ptr, batch_size, total_dim, num_values, last_offset, n,
    META_W: tl.constexpr, HAS_WEIGHTS: tl.constexpr, POSITIONAL: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """One entry per lookup, feature after feature (feature f's lookups from feature_base[f], in
    input order): the row it reads (its table's row base + id), where its gradient row starts in
    grad_output, its scale (sample weight x 1/L for mean pooling) and its feature. POSITIONAL (every
    key read by one feature): a lookup's entry is its position in values instead.

    A program covers BLOCK_B bags of one feature, a lane per lookup (not per bag: the four
    outputs are then written coalesced); a lane finds its bag by a binary search of the block's
    bag offsets, which stay in L1.

    Whatever the batch holds, entries stay in [0, n) and row keys in their tables (ids outside
    read row 0, as in the forward, which reports them); positions no bag covers (lengths not adding
    up to the values) get a harmless entry: row 0 of feature 0's table, scale 0."""
    f = tl.program_id(0)
    pid_b = tl.program_id(1)
    col = tl.load(meta_ptr + f * META_W + 2)
    pooling = tl.load(meta_ptr + f * META_W + 3)
    rows = tl.load(meta_ptr + f * META_W + 4)
    row_base = tl.load(meta_ptr + f * META_W + 5)
    key = tl.load(key_index_ptr + f).to(tl.int64)
    b0 = pid_b * BLOCK_B
    bags = tl.minimum(batch_size - b0, BLOCK_B)
    bag_offsets = offsets_ptr + key * batch_size + b0
    v0 = tl.maximum(tl.load(bag_offsets).to(tl.int64), 0)
    v1 = tl.minimum(tl.load(bag_offsets + bags).to(tl.int64), num_values)
    if POSITIONAL:
        first = 0
        out_base = 0
        if (f == 0) & (pid_b == 0):
            head = tl.minimum(tl.maximum(tl.load(offsets_ptr).to(tl.int64), 0), n)
            tail = tl.minimum(tl.maximum(tl.load(offsets_ptr + last_offset).to(tl.int64), head), n)
            _fill_uncovered(row_key_ptr, src_ptr, scale_ptr, feature_ptr, 0, head, row_base, col, BLOCK_V)
            _fill_uncovered(row_key_ptr, src_ptr, scale_ptr, feature_ptr, tail, n, row_base, col, BLOCK_V)
    else:
        # the key's values, clamped into the values as lookup_bases counts them
        first = tl.minimum(tl.maximum(tl.load(offsets_ptr + key * batch_size).to(tl.int64), 0), num_values)
        last = tl.minimum(tl.maximum(tl.load(offsets_ptr + (key + 1) * batch_size).to(tl.int64), 0), num_values)
        out_base = tl.load(feature_base_ptr + f)
        v0 = tl.maximum(v0, first)
        v1 = tl.minimum(v1, last)
    c = v0
    while c < v1:  # a while loop: the interpreter cannot range() over loaded values
        pos = c + tl.arange(0, BLOCK_V)
        live = pos < v1
        # The bag holding pos: the last of the block's bags that starts at or before pos, i.e. one
        # before the first j in [1, bags] with offsets[j] > pos (empty bags resolve correctly).
        lo = tl.full([BLOCK_V], 1, tl.int64)
        hi = tl.zeros([BLOCK_V], tl.int64) + bags
        for _ in tl.static_range(SEARCH_STEPS):
            searching = lo < hi
            mid = (lo + hi) // 2
            after = tl.load(bag_offsets + mid, mask=live & searching, other=0).to(tl.int64) > pos
            hi = tl.where(searching & after, mid, hi)
            lo = tl.where(searching & (after == 0), mid + 1, lo)
        j = lo - 1
        idx = tl.load(values_ptr + pos, mask=live, other=0).to(tl.int64)
        idx = tl.where((idx < 0) | (idx >= rows), 0, idx)
        scale = tl.full([BLOCK_V], 1.0, tl.float32)
        if pooling == 1:
            length = tl.load(bag_offsets + j + 1, mask=live, other=1) - tl.load(bag_offsets + j, mask=live, other=0)
            scale = 1.0 / tl.maximum(length, 1).to(tl.float32)
        if HAS_WEIGHTS:
            scale = scale * tl.load(weights_ptr + pos, mask=live, other=0.0).to(tl.float32)
        at = out_base + pos - first
        tl.store(row_key_ptr + at, (row_base + idx).to(row_key_ptr.dtype.element_ty), mask=live)
        tl.store(src_ptr + at, (b0 + j) * total_dim + col, mask=live)
        tl.store(scale_ptr + at, scale, mask=live)
        tl.store(feature_ptr + at, tl.full([BLOCK_V], 0, tl.int32) + f, mask=live)
        c += BLOCK_V


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["n"])
def _plan_kernel(
    row_key_ptr, n, piece_ptr, split_row_ptr, counts_ptr,
    PIECE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Cuts the sorted lookups into pieces: a piece starts where a row (a run of equal keys)
    starts and again every PIECE lookups into the row, so a row's pieces - and the order its
    lookups are summed in - do not depend on where the row lands in the sorted array. Appends the
    pieces (start << 2 | split << 1 | first) to one list and the starts of rows of more than PIECE
    lookups (split rows) to another, at counts[0] and counts[1]; list order is arbitrary (atomic
    appends), as each piece's and row's work depends only on its start."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < n
    key = tl.load(row_key_ptr + p, mask=live, other=0)
    prev = tl.load(row_key_ptr + p - 1, mask=live & (p > 0), other=0)
    first = live & ((p == 0) | (prev != key))
    ahead = tl.load(row_key_ptr + p + PIECE, mask=live & (p + PIECE < n), other=0)
    long_from_here = live & (p + PIECE < n) & (ahead == key)
    # Each lane's row start: the last row start at or before it in the block (a max-scan) ...
    run_start = tl.associative_scan(tl.where(first, p.to(tl.int64), -1), 0, _max_combine)
    # ... or, for the lanes before the block's first row start, the start of the row the block
    # opens in: one lower-bound search of that key, shared by the block (hot rows make long runs,
    # and a search per lane cost zipf's plan 0.57 ms on the H100).
    block0 = tl.program_id(0).to(tl.int64) * BLOCK
    if tl.min(run_start, axis=0) < 0:
        key0 = tl.load(row_key_ptr + block0)
        lo = block0 * 0
        hi = block0
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(row_key_ptr + mid) < key0:
                lo = mid + 1
            else:
                hi = mid
        run_start = tl.where(run_start < 0, lo.to(tl.int64), run_start)
    depth = p - run_start  # lookups of this row before p
    start = live & ((depth % PIECE) == 0)
    split = start & ((depth >= PIECE) | long_from_here)
    packed = p.to(tl.int64) * 4 + split.to(tl.int64) * 2 + first.to(tl.int64)
    starts = start.to(tl.int32)
    base = tl.atomic_add(counts_ptr, tl.sum(starts, axis=0))
    tl.store(piece_ptr + base + tl.cumsum(starts, axis=0) - 1, packed, mask=start)
    rows = (first & long_from_here).to(tl.int32)
    base = tl.atomic_add(counts_ptr + 1, tl.sum(rows, axis=0))
    tl.store(split_row_ptr + base + tl.cumsum(rows, axis=0) - 1, p.to(tl.int64), mask=rows != 0)


@triton.jit(do_not_specialize=["n"])
def _piece_kernel(
    row_key_ptr, order_ptr, src_ptr, scale_ptr, feature_ptr, grad_out_ptr, meta_ptr,
    piece_ptr, counts_ptr, n, partial_ptr, out_ptr, state1_ptr, state2_ptr, hyper_ptr, step_ptr,
    META_W: tl.constexpr, PIECE: tl.constexpr, BLOCK_R: tl.constexpr, UNROLL: tl.constexpr,
    BLOCK_D: tl.constexpr, OPT: tl.constexpr,
):
    """One lane per piece, programs looping over the piece list (its length is on the device: no
    host sync). A lane sums its piece's scaled gradient rows UNROLL at a time (independent loads in
    flight); a piece that is a whole row finishes the row here, a piece of a split row leaves its
    sum in the partial slot of its start (two slots per PIECE positions: a split row's first piece
    and the piece of an earlier row can share a PIECE-block, no other two can)."""
    num = tl.load(counts_ptr)
    d = tl.arange(0, BLOCK_D)
    u = tl.arange(0, UNROLL)
    r0 = tl.program_id(0) * BLOCK_R
    while r0 < num:
        r = r0 + tl.arange(0, BLOCK_R)
        lane = r < num
        packed = tl.load(piece_ptr + r, mask=lane, other=0)
        start = packed >> 2
        split = lane & ((packed & 2) != 0)
        key = tl.load(row_key_ptr + start, mask=lane, other=0)
        feature = tl.load(feature_ptr + tl.load(order_ptr + start, mask=lane, other=0), mask=lane, other=0)
        dim, base, row_base = _row_meta(meta_ptr, feature, lane, META_W)
        d_mask = d[None, :] < dim[:, None]
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        i = 0
        go = 1
        while go > 0:
            pos = start[:, None] + i + u[None, :]
            live = lane[:, None] & (pos < n) & ((i + u[None, :]) < PIECE)
            live = live & (tl.load(row_key_ptr + pos, mask=live, other=0) == key[:, None])
            o = tl.load(order_ptr + pos, mask=live, other=0)
            src = tl.load(src_ptr + o, mask=live, other=0)
            s = tl.load(scale_ptr + o, mask=live, other=0.0)
            g = tl.load(grad_out_ptr + src[:, :, None] + d[None, None, :],
                        mask=live[:, :, None] & d_mask[:, None, :], other=0.0)
            acc += tl.sum(g.to(tl.float32) * s[:, :, None], axis=1)
            i += UNROLL
            last_live = tl.sum(tl.where(u[None, :] == UNROLL - 1, live.to(tl.int32), 0), axis=1)
            go = tl.max(last_live, axis=0) * (i < PIECE).to(tl.int32)
        slot = 2 * (start // PIECE) + (packed & 1)
        tl.store(partial_ptr + slot[:, None] * BLOCK_D + d[None, :], acc, mask=split[:, None])
        _apply_rows(acc, key, dim, base, row_base, lane & ((packed & 2) == 0), out_ptr, state1_ptr, state2_ptr,
                    hyper_ptr, step_ptr, BLOCK_D, OPT)
        r0 += tl.num_programs(0) * BLOCK_R


@triton.jit(do_not_specialize=["n"])
def _split_row_kernel(
    row_key_ptr, order_ptr, feature_ptr, meta_ptr, split_row_ptr, counts_ptr, n, partial_ptr,
    out_ptr, state1_ptr, state2_ptr, hyper_ptr, step_ptr,
    META_W: tl.constexpr, PIECE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, OPT: tl.constexpr,
):
    """Rows of more than PIECE lookups (tiny tables, hot ids): add their pieces' partial sums,
    BLOCK_K at a time and always in the same order (deterministic), and finish the row."""
    num = tl.load(counts_ptr + 1)
    d = tl.arange(0, BLOCK_D)
    k = tl.arange(0, BLOCK_K)
    r0 = tl.program_id(0) * BLOCK_R
    while r0 < num:
        r = r0 + tl.arange(0, BLOCK_R)
        lane = r < num
        start = tl.load(split_row_ptr + r, mask=lane, other=0)
        key = tl.load(row_key_ptr + start, mask=lane, other=0)
        # The row's end: the upper bound of key in (start + PIECE, n].
        lo = tl.where(lane, start + PIECE + 1, 0)
        hi = tl.where(lane, n, 0).to(tl.int64)
        while tl.max(hi - lo, axis=0) > 0:
            searching = lo < hi
            mid = (lo + hi) // 2
            within = tl.load(row_key_ptr + mid, mask=searching, other=0) <= key
            lo = tl.where(searching & within, mid + 1, lo)
            hi = tl.where(searching & (within == 0), mid, hi)
        count = tl.where(lane, (lo - start + PIECE - 1) // PIECE, 0)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        j = 0
        while j < tl.max(count, axis=0):
            piece = j + k[None, :]
            live = piece < count[:, None]
            slot = 2 * ((start[:, None] + piece * PIECE) // PIECE) + (piece == 0).to(tl.int64)
            acc += tl.sum(tl.load(partial_ptr + slot[:, :, None] * BLOCK_D + d[None, None, :],
                                  mask=live[:, :, None], other=0.0), axis=1)
            j += BLOCK_K
        feature = tl.load(feature_ptr + tl.load(order_ptr + start, mask=lane, other=0), mask=lane, other=0)
        dim, base, row_base = _row_meta(meta_ptr, feature, lane, META_W)
        _apply_rows(acc, key, dim, base, row_base, lane, out_ptr, state1_ptr, state2_ptr, hyper_ptr, step_ptr,
                    BLOCK_D, OPT)
        r0 += tl.num_programs(0) * BLOCK_R


def _block_d(feature_meta_cpu_max_dim: int) -> int:
    return max(16, next_power_of_2(int(feature_meta_cpu_max_dim)))


def forward(
    flat: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    batch_size: int,
    total_dim: int,
    max_dim: int,
    block_b: Optional[int] = None,
    num_warps: Optional[int] = None,
    check=None,
) -> torch.Tensor:
    """``check``: an input_check.KernelReport to report bad ids and bags to (they are clamped
    either way)."""
    out = torch.empty(batch_size, total_dim, dtype=torch.float32, device=flat.device)
    num_features = feature_meta.shape[0]
    if num_features == 0 or batch_size == 0:
        return out.zero_()
    # the kernels index the batch's tensors densely (a KJT may hold views, e.g. a slice's values)
    values, offsets, per_sample_weights = _dense(values, offsets, per_sample_weights)
    block_d = _block_d(max_dim)
    if block_b is None:
        # From the H100 sweep (docs/perf-notes.md, v1): ~8K-element tiles for wide rows with 2
        # warps, up to 128 bags for narrow ones with 4.
        block_b = max(8, min(128, 8192 // block_d))
    if num_warps is None:
        num_warps = forward_warps(block_d)
    grid = (num_features, cdiv(batch_size, block_b))
    weights = per_sample_weights if per_sample_weights is not None else flat
    _pooled_forward_kernel[grid](
        flat, values, offsets, weights, feature_meta, key_index, out,
        batch_size, total_dim, values.numel(), offsets.numel() - 1,
        check.claim if check is not None else out, check.words if check is not None else out,
        META_W=META_WIDTH, HAS_WEIGHTS=per_sample_weights is not None, BLOCK_B=block_b, BLOCK_D=block_d,
        REPORT=check is not None, num_warps=num_warps,
    )
    return out


# A row's lookups are summed in pieces of at most PIECE lookups, one lane each: bounding the piece
# bounds how long the lanes of a program wait for their slowest one, and a row read 65536 times
# (a 3-row table) is spread over many lanes, its partial sums then added in a fixed order.
PIECE = 32
EXPAND_LOOKUPS = 1024  # lookups per expand program step (a lane each)


def expand_block(num_lookups: int, num_bags: int) -> int:
    """Bags per expand program: about EXPAND_LOOKUPS lookups' worth at the batch's mean bag length
    (short bags need many per program, or most lanes idle), 64 to 1024."""
    mean = max(1.0, num_lookups / max(1, num_bags))
    return max(64, min(1024, next_power_of_2(int(-(-EXPAND_LOOKUPS // mean)))))
PLAN_BLOCK = 1024
PROGRAM_WAVES = 8  # programs per SM for the kernels that loop over an on-device list


def forward_warps(block_d: int) -> int:
    """Warps of the forward kernel: from the H100 sweep (v1), 2 for rows of 128-256 columns and
    4 for narrower ones. Wider rows take 8+ warps, ~32-64 of the tile's elements a thread: at 2
    warps the [8, 2048] tile spilled 3 KB a thread to the stack (sm_90 build, v50)."""
    if block_d > 256:
        return min(32, max(8, block_d // 256))
    return 2 if block_d >= 128 else 4


def piece_launch(block_d: int):
    """(lanes per program, lookups unrolled per lane, warps) of the piece kernel. From the H100
    sweep (docs/perf-notes.md, v5): 8 x 8 at 2 warps for rows of 128-256 columns, 4 x 4 at 4 warps
    for narrower ones (tools/profile_gpu.py sweeps others by replacing this function). Wider rows
    (the GPU runs them here only above the CUDA kernels' 1024 columns, or on the Triton backend):
    tiles of ~8K elements over 8+ warps. The sweep's 8 x 8 x 2 there spilled kilobytes a thread and
    took Triton 33 s to compile at 2048 columns (sm_90 build, v50), which a first training step paid."""
    if block_d > 256:
        lanes = max(1, 1024 // block_d)
        return lanes, max(1, min(8, 8192 // (lanes * block_d))), min(32, max(8, block_d // 512))
    wide = block_d >= 128
    return (8, 8, 2) if wide else (4, 4, 4)


def split_block_k(block_d: int) -> int:
    """Partial sums the split-row kernel adds per step: ~2K-element [BLOCK_K x BLOCK_D] tiles."""
    return max(1, min(16, 2048 // block_d))


def _programs(device: torch.device, wanted: int) -> int:
    """Programs for a kernel that loops over a list whose length is known only on the device:
    enough to fill the GPU (a few waves of resident programs), never more than there is work for."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(wanted, sms * PROGRAM_WAVES))
    return max(1, min(wanted, 16))  # the interpreter runs programs one after another


def _dense(values, offsets, per_sample_weights):
    """The batch's tensors as the kernels index them (no copy when they are already dense)."""
    return (values.contiguous(), offsets.contiguous(),
            None if per_sample_weights is None else per_sample_weights.contiguous())


def lookup_bases(offsets, key_index, batch_size, num_lookups, values_numel):
    """(positional, feature_base, n): with num_lookups >= 0 every key is read by exactly one
    feature, so a lookup's entry can be its position in values (no per-feature bases to compute:
    fewer small launches, less host time); otherwise feature f's entries start at feature_base[f]
    and counting them syncs with the device."""
    if num_lookups >= 0:
        return True, None, num_lookups
    # Clamped into the values as the expand kernels clamp them: malformed offsets (reported by the
    # forward) give no entry outside [0, n).
    bounds = offsets[torch.stack((key_index * batch_size, (key_index + 1) * batch_size))].to(torch.int64)
    bounds = bounds.clamp_(0, values_numel)
    counts = (bounds[1] - bounds[0]).clamp_(min=0)
    return False, torch.cumsum(counts, 0) - counts, int(counts.sum())


def _sorted_lookups(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, row_count,
                    total_dim, num_lookups):
    """Every lookup's (row key, gradient source, scale, feature), then the row keys sorted (stable:
    a row's lookups stay in input order). No host sync when ``num_lookups`` is known."""
    device = values.device
    key_index = key_index.to(torch.int64)
    values, offsets, per_sample_weights = _dense(values, offsets, per_sample_weights)
    positional, feature_base, n = lookup_bases(offsets, key_index, batch_size, num_lookups, values.numel())
    # 32-bit keys when they fit: a radix sort of half the passes.
    row_key = torch.empty(n, dtype=torch.int32 if row_count < 2**31 else torch.int64, device=device)
    src = torch.empty(n, dtype=torch.int64, device=device)
    scale = torch.empty(n, dtype=torch.float32, device=device)
    feature = torch.empty(n, dtype=torch.int32, device=device)
    if n:
        weights = per_sample_weights if per_sample_weights is not None else scale
        block_b = expand_block(n, feature_meta.shape[0] * batch_size)
        _expand_kernel[(feature_meta.shape[0], cdiv(batch_size, block_b))](
            values, offsets, weights, feature_meta, key_index, key_index if positional else feature_base,
            row_key, src, scale, feature, batch_size, total_dim, values.numel(), offsets.numel() - 1, n,
            META_W=META_WIDTH, HAS_WEIGHTS=per_sample_weights is not None, POSITIONAL=positional, BLOCK_B=block_b,
            BLOCK_V=EXPAND_LOOKUPS, SEARCH_STEPS=block_b.bit_length(), num_warps=4,
        )
    sorted_key, order = torch.sort(row_key, stable=True)
    return sorted_key, order, src, scale, feature


def _triton_plan(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, row_count, total_dim,
                 num_lookups):
    """The backward's plan: sorted keys, order, sources, scales, features, then the pieces and
    split rows (appended by the plan kernel; their counts stay on the device)."""
    return plan_sorted_lookups(*_sorted_lookups(
        values, offsets, per_sample_weights, feature_meta, key_index, batch_size, row_count, total_dim, num_lookups))


def plan_sorted_lookups(row_key, order, src, scale, feature):
    """The plan of lookups whose row keys are sorted (``order``: their input positions): the
    pieces and split rows the piece kernels walk. Shared with the unpooled lookup
    (unpooled_triton.py), whose lookups are expanded differently."""
    n = row_key.numel()
    device = row_key.device
    piece_list = torch.empty(n, dtype=torch.int64, device=device)
    split_rows = torch.empty(n // (PIECE + 1) + 1, dtype=torch.int64, device=device)
    counts = torch.zeros(2, dtype=torch.int32, device=device)
    if n:
        _plan_kernel[(cdiv(n, PLAN_BLOCK),)](row_key, n, piece_list, split_rows, counts,
                                                    PIECE=PIECE, BLOCK=PLAN_BLOCK, num_warps=4)
    return row_key, order, src, scale, feature, piece_list, split_rows, counts


def run_backward(grad_output, out, states, hyper, step, values, offsets, per_sample_weights, feature_meta,
                  key_index, batch_size, max_dim, num_rows, opt, num_lookups, pieces=None, planner=None,
                  grad_rows=None):
    """The backward of one group: plan, then sum every row's lookups and finish the rows.
    ``planner`` replaces the Triton planning and ``pieces`` (taking the plan) the Triton piece and
    split-row kernels: the CUDA backend's pooled_cuda._cuda_plan and _cuda_pieces. ``num_rows``
    (-1: unknown) bounds the row keys; unknown, the bound is ``out``'s element count, which may push
    the keys to 64 bits (twice the sort's passes and key traffic).
    ``grad_rows`` (int64, a bag each; one feature, bags of one lookup without sample weights: the
    unpooled backward's): where each bag's gradient row starts, in elements from ``grad_output``'s
    start, which is then only the first of the tensors holding them; rows where it names them are
    16-byte aligned where ``grad_output`` is and its width is a multiple of 4. Without it, bag b's row
    is ``grad_output[b]``."""
    if grad_rows is None:
        grad_output = grad_output.contiguous()
    device = grad_output.device
    row_count = num_rows if num_rows >= 0 else out.numel()
    plan = (planner or _triton_plan)(values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                                     row_count, grad_output.shape[1], num_lookups)
    n = plan[0].numel()
    if n == 0:
        return
    block_d = _block_d(max_dim)
    partials = torch.empty(2 * ((n - 1) // PIECE + 1) * block_d, dtype=torch.float32, device=device)
    state1 = states[0] if len(states) > 0 else out
    state2 = states[1] if len(states) > 1 else out
    hyper = hyper if hyper is not None else partials
    step = step if step is not None else partials
    if pieces is not None:  # the planner's own piece and split-row kernels
        pieces(plan, grad_output, feature_meta, n, partials, block_d, out, state1, state2, hyper, step, opt, max_dim)
        return
    row_key, order, src, scale, feature, piece_list, split_rows, counts = plan
    if grad_rows is not None:  # bags of one lookup: lookup i's row is bag i's
        src = grad_rows
    block_r, unroll, num_warps = piece_launch(block_d)
    _piece_kernel[(_programs(device, cdiv(n, block_r)),)](
        row_key, order, src, scale, feature, grad_output, feature_meta, piece_list, counts, n, partials,
        out, state1, state2, hyper, step,
        META_W=META_WIDTH, PIECE=PIECE, BLOCK_R=block_r, UNROLL=unroll, BLOCK_D=block_d, OPT=opt,
        num_warps=num_warps,
    )
    _split_row_kernel[(_programs(device, split_rows.numel()),)](
        row_key, order, feature, feature_meta, split_rows, counts, n, partials, out, state1, state2, hyper, step,
        META_W=META_WIDTH, PIECE=PIECE, BLOCK_R=1, BLOCK_K=split_block_k(block_d), BLOCK_D=block_d, OPT=opt,
        num_warps=4,
    )


def backward(
    grad_output: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_meta: torch.Tensor,
    key_index: torch.Tensor,
    batch_size: int,
    total_numel: int,
    dtype: torch.dtype,
    max_dim: int,
    num_lookups: int = -1,
    num_rows: int = -1,
    grad_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    grad = torch.zeros(total_numel, dtype=dtype, device=grad_output.device)
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return grad
    run_backward(grad_output, grad, [], None, None, values, offsets, per_sample_weights, feature_meta,
                  key_index, batch_size, max_dim, num_rows, -1, num_lookups, grad_rows=grad_rows)
    return grad


def fused_update(
    grad_output, flat, states, state_is_row, hyper, step, values, offsets, per_sample_weights,
    feature_meta, key_index, batch_size, max_dim, kind, num_lookups=-1, num_rows=-1, grad_rows=None,
) -> None:
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return
    run_backward(grad_output, flat, states, hyper, step, values, offsets, per_sample_weights, feature_meta,
                  key_index, batch_size, max_dim, num_rows, kind, num_lookups, grad_rows=grad_rows)
