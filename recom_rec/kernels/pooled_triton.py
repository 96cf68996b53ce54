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
from ..ops.layout import META_ELEM_BASE, META_ROW_BASE, META_WIDTH


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
def _run_sum(
    sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr,
    start, stop, key, total_dim, d, d_mask,
    META_W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Sum of the scaled output gradients of the lookups at sorted positions [start, stop) whose
    row is ``key`` (a prefix of that range, since positions are sorted), BLOCK_L at a time."""
    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    lane = tl.arange(0, BLOCK_L)
    j = start
    more = start < stop
    while more:
        pos = j + lane
        live = tl.load(sorted_key_ptr + pos, mask=pos < stop, other=-1) == key
        e = tl.load(order_ptr + pos, mask=live, other=0)
        f = tl.load(feature_ptr + e, mask=live, other=0)
        bag = tl.load(bag_ptr + e, mask=live, other=0)
        s = tl.load(scale_ptr + e, mask=live, other=0.0)
        col = tl.load(meta_ptr + f * META_W + 2, mask=live, other=0)
        g = tl.load(grad_out_ptr + bag[:, None] * total_dim + col[:, None] + d[None, :],
                    mask=live[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        acc += g * s[:, None]
        j += BLOCK_L
        more = (j < stop) & (tl.sum(live.to(tl.int32), axis=0) == BLOCK_L)
    return tl.sum(acc, axis=0)


@triton.jit
def _chunk_partials_kernel(
    sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr, partial_ptr,
    num_lookups, total_dim,
    META_W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    """A row hit many times (a small table, a hot id) would leave one program summing a very
    long run. The sorted lookups are cut into chunks; a chunk that begins inside a run sums that
    run's part in the chunk here, and the run's owner adds these partials in order."""
    c = tl.program_id(0).to(tl.int64)
    start = c * CHUNK
    key = tl.load(sorted_key_ptr + start)
    prev = tl.load(sorted_key_ptr + start - 1, mask=start > 0, other=-1)
    if (start > 0) & (prev == key):
        f0 = tl.load(feature_ptr + tl.load(order_ptr + start))
        dim = tl.load(meta_ptr + f0 * META_W + 0)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < dim
        acc = _run_sum(sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr,
                       start, tl.minimum(start + CHUNK, num_lookups), key, total_dim, d, d_mask,
                       META_W, BLOCK_L, BLOCK_D)
        tl.store(partial_ptr + c * BLOCK_D + d, acc)


@triton.jit
def _row_total(
    sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr, partial_ptr,
    i, key, num_lookups, total_dim, d, d_mask,
    META_W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    """Full gradient of the row whose run starts at sorted position i: its part of i's chunk,
    then the partials of the following chunks the run covers (fixed order: deterministic)."""
    chunk = i // CHUNK + 1
    acc = _run_sum(sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr,
                   i, tl.minimum(chunk * CHUNK, num_lookups), key, total_dim, d, d_mask,
                   META_W, BLOCK_L, BLOCK_D)
    at = chunk * CHUNK
    more = tl.load(sorted_key_ptr + at, mask=at < num_lookups, other=-1) == key
    while more:
        acc += tl.load(partial_ptr + chunk * BLOCK_D + d, mask=d_mask, other=0.0)
        chunk += 1
        at = chunk * CHUNK
        more = tl.load(sorted_key_ptr + at, mask=at < num_lookups, other=-1) == key
    return acc


@triton.jit
def _row_gradient_kernel(
    sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr, partial_ptr, grad_ptr,
    num_lookups, total_dim,
    META_W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    key = tl.load(sorted_key_ptr + i)
    prev = tl.load(sorted_key_ptr + i - 1, mask=i > 0, other=-1)
    # Only the first lookup of each distinct row does the work for all of that row's lookups.
    if (i == 0) | (prev != key):
        f0 = tl.load(feature_ptr + tl.load(order_ptr + i))
        dim = tl.load(meta_ptr + f0 * META_W + 0)
        base = tl.load(meta_ptr + f0 * META_W + 1)
        row_base = tl.load(meta_ptr + f0 * META_W + 5)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < dim
        acc = _row_total(sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr,
                         partial_ptr, i, key, num_lookups, total_dim, d, d_mask, META_W, BLOCK_L, BLOCK_D, CHUNK)
        row = key - row_base
        tl.store(grad_ptr + base + row * dim + d, acc.to(grad_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _row_update_kernel(
    sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr, partial_ptr,
    weight_ptr, state1_ptr, state2_ptr, hyper_ptr, step_ptr,
    num_lookups, total_dim,
    META_W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
    OPT: tl.constexpr,
):
    """Backward with the optimizer fused in: one program per distinct row sums its gradient and
    updates the row (and its optimizer state) in place. Same formulas as optim/rows.py."""
    i = tl.program_id(0).to(tl.int64)
    key = tl.load(sorted_key_ptr + i)
    prev = tl.load(sorted_key_ptr + i - 1, mask=i > 0, other=-1)
    if (i == 0) | (prev != key):
        f0 = tl.load(feature_ptr + tl.load(order_ptr + i))
        dim = tl.load(meta_ptr + f0 * META_W + 0)
        base = tl.load(meta_ptr + f0 * META_W + 1)
        row_base = tl.load(meta_ptr + f0 * META_W + 5)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < dim
        g = _row_total(sorted_key_ptr, order_ptr, feature_ptr, bag_ptr, scale_ptr, meta_ptr, grad_out_ptr,
                       partial_ptr, i, key, num_lookups, total_dim, d, d_mask, META_W, BLOCK_L, BLOCK_D, CHUNK)
        at = base + (key - row_base) * dim + d
        w = tl.load(weight_ptr + at, mask=d_mask, other=0.0).to(tl.float32)
        lr = tl.load(hyper_ptr + 0)
        eps = tl.load(hyper_ptr + 1)
        wd = tl.load(hyper_ptr + 4)
        decoupled = tl.load(hyper_ptr + 5)
        g = tl.where(d_mask, g + wd * (1.0 - decoupled) * w, 0.0)
        if OPT == 0:  # SGD
            w_new = w - lr * g
        elif OPT == 1:  # Adagrad: one accumulator per element
            acc = tl.load(state1_ptr + at, mask=d_mask, other=0.0) + g * g
            tl.store(state1_ptr + at, acc, mask=d_mask)
            w_new = w - lr * g / (tl.sqrt(acc) + eps)
        elif OPT == 2:  # row-wise Adagrad: one accumulator per row, indexed by global row
            acc = tl.load(state1_ptr + key) + tl.sum(g * g, axis=0) / dim.to(tl.float32)
            tl.store(state1_ptr + key, acc)
            w_new = w - lr * g / (tl.sqrt(acc) + eps)
        else:  # Adam (sparse: only touched rows' moments move)
            beta1 = tl.load(hyper_ptr + 2)
            beta2 = tl.load(hyper_ptr + 3)
            t = tl.load(step_ptr).to(tl.float32)
            m = beta1 * tl.load(state1_ptr + at, mask=d_mask, other=0.0) + (1.0 - beta1) * g
            v = beta2 * tl.load(state2_ptr + at, mask=d_mask, other=0.0) + (1.0 - beta2) * g * g
            tl.store(state1_ptr + at, m, mask=d_mask)
            tl.store(state2_ptr + at, v, mask=d_mask)
            m_hat = m / (1.0 - tl.exp(t * tl.log(beta1)))
            v_hat = v / (1.0 - tl.exp(t * tl.log(beta2)))
            w_new = w - lr * (m_hat / (tl.sqrt(v_hat) + eps)) - lr * wd * decoupled * w
        tl.store(weight_ptr + at, w_new.to(weight_ptr.dtype.element_ty), mask=d_mask)


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
        block_b = max(1, min(64, 4096 // block_d))
    grid = (num_features, triton.cdiv(batch_size, block_b))
    weights = per_sample_weights if per_sample_weights is not None else flat
    _pooled_forward_kernel[grid](
        flat, values, offsets, weights, feature_meta, key_index, out,
        batch_size, total_dim,
        META_W=META_WIDTH, HAS_WEIGHTS=per_sample_weights is not None, BLOCK_B=block_b, BLOCK_D=block_d,
        num_warps=num_warps or 4,
    )
    return out


def sorted_lookups(values, offsets, per_sample_weights, feature_meta, key_index, batch_size):
    """Lookups ordered by global row (table row base + id); stable, so ties keep input order."""
    lookups = expand_lookups(values, offsets, feature_meta, key_index, batch_size)
    scale = lookup_scale(lookups, per_sample_weights).contiguous()
    row_key = feature_meta[lookups.feature, META_ROW_BASE] + lookups.ids
    sorted_key, order = torch.sort(row_key, stable=True)
    return lookups, scale, sorted_key.contiguous(), order.contiguous()


def _backward_launch_shape(max_dim: int):
    block_d = _block_d(max_dim)
    block_l = max(4, min(64, 2048 // block_d))
    return block_d, block_l, block_l * 16


def _chunk_partials(lookups, scale, sorted_key, order, feature_meta, grad_output, max_dim):
    block_d, block_l, chunk = _backward_launch_shape(max_dim)
    n = sorted_key.numel()
    num_chunks = triton.cdiv(n, chunk)
    partials = torch.empty(num_chunks * block_d, dtype=torch.float32, device=grad_output.device)
    _chunk_partials_kernel[(num_chunks,)](
        sorted_key, order, lookups.feature, lookups.bag, scale, feature_meta, grad_output, partials,
        n, grad_output.shape[1],
        META_W=META_WIDTH, BLOCK_L=block_l, BLOCK_D=block_d, CHUNK=chunk,
    )
    return partials


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
) -> torch.Tensor:
    grad = torch.zeros(total_numel, dtype=dtype, device=grad_output.device)
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return grad
    lookups, scale, sorted_key, order = sorted_lookups(
        values, offsets, per_sample_weights, feature_meta, key_index, batch_size
    )
    n = sorted_key.numel()
    if n == 0:
        return grad
    grad_output = grad_output.contiguous()
    partials = _chunk_partials(lookups, scale, sorted_key, order, feature_meta, grad_output, max_dim)
    block_d, block_l, chunk = _backward_launch_shape(max_dim)
    _row_gradient_kernel[(n,)](
        sorted_key, order, lookups.feature, lookups.bag, scale, feature_meta, grad_output, partials, grad,
        n, grad_output.shape[1],
        META_W=META_WIDTH, BLOCK_L=block_l, BLOCK_D=block_d, CHUNK=chunk,
    )
    return grad


def fused_update(
    grad_output, flat, states, state_is_row, hyper, step, values, offsets, per_sample_weights,
    feature_meta, key_index, batch_size, max_dim, kind,
) -> None:
    if feature_meta.shape[0] == 0 or batch_size == 0:
        return
    lookups, scale, sorted_key, order = sorted_lookups(
        values, offsets, per_sample_weights, feature_meta, key_index, batch_size
    )
    n = sorted_key.numel()
    if n == 0:
        return
    grad_output = grad_output.contiguous()
    partials = _chunk_partials(lookups, scale, sorted_key, order, feature_meta, grad_output, max_dim)
    block_d, block_l, chunk = _backward_launch_shape(max_dim)
    state1 = states[0] if len(states) > 0 else flat
    state2 = states[1] if len(states) > 1 else flat
    _row_update_kernel[(n,)](
        sorted_key, order, lookups.feature, lookups.bag, scale, feature_meta, grad_output, partials,
        flat, state1, state2, hyper, step, n, grad_output.shape[1],
        META_W=META_WIDTH, BLOCK_L=block_l, BLOCK_D=block_d, CHUNK=chunk, OPT=kind,
    )
