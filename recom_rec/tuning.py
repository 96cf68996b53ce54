"""``recom_rec.tune(model, batches)``: the measured kernel choices made ahead of time.

The GPU kernels' choices are measured per shape on a shape's first calls (kernels/launch_tuner.py).
``tune`` runs those calls itself, on batches like the ones the model will see, until no call is a
trial any more, so that the first real request or training step already runs the chosen kernels.
With ``RECOM_REC_CACHE`` set the decisions also go to that file (kernels/decision_cache.py), which
later processes and every rank read instead of measuring again.
"""
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor



def _outputs(result: Any):
    """The float tensors a model returned (tensors, KeyedTensors, JaggedTensors, in dicts, lists, tuples)."""
    if isinstance(result, torch.Tensor):
        if result.is_floating_point() and result.requires_grad:
            yield result
    elif isinstance(result, KeyedTensor):
        yield from _outputs(result.values())
    elif isinstance(result, JaggedTensor):
        yield from _outputs(result.values())
    elif isinstance(result, dict):
        for value in result.values():
            yield from _outputs(value)
    elif isinstance(result, (list, tuple)):
        for value in result:
            yield from _outputs(value)


def _call(model: nn.Module, batch: Any):
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def tune(model: nn.Module, batches: Iterable[Any], *, train: bool = False,
         call: Optional[Callable[[nn.Module, Any], Any]] = None, max_passes: int = 100) -> Dict[str, int]:
    """Runs ``model`` on ``batches`` (each ``model(batch)``, a tuple ``model(*batch)``, or
    ``call(model, batch)``) pass after pass until a pass makes no trial launch, at most
    ``max_passes`` passes. ``train=True`` also runs the backward (with the fused optimizers' update,
    whose paths are measured too) and puts the model's parameters, buffers and fused-optimizer
    state back afterwards (a copy of them is held in host memory meanwhile). Returns
    ``{"passes": ..., "trial_launches": ...}``. On the CPU (no measured choices) one pass runs."""
    from .kernels.launch_tuner import unpaced_trials
    from .kernels.selection import trial_launches  # (the kernels' modules load on first use)

    batches = list(batches)
    call = call or _call
    saved = None
    if train and any(getattr(m, "_ps", None) is not None for m in model.modules()):
        raise ValueError("tune(train=True) would write parameter-server tables' rows to their store; tune them "
                         "with train=False, or on a copy of the model without ps=...")
    if train:
        # The state_dict holds the fused optimizers' state too (the tables' views of it, the step).
        saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict(keep_vars=True).items()
                 if isinstance(v, torch.Tensor)}
    started = trial_launches()
    passes = 0
    try:
        with unpaced_trials():  # (tuning ahead of time: the trials back to back, not paced by the calls)
            passes = _passes(model, batches, call, train, max_passes, trial_launches)
    finally:
        if saved is not None:
            with torch.no_grad():
                for key, value in model.state_dict(keep_vars=True).items():
                    if key in saved:
                        value.copy_(saved[key])
            for p in model.parameters():
                p.grad = None
    return {"passes": passes, "trial_launches": trial_launches() - started}


def _passes(model: nn.Module, batches: List[Any], call: Callable[[nn.Module, Any], Any], train: bool, max_passes: int,
            trial_launches: Callable[[], int]) -> int:
    """Passes over ``batches`` until one makes no trial launch (at most ``max_passes``); their count."""
    passes = 0
    for passes in range(1, max_passes + 1):
        before = trial_launches()
        for batch in batches:
            if train:
                outputs = list(_outputs(call(model, batch)))
                if outputs:
                    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
            else:
                with torch.no_grad():
                    call(model, batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the trials' timing events finish: the next pass reads them
        if trial_launches() == before:
            break
    return passes
