"""Triton kernels of the variable-batch expansion (ops/expand_bags.py): each output element from its
bag's pooled row, ``out[b, c] = pooled[inverse[feature(c), b], c]``, and the gradient's sum back.

Forward: a program covers BLOCK_B rows x BLOCK_C columns; an element finds its bag through the
inverse indices of its column's feature (one int64 a row and feature, in L1 across the feature's
columns), so no ``[B, columns]`` index is ever built.

Backward: a segmented sum, deterministic and without atomics (which made the summation order, so
the trained weights, vary from run to run). On the device, with no host synchronisation, one
stable sort of the ``F * B`` int32 keys ``f * num_bags + inverse[f, b]`` groups each feature's rows
by bag, ascending b within a bag, and ``searchsorted`` gives each (feature, bag) its segment of the
sorted order (``bag_segments``). A program owns BLOCK_S bags x BLOCK_C columns and, for the feature
of its columns (each in turn where the block straddles features), adds each bag's rows in
ascending b into fp32 accumulators, then writes every bag row, empty bags as zeros, so the output
needs no memset. Each gradient element is read once and each output element written once, against
a memset of the output and one atomic add a gradient element before; the result is bitwise
reproducible and equals adding each bag's rows in ascending b, starting from zero.

Its costs: the sort and search, a few small launches (F * B keys against B * C gradient floats),
which tiny batches feel most; and a bag's rows are a sequential chain (UNROLL rows in flight at a
time), so a few bags of very many rows each take longer than the atomics did.
The full-batch features' identity inverse indices get no path of their own (it could not be
chosen without a host synchronisation): their keys sort like any, each bag being one row.
"""
import torch
import triton
import triton.language as tl

from .grid_math import cdiv, next_power_of_2

BLOCK_B, BLOCK_C = 16, 128
# The backward's tile holds BACKWARD_TILE elements (8 a thread at 4 warps: ~70 registers on sm_90
# where the sizes are multiples of 16, twice the tile nearly doubles them); a bag's rows are read
# UNROLL at a time, independent loads in flight rather than one round trip each.
BACKWARD_TILE, UNROLL = 1024, 4


@triton.jit
def _tile(inverse_ptr, col_feature_ptr, batch, cols, inverse_stride, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """The program's rows b, columns c, mask, and each element's bag."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (b < batch)[:, None] & (c < cols)[None, :]
    f = tl.load(col_feature_ptr + c, mask=c < cols, other=0).to(tl.int64)
    bag = tl.load(inverse_ptr + f[None, :] * inverse_stride + b[:, None], mask=mask, other=0).to(tl.int64)
    return b, c, mask, bag


@triton.jit
def _expand_forward_kernel(pooled_ptr, inverse_ptr, col_feature_ptr, out_ptr, batch, cols, inverse_stride,
                           BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    b, c, mask, src = _tile(inverse_ptr, col_feature_ptr, batch, cols, inverse_stride, BLOCK_B, BLOCK_C)
    v = tl.load(pooled_ptr + src * cols + c[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + b[:, None] * cols + c[None, :], v, mask=mask)


@triton.jit
def _add_bags(acc, grad_ptr, order_ptr, seg_ptr, f, s, s_ok, c, cols_mask, batch, cols, num_bags,
              UNROLL: tl.constexpr):
    """``acc`` plus, for each bag s, feature f's rows of it in ascending b, at columns ``cols_mask``."""
    key = f * num_bags + s  # < 2**31: backward_fits
    start = tl.load(seg_ptr + key, mask=s_ok, other=0)
    count = tl.load(seg_ptr + key + 1, mask=s_ok, other=0) - start
    max_count = tl.max(count, axis=0)
    f_end = (f + 1) * batch - 1
    # A while loop: the interpreter cannot take a reduced value as a range() bound (numpy >= 2.3).
    k = 0
    while k < max_count:
        # UNROLL rows a bag at once, added in order: their loads are independent, in flight together.
        for u in tl.static_range(UNROLL):
            live = k + u < count
            # Clamped (in bounds for every lane; dead lanes' rows are masked below) rather than
            # masked: a masked form of this load, in an earlier draft, broke Triton 3.6's layout
            # pass for sm_90 when ``cols`` was a multiple of 16; clamped, it also takes fewer registers.
            b = (tl.load(order_ptr + tl.minimum(start + k + u, f_end)) - f.to(tl.int64) * batch).to(tl.int32)
            acc += tl.load(grad_ptr + b.to(tl.int64)[:, None] * cols + c[None, :],
                           mask=live[:, None] & cols_mask[None, :], other=0.0)
        k += UNROLL
    return acc


@triton.jit
def _expand_backward_kernel(grad_ptr, order_ptr, seg_ptr, col_feature_ptr, grad_pooled_ptr, batch, cols, num_bags,
                            BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr):
    """``grad_pooled[s, c]``: the sum of ``grad[b, c]`` over feature(c)'s rows b in bag s, in
    ascending b. ``order`` [F * B]: the flat positions ``f * batch + b`` sorted by (f, bag, b);
    ``seg`` [F * num_bags + 1] int32: where (f, s)'s rows start in it."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s_ok, c_ok = s < num_bags, c < cols
    # Clamped rather than masked: the block's first column exists, so its features are all real.
    feature = tl.load(col_feature_ptr + tl.minimum(c, cols - 1))
    f = tl.min(feature, axis=0)
    f_last = tl.max(feature, axis=0)
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    if f == f_last:  # the block within one feature (always, where dims are multiples of BLOCK_C)
        # its own call: a mask the compiler sees constant along columns lets it load 16 bytes at once
        acc = _add_bags(acc, grad_ptr, order_ptr, seg_ptr, f, s, s_ok, c, c_ok, batch, cols, num_bags, UNROLL)
    else:
        # Each feature in turn: masked-out elements add 0.0, which leaves a sum started at +0.0
        # bitwise unchanged.
        while f <= f_last:
            acc = _add_bags(acc, grad_ptr, order_ptr, seg_ptr, f, s, s_ok, c, c_ok & (feature == f), batch, cols,
                            num_bags, UNROLL)
            f += 1
    tl.store(grad_pooled_ptr + s.to(tl.int64)[:, None] * cols + c[None, :], acc, mask=s_ok[:, None] & c_ok[None, :])


def forward(pooled, inverse, col_feature):
    batch, cols = inverse.shape[1], pooled.shape[1]
    out = torch.empty(batch, cols, dtype=pooled.dtype, device=pooled.device)
    if batch and cols:
        _expand_forward_kernel[(cdiv(batch, BLOCK_B), cdiv(cols, BLOCK_C))](
            pooled, inverse, col_feature, out, batch, cols, inverse.stride(0), BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C,
            num_warps=4)
    return out


def backward_fits(features, batch, num_bags):
    """Whether the backward's int32 keys and positions hold ``F * num_bags`` bags and ``F * B`` rows
    (with a block's margin); beyond, ops/expand_bags.py takes torch's scatter-add."""
    return features * (max(batch, num_bags) + 1) + BACKWARD_TILE < 2**31


def bag_segments(inverse, num_bags):
    """``(order, seg)`` for the backward, by device ops only (no host synchronisation): ``order``
    [F * B] int64, the flat positions ``f * B + b`` sorted stably by the key
    ``f * num_bags + inverse[f, b]``, so by feature, then bag, then ascending b; ``seg``
    [F * num_bags + 1] int32, where each key's rows start in ``order`` (a bag's end: the next entry)."""
    features = inverse.shape[0]
    keys_end = features * num_bags
    # int32 keys (backward_fits): a radix sort makes half the passes of int64's.
    keys = torch.empty(inverse.shape, dtype=torch.int32, device=inverse.device)
    torch.add(inverse, torch.arange(0, keys_end, num_bags, dtype=torch.int32, device=inverse.device)[:, None], out=keys)
    sorted_keys, order = torch.sort(keys.view(-1), stable=True)
    seg = torch.searchsorted(sorted_keys, torch.arange(keys_end + 1, dtype=torch.int32, device=inverse.device),
                             out_int32=True)
    return order, seg


def backward_blocks(cols, features):
    """(BLOCK_S, BLOCK_C) of the backward: the column block near the mean feature dim, 16 to 128, so
    that few blocks hold several features."""
    block_c = max(16, min(128, next_power_of_2(cdiv(cols, max(features, 1)))))
    return BACKWARD_TILE // block_c, block_c


def backward(grad, inverse, col_feature, num_bags):
    """fp32 ``grad`` [B, C] (contiguous): the pooled rows' gradient [num_bags, C], each bag's rows
    summed in ascending b: deterministic, no atomics. Needs ``backward_fits``."""
    batch, cols = grad.shape
    features = inverse.shape[0]
    grad_pooled = torch.empty(num_bags, cols, dtype=torch.float32, device=grad.device)
    if not (num_bags and cols):
        return grad_pooled
    if not batch:
        return grad_pooled.zero_()
    order, seg = bag_segments(inverse, num_bags)
    block_s, block_c = backward_blocks(cols, features)
    # Bag blocks on grid axis 0 (up to 2**31 - 1); column blocks on axis 1 (65535: C < 1M).
    _expand_backward_kernel[(cdiv(num_bags, block_s), cdiv(cols, block_c))](
        grad, order, seg, col_feature, grad_pooled, batch, cols, num_bags,
        BLOCK_S=block_s, BLOCK_C=block_c, UNROLL=UNROLL, num_warps=4)
    return grad_pooled
