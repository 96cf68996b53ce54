"""torchrec's view of an optimizer fused into the backward: a ``KeyedOptimizer``.

The update itself happens in the backward kernel, so ``step()`` and ``zero_grad()`` do nothing;
what this object offers is the torchrec contract around it: ``state`` keyed by parameter,
``state_dict``/``load_state_dict`` (tensors are copied into the fused state in place), and
``param_groups`` whose ``lr`` (and other hyper-parameters) an lr scheduler may change.
"""
from typing import Any, Dict, Mapping

import torch
from torchrec.optim.keyed import KeyedOptimizer

from .spec import HYPER_BETA1, HYPER_BETA2, HYPER_KEYS, FusedOptimizerSpec


class _HyperParamGroup(dict):
    """A param group whose hyper-parameter writes go straight to the device tensor the kernels
    read (so ``group["lr"] = x`` from a scheduler takes effect on the next backward)."""

    def __init__(self, values: Mapping[str, Any], hyper: torch.Tensor) -> None:
        super().__init__()
        self._hyper = hyper
        for k, v in values.items():
            self[k] = v

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        hyper = self.__dict__.get("_hyper")
        if hyper is None:
            return
        with torch.no_grad():
            if key in HYPER_KEYS:
                hyper[HYPER_KEYS[key]].fill_(float(value))
            elif key == "betas":
                hyper[HYPER_BETA1].fill_(float(value[0]))
                hyper[HYPER_BETA2].fill_(float(value[1]))

    def __deepcopy__(self, memo):
        # Saved param groups are plain dicts (KeyedOptimizer deep-copies their values).
        return {k: v for k, v in self.items()}


class FusedEmbeddingOptimizer(KeyedOptimizer):
    def __init__(self, spec: FusedOptimizerSpec, params: Dict[str, torch.nn.Parameter],
                 state: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]], hyper: torch.Tensor) -> None:
        group = _HyperParamGroup({**spec.param_group(), "params": list(params.values())}, hyper)
        super().__init__(params, state, [group])
        self.spec = spec

    def step(self, closure: Any = None) -> None:
        """Nothing to do: the rows were updated in the backward pass."""
        if closure is not None:
            closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: fused tables never hold a ``.grad``."""
