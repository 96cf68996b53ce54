"""``--workloads random --seed N``: table layouts drawn from a written-down distribution of real
models, a fresh seed each run, so that no fixed list of shapes decides how fast the package is
(issue 51).

The distribution (one draw per layout; the GPU's memory caps the tables, the CPU's run a scaled-down
version of the same draw):
- tables: 1 to 64, log-uniform; rows per table log-uniform from 1e3 to 1e8, the total weights capped
  (``MAX_WEIGHT_BYTES``: 24 GB on a GPU, so ours and fbgemm's copies fit an H100 together; the
  largest tables shrink until the layout fits);
- dims: one module mixes them, each table 4 to 1024 (half multiples of 4, half not: 4 * k or 4 * k
  + 1..3 from the log-uniform 4-1024 draw);
- multi-hot: ids per bag 1 to 500 per table, log-uniform;
- batch: 16 to 131,072, log-uniform, within the ids' cap (``MAX_IDS``: 64M ids a batch);
- ids: uniform, or Zipf with an exponent from 0.6 to 1.2 in a third of the layouts;
- pooling: mean in a quarter of the tables.
Half-precision tables (fp16/bf16) and weighted bags are in the issue's list but not in the
benchmark's peers' common ground yet (its fbgemm peer trains fp32 tables): not drawn.
The MLPerf DLRM-DCNv2 configuration (26 tables, its multi-hot sizes, dim 128) is drawn alongside.

Sequence and variable-batch layouts (issue 53; ``random_unpooled_workloads``, a quarter as many
of each as the pooled ones, at least one, each kind from its own stream of the seed: the pooled
draws of a seed stay what they were):
- sequence (``bench/sequence.py``'s EmbeddingCollection: an item table read by a history and the
  target item, two side tables read by the history): item rows log-uniform 1e4 to 2e7, side tables
  16 to 1e6 rows, one dim a module (a multiple of 4, log-uniform 16-512: fbgemm's TBE needs it),
  histories of ``lo`` to ``hi`` ids (``lo`` log-uniform 1-200, ``hi`` log-uniform ``lo``-4000),
  batch log-uniform 16-2048;
- variable batch (``bench/vbe.py``: user features at 1/divisor of the batch, item features at the
  full batch, multi-hot on every other feature): user features 1-16 and item features 1-32
  (log-uniform), divisor 2-128 (a power of two), rows 1e3-1e7 a table, dim a multiple of 4
  (log-uniform 8-256), up to 1-100 ids a bag, batch log-uniform 256-65,536;
- caps: weights ``MAX_UNPOOLED_WEIGHT_BYTES`` (the largest tables shrink), the output
  ``MAX_OUTPUT_BYTES`` (the batch shrinks: a peer's output and its gradient stay a few GB).
"""
import math
from typing import List, Tuple

import numpy as np
from torchrec import PoolingType

from ..data import CRITEO_KAGGLE_CARDINALITIES
from .report import speedup
from .sequence import SequenceWorkload
from .vbe import VbeWorkload
from .workloads import Workload

MAX_WEIGHT_BYTES = 24 << 30
MAX_IDS = 64 << 20
MAX_UNPOOLED_WEIGHT_BYTES = 16 << 30
MAX_OUTPUT_BYTES = 4 << 30
SMALL_SCALE = 1000  # the CPU's version: rows / 1000 (at least 100), batch / 64, ids per bag / 10

# MLPerf DLRM-DCNv2 (Criteo 1TB): ids per bag of its 26 multi-hot features
DCNV2_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
DCNV2_ROWS_CAP = 40_000_000


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _dim(rng: np.random.Generator) -> int:
    d = int(_log_uniform(rng, 4, 1024))
    return max(4, d - d % 4) if rng.random() < 0.5 else max(1, d)


def draw_layout(rng: np.random.Generator, index: int, small: bool) -> Workload:
    tables = int(round(_log_uniform(rng, 1, 64)))
    rows = [int(_log_uniform(rng, 1e3, 1e8)) for _ in range(tables)]
    dims = [_dim(rng) for _ in range(tables)]
    hots = [int(round(_log_uniform(rng, 1, 500))) for _ in range(tables)]
    batch = int(_log_uniform(rng, 16, 131072))
    zipf = float(rng.uniform(0.6, 1.2)) if rng.random() < 1 / 3 else None
    poolings = [PoolingType.MEAN if rng.random() < 0.25 else PoolingType.SUM for _ in range(tables)]
    while sum(r * d for r, d in zip(rows, dims)) * 4 > MAX_WEIGHT_BYTES:
        biggest = max(range(tables), key=lambda t: rows[t] * dims[t])
        rows[biggest] = max(1000, rows[biggest] // 2)
    batch = max(16, min(batch, MAX_IDS // max(1, sum(hots))))
    if small:
        rows = [max(100, r // SMALL_SCALE) for r in rows]
        batch = max(4, batch // 64)
        hots = [max(1, h // 10) for h in hots]
    name = f"random-{index}"
    description = (f"{tables} tables, rows {min(rows)}-{max(rows)}, dims {min(dims)}-{max(dims)}, "
                   f"{min(hots)}-{max(hots)} ids/bag, B={batch}" + (f", Zipf({zipf:.2f})" if zipf else ""))
    return Workload(name, rows, dims, batch, hots, zipf_a=zipf, description=description, poolings=poolings)


def dcnv2(small: bool) -> Workload:
    rows = [min(c, DCNV2_ROWS_CAP) for c in _criteo_1tb_rows()]
    hots, batch = list(DCNV2_MULTI_HOT), 16384
    if small:
        rows = [max(100, r // SMALL_SCALE) for r in rows]
        hots, batch = [max(1, h // 10) for h in hots], 256
    return Workload("dlrm-dcnv2", rows, [128] * 26, batch, hots,
                    description=f"MLPerf DLRM-DCNv2: 26 tables (rows capped at {DCNV2_ROWS_CAP:,}), D=128, "
                                f"its multi-hot sizes, B={batch}")


def _criteo_1tb_rows() -> List[int]:
    # Criteo 1TB's cardinalities are not shipped; its layout keeps Kaggle's relative sizes scaled to
    # the 1TB dataset's largest table (~40M rows after MLPerf's cap).
    largest = max(CRITEO_KAGGLE_CARDINALITIES)
    return [max(3, int(c * DCNV2_ROWS_CAP / largest)) for c in CRITEO_KAGGLE_CARDINALITIES]


def random_workloads(seed: int, count: int, small: bool) -> List[Workload]:
    """``count`` drawn layouts (seed ``seed``) and the DLRM-DCNv2 configuration."""
    rng = np.random.default_rng(seed)
    return [draw_layout(rng, i, small) for i in range(count)] + [dcnv2(small)]


def _dim_multiple_of_4(rng: np.random.Generator, low: int, high: int) -> int:
    d = int(_log_uniform(rng, low, high))
    return max(low, d - d % 4)


def draw_sequence(rng: np.random.Generator, index: int, small: bool) -> SequenceWorkload:
    item_rows = int(_log_uniform(rng, 1e4, 2e7))
    side_rows = [int(_log_uniform(rng, 16, 1e6)) for _ in range(2)]
    dim = _dim_multiple_of_4(rng, 16, 512)
    lo = int(_log_uniform(rng, 1, 200))
    hi = max(lo, int(_log_uniform(rng, lo, 4000)))
    batch = int(_log_uniform(rng, 16, 2048))
    while (item_rows + sum(side_rows)) * dim * 4 > MAX_UNPOOLED_WEIGHT_BYTES:
        item_rows //= 2
    ids_a_sample = 3 * (lo + hi) / 2 + 1  # the history's three features and the target
    while batch > 16 and batch * ids_a_sample * dim * 4 > MAX_OUTPUT_BYTES:
        batch = max(16, batch // 2)
    if small:
        item_rows, side_rows = max(100, item_rows // SMALL_SCALE), [max(16, r // SMALL_SCALE) for r in side_rows]
        lo, hi, batch = max(1, lo // 10), max(1, hi // 10), max(2, batch // 64)
        dim = min(dim, 64)
    return SequenceWorkload(batch, item_rows, side_rows, (lo, max(lo, hi)), dim=dim, name=f"random-seq-{index}")


def draw_vbe(rng: np.random.Generator, index: int, small: bool) -> VbeWorkload:
    user_features = int(round(_log_uniform(rng, 1, 16)))
    item_features = int(round(_log_uniform(rng, 1, 32)))
    divisor = 2 ** int(rng.integers(1, 8))
    rows = int(_log_uniform(rng, 1e3, 1e7))
    dim = _dim_multiple_of_4(rng, 8, 256)
    multi_hot = int(round(_log_uniform(rng, 1, 100)))
    batch = int(_log_uniform(rng, 256, 65536))
    tables = user_features + item_features
    while tables * rows * dim * 4 > MAX_UNPOOLED_WEIGHT_BYTES:
        rows //= 2
    while batch > 256 and batch * tables * dim * 4 > MAX_OUTPUT_BYTES:
        batch = max(256, batch // 2)
    if small:
        rows, batch, multi_hot = max(100, rows // SMALL_SCALE), max(16, batch // 64), max(1, multi_hot // 10)
        dim = min(dim, 32)
        user_features, item_features = min(user_features, 4), min(item_features, 4)
    divisor = min(divisor, batch)
    return VbeWorkload(batch, rows, dim, user_features, item_features, multi_hot, divisor, name=f"random-vbe-{index}")


def random_unpooled_workloads(seed: int, count: int, small: bool) -> Tuple[List[SequenceWorkload], List[VbeWorkload]]:
    """The sequence and variable-batch layouts drawn beside ``count`` pooled ones (seed ``seed``)."""
    # (streams of their own: a seed's pooled draws stay what they were, and each kind's layouts do
    # not depend on how many of the other kind are drawn)
    sequence_rng, vbe_rng = np.random.default_rng([seed, 53, 0]), np.random.default_rng([seed, 53, 1])
    n = max(1, round(count / 4))
    return [draw_sequence(sequence_rng, i, small) for i in range(n)], [draw_vbe(vbe_rng, i, small) for i in range(n)]


def summarize(results: List[dict], names: List[str], peers: List[str], what: str = "random layouts") -> str:
    """Per peer and phase, over the drawn layouts: the share of layouts where ours is at or above
    1.0x the peer, the geomean and the worst."""
    return "\n".join(filter(None, (_summary(results, names, peer, what) for peer in peers)))


def _summary(results: List[dict], names: List[str], peer: str, what: str) -> str:
    lines = []
    phases = sorted({r["phase"] for r in results if r["workload"] in names})
    for phase in phases:
        ratios = []
        for name in names:
            by = {r["peer"]: r for r in results if r["workload"] == name and r["phase"] == phase and "ms" in r}
            ratio = speedup(by.get("recom_rec"), by.get(peer))
            if ratio:
                ratios.append((ratio, name))
        if ratios:
            lines.append(ratio_summary(f"{what}, {phase} x {peer}", ratios))
    return "\n".join(lines)


def ratio_summary(label: str, ratios: List[Tuple[float, str]]) -> str:
    """``label``: the share of (ratio, layout) pairs at or above 1.0x, their geomean and the worst."""
    geomean = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
    worst = min(ratios)
    at_least = sum(r >= 1.0 for r, _ in ratios)
    return (f"{label}: {at_least}/{len(ratios)} at or above 1.0x, geomean {geomean:.2f}x, "
            f"worst {worst[0]:.2f}x ({worst[1]})")
