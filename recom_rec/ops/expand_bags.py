"""The variable-batch expansion as torch custom ops: ``recom_rec::expand_bags`` gives each output row
its bag's pooled row by the KJT's inverse indices, feature by feature
(``out[b, c] = pooled[inverse[feature(c), b], c]``); its backward adds each row's gradient to its
bag (``expand_bags_backward``). On CUDA the Triton kernels (kernels/expand_triton.py; eagerly the
CUDA extension's where the lookup runs on it, csrc/lookup/expand.cu), elsewhere
torch's gather and scatter-add, which are also their reference.
"""
from functools import lru_cache
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor


@lru_cache(maxsize=None)
def _triton():
    from ..kernels import expand_triton

    return expand_triton


def _rows(inverse: Tensor, col_feature: Tensor) -> Tensor:
    return inverse.index_select(0, col_feature.to(torch.int64)).t()


def _expand(pooled: Tensor, inverse: Tensor, col_feature: Tensor) -> Tensor:
    if pooled.is_cuda and pooled.dtype != torch.float64:
        return _triton().forward(pooled, inverse, col_feature)
    return pooled.gather(0, _rows(inverse, col_feature))


def _expand_backward(grad: Tensor, inverse: Tensor, col_feature: Tensor, num_bags: int) -> Tensor:
    if grad.is_cuda and grad.dtype == torch.float32:  # (the kernel adds in fp32 atomics)
        return _triton().backward(grad, inverse, col_feature, num_bags)
    out = torch.zeros(num_bags, grad.shape[1], dtype=grad.dtype, device=grad.device)
    return out.scatter_add_(0, _rows(inverse, col_feature), grad)


@torch.library.custom_op("recom_rec::expand_bags", mutates_args=())
def expand_bags(pooled: Tensor, inverse: Tensor, col_feature: Tensor) -> Tensor:
    """``[B, C]`` from ``pooled [S, C]``: ``inverse [F, B]`` (int64) is each feature's bag of each
    output row, ``col_feature [C]`` each column's feature."""
    return _expand(pooled, inverse, col_feature)


@expand_bags.register_fake
def _(pooled, inverse, col_feature):
    return pooled.new_empty((inverse.shape[1], pooled.shape[1]))


@torch.library.custom_op("recom_rec::expand_bags_backward", mutates_args=())
def expand_bags_backward(grad: Tensor, inverse: Tensor, col_feature: Tensor, num_bags: int) -> Tensor:
    """``[num_bags, C]``: each output row's gradient added to its bag's row."""
    return _expand_backward(grad, inverse, col_feature, num_bags)


@expand_bags_backward.register_fake
def _(grad, inverse, col_feature, num_bags):
    return grad.new_empty((num_bags, grad.shape[1]))


def _setup(ctx, inputs, output):
    pooled, inverse, col_feature = inputs
    ctx.save_for_backward(inverse, col_feature)
    ctx.num_bags = pooled.shape[0]


def _backward(ctx, grad):
    inverse, col_feature = ctx.saved_tensors
    return expand_bags_backward(grad, inverse, col_feature, ctx.num_bags), None, None


expand_bags.register_autograd(_backward, setup_context=_setup)


# ---- eager fast path ----------------------------------------------------------------------------
# The custom ops' Python layers (pytree, alias checks, redispatch, the generated autograd node) cost
# the VBE step ~0.4 ms of host time on the H200 machine, more than the expansion's kernels
# (perf-notes v53: the step was host-bound). Plain eager calls run the same bodies through a
# torch.autograd.Function, as the lookup does (pooled_embedding._EagerLookup); compiled, traced,
# scripted, fake and dispatch-mode code keeps the registered ops. With ``dims_gcd`` > 0 (the
# output's dims' greatest common divisor) the CUDA extension's kernels run it (csrc/lookup/expand.cu):
# one C++ call each way instead of Triton's Python launches and torch's fills (perf-notes v54).
# A module of one table group runs the expansion inside the lookup's own autograd node instead
# (pooled_embedding.pooled_lookup with an Expansion): one node fewer a step.
class Expansion(NamedTuple):
    """An eager expansion's arguments: ``inverse [F, B]`` (int64), ``col_feature [C]``, ``dims_gcd``
    (> 0: the CUDA extension's kernels), ``check`` (the GPU's input check: each output feature's
    bags in this batch and the input_check.KernelReport to report an inverse index outside them to,
    or None) and ``bags`` (each output feature's bags in this batch, int64 on the device, where
    ``dims_gcd`` > 0; else None)."""

    inverse: Tensor
    col_feature: Tensor
    dims_gcd: int
    check: Optional[tuple]
    bags: Optional[Tensor] = None

    def forward(self, pooled: Tensor, owned: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """(``[B, C]`` from ``pooled [S, C]``, the moved flags for ``backward`` or None), without
        autograd: the caller's node records it. ``owned``: ``pooled`` is the caller's own, which the
        CUDA kernels may expand in place where S == B (csrc/lookup/expand.cu)."""
        inverse, col_feature, dims_gcd, check, bags = self
        if dims_gcd:
            whole = dims_gcd * pooled.element_size() % 16 == 0
            claim, words = (check[1].claim, check[1].words) if check is not None else (None, None)
            if owned and bags is not None and pooled.shape[0] == inverse.shape[1] and pooled.is_contiguous():
                return _cuda_ext().expand_rows_forward_in_place(pooled, inverse.contiguous(), col_feature, bags, whole,
                                                                claim, words)
            limits = check[0] if check is not None else None
            return _cuda_ext().expand_rows_forward(pooled.contiguous(), inverse.contiguous(), col_feature, whole,
                                                   limits, claim, words), None
        if check is not None and pooled.is_cuda and pooled.dtype != torch.float64:
            return _triton().forward(pooled, inverse, col_feature, check), None
        return _expand(pooled, inverse, col_feature), None

    def backward(self, grad: Tensor, num_bags: int, moved: Optional[Tensor] = None) -> Tensor:
        """``[num_bags, C]``: each output row's gradient added to its bag's row (``moved``: forward's)."""
        inverse, col_feature, dims_gcd = self.inverse, self.col_feature, self.dims_gcd
        if dims_gcd and grad.dtype == torch.float32:
            return _cuda_ext().expand_rows_backward(grad.contiguous(), inverse.contiguous(), col_feature, num_bags,
                                                    dims_gcd % 4 == 0, moved)
        return _expand_backward(grad, inverse, col_feature, num_bags)


class _EagerExpandBags(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pooled, inverse, col_feature, dims_gcd, check):
        ctx.save_for_backward(inverse, col_feature)
        ctx.num_bags = pooled.shape[0]
        ctx.dims_gcd = dims_gcd
        return Expansion(inverse, col_feature, dims_gcd, check).forward(pooled)[0]

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the op has no double backward either)
    def backward(ctx, grad):
        inverse, col_feature = ctx.saved_tensors
        return Expansion(inverse, col_feature, ctx.dims_gcd, None).backward(grad, ctx.num_bags), None, None, None, None


_apply = super(torch.autograd.Function, _EagerExpandBags).apply


@lru_cache(maxsize=None)
def _cuda_ext():
    from ..kernels import cuda_ext

    return cuda_ext.extension()


def eager_expand_bags(pooled: Tensor, inverse: Tensor, col_feature: Tensor, dims_gcd: int = 0,
                      check=None) -> Tensor:
    """``expand_bags`` through the C apply (Function.apply's Python layer unwraps every argument);
    only ``inverse``, from the user's KJT, can be a finished functorch transform's dead wrapper:
    ``pooled`` is the lookup's output and ``col_feature`` the module's. ``dims_gcd`` > 0: on the
    CUDA extension's kernels (the caller has checked that it builds). ``check``: (limits, report),
    the GPU kernels' input check (CUDA tensors only)."""
    return _apply(pooled, torch._C._functorch.unwrap_if_dead(inverse), col_feature, dims_gcd, check)
