"""Triton kernels of the variable-batch expansion (ops/expand_bags.py): each output element from its
bag's pooled row, ``out[b, c] = pooled[inverse[feature(c), b], c]``, and the gradient's scatter back.

A program covers BLOCK_B rows x BLOCK_C columns; an element finds its bag through the inverse
indices of its column's feature (one int64 a row and feature, in L1 across the feature's columns),
so no ``[B, columns]`` index is ever built.

The backward adds rows to bags with fp32 atomics, except for a feature whose inverse indices are
the identity (a feature at the full batch: torchrec's VBE gives those ``arange(B)``), whose rows are
its bags: they are stored, at a plain store's cost (perf-notes v47). A small kernel finds those
features on the device (no sync).
"""
import torch
import triton
import triton.language as tl

from .grid_math import cdiv
from .pooled_triton import _report

BLOCK_B, BLOCK_C = 16, 128
MOVED_BLOCK = 1024


@triton.jit
def _tile(inverse_ptr, col_feature_ptr, batch, cols, inverse_stride, num_bags, BLOCK_B: tl.constexpr,
          BLOCK_C: tl.constexpr):
    """The program's rows b, columns c, mask, each column's feature f, each element's bag (a bag
    outside [0, num_bags) reads bag 0: the reads stay in bounds whatever the inverse indices hold)
    and its inverse index as given."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (b < batch)[:, None] & (c < cols)[None, :]
    f = tl.load(col_feature_ptr + c, mask=c < cols, other=0).to(tl.int64)
    bag = tl.load(inverse_ptr + f[None, :] * inverse_stride + b[:, None], mask=mask, other=0).to(tl.int64)
    return b, c, mask, f, tl.where((bag >= 0) & (bag < num_bags), bag, 0), bag


# The batch, the inverse indices' row stride (the batch too) and the bags change with every batch:
# not specialized on (pooled_triton.BATCH_COUNTS says why), so a stream of batch sizes compiles one
# variant.
@triton.jit(do_not_specialize=["batch", "inverse_stride", "num_bags"])
def _expand_forward_kernel(pooled_ptr, inverse_ptr, col_feature_ptr, out_ptr, batch, cols, inverse_stride, num_bags,
                           limit_ptr, claim_ptr, report_ptr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
                           CHECK: tl.constexpr):
    b, c, mask, f, src, bag = _tile(inverse_ptr, col_feature_ptr, batch, cols, inverse_stride, num_bags, BLOCK_B,
                                    BLOCK_C)
    v = tl.load(pooled_ptr + src * cols + c[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + b[:, None] * cols + c[None, :], v, mask=mask)
    if CHECK:
        _report_bad_bags(limit_ptr, claim_ptr, report_ptr, b, mask, f, bag, BLOCK_B, BLOCK_C)


@triton.jit
def _report_bad_bags(limit_ptr, claim_ptr, report_ptr, b, mask, f, bag, BLOCK_B: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """The input check (ops/input_check.py): reports the program's first element whose inverse
    index lies outside its feature's bags in this batch, ``[0, limit[f])`` (an index past a
    feature's own bags but inside the padded ones reads an empty bag: not out of bounds, but not
    the user's row either)."""
    limit = tl.broadcast_to(tl.load(limit_ptr + f).to(tl.int64)[None, :], (BLOCK_B, BLOCK_C))
    bad = mask & ((bag < 0) | (bag >= limit))
    if tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0:
        at = tl.arange(0, BLOCK_B)[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        pick = at == tl.min(tl.min(tl.where(bad, at, BLOCK_B * BLOCK_C), axis=1), axis=0)
        _report(claim_ptr, report_ptr, tl.full([], 4, tl.int64),
                _pick(pick, tl.broadcast_to(f[None, :], (BLOCK_B, BLOCK_C))),
                _pick(pick, tl.broadcast_to(b[:, None], (BLOCK_B, BLOCK_C))), _pick(pick, bag), _pick(pick, limit),
                tl.full([], -1, tl.int64))


@triton.jit
def _pick(pick, x):
    """The element of ``x`` where ``pick`` (one element) is set."""
    return tl.sum(tl.sum(tl.where(pick, x, 0), axis=1), axis=0)


@triton.jit(do_not_specialize=["batch", "inverse_stride"])
def _moved_features_kernel(inverse_ptr, moved_ptr, batch, inverse_stride, BLOCK: tl.constexpr):
    """moved[f] = 1 where some row b of feature f takes a bag other than b (moved starts at 0)."""
    f = tl.program_id(1)
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = b < batch
    bag = tl.load(inverse_ptr + f * inverse_stride + b, mask=live, other=0).to(tl.int64)
    moved = tl.max(((bag != b) & live).to(tl.int32), axis=0)
    tl.store(moved_ptr + f, moved, mask=moved > 0)  # every writer writes 1


@triton.jit(do_not_specialize=["batch", "inverse_stride", "num_bags"])
def _expand_backward_kernel(grad_ptr, inverse_ptr, col_feature_ptr, moved_ptr, grad_pooled_ptr, batch, cols,
                            inverse_stride, num_bags, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    b, c, mask, f, src, _ = _tile(inverse_ptr, col_feature_ptr, batch, cols, inverse_stride, num_bags, BLOCK_B,
                                  BLOCK_C)
    g = tl.load(grad_ptr + b[:, None] * cols + c[None, :], mask=mask, other=0.0)
    summed = (tl.load(moved_ptr + f, mask=c < cols, other=1) != 0)[None, :]
    # an identity feature's row b is its bag b and no other row adds to it: a store, same bits
    tl.atomic_add(grad_pooled_ptr + src * cols + c[None, :], g, mask=mask & summed)
    tl.store(grad_pooled_ptr + src * cols + c[None, :], g, mask=mask & ~summed)


def forward(pooled, inverse, col_feature, check=None):
    """``check``: (``limits``, report), each output feature's bags in this batch (int64 ``[F]``) and
    the input_check.KernelReport an inverse index outside them is reported to (read either way
    as without the check)."""
    # (the kernels step along a feature's inverse indices by one: a strided view is made dense)
    pooled, inverse, col_feature = pooled.contiguous(), inverse.contiguous(), col_feature.contiguous()
    batch, cols = inverse.shape[1], pooled.shape[1]
    out = torch.empty(batch, cols, dtype=pooled.dtype, device=pooled.device)
    if batch and cols and pooled.shape[0]:
        _expand_forward_kernel[(cdiv(batch, BLOCK_B), cdiv(cols, BLOCK_C))](
            pooled, inverse, col_feature, out, batch, cols, inverse.stride(0), pooled.shape[0],
            *((check[0], check[1].claim, check[1].words) if check is not None else (out, out, out)),
            BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C, CHECK=check is not None, num_warps=4)
    elif batch and cols:  # (no bags at all: every row reads nothing)
        out.zero_()
    return out


def backward(grad, inverse, col_feature, num_bags):
    """fp32 ``grad``: the pooled rows' gradient, summed by fp32 atomics."""
    batch, cols = grad.shape
    grad, inverse, col_feature = grad.contiguous(), inverse.contiguous(), col_feature.contiguous()
    grad_pooled = torch.zeros(num_bags, cols, dtype=torch.float32, device=grad.device)
    if batch and cols and num_bags:
        moved = torch.zeros(inverse.shape[0], dtype=torch.int32, device=grad.device)
        _moved_features_kernel[(cdiv(batch, MOVED_BLOCK), inverse.shape[0])](
            inverse, moved, batch, inverse.stride(0), BLOCK=MOVED_BLOCK, num_warps=4)
        _expand_backward_kernel[(cdiv(batch, BLOCK_B), cdiv(cols, BLOCK_C))](
            grad, inverse, col_feature, moved, grad_pooled, batch, cols, inverse.stride(0), num_bags,
            BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C, num_warps=4)
    return grad_pooled
