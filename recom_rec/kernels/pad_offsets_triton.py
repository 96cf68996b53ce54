"""Triton kernel of the variable-batch padding (ops/variable_batch.py): a VBE KJT's offsets padded so
that each of its K keys has ``width`` bags, the missing ones empty at the key's end.

Padded position ``p = k * width + i`` takes ``offsets[first[k] + min(i, s_k)]`` (``first[k]``: the
bags before key k, ``s_k``: key k's bags), the last one (``p = K * width``) ``offsets[bags]``. One
gather from the KJT's own offsets: the padding in one launch, where building padded lengths and
summing them took about eight small ops, each a launch and an allocation of host time (the VBE
step is host-bound, perf-notes v53).
"""
import torch
import triton
import triton.language as tl

from .grid_math import cdiv

BLOCK = 1024


# The width (the largest key's bags), the bags and the padded offsets' count change with every
# batch: not specialized on (pooled_triton.BATCH_COUNTS says why). The key count is the model's.
@triton.jit(do_not_specialize=["width", "bags", "n"])
def _pad_offsets_kernel(offsets_ptr, per_key_ptr, out_ptr, num_keys, width, bags, n, BLOCK: tl.constexpr):
    """``n = num_keys * width + 1`` offsets; ``per_key``: int64 ``[first; strides]``, ``2 * num_keys``."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = p < n
    in_key = p < n - 1  # (the last offset is every bag's end)
    k = p // tl.maximum(width, 1)  # (width 0: the one position is the last)
    i = p - k * width
    first = tl.load(per_key_ptr + k, mask=in_key, other=0)
    stride = tl.load(per_key_ptr + num_keys + k, mask=in_key, other=0)
    src = tl.where(in_key, first + tl.minimum(i, stride), bags)
    tl.store(out_ptr + p, tl.load(offsets_ptr + src, mask=live, other=0), mask=live)


def pad_offsets(offsets: torch.Tensor, per_key: torch.Tensor, width: int, bags: int) -> torch.Tensor:
    """``[K * width + 1]`` padded offsets, ``offsets``' dtype; ``per_key``: int64 ``[2, K]`` (or
    ``[2 * K]``, contiguous), the keys' first bags and then their bag counts; ``bags``: their sum."""
    offsets = offsets.contiguous()
    num_keys = per_key.numel() // 2
    n = num_keys * width + 1
    out = torch.empty(n, dtype=offsets.dtype, device=offsets.device)
    _pad_offsets_kernel[(cdiv(n, BLOCK),)](offsets, per_key, out, num_keys, width, bags, n, BLOCK=BLOCK,
                                           num_warps=4)
    return out
