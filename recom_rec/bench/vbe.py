"""The ``vbe`` workload: a variable batch per feature (torchrec's VBE KJTs).

A DLRM-like layer of 26 tables (dim 128, 1M rows each, fp32) at batch 8192, whose 8 user features
come at 1/16 of the batch (one user row per 16 requests: ``stride_per_key_per_rank`` 512, the
inverse indices say which) and 18 item features at the full batch; 12 of the features multi-hot
(20 ids a bag), the rest one id. Peers, on the same KJT and weights: ours (the module pools each
feature's own bags and expands them to the batch's rows by the inverse indices); fbgemm's VBE TBE
(``batch_size_per_feature_per_rank``: its output is each feature's own bags, not expanded - less
work than a module's output) with its bounds check, SGD fused; the same TBE followed by the
expansion sharded torchrec runs on its output (``ShardedEmbeddingBagCollection``'s VBE output:
fbgemm's ``batch_index_select_dim0``), which returns what a module returns; torchrec's
EmbeddingBagCollection (a kernel per table, then its expansion; forward only).
"""
import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from .gradients import upstream_ones
from .report import format_peers
from .timing import time_beside_ours

LR = 0.01


@dataclass
class VbeWorkload:
    batch_size: int
    rows: int
    dim: int
    user_features: int
    item_features: int
    multi_hot: int
    divisor: int = 16
    name: str = ""  # (the random layouts' draws name theirs)

    def label(self) -> str:
        return self.name or f"vbe-b{self.batch_size}"

    def describe(self) -> str:
        return (f"{self.user_features} user features at 1/{self.divisor} of B={self.batch_size}, "
                f"{self.item_features} item features, {self.rows:,} rows x D={self.dim} each, "
                f"up to {self.multi_hot} ids a bag")

    def keys(self) -> List[str]:
        return [f"user{i}" for i in range(self.user_features)] + [f"item{i}" for i in range(self.item_features)]

    def tables(self) -> List[EmbeddingBagConfig]:
        return [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=self.dim, num_embeddings=self.rows, feature_names=[k])
                for k in self.keys()]

    def strides(self) -> List[int]:
        return [self.batch_size // self.divisor] * self.user_features + [self.batch_size] * self.item_features

    def make_input(self, device: torch.device, seed: int = 0) -> KeyedJaggedTensor:
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        keys, strides = self.keys(), self.strides()
        lengths = []
        for i, s in enumerate(strides):
            hot = self.multi_hot if i % 2 == 0 else 1
            lengths += [rng.randint(1, hot) if hot > 1 else 1 for _ in range(s)]
        n = sum(lengths)
        inverse = torch.stack([torch.randint(s, (self.batch_size,), generator=g) if s < self.batch_size
                               else torch.arange(self.batch_size) for s in strides])
        return KeyedJaggedTensor(keys=keys, values=torch.randint(self.rows, (n,), generator=g),
                                 lengths=torch.tensor(lengths), stride_per_key_per_rank=[[s] for s in strides],
                                 inverse_indices=(keys, inverse)).to(device)


def workloads(small: bool) -> List[VbeWorkload]:
    if small:
        return [VbeWorkload(256, 5_000, 16, 3, 5, 5)]
    return [VbeWorkload(8192, 1_000_000, 128, 8, 18, 20)]


class _Module:
    def __init__(self, module) -> None:
        self.module = module

    def load(self, weights: List[torch.Tensor]) -> None:
        with torch.no_grad():
            for bag, w in zip(self.module.embedding_bags.values(), weights):
                bag.weight.copy_(w)

    def forward(self, kjt) -> torch.Tensor:
        return self.module(kjt).values()

    def train_step(self, kjt) -> None:
        out = self.module(kjt).values()
        out.backward(upstream_ones(self, [out])[0])


class _Fbgemm:
    def __init__(self, w: VbeWorkload, device) -> None:
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

        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(t.num_embeddings, t.embedding_dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
                             for t in w.tables()],
            optimizer=EmbOptimType.EXACT_SGD, learning_rate=LR, pooling_mode=PoolingMode.SUM,
            weights_precision=SparseType.FP32, output_dtype=SparseType.FP32, device=device,
            bounds_check_mode=BoundsCheckMode.WARNING)
        self.per_feature = [[s] for s in w.strides()]
        self.w = w

    def load(self, weights: List[torch.Tensor]) -> None:
        with torch.no_grad():
            for mine, weight in zip(self.tbe.split_embedding_weights(), weights):
                mine.copy_(weight)

    def forward(self, kjt) -> torch.Tensor:
        return self.tbe(kjt.values(), kjt.offsets(), batch_size_per_feature_per_rank=self.per_feature)

    def train_step(self, kjt) -> None:
        out = self.forward(kjt)
        out.backward(upstream_ones(self, [out])[0])

    def expanded(self, out: torch.Tensor, kjt) -> torch.Tensor:
        """fbgemm's per-feature bags expanded to the batch's rows (to compare with a module's output)."""
        inverse = kjt.inverse_indices()[1]
        pieces, at = [], 0
        for f, s in enumerate(self.w.strides()):
            bags = out[at:at + s * self.w.dim].view(s, self.w.dim)
            pieces.append(bags[inverse[f].long()])
            at += s * self.w.dim
        return torch.cat(pieces, dim=1)


class _FbgemmExpanded(_Fbgemm):
    """fbgemm's VBE TBE, then its bags expanded to the batch's rows as sharded torchrec expands them
    (torchrec/distributed/embeddingbag.py, the VBE output's wait: ``batch_index_select_dim0``). A
    build of fbgemm without that kernel for this GPU (the GPU stack's sm_90 build) expands with
    torch's ``index_select`` a feature and one ``cat``, as the row's ``expansion`` says."""

    def __init__(self, w: VbeWorkload, device) -> None:
        super().__init__(w, device)
        self.strides, self.columns = w.strides(), [w.dim] * len(w.strides())  # (not rebuilt in the timed calls)
        self.expansion = "batch_index_select_dim0"
        try:
            self._fbgemm_expand(torch.zeros(2 * w.dim * len(w.strides()), device=device),
                                torch.zeros(len(w.strides()), 1, dtype=torch.int64, device=device), [2] * len(w.strides()))
        except RuntimeError:
            self.expansion = "index_select+cat"

    def _fbgemm_expand(self, flat, inverse, strides) -> torch.Tensor:
        batch, features = inverse.shape[1], inverse.shape[0]
        return torch.ops.fbgemm.batch_index_select_dim0(
            inputs=flat, indices=inverse.reshape(-1), input_num_indices=[batch] * features, input_rows=strides,
            input_columns=self.columns, permute_output_dim_0_1=True).view(batch, -1)

    def forward(self, kjt) -> torch.Tensor:
        flat = super().forward(kjt)
        if self.expansion == "batch_index_select_dim0":
            return self._fbgemm_expand(flat, kjt.inverse_indices()[1], self.strides)
        return super().expanded(flat, kjt)

    def expanded(self, out: torch.Tensor, kjt) -> torch.Tensor:
        return out


def run_vbe(device: torch.device, small: bool, iters: int = 20, warmup: int = 5,
            drawn: Optional[List[VbeWorkload]] = None, peers: Optional[List[str]] = None,
            phases: Optional[List[str]] = None) -> List[Dict]:
    """Per workload (the named one, or ``drawn``), phase and peer: median ms, forwards compared
    with ours. ``peers`` and ``phases`` narrow the run (ours always runs; fbgemm+expand with
    fbgemm); a peer that fails gives an ``error`` row."""
    from .peers import fbgemm_available

    rows: List[Dict] = []
    for w in drawn if drawn is not None else workloads(small):
        kjt = w.make_input(device)
        name = w.label()
        torch.manual_seed(0)
        weights = [torch.empty(w.rows, w.dim, device=device).uniform_(-0.01, 0.01) for _ in w.tables()]
        names = ["recom_rec", "torchrec"] + (["fbgemm", "fbgemm+expand"] if device.type == "cuda" and fbgemm_available(device) else [])
        names = [n for n in names if peers is None or n == "recom_rec" or n.split("+")[0] in peers]
        for phase in ("forward", "sgd"):
            if phases is not None and phase not in phases:
                continue

            def make(peer_name, phase=phase):
                peer = _make_peer(peer_name, w, device, phase)
                peer.load(weights)
                return peer

            def comparable(peer_name, peer):
                return (lambda out: peer.expanded(out, kjt)) if peer_name.startswith("fbgemm") else (lambda out: out)

            def annotate(peer_name, peer, row):
                if peer_name == "fbgemm+expand":
                    row["expansion"] = peer.expansion

            timed = [n for n in names if not (phase == "sgd" and n == "torchrec")]
            rows += time_beside_ours(timed, make, kjt, phase, device, warmup, iters, comparable,
                                     {"workload": name, "phase": phase, "ids": kjt.values().numel()}, annotate)
        del weights
    return rows


def _make_peer(peer_name: str, w: VbeWorkload, device: torch.device, phase: str):
    import torchrec

    import recom_rec

    if peer_name == "fbgemm":
        return _Fbgemm(w, device)
    if peer_name == "fbgemm+expand":
        return _FbgemmExpanded(w, device)
    if peer_name == "recom_rec":
        module = recom_rec.EmbeddingBagCollection(w.tables(), device=device)
        if phase == "sgd":
            module.enable_fused_optimizer("sgd", lr=LR)
        return _Module(module)
    return _Module(torchrec.EmbeddingBagCollection(w.tables(), device=device))


def format_vbe(rows: List[Dict]) -> str:
    table = format_peers("vbe (a batch size per feature; fbgemm+expand: its output expanded as sharded torchrec does)",
                         rows, peers=("recom_rec", "fbgemm", "fbgemm+expand", "torchrec"))
    expansions = sorted({r["expansion"] for r in rows if "expansion" in r})
    return table + ("\nfbgemm+expand expanded with " + ", ".join(expansions) if expansions else "")
