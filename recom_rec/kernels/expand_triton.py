"""Triton kernels of the variable-batch expansion (ops/expand_bags.py): each output element from its
bag's pooled row, ``out[b, c] = pooled[inverse[feature(c), b], c]``, and the gradient's scatter back.

A program covers BLOCK_B rows x BLOCK_C columns; an element finds its bag through the inverse
indices of its column's feature (one int64 a row and feature, in L1 across the feature's columns),
so no ``[B, columns]`` index is ever built.
"""
import torch
import triton
import triton.language as tl

from .grid_math import cdiv

BLOCK_B, BLOCK_C = 16, 128


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
def _expand_backward_kernel(grad_ptr, inverse_ptr, col_feature_ptr, grad_pooled_ptr, batch, cols, inverse_stride,
                            BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    b, c, mask, src = _tile(inverse_ptr, col_feature_ptr, batch, cols, inverse_stride, BLOCK_B, BLOCK_C)
    g = tl.load(grad_ptr + b[:, None] * cols + c[None, :], mask=mask, other=0.0)
    tl.atomic_add(grad_pooled_ptr + src * cols + c[None, :], g, mask=mask)


def forward(pooled, inverse, col_feature):
    batch, cols = inverse.shape[1], pooled.shape[1]
    out = torch.empty(batch, cols, dtype=pooled.dtype, device=pooled.device)
    if batch and cols:
        _expand_forward_kernel[(cdiv(batch, BLOCK_B), cdiv(cols, BLOCK_C))](
            pooled, inverse, col_feature, out, batch, cols, inverse.stride(0), BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C,
            num_warps=4)
    return out


def backward(grad, inverse, col_feature, num_bags):
    """fp32 ``grad``: the pooled rows' gradient, summed by fp32 atomics."""
    batch, cols = grad.shape
    grad_pooled = torch.zeros(num_bags, cols, dtype=torch.float32, device=grad.device)
    if batch and cols:
        _expand_backward_kernel[(cdiv(batch, BLOCK_B), cdiv(cols, BLOCK_C))](
            grad, inverse, col_feature, grad_pooled, batch, cols, inverse.stride(0),
            BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C, num_warps=4)
    return grad_pooled
