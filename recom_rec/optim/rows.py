"""The fused optimizers' row update, in torch (the CPU path and the reference for the Triton
kernel, which implements the same formulas per row).

All tensors are ``[U, maxD]`` rows padded to the widest table; ``mask`` marks real columns.
Hyper-parameters stay tensors on the device, so nothing here syncs with the host.
"""
from typing import List

import torch

from .spec import (
    HYPER_BETA1,
    HYPER_BETA2,
    HYPER_DECOUPLED,
    HYPER_EPS,
    HYPER_LR,
    HYPER_WEIGHT_DECAY,
    OPT_ADAGRAD,
    OPT_ADAM,
    OPT_ROWWISE_ADAGRAD,
    OPT_SGD,
)


def update_rows(kind: int, weights: torch.Tensor, grads: torch.Tensor, mask: torch.Tensor, dims: torch.Tensor,
                states: List[torch.Tensor], hyper: torch.Tensor, step: torch.Tensor):
    """Returns (new weights, new states) for the touched rows. ``step`` is the 1-based count
    of fused backward passes so far (Adam's bias correction)."""
    lr, eps = hyper[HYPER_LR], hyper[HYPER_EPS]
    wd, decoupled = hyper[HYPER_WEIGHT_DECAY], hyper[HYPER_DECOUPLED]
    grads = torch.where(mask, grads + wd * (1 - decoupled) * weights, torch.zeros_like(grads))
    if kind == OPT_SGD:
        return weights - lr * grads, []
    if kind == OPT_ADAGRAD:
        (acc,) = states
        acc = acc + grads * grads
        return weights - lr * grads / (acc.sqrt() + eps), [acc]
    if kind == OPT_ROWWISE_ADAGRAD:
        (acc,) = states
        acc = acc + (grads * grads).sum(1) / dims.to(grads.dtype)
        # the step a row, lr / (sqrt(acc) + eps), as fbgemm computes it (its `multiplier`)
        return weights - (lr / (acc.sqrt() + eps))[:, None] * grads, [acc]
    if kind == OPT_ADAM:
        exp_avg, exp_avg_sq = states
        beta1, beta2 = hyper[HYPER_BETA1], hyper[HYPER_BETA2]
        exp_avg = beta1 * exp_avg + (1 - beta1) * grads
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grads * grads
        t = step.to(torch.float32)
        m_hat = exp_avg / (1 - beta1 ** t)
        v_hat = exp_avg_sq / (1 - beta2 ** t)
        new = weights - lr * (m_hat / (v_hat.sqrt() + eps)) - lr * wd * decoupled * weights
        return new, [exp_avg, exp_avg_sq]
    raise ValueError(f"unknown fused optimizer kind {kind}")
