"""Which optimizers the fused backward applies, and how torch/torchrec optimizers map to them.

Fused = applied row by row, inside the backward kernel, to the rows a batch touched, after
summing the gradients of duplicate ids (fbgemm's "exact" optimizers). Rows a batch did not touch
do not move, and neither does their state (so Adam here is fbgemm's sparse Adam, not torch's
dense Adam, whose untouched moments decay every step).
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

OPT_SGD = 0
OPT_ADAGRAD = 1
OPT_ROWWISE_ADAGRAD = 2
OPT_ADAM = 3

# Layout of the hyper-parameter tensor the kernels read (a tensor, so that changing the rate
# through param_groups needs neither a recompile nor a host sync).
HYPER_LR, HYPER_EPS, HYPER_BETA1, HYPER_BETA2, HYPER_WEIGHT_DECAY, HYPER_DECOUPLED = range(6)
HYPER_SIZE = 8
HYPER_KEYS = {"lr": HYPER_LR, "eps": HYPER_EPS, "beta1": HYPER_BETA1, "beta2": HYPER_BETA2,
              "weight_decay": HYPER_WEIGHT_DECAY}

SUPPORTED = ("torch.optim.SGD (momentum=0)", "torch.optim.Adagrad", "torchrec.optim.RowWiseAdagrad",
             "torch.optim.Adam", "torch.optim.AdamW", "or by name: sgd, adagrad, rowwise_adagrad, adam, adamw")


@dataclass(frozen=True)
class FusedOptimizerSpec:
    kind: int
    lr: float
    eps: float = 1e-10
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False  # AdamW / fbgemm Adam: w -= lr * wd * w
    initial_accumulator_value: float = 0.0

    @property
    def name(self) -> str:
        return {OPT_SGD: "sgd", OPT_ADAGRAD: "adagrad", OPT_ROWWISE_ADAGRAD: "rowwise_adagrad",
                OPT_ADAM: "adamw" if self.decoupled_weight_decay else "adam"}[self.kind]

    def state_names(self) -> List[Tuple[str, str]]:
        """(name, "element" | "row") for each state tensor: per weight element or per row."""
        return {
            OPT_SGD: [],
            OPT_ADAGRAD: [("sum", "element")],
            OPT_ROWWISE_ADAGRAD: [("sum", "row")],
            OPT_ADAM: [("exp_avg", "element"), ("exp_avg_sq", "element")],
        }[self.kind]

    def initial_value(self, state: str) -> float:
        """What a row's state ``state`` (one of state_names) starts at: Adagrad's initial
        accumulator for "sum", zero for Adam's moments."""
        return self.initial_accumulator_value if state == "sum" else 0.0

    def hyper_tensor(self, device) -> torch.Tensor:
        h = torch.zeros(HYPER_SIZE, dtype=torch.float32)
        h[HYPER_LR], h[HYPER_EPS] = self.lr, self.eps
        h[HYPER_BETA1], h[HYPER_BETA2] = self.beta1, self.beta2
        h[HYPER_WEIGHT_DECAY] = self.weight_decay
        h[HYPER_DECOUPLED] = float(self.decoupled_weight_decay)
        return h.to(device)

    def param_group(self) -> Dict[str, Any]:
        group = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.kind in (OPT_ADAGRAD, OPT_ROWWISE_ADAGRAD, OPT_ADAM):
            group["eps"] = self.eps
        if self.kind == OPT_ADAM:
            group["betas"] = (self.beta1, self.beta2)
        return group


def _unsupported(what: str, why: str) -> ValueError:
    return ValueError(f"{what} cannot be fused into the backward ({why}); fused optimizers: "
                      + ", ".join(SUPPORTED))


def _reject(kwargs: Dict[str, Any], name: str, **defaults: Any) -> None:
    for key, default in defaults.items():
        if kwargs.get(key, default) != default:
            raise _unsupported(f"{name}({key}={kwargs[key]!r})", f"{key} is not fused")


def spec_from_optimizer(optimizer_class: Any, kwargs: Dict[str, Any]) -> FusedOptimizerSpec:
    """Maps an optimizer class (as given to ``apply_optimizer_in_backward``) or a name."""
    kw = dict(kwargs)
    name = optimizer_class if isinstance(optimizer_class, str) else getattr(optimizer_class, "__name__", "")
    module = "" if isinstance(optimizer_class, str) else getattr(optimizer_class, "__module__", "")
    key = name.lower()
    lr = float(kw.get("lr", 0.01 if key != "sgd" else kw.get("lr", 1e-3)))
    wd = float(kw.get("weight_decay", 0.0))
    if key == "sgd" and (isinstance(optimizer_class, str) or module.startswith("torch.optim")):
        _reject(kw, "SGD", momentum=0, dampening=0, nesterov=False, maximize=False)
        return FusedOptimizerSpec(OPT_SGD, lr=lr, weight_decay=wd)
    if key == "adagrad" and (isinstance(optimizer_class, str) or module.startswith("torch.optim")):
        _reject(kw, "Adagrad", lr_decay=0, maximize=False)
        return FusedOptimizerSpec(OPT_ADAGRAD, lr=lr, eps=float(kw.get("eps", 1e-10)), weight_decay=wd,
                                  initial_accumulator_value=float(kw.get("initial_accumulator_value", 0.0)))
    if key in ("rowwiseadagrad", "rowwise_adagrad"):
        _reject(kw, "RowWiseAdagrad", lr_decay=0)
        return FusedOptimizerSpec(OPT_ROWWISE_ADAGRAD, lr=lr, eps=float(kw.get("eps", 1e-10)), weight_decay=wd,
                                  initial_accumulator_value=float(kw.get("initial_accumulator_value", 0.0)))
    if key in ("adam", "adamw") and (isinstance(optimizer_class, str) or module.startswith("torch.optim")):
        _reject(kw, name, amsgrad=False, maximize=False)
        beta1, beta2 = kw.get("betas", (0.9, 0.999))
        return FusedOptimizerSpec(OPT_ADAM, lr=float(kw.get("lr", 1e-3)), eps=float(kw.get("eps", 1e-8)),
                                  beta1=float(beta1), beta2=float(beta2),
                                  weight_decay=float(kw.get("weight_decay", 0.01 if key == "adamw" else 0.0)),
                                  decoupled_weight_decay=key == "adamw")
    raise _unsupported(f"{module + '.' if module else ''}{name}", "not implemented")
