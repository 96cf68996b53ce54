"""Worker processes for tests/distributed/test_wrapped_sharding.py: torchrec's wrappers around an
EmbeddingBagCollection (managed collision, feature processed) under DistributedModelParallel,
sharded by torchrec's wrapper sharders built on our sharder. Each case builds the same model
twice under one seed, once around ``recom_rec.EmbeddingBagCollection`` (our sharder inside the
wrapper's sharder) and once around torchrec's (torchrec's sharders), shards both with the same
plan and trains both with fused SGD on the same batches: outputs, remapped ids, position-weight
gradients and the tables after training must agree."""
import random
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as TorchrecSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import recom_rec
from recom_rec.distributed import EmbeddingBagCollectionSharder
from recom_rec.distributed import lookup as lookup_module
from tests.distributed import _workers
from tests.distributed._workers import gather_full, in_process_group

LR = 0.1
STEPS = 3
BATCH = 3  # per rank
SLOTS = 16  # rows of each table = managed-collision slots
RAW_IDS = 1000  # raw ids of the managed-collision model (remapped into the slots)
MAX_LENGTH = 3  # position weights per feature
FUSED = {
    "sgd": {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
    # state per row: the managed-collision eviction resets it for the slots given to new ids
    "rowwise_adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8},
}


def tables() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t1", num_embeddings=SLOTS, embedding_dim=4, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", num_embeddings=SLOTS, embedding_dim=8, feature_names=["f2"]),
    ]


PLANS = {
    "table_wise": lambda w: {"t1": table_wise(rank=0, compute_kernel="fused"),
                             "t2": table_wise(rank=w - 1, compute_kernel="fused")},
    "row_wise": lambda w: {"t1": row_wise(compute_kernel="fused"), "t2": row_wise(compute_kernel="fused")},
}


class Top(nn.Module):
    def __init__(self, wrapped: nn.Module) -> None:
        super().__init__()
        self.wrapped = wrapped

    def forward(self, kjt: KeyedJaggedTensor):
        return self.wrapped(kjt)


def _ebc(ours: bool, weighted: bool, device: torch.device, meta: bool) -> nn.Module:
    cls = recom_rec.EmbeddingBagCollection if ours else TorchrecEBC
    if meta:  # how large models are built for DistributedModelParallel
        with torch.device("meta"):
            return cls(tables(), is_weighted=weighted)
    return cls(tables(), is_weighted=weighted, device=device)


def mc_model(ours: bool, device: torch.device, meta: bool = False) -> Top:
    ebc = _ebc(ours, False, device, meta)
    configs = ebc.embedding_bag_configs()
    mcc = ManagedCollisionCollection({
        c.name: MCHManagedCollisionModule(zch_size=SLOTS, device=device, eviction_interval=1,
                                          input_hash_size=RAW_IDS, eviction_policy=DistanceLFU_EvictionPolicy())
        for c in configs
    }, configs)
    return Top(ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=True))


def fp_model(ours: bool, device: torch.device, meta: bool = False) -> Top:
    processors = PositionWeightedModuleCollection({"f1": MAX_LENGTH, "f2": MAX_LENGTH}, device=device)
    with torch.no_grad():  # not all ones, so that the weights matter
        for name, w in processors.position_weights.items():
            w.copy_(torch.linspace(0.5, 1.5, MAX_LENGTH))
    return Top(FeatureProcessedEmbeddingBagCollection(_ebc(ours, True, device, meta), processors))


def _sharder(kind: str, ours: bool, opt: str):
    fused = FUSED[opt]
    ebc_sharder = EmbeddingBagCollectionSharder(fused_params=fused) if ours else TorchrecSharder(fused_params=fused)
    if kind == "mc":
        return ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=ebc_sharder,
                                                             mc_sharder=ManagedCollisionCollectionSharder())
    return FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc_sharder)


def batch(step: int, world: int, rank: int, max_id: int) -> KeyedJaggedTensor:
    """This rank's slice of the step's global batch (bags of 0 to MAX_LENGTH ids)."""
    rng = random.Random(500 + step)
    samples = [{f: [rng.randrange(max_id) for _ in range(rng.randrange(0, MAX_LENGTH + 1))] for f in ("f1", "f2")}
               for _ in range(world * BATCH)]
    mine = samples[rank * BATCH:(rank + 1) * BATCH]
    values, lengths = [], []
    for f in ("f1", "f2"):
        for s in mine:
            values.extend(s[f])
            lengths.append(len(s[f]))
    return KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.tensor(values, dtype=torch.int64),
                                               lengths=torch.tensor(lengths, dtype=torch.int64)).to(_workers.DEV)


def _shard(model: Top, kind: str, ours: bool, case: str, world: int, opt: str) -> DistributedModelParallel:
    sharder = _sharder(kind, ours, opt)
    plan = ShardingPlan({"wrapped": construct_module_sharding_plan(
        model.wrapped, PLANS[case](world), sharder=sharder, local_size=world, world_size=world,
        device_type=_workers.DEV.type)})
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                    sharders=[sharder], device=_workers.DEV)


def _wait(x):
    from torchrec.distributed.types import LazyAwaitable

    return x.wait() if isinstance(x, LazyAwaitable) else x


def _loss(kt) -> torch.Tensor:
    total = 0
    for key, value in kt.to_dict().items():
        scale = torch.linspace(-1.0, 1.5, value.shape[1], device=value.device) * (2 if key == "f2" else 1)
        total = total + (value * scale).sum()
    return total


def _tables_of(dmp: DistributedModelParallel, prefix: str) -> Dict[str, torch.Tensor]:
    state = dmp.state_dict()
    return {c.name: gather_full(state[f"{prefix}embedding_bags.{c.name}.weight"], (c.num_embeddings, c.embedding_dim))
            for c in tables()}


def check_wrapped(rank: int, world: int, kind: str, case: str, build: str, opt: str = "sgd") -> None:
    """``kind`` "mc" or "fp"; ``build`` "device" (built on the worker's device) or "meta" (ours
    built under ``with torch.device("meta")``, materialised by DistributedModelParallel and
    loaded from the twin's checkpoint); ``opt`` the fused optimizer (a FUSED key)."""
    make: Callable[..., Top] = mc_model if kind == "mc" else fp_model
    torch.manual_seed(0)
    theirs = _shard(make(False, _workers.DEV), kind, False, case, world, opt)
    torch.manual_seed(0)
    model = make(True, _workers.DEV, build == "meta")
    if build == "meta":
        ebc = model.wrapped._embedding_module if kind == "mc" else model.wrapped._embedding_bag_collection
        assert ebc.device.type == "meta" and ebc.embedding_bags["t1"].weight.is_meta
    ours = _shard(model, kind, True, case, world, opt)
    # torchrec's sharded module draws its own initial weights (init_fn per shard): start ours
    # from them (through torchrec's ShardedTensor checkpoint format).
    ours.load_state_dict(theirs.state_dict())
    prefix = "wrapped._embedding_module." if kind == "mc" else "wrapped._embedding_bag_collection."
    for name, w in _tables_of(theirs, prefix).items():
        torch.testing.assert_close(_tables_of(ours, prefix)[name], w, msg=f"{kind} {case}: initial {name}")
    max_id = RAW_IDS if kind == "mc" else SLOTS
    # Count the slots torchrec's sharded managed-collision module hands to new ids through our
    # lookup (a spy around the real method): the batches are sized so that it happens.
    evicted = []
    reset = lookup_module._EvictionView.reset_embedding_weight_momentum

    def counting_reset(view, *args, **kwargs):
        evicted.append((args[0] if args else kwargs["pruned_indices"]).numel())
        return reset(view, *args, **kwargs)

    lookup_module._EvictionView.reset_embedding_weight_momentum = counting_reset
    for step in range(STEPS):
        kjt = batch(step, world, rank, max_id)
        # Slots given to new ids are re-initialised with the table's init_fn (random): same seed.
        torch.manual_seed(100 + step)
        out_ours = ours(kjt)
        torch.manual_seed(100 + step)
        out_theirs = theirs(kjt)
        if kind == "mc":
            (kt_ours, remapped_ours), (kt_theirs, remapped_theirs) = out_ours, out_theirs
            remapped_ours, remapped_theirs = _wait(remapped_ours), _wait(remapped_theirs)
            for key in ("f1", "f2"):
                got, want = remapped_ours[key].values(), remapped_theirs[key].values()
                assert torch.equal(got, want), (case, step, key, got, want)
                assert bool(((got >= 0) & (got < SLOTS)).all()), (case, step, key, got)
        else:
            kt_ours, kt_theirs = out_ours, out_theirs
        kt_ours, kt_theirs = _wait(kt_ours), _wait(kt_theirs)
        for key, want in kt_theirs.to_dict().items():
            torch.testing.assert_close(kt_ours[key], want, msg=f"{kind} {case} step {step} key {key}")
        _loss(kt_theirs).backward()
        _loss(kt_ours).backward()
        if kind == "fp":
            # Position weights are dense parameters (data parallel): their gradient runs through
            # our op's per-sample-weight backward and the all-to-all.
            for key in ("f1", "f2"):
                got = dict(ours.named_parameters())[f"wrapped._feature_processors.position_weights.{key}"].grad
                want = dict(theirs.named_parameters())[f"wrapped._feature_processors.position_weights.{key}"].grad
                assert got is not None, (case, step, key)
                torch.testing.assert_close(got, want, msg=f"fp {case} step {step} position weights {key}")
                reached = got.abs().sum()
                dist.all_reduce(reached)  # table-wise: only the rank holding the table has a gradient
                assert float(reached) > 0, (case, step, key)
            for dmp in (ours, theirs):
                for p in dmp.parameters():
                    p.grad = None
    lookup_module._EvictionView.reset_embedding_weight_momentum = reset
    if kind == "mc":
        total = torch.tensor([sum(evicted)], device=_workers.DEV)
        dist.all_reduce(total)
        assert int(total) > 0, "no slot was reassigned: the eviction path went untested"
    final_theirs = _tables_of(theirs, prefix)
    final_ours = _tables_of(ours, prefix)
    for name, w in final_theirs.items():
        torch.testing.assert_close(final_ours[name], w, msg=f"{kind} {case}: {name} after {STEPS} fused {opt} steps")


def run_wrapped(rank: int, world: int, port: int, cases: List[tuple], backend: str = "gloo") -> None:
    if backend == "nccl":
        _workers.DEV = torch.device("cuda", rank)
        torch.cuda.set_device(_workers.DEV)

    def work() -> None:
        for case in cases:
            check_wrapped(rank, world, *case)

    in_process_group(rank, world, port, backend, work)
