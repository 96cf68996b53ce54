"""Random EmbeddingBagCollection cases (tables, KJT) shared by the tests."""
import os
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch
from hypothesis import strategies as st
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_configs import DataType


# The suite runs on the CPU by default (Triton under its interpreter); RECOM_TEST_DEVICE=cuda runs
# the same tests with CUDA tensors on the GPU machine.
DEVICE = torch.device(os.environ.get("RECOM_TEST_DEVICE", "cpu"))
# A long multi-process or interpreter check: on the CPU `make test-slow` runs it (CI too), keeping
# `make test` under its 10 minutes; the GPU suite keeps running it in one process with the rest.
# (on a GPU a marker of no effect: pytest.param refuses an empty usefixtures(), as newer pytest has it)
SLOW_ON_CPU = pytest.mark.slow if DEVICE.type == "cpu" else pytest.mark.slow_on_cpu
# The backends whose kernels the suite checks: the CUDA C++ kernels need a GPU (on the CPU, CI
# compiles them with nvcc instead: tests/test_kernels_compile.py).
KERNEL_BACKENDS = ["torch", "triton"] + (["cuda"] if DEVICE.type == "cuda" else [])



def capture_forward(forward, warmup_runs: int):
    """A CUDA graph of ``forward()`` and the output it writes on each replay. ``forward`` runs
    ``warmup_runs`` times on a side stream first (launch tuners decide, report slots exist)."""
    from recom_rec.kernels.launch_tuner import unpaced_trials

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), unpaced_trials():  # (their trials back to back, as recom_rec.tune runs them)
        for _ in range(warmup_runs):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    return graph, out

@dataclass
class Case:
    tables: List[EmbeddingBagConfig]
    kjt: KeyedJaggedTensor
    is_weighted: bool

    def fresh_tables(self) -> List[EmbeddingBagConfig]:
        """Configs are mutated by the modules (feature_names defaults): copy per module."""
        return [EmbeddingBagConfig(
            name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names), pooling=t.pooling, data_type=t.data_type,
        ) for t in self.tables]


class KJTInTheGraph(torch.nn.Module):
    """A model that builds its KJT from tensors in its forward (as torchrec's export examples do):
    under torch.compile and torch.export the per-key lengths are known only at run time. Returns
    the module's JaggedTensors' values, keys in sorted order, in one tensor."""

    def __init__(self, module, keys):
        super().__init__()
        self.module, self.keys = module, list(keys)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out = self.module(KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths))
        return torch.cat([out[k].values() for k in sorted(out)])


def make_kjt(tables, batch_size, max_len, seed, is_weighted, index_dtype=torch.int64,
             extra_keys=0, zero_fraction=0.3, shuffle_keys=True) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    limits = {}
    for t in tables:
        for f in (t.feature_names or [t.name]):
            limits[f] = min(limits.get(f, t.num_embeddings), t.num_embeddings)
    keys = list(limits)
    keys += [f"unused_{i}" for i in range(extra_keys)]
    if shuffle_keys:
        keys = [keys[i] for i in torch.randperm(len(keys), generator=g).tolist()]
    lengths = torch.randint(0, max_len + 1, (len(keys), batch_size), generator=g)
    lengths[torch.rand(lengths.shape, generator=g) < zero_fraction] = 0
    values = []
    for k, key in enumerate(keys):
        n = int(lengths[k].sum())
        values.append(torch.randint(0, limits.get(key, 1000), (n,), generator=g))
    values = torch.cat(values) if values else torch.zeros(0, dtype=torch.int64)
    weights = torch.rand(values.numel(), generator=g) if is_weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values.to(index_dtype), lengths=lengths.reshape(-1).to(index_dtype), weights=weights
    )


@st.composite
def cases(draw, max_tables=40, max_dim=256, max_rows=10**5, max_batch=12, max_len=6,
          element_budget=4 * 10**6, weighted: Optional[bool] = None, allow_mean_weighted=False,
          data_types=(DataType.FP32,)):
    is_weighted = draw(st.booleans()) if weighted is None else weighted
    n_tables = draw(st.integers(1, max_tables))
    per_table_budget = max(1, element_budget // n_tables)
    pool = [f"f{i}" for i in range(max(2, n_tables + 2))]
    tables = []
    for i in range(n_tables):
        dim = draw(st.integers(1, max_dim))
        rows = min(draw(st.integers(1, max_rows)), max(1, per_table_budget // dim))
        if is_weighted and not allow_mean_weighted:
            pooling = PoolingType.SUM
        else:
            pooling = draw(st.sampled_from([PoolingType.SUM, PoolingType.MEAN]))
        names = draw(st.lists(st.sampled_from(pool), min_size=0, max_size=3, unique=True))
        tables.append(EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=names,
            pooling=pooling, data_type=draw(st.sampled_from(list(data_types))),
        ))
    batch = draw(st.integers(1, max_batch))
    seed = draw(st.integers(0, 2**31 - 1))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    kjt = make_kjt(tables, batch, draw(st.integers(0, max_len)), seed, is_weighted, index_dtype,
                   extra_keys=draw(st.integers(0, 2)))
    return Case(tables, kjt, is_weighted)
