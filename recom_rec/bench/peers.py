"""The modules the benchmark runs, each behind the same small interface: build on a device,
forward on a KJT, one training step on a KJT."""
from typing import Callable, Dict, List, Optional

import torch
import torchrec

import recom_rec

from .workloads import Workload


class Peer:
    name = ""

    def __init__(self, workload: Workload, device: torch.device, optimizer: str) -> None:
        self.workload, self.device, self.optimizer = workload, device, optimizer

    def forward(self, kjt) -> torch.Tensor:
        raise NotImplementedError

    def train_step(self, kjt, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def load(self, weights: List[torch.Tensor]) -> None:
        """Copies ``weights`` (one tensor a table, in the workload's order) into this peer's tables."""
        with torch.no_grad():
            for mine, weight in zip(self.tables(), weights):
                mine.copy_(weight)

    def tables(self) -> List[torch.Tensor]:
        raise NotImplementedError

    @property
    def output_width(self) -> int:
        """Columns of this peer's forward output (what a training step's upstream gradient needs)."""
        return sum(self.workload.dims)


class _ModulePeer(Peer):
    """torchrec-style modules (ours, torchrec's): dense gradients, then the optimizer."""

    def __init__(self, workload, device, optimizer, module) -> None:
        super().__init__(workload, device, optimizer)
        self.module = module
        # Held once, as a user's optimizer holds its parameters: walking the module's tree each
        # step costs ~6 us a table (6 ms a step with 1000 tables) for both module peers. The
        # trainable ones only (ours with group_parameters has frozen per-table views).
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt = _dense_optimizer(optimizer, self.params)

    def forward(self, kjt):
        return self.module(kjt).values()

    def train_step(self, kjt, grad):
        self.step_from(self.module(kjt).values(), grad)

    def tables(self):
        return [bag.weight for bag in self.module.embedding_bags.values()]

    def step_from(self, out, grad):
        """train_step after its forward: the backward of ``out``, the optimizer, the gradients dropped."""
        out.backward(grad)
        if self.opt is not None:
            self.opt.step()
        for p in self.params:
            p.grad = None


def _dense_optimizer(name: str, params):
    if name == "none":
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    if name == "rowwise_adagrad":
        from torchrec.optim import RowWiseAdagrad

        return RowWiseAdagrad(params, lr=0.01)
    raise ValueError(f"no dense optimizer {name!r} for this peer")


class RecomRec(_ModulePeer):
    """Ours at its defaults (the kernels check every id: ops/input_check.py): with an optimizer,
    fused into the backward (no dense gradient, no optimizer step)."""

    name = "recom_rec"

    def __init__(self, workload, device, optimizer, backend="auto", group_parameters=False):
        module = recom_rec.EmbeddingBagCollection(workload.tables(), device=device, backend=backend,
                                                  group_parameters=group_parameters)
        self.fused = optimizer != "none"
        if self.fused:
            module.enable_fused_optimizer(optimizer, lr=0.01)
        super().__init__(workload, device, "none", module)

    def train_step(self, kjt, grad):
        if not self.fused:
            return super().train_step(kjt, grad)
        # The update happens inside the backward and the tables never get a .grad: nothing to
        # step or clear (walking hundreds of Parameters to reset .grad would be host time only).
        self.module(kjt).values().backward(grad)


class TorchrecEBC(_ModulePeer):
    name = "torchrec"

    def __init__(self, workload, device, optimizer):
        super().__init__(workload, device, optimizer, torchrec.EmbeddingBagCollection(workload.tables(), device=device))


class CompiledTorchrecEBC(_ModulePeer):
    name = "compile"

    def __init__(self, workload, device, optimizer):
        super().__init__(workload, device, optimizer, torchrec.EmbeddingBagCollection(workload.tables(), device=device))
        self.compiled = torch.compile(self.module)

    def forward(self, kjt):
        return self.compiled(kjt).values()

    def train_step(self, kjt, grad):
        self.step_from(self.compiled(kjt).values(), grad)


def fbgemm_available(device: torch.device) -> bool:
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception:
        return False
    return True


def fbgemm_bounds_check(checked: bool):
    """fbgemm's BoundsCheckMode: its default (WARNING: a kernel before each lookup clamps ids out of
    range to row 0 and counts them; what sharded torchrec trains with; ours checks ids inside its
    lookup kernels, no kernel of its own), or NONE (no check)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

    return BoundsCheckMode.WARNING if checked else BoundsCheckMode.NONE


class FbgemmTBE(Peer):
    """fbgemm's table-batched embedding (what sharded torchrec runs), optimizer fused into its
    backward (it has no plain-gradient mode), with its default bounds check.

    Its kernels need every dim a multiple of 4 (sharded torchrec asserts it too), so a layout with
    other dims runs here as a user of fbgemm would have to build it: each such table padded up to
    the next multiple of 4. Its output keeps the padding columns (no narrowing copy is timed: the
    comparison favours fbgemm); the padding starts at zero, and ``tables()`` are the unpadded
    views, so ``load`` fills the real columns. One TBE pools every table by sum: a layout's mean
    tables cost it a sum's work (sharded torchrec runs a TBE per pooling), also in its favour."""

    name = "fbgemm"
    bounds_checked = True

    def __init__(self, workload, device, optimizer):
        super().__init__(workload, device, optimizer)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        cuda = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
        opt = {"sgd": OptimType.EXACT_SGD, "none": OptimType.EXACT_SGD,
               "rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD}[optimizer]
        self.padded_dims = [-(-d // 4) * 4 for d in workload.dims]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(n, d, location, compute) for n, d in zip(workload.rows, self.padded_dims)],
            optimizer=opt, learning_rate=0.01, pooling_mode=PoolingMode.SUM,
            weights_precision=SparseType.FP32, output_dtype=SparseType.FP32,
            device=device if cuda else None, bounds_check_mode=fbgemm_bounds_check(self.bounds_checked),
        )
        with torch.no_grad():
            for weight, d in zip(self.tbe.split_embedding_weights(), workload.dims):
                weight[:, d:].zero_()

    def forward(self, kjt):
        return self.tbe(kjt.values(), kjt.offsets())

    def tables(self):
        return [w[:, :d] for w, d in zip(self.tbe.split_embedding_weights(), self.workload.dims)]

    @property
    def padded(self) -> bool:
        return self.padded_dims != list(self.workload.dims)

    @property
    def output_width(self) -> int:
        return sum(self.padded_dims)

    def train_step(self, kjt, grad):
        self.tbe(kjt.values(), kjt.offsets()).backward(grad)


class FbgemmTBEUnchecked(FbgemmTBE):
    """fbgemm's TBE without its bounds check: less work than ours, whose kernels check every id
    (the like-for-like peer is ``fbgemm``)."""

    name = "fbgemm_unchecked"
    bounds_checked = False


PEERS: Dict[str, Callable[..., Peer]] = {
    "recom_rec": RecomRec,
    "torchrec": TorchrecEBC,
    "fbgemm": FbgemmTBE,
    "fbgemm_unchecked": FbgemmTBEUnchecked,
    "compile": CompiledTorchrecEBC,
}
# Ours with a pinned backend, side by side with the default ("recom_rec", --backend).
PINNED_BACKENDS = ("recom_rec:triton", "recom_rec:cuda", "recom_rec:torch")
# Ours built with group_parameters=True (one trainable Parameter a dtype group: the `backward`
# phase's dense gradients come as one tensor a group), at --backend.
GROUP_PARAMETERS = "recom_rec:group-params"


def make_peer(name: str, workload, device, optimizer, backend: str = "auto") -> Peer:
    if name == GROUP_PARAMETERS:
        return RecomRec(workload, device, optimizer, backend=backend, group_parameters=True)
    if name.startswith("recom_rec:"):
        return RecomRec(workload, device, optimizer, backend=name.split(":", 1)[1])
    if name == "recom_rec":
        return RecomRec(workload, device, optimizer, backend=backend)
    return PEERS[name](workload, device, optimizer)
