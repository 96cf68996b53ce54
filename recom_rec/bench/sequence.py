"""The ``sequence`` workload: unpooled lookups of a sequence model (``recom_rec.EmbeddingCollection``).

A user-history model's embedding layer: an item table of 10M rows x 256 (fp32, 10 GB: far past
the L2) read by the history and the target item, and side tables (category, action) read by
sequences as long as the history; histories of 50-2000 ids (uniform), batches of 128 and 1024
(the CPU: 20k rows, histories of 5-50, batches of 8 and 32). Peers, on the same KJT and weights:
ours; fbgemm's TBE in ``PoolingMode.NONE`` (what torchrec's sharded EmbeddingCollection runs), with
its default bounds check, the SGD fused into its backward as ours; torchrec's EmbeddingCollection
(an nn.Embedding per table; forward only: its training step writes a dense 10 GB gradient).

Phases: ``forward`` (no_grad), ``sgd`` (forward + backward with SGD fused, an upstream gradient
of ones made once per shape, as the pooled benchmarks pass theirs) and ``int8`` (serving INT8 rows: ours against torchrec's quantized EmbeddingCollection, both
quantized from the same tables). The modules' forwards include splitting their output into one JaggedTensor a feature (and
their backward the gathering of those gradients into one, autograd's copy); fbgemm's TBE returns
one tensor and takes one gradient. Bytes moved by a forward: each id's row read and written (fp32),
plus the ids.
"""
import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .gradients import upstream_ones
from .report import format_peers
from .timing import time_beside_ours

DIM = 256
LR = 0.01


@dataclass
class SequenceWorkload:
    batch_size: int
    item_rows: int
    side_rows: List[int]  # category, action
    history: tuple  # (shortest, longest) history
    dim: int = DIM
    name: str = ""  # (the random layouts' draws name theirs)

    def label(self) -> str:
        return self.name or f"sequence-b{self.batch_size}"

    def describe(self) -> str:
        return (f"item table {self.item_rows:,} rows, side tables {self.side_rows[0]:,} and {self.side_rows[1]:,}, "
                f"D={self.dim}, histories {self.history[0]}-{self.history[1]}, B={self.batch_size}")

    def tables(self) -> List[EmbeddingConfig]:
        return [
            EmbeddingConfig(name="item", embedding_dim=self.dim, num_embeddings=self.item_rows,
                            feature_names=["history_items", "target_item"]),
            EmbeddingConfig(name="category", embedding_dim=self.dim, num_embeddings=self.side_rows[0],
                            feature_names=["history_categories"]),
            EmbeddingConfig(name="action", embedding_dim=self.dim, num_embeddings=self.side_rows[1],
                            feature_names=["history_actions"]),
        ]

    def tables_as(self, configs: List[EmbeddingConfig]) -> List[EmbeddingConfig]:
        """Fresh copies of ``configs`` (a module may change the configs it is given)."""
        return [EmbeddingConfig(name=c.name, embedding_dim=c.embedding_dim, num_embeddings=c.num_embeddings,
                                feature_names=list(c.feature_names), data_type=c.data_type) for c in configs]

    def make_input(self, device: torch.device, seed: int = 0) -> KeyedJaggedTensor:
        rng = random.Random(seed)
        history = [rng.randint(*self.history) for _ in range(self.batch_size)]
        g = torch.Generator().manual_seed(seed)
        n = sum(history)
        keys = ["history_items", "target_item", "history_categories", "history_actions"]
        values = torch.cat([torch.randint(self.item_rows, (n,), generator=g),
                            torch.randint(self.item_rows, (self.batch_size,), generator=g),
                            torch.randint(self.side_rows[0], (n,), generator=g),
                            torch.randint(self.side_rows[1], (n,), generator=g)])
        lengths = torch.tensor(history + [1] * self.batch_size + history + history)
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths).to(device)

    def forward_bytes(self, kjt: KeyedJaggedTensor) -> int:
        n = kjt.values().numel()
        return n * self.dim * 4 * 2 + n * kjt.values().element_size()


def workloads(small: bool) -> List[SequenceWorkload]:
    if small:
        return [SequenceWorkload(b, 20_000, [1000, 16], (5, 50)) for b in (8, 32)]
    return [SequenceWorkload(b, 10_000_000, [100_000, 16], (50, 2000)) for b in (128, 1024)]


def _feature_of_tables(tables: List[EmbeddingConfig], keys: List[str]) -> List[int]:
    table_of = {f: i for i, t in enumerate(tables) for f in t.feature_names}
    return [table_of[k] for k in keys]


class _Ours:
    def __init__(self, w: SequenceWorkload, device, train: bool):
        import recom_rec

        self.module = recom_rec.EmbeddingCollection(tables=w.tables(), device=device)
        if train:
            self.module.enable_fused_optimizer(torch.optim.SGD, lr=LR)

    def load(self, weights: List[torch.Tensor]) -> None:
        with torch.no_grad():
            for table, weight in zip(self.module.embeddings.values(), weights):
                table.weight.copy_(weight)

    def forward(self, kjt):
        return self.module(kjt)

    def train_step(self, kjt) -> None:
        outs = [jt.values() for jt in self.module(kjt).values()]
        torch.autograd.backward(outs, upstream_ones(self, outs))


class _Torchrec(_Ours):
    def __init__(self, w: SequenceWorkload, device, train: bool):
        import torchrec

        self.module = torchrec.EmbeddingCollection(tables=w.tables(), device=device)


class _Fbgemm:
    """fbgemm's TBE, unpooled, one table per config and a feature map (as torchrec's sharded EC)."""

    def __init__(self, w: SequenceWorkload, device, train: bool, keys: List[str]):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        tables = w.tables()
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(t.num_embeddings, t.embedding_dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
                             for t in tables],
            feature_table_map=_feature_of_tables(tables, keys), optimizer=EmbOptimType.EXACT_SGD, learning_rate=LR,
            pooling_mode=PoolingMode.NONE, weights_precision=SparseType.FP32, output_dtype=SparseType.FP32,
            device=device, bounds_check_mode=BoundsCheckMode.WARNING)

    def load(self, weights: List[torch.Tensor]) -> None:
        with torch.no_grad():
            for mine, weight in zip(self.tbe.split_embedding_weights(), weights):
                mine.copy_(weight)

    def forward(self, kjt) -> torch.Tensor:
        return self.tbe(kjt.values(), kjt.offsets())

    def train_step(self, kjt) -> None:
        out = self.tbe(kjt.values(), kjt.offsets())
        out.backward(upstream_ones(self, [out])[0])


def _flat(out) -> torch.Tensor:
    """A peer's forward as one tensor in KJT order (the modules' dicts follow it here)."""
    return torch.cat([jt.values() for jt in out.values()]) if isinstance(out, dict) else out


def _peers(device: torch.device) -> List[str]:
    names = ["recom_rec", "torchrec"]
    if device.type == "cuda":
        from .peers import fbgemm_available

        if fbgemm_available(device):
            names.insert(1, "fbgemm")
    return names


def _make(name: str, w: SequenceWorkload, device, train: bool, keys: List[str]):
    if name == "recom_rec":
        return _Ours(w, device, train)
    if name == "fbgemm":
        return _Fbgemm(w, device, train, keys)
    return _Torchrec(w, device, train)


def run_sequence(device: torch.device, small: bool, iters: int = 20, warmup: int = 5,
                 drawn: Optional[List[SequenceWorkload]] = None, peers: Optional[List[str]] = None,
                 phases: Optional[List[str]] = None) -> List[Dict]:
    """Per workload (the named ones, or ``drawn``), phase and peer: median ms; forwards also
    compared element for element with ours (``identical``: bit for bit). ``peers`` and ``phases``
    narrow the run (ours always runs; the INT8 serving rows come with the forward); a peer that
    fails gives an ``error`` row."""
    rows: List[Dict] = []
    names = [n for n in _peers(device) if peers is None or n == "recom_rec" or n in peers]
    for w in drawn if drawn is not None else workloads(small):
        kjt = w.make_input(device)
        keys = kjt.keys()
        name = w.label()
        torch.manual_seed(0)
        weights = [torch.empty(t.num_embeddings, w.dim, device=device).uniform_(-0.01, 0.01) for t in w.tables()]
        for phase in ("forward", "sgd"):
            if phases is not None and phase not in phases:
                continue
            train = phase == "sgd"

            def make(peer_name, train=train):
                peer = _make(peer_name, w, device, train, keys)
                peer.load(weights)
                return peer

            def annotate(peer_name, peer, row):
                if row["phase"] == "forward":
                    row["gbs"] = w.forward_bytes(kjt) / (row["ms"] * 1e-3) / 1e9

            timed = [n for n in names if not (train and n == "torchrec")]
            rows += time_beside_ours(timed, make, kjt, phase, device, warmup, iters, lambda n, p: _flat,
                                     {"workload": name, "phase": phase, "ids": kjt.values().numel()}, annotate)
        if phases is None or "forward" in phases:
            try:
                rows.extend(_int8_rows(w, kjt, weights, device, name, iters, warmup, "torchrec" in names))
            except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
                rows.append({"workload": name, "peer": "recom_rec", "phase": "int8", "error": str(e)[:200]})
        del weights
    return rows


def _int8_rows(w: SequenceWorkload, kjt, weights, device, name: str, iters: int, warmup: int,
               with_torchrec: bool = True) -> List[Dict]:
    """Serving: INT8 rows, ours (recom_rec.quant.EmbeddingCollection) against torchrec's quantized
    EmbeddingCollection (fbgemm's IntN TBE, unpooled), both quantized from the same float tables."""
    from torchrec.modules.embedding_configs import DataType
    from torchrec.quant.embedding_modules import EmbeddingCollection as TorchrecQuantEC

    from ..quant import EmbeddingCollection as QuantEC
    from ..quant.rows import RowType, quantize_rows

    # Both modules from the same INT8 rows (fbgemm's quantizer, in blocks of rows: recom_rec.quant.rows).
    configs = w.tables()
    for config in configs:
        config.data_type = DataType.INT8
    quantized = {c.name: quantize_rows(weight, RowType.INT8) for c, weight in zip(configs, weights)}
    peers = {"recom_rec": QuantEC(configs, device=device, table_name_to_quantized_weights=quantized)}
    if with_torchrec:
        peers["torchrec"] = TorchrecQuantEC(w.tables_as(configs), device=device,
                                            table_name_to_quantized_weights=quantized)
    del quantized
    serving = {n: _Serving(m) for n, m in peers.items()}
    return time_beside_ours(list(serving), serving.__getitem__, kjt, "forward", device, warmup, iters,
                            lambda n, p: _flat, {"workload": name, "phase": "int8", "ids": kjt.values().numel()})


class _Serving:
    """A quantized module as time_beside_ours's peer: its forward is the module's call."""

    def __init__(self, module):
        self.module = module

    def forward(self, kjt):
        return self.module(kjt)


def format_sequence(rows: List[Dict]) -> str:
    return format_peers("sequence (EmbeddingCollection)", rows)
