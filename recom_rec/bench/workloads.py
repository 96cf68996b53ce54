"""The benchmark workloads (names fixed so results stay comparable across versions).

Each workload is a list of tables and an input generator. ``small=True`` gives a scaled-down
version of the same shape for CPU runs."""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from ..data import CRITEO_KAGGLE_CARDINALITIES, truncated_zipf

@dataclass
class Workload:
    name: str
    rows: List[int]
    dims: List[int]
    batch_size: int
    pooling_factors: List[int]  # ids per bag, per table (fixed length bags, as in the baselines)
    zipf_a: Optional[float] = None
    description: str = ""
    poolings: List[PoolingType] = field(default_factory=list)

    @property
    def num_tables(self) -> int:
        return len(self.rows)

    def tables(self) -> List[EmbeddingBagConfig]:
        poolings = self.poolings or [PoolingType.SUM] * self.num_tables
        return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f{i}"],
                                   pooling=p)
                for i, (n, d, p) in enumerate(zip(self.rows, self.dims, poolings))]

    def weight_bytes(self, itemsize: int = 4) -> int:
        return sum(n * d for n, d in zip(self.rows, self.dims)) * itemsize

    def dense_gradient_bytes(self, itemsize: int = 4) -> int:
        """Bytes a backward to dense gradients must move at least: every table's gradient written
        once (the rows no lookup read hold zeros there) and the output's gradient read once."""
        return self.weight_bytes(itemsize) + self.batch_size * sum(self.dims) * 4

    def lookup_bytes(self, itemsize: int = 4) -> int:
        """Bytes a forward must move at least: every looked-up row read, the output written."""
        rows_read = sum(L * d for L, d in zip(self.pooling_factors, self.dims)) * self.batch_size * itemsize
        out = self.batch_size * sum(self.dims) * 4
        return rows_read + out

    def make_input(self, device: torch.device, seed: int = 0) -> KeyedJaggedTensor:
        """Table-major KJT (key ``f{i}`` for table ``i``), int64 ids, fixed-length bags."""
        rng = np.random.default_rng(seed)
        values, lengths = [], []
        for n, L in zip(self.rows, self.pooling_factors):
            count = self.batch_size * L
            if self.zipf_a is None:
                ids = rng.integers(0, n, count)
            else:
                ids = zipf_ids(rng, self.zipf_a, n, count)
            values.append(ids)
            lengths.append(np.full(self.batch_size, L))
        return KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(self.num_tables)],
            values=torch.from_numpy(np.concatenate(values)).to(device),
            lengths=torch.from_numpy(np.concatenate(lengths)).to(device),
        )


def zipf_ids(rng: np.random.Generator, a: float, n: int, count: int) -> np.ndarray:
    """Zipf(a) ids in [0, n), hot ranks scattered over the table by a fixed multiplicative hash
    (so the hot rows are not all adjacent in memory)."""
    return (truncated_zipf(rng, a, n, count) * 2654435761) % n


def _dlrm_kaggle(small: bool) -> Workload:
    cap = 20_000 if small else None
    rows = [min(c, cap) if cap else c for c in CRITEO_KAGGLE_CARDINALITIES]
    return Workload("dlrm-kaggle", rows, [128] * 26, 1024 if small else 65536, [1] * 26,
                    description="26 Criteo Kaggle tables, D=128, B=65536, 1 id/bag")


def _many(name, tables, rows, dim, batch, L, small, zipf=None) -> Workload:
    if small:
        tables, rows, batch = tables // 10, rows // 20, max(64, batch // 8)
    return Workload(name, [rows] * tables, [dim] * tables, batch, [L] * tables, zipf_a=zipf,
                    description=f"{tables} tables x{rows} rows, D={dim}, B={batch}, {L} ids/bag"
                    + (f", Zipf({zipf}) ids" if zipf else ""))


def _mixed(small: bool) -> Workload:
    rng = np.random.default_rng(300)
    n = 30 if small else 300
    dims = rng.choice(np.arange(8, 129, 4), n).tolist()
    rows = np.exp(rng.uniform(np.log(1e3), np.log(1e5 if small else 1e6), n)).astype(int).tolist()
    L = rng.integers(1, 51, n).tolist()
    batch = 256 if small else 2048
    return Workload("mixed", rows, dims, batch, L,
                    description=f"{n} tables, D 8-128, rows 1e3-1e{5 if small else 6}, 1-50 ids/bag, B={batch}")


SERVING_MAX_WEIGHT_BYTES = 16 << 30  # three fp32 copies (the float peers) fit an H100 at once
SERVING_IDS_PER_BAG = (1, 1, 1, 2, 5, 10, 20, 50)  # one-hot features (user, item) and histories


def serving_layout(small: bool) -> Workload:
    """The tables of ``--workloads serving`` (serving.py): a fixed draw (seed 51) of 40 tables, rows
    log-uniform 1e5-1e7 (the largest halved until the fp32 weights fit SERVING_MAX_WEIGHT_BYTES),
    dims from {16, 32, 64, 128}, ids per bag from SERVING_IDS_PER_BAG, uniform ids, sum pooling.
    The batch varies per request (batch_size is set per request); ``small``: rows / 1000 (at
    least 100), ids per bag / 10 (at least 1)."""
    rng = np.random.default_rng(51)
    n = 40
    rows = np.exp(rng.uniform(np.log(1e5), np.log(1e7), n)).astype(int).tolist()
    dims = rng.choice([16, 32, 64, 128], n).tolist()
    hots = rng.choice(SERVING_IDS_PER_BAG, n).tolist()
    while sum(r * d for r, d in zip(rows, dims)) * 4 > SERVING_MAX_WEIGHT_BYTES:
        biggest = max(range(n), key=lambda t: rows[t] * dims[t])
        rows[biggest] //= 2
    if small:
        rows = [max(100, r // 1000) for r in rows]
        hots = [max(1, h // 10) for h in hots]
    return Workload("serving", rows, dims, 1, hots,
                    description=f"{n} tables, rows {min(rows):,}-{max(rows):,}, dims 16-128, {sum(hots)} ids a "
                                f"sample, {sum(r * d for r, d in zip(rows, dims)) * 4 / 2**30:.2f} GiB fp32")


WORKLOADS: Dict[str, Callable[[bool], Workload]] = {
    "dlrm-kaggle": _dlrm_kaggle,
    "many-500": lambda small: _many("many-500", 500, 100_000, 32, 2048, 10, small),
    "many-1000": lambda small: _many("many-1000", 1000, 50_000, 16, 512, 4, small),
    "mixed": _mixed,
    "zipf": lambda small: _many("zipf", 500, 100_000, 32, 2048, 10, small, zipf=1.05),
    # RECom's thousands of columns at online batch sizes (the inference benchmark's)
    "many-4000": lambda small: _many("many-4000", 4000, 10_000, 32, 128, 3, small),
}
# What a run without --workloads measures: the training-era set (many-4000 is an inference shape).
DEFAULT_WORKLOADS = [name for name in WORKLOADS if name != "many-4000"]


# Workloads made for one run (the drawn layouts of --workloads random), by name.
DRAWN: Dict[str, Workload] = {}


def get_workload(name: str, small: bool) -> Workload:
    if name in DRAWN:
        return DRAWN[name]
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](small)
