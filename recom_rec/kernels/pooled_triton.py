"""Triton kernels: every table of a group in one launch.

Forward: one program per (feature, block of bags). It reads the feature's row of
``feature_meta`` (dim, table base, output column, pooling), walks its bags' ids in lock-step and
accumulates rows in fp32; dims narrower than the block are masked, so tables of any dims share a
launch. The output row of each feature is written once (no atomics, no zero-fill).

Backward: lookups are sorted by (table, id) so that every distinct row is owned by exactly one
program, which sums its contributions in input order (deterministic, no atomics) and writes the
row's gradient once.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..ops.jagged import expand_lookups, lookup_scale
from ..ops.layout import META_OUT_COL, META_ROW_BASE, META_WIDTH


@triton.jit
def _pooled_forward_kernel(
    flat_ptr, values_ptr, offsets_ptr, weights_ptr, meta_ptr, key_index_ptr, out_ptr,
    batch_size, total_dim,
    META_W: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    f = tl.program_id(0)
    pid_b = tl.program_id(1)
    dim = tl.load(meta_ptr + f * META_W + 0)
    base = tl.load(meta_ptr + f * META_W + 1)
    col = tl.load(meta_ptr + f * META_W + 2)
    pooling = tl.load(meta_ptr + f * META_W + 3)
    key = tl.load(key_index_ptr + f).to(tl.int64)

    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = b < batch_size
    bag = key * batch_size + b
    start = tl.load(offsets_ptr + bag, mask=b_mask, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1, mask=b_mask, other=0).to(tl.int64)
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
    inv_len = 1.0 / tl.maximum(length, 1).to(tl.float32)
    scale = tl.where(pooling == 1, inv_len, tl.full([BLOCK_B], 1.0, tl.float32))
    acc = acc * scale[:, None]
    tl.store(out_ptr + b[:, None] * total_dim + col + d[None, :], acc, mask=b_mask[:, None] & d_mask[None, :])


@triton.jit
def _sum_pieces(
    src_ptr, scale_ptr, grad_out_ptr, start, length, dim, lane_mask,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """For BLOCK_R pieces of the sorted lookups at once (lock-step, like the forward's bags): the
    sum of each piece's scaled output-gradient rows, [BLOCK_R, BLOCK_D] in fp32. ``src`` (where
    each lookup's gradient row starts in grad_output) and ``scale`` are in sorted order."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d[None, :] < dim[:, None]
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    max_len = tl.max(length, axis=0)
    i = 0
    while i < max_len:
        live = lane_mask & (i < length)
        src = tl.load(src_ptr + start + i, mask=live, other=0)
        s = tl.load(scale_ptr + start + i, mask=live, other=0.0)
        g = tl.load(grad_out_ptr + src[:, None] + d[None, :], mask=live[:, None] & d_mask, other=0.0)
        acc += g.to(tl.float32) * s[:, None]
        i += 1
    return acc


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
            w_new = w - lr * g / (tl.sqrt(acc)[:, None] + eps)
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
def _piece_kernel(
    src_ptr, scale_ptr, grad_out_ptr, meta_ptr,
    piece_start_ptr, piece_len_ptr, piece_key_ptr, piece_feature_ptr, piece_slot_ptr, num_pieces_ptr,
    partial_ptr, out_ptr, state1_ptr, state2_ptr, hyper_ptr, step_ptr,
    META_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, OPT: tl.constexpr,
):
    """One lane per piece (at most PIECE lookups of one row). A piece that is a whole row finishes
    the row here; a piece of a longer row leaves its sum in its partial slot. The grid is sized
    for the most pieces possible; the actual count is read on the device (no host sync)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    lane = r < tl.load(num_pieces_ptr)
    start = tl.load(piece_start_ptr + r, mask=lane, other=0)
    length = tl.load(piece_len_ptr + r, mask=lane, other=0)
    key = tl.load(piece_key_ptr + r, mask=lane, other=0)
    feature = tl.load(piece_feature_ptr + r, mask=lane, other=0)
    slot = tl.load(piece_slot_ptr + r, mask=lane, other=-1)
    dim, base, row_base = _row_meta(meta_ptr, feature, lane, META_W)
    g = _sum_pieces(src_ptr, scale_ptr, grad_out_ptr, start, length, dim, lane, BLOCK_R, BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    is_part = lane & (slot >= 0)
    tl.store(partial_ptr + slot[:, None] * BLOCK_D + d[None, :], g, mask=is_part[:, None])
    _apply_rows(g, key, dim, base, row_base, lane & (slot < 0), out_ptr, state1_ptr, state2_ptr,
                hyper_ptr, step_ptr, BLOCK_D, OPT)


@triton.jit
def _split_row_kernel(
    partial_ptr, first_slot_ptr, num_slots_ptr, key_ptr, feature_ptr, num_rows_ptr, meta_ptr,
    out_ptr, state1_ptr, state2_ptr, hyper_ptr, step_ptr,
    META_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, OPT: tl.constexpr,
):
    """Rows longer than one piece (tiny tables, hot ids): add their pieces' partial sums in order
    (deterministic) and finish the row."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    lane = r < tl.load(num_rows_ptr)
    first = tl.load(first_slot_ptr + r, mask=lane, other=0)
    count = tl.load(num_slots_ptr + r, mask=lane, other=0)
    key = tl.load(key_ptr + r, mask=lane, other=0)
    feature = tl.load(feature_ptr + r, mask=lane, other=0)
    d = tl.arange(0, BLOCK_D)
    g = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    max_count = tl.max(count, axis=0)
    i = 0
    while i < max_count:
        live = lane & (i < count)
        g += tl.load(partial_ptr + (first + i)[:, None] * BLOCK_D + d[None, :], mask=live[:, None], other=0.0)
        i += 1
    dim, base, row_base = _row_meta(meta_ptr, feature, lane, META_W)
    _apply_rows(g, key, dim, base, row_base, lane, out_ptr, state1_ptr, state2_ptr, hyper_ptr, step_ptr,
                BLOCK_D, OPT)


def _block_d(feature_meta_cpu_max_dim: int) -> int:
    return max(16, triton.next_power_of_2(int(feature_meta_cpu_max_dim)))


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
) -> torch.Tensor:
    out = torch.empty(batch_size, total_dim, dtype=torch.float32, device=flat.device)
    num_features = feature_meta.shape[0]
    if num_features == 0 or batch_size == 0:
        return out.zero_()
    block_d = _block_d(max_dim)
    if block_b is None:
        # From the H100 sweep (docs/perf-notes.md, v1): ~8K-element tiles for wide rows with 2
        # warps, up to 128 bags for narrow ones with 4.
        block_b = max(8, min(128, 8192 // block_d))
    if num_warps is None:
        num_warps = 2 if block_d >= 128 else 4
    grid = (num_features, triton.cdiv(batch_size, block_b))
    weights = per_sample_weights if per_sample_weights is not None else flat
    _pooled_forward_kernel[grid](
        flat, values, offsets, weights, feature_meta, key_index, out,
        batch_size, total_dim,
        META_W=META_WIDTH, HAS_WEIGHTS=per_sample_weights is not None, BLOCK_B=block_b, BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out


# A row's lookups are summed by one lane in pieces of at most PIECE lookups: lanes of a program
# walk their pieces in lock-step, so bounding the piece length bounds the idle lanes, and a row
# read 65536 times (a 3-row table) is spread over many lanes, its partial sums added in order.
PIECE = 32
# Launch-shape overrides for experiments (tools/profile_gpu.py); empty means the defaults.
BACKWARD_LAUNCH: dict = {}


def _first_index(segment: torch.Tensor, size: int) -> torch.Tensor:
    """For segment ids ``segment`` (non-decreasing, 0..k-1), the first position of each segment
    (entries past k stay ``size``)."""
    n = segment.numel()
    first = torch.full((size,), n, dtype=torch.int64, device=segment.device)
    return first.scatter_reduce_(0, segment, torch.arange(n, device=segment.device), "amin", include_self=True)


def _pieces(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, row_count,
            total_dim, num_lookups):
    """Sorted lookups cut into pieces, with no device-to-host sync when ``num_lookups`` is
    known: arrays are sized for the worst case and the real counts stay on the device."""
    lookups = expand_lookups(values, offsets, feature_meta, key_index, batch_size, num_lookups)
    n = lookups.ids.numel()
    device = values.device
    scale = lookup_scale(lookups, per_sample_weights)
    row_key = feature_meta[lookups.feature, META_ROW_BASE] + lookups.ids
    if row_count < 2**31:  # 32-bit radix sort: half the passes
        row_key = row_key.to(torch.int32)
    sorted_key, order = torch.sort(row_key, stable=True)
    sorted_key = sorted_key.to(torch.int64)
    feature = lookups.feature[order]
    src = (lookups.bag * total_dim + feature_meta[lookups.feature, META_OUT_COL])[order]
    scale = scale[order]

    positions = torch.arange(n, device=device)
    row_start = torch.ones(n, dtype=torch.bool, device=device)
    row_start[1:] = sorted_key[1:] != sorted_key[:-1]
    row = torch.cumsum(row_start, 0) - 1  # row (segment) id of each lookup
    row_first = _first_index(row, n)
    within = positions - row_first[row]
    piece_start = (within % PIECE) == 0
    piece = torch.cumsum(piece_start, 0) - 1
    num_pieces = piece[-1:] + 1 if n else torch.zeros(1, dtype=torch.int64, device=device)
    first = _first_index(piece, n)  # start of each piece; n past the last
    length = torch.zeros(n, dtype=torch.int32, device=device).index_add_(
        0, piece, torch.ones(n, dtype=torch.int32, device=device))
    at = first.clamp_max(max(n - 1, 0))
    pieces_per_row = torch.zeros(n, dtype=torch.int64, device=device).index_add_(0, row, piece_start.to(torch.int64))
    split = pieces_per_row[row[at]] > 1  # the piece belongs to a row of several pieces
    split &= positions < num_pieces
    slot = torch.where(split, torch.cumsum(split, 0) - 1, -1)
    pieces = (first, length, sorted_key[at], feature[at], slot, num_pieces)

    # Rows of several pieces, compacted (row r's first piece is piece[row_first[r]]).
    row_split = (pieces_per_row > 1) & (positions < row[-1:] + 1)
    split_rank = torch.cumsum(row_split, 0) - 1
    num_split = split_rank[-1:] + 1
    dest = torch.where(row_split, split_rank, n)  # n: dropped
    def compact(v, fill=0):
        out = torch.full((n + 1,), fill, dtype=v.dtype, device=device)
        return out.scatter_(0, dest, v)[:n]
    row_at = row_first.clamp_max(max(n - 1, 0))
    rows = (compact(slot[piece[row_at]]), compact(pieces_per_row.to(torch.int32)), compact(sorted_key[row_at]),
            compact(feature[row_at]), num_split)
    return src.contiguous(), scale.contiguous(), pieces, rows


def _run_backward(grad_output, out, states, hyper, step, values, offsets, per_sample_weights, feature_meta,
                  key_index, batch_size, max_dim, row_count, opt, num_lookups):
    grad_output = grad_output.contiguous()
    src, scale, pieces, rows = _pieces(values, offsets, per_sample_weights, feature_meta, key_index,
                                       batch_size, row_count, grad_output.shape[1], num_lookups)
    n = src.numel()
    if n == 0:
        return
    block_d = _block_d(max_dim)
    # From the H100 sweep (docs/perf-notes.md, v4): ~512-element tiles; one warp for wide rows.
    block_r = BACKWARD_LAUNCH.get("block_r") or max(1, min(32, 512 // block_d))
    num_warps = BACKWARD_LAUNCH.get("num_warps") or (1 if block_d >= 64 else 4)
    # Pieces of split rows: a split row of L > PIECE lookups has at most L / PIECE + 1 pieces.
    max_slots = 2 * n // PIECE + 1
    partials = torch.empty(max_slots * block_d, dtype=torch.float32, device=grad_output.device)
    state1 = states[0] if len(states) > 0 else out
    state2 = states[1] if len(states) > 1 else out
    hyper = hyper if hyper is not None else partials
    step = step if step is not None else partials
    _piece_kernel[(triton.cdiv(n, block_r),)](
        src, scale, grad_output, feature_meta, *pieces, partials, out, state1, state2, hyper, step,
        META_W=META_WIDTH, BLOCK_R=block_r, BLOCK_D=block_d, OPT=opt, num_warps=num_warps,
    )
    # A split row has at least PIECE + 1 lookups.
    _split_row_kernel[(triton.cdiv(n // (PIECE + 1) + 1, block_r),)](
        partials, *rows, feature_meta, out, state1, state2, hyper, step,
        META_W=META_WIDTH, BLOCK_R=block_r, BLOCK_D=block_d, OPT=opt,
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
) -> torch.Tensor:
    grad = torch.zeros(total_numel, dtype=dtype, device=grad_output.device)
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return grad
    _run_backward(grad_output, grad, [], None, None, values, offsets, per_sample_weights, feature_meta,
                  key_index, batch_size, max_dim, total_numel, -1, num_lookups)
    return grad


def fused_update(
    grad_output, flat, states, state_is_row, hyper, step, values, offsets, per_sample_weights,
    feature_meta, key_index, batch_size, max_dim, kind, num_lookups=-1,
) -> None:
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return
    _run_backward(grad_output, flat, states, hyper, step, values, offsets, per_sample_weights, feature_meta,
                  key_index, batch_size, max_dim, flat.numel(), kind, num_lookups)
