"""Batch sizes of a serving workload's requests: written-down distributions over 1..1024, drawn
from a seed (``--workloads serving``, recom_rec/bench/serving.py).

Each distribution is a mixture of components (weights summing to 1); a draw picks a component per
request, draws from it, rounds to an integer and clips to 1..MAX_BATCH:
- ``log-uniform``: log-uniform over 1..1024 (as many requests of 1-2 as of 512-1024);
- ``long-tail``: most requests small, rare ones up to 1024: 90% log-normal (median 8, sigma 1),
  10% Zipf(1.1) truncated to 1..1024 (median ~8; about 0.6% of requests 512 or more);
- ``bimodal``: 70% single-user requests around 16 (log-normal, sigma 0.5), 30% ranking passes
  around 512 (log-normal, sigma 0.25).
"""
import math
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from ..data import truncated_zipf

MAX_BATCH = 1024


@dataclass(frozen=True)
class LogUniform:
    low: float
    high: float

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # floor of exp(U(ln low, ln(high + 1))): every integer in low..high, log-uniformly
        return np.floor(np.exp(rng.uniform(math.log(self.low), math.log(self.high + 1), n)))


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.rint(rng.lognormal(math.log(self.median), self.sigma, n))


@dataclass(frozen=True)
class Zipf:
    a: float

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return truncated_zipf(rng, self.a, MAX_BATCH, n) + 1  # ranks 0..1023 -> batches 1..1024


Mixture = Tuple[Tuple[float, object], ...]  # (weight, component)

DISTRIBUTIONS: Dict[str, Mixture] = {
    "log-uniform": ((1.0, LogUniform(1, MAX_BATCH)),),
    "long-tail": ((0.9, LogNormal(8, 1.0)), (0.1, Zipf(1.1))),
    "bimodal": ((0.7, LogNormal(16, 0.5)), (0.3, LogNormal(512, 0.25))),
}


def draw_batch_sizes(name: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` batch sizes (int64, each in 1..MAX_BATCH) from the distribution ``name``."""
    mixture = DISTRIBUTIONS[name]
    weights = np.array([w for w, _ in mixture])
    which = rng.choice(len(mixture), size=n, p=weights / weights.sum())
    sizes = np.empty(n)
    for i, (_, component) in enumerate(mixture):
        picked = which == i
        sizes[picked] = component.draw(rng, int(picked.sum()))
    return np.clip(sizes, 1, MAX_BATCH).astype(np.int64)
