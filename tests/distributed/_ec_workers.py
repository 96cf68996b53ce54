"""Worker processes of the EmbeddingCollection sharding tests (gloo on the CPU, NCCL on GPUs).

Each worker builds the same sequence model under one seed, shards its ``recom_rec.EmbeddingCollection``
with DistributedModelParallel and our sharder, trains a few steps on its slice of a global batch,
and checks against the unsharded module trained on the whole batch: each feature's embeddings
(the rank's rows) at every step, and the tables after training (gathered from the sharded
state_dict)."""
import random
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from recom_rec.distributed import EmbeddingCollectionSharder
from tests.distributed import _workers
from tests.distributed._workers import gather_full, in_process_group

LR = 0.1
STEPS = 3
BATCH = 3  # per rank
FEATURES = ["s0", "s1", "s2", "s3"]
DIM = 4


def tables() -> List[EmbeddingConfig]:
    return [EmbeddingConfig(name="t0", embedding_dim=DIM, num_embeddings=13, feature_names=["s0", "s1"]),
            EmbeddingConfig(name="t1", embedding_dim=DIM, num_embeddings=7, feature_names=["s2"]),
            EmbeddingConfig(name="t2", embedding_dim=DIM, num_embeddings=10, feature_names=["s3"])]


FUSED = "fused"
PLANS = {
    "table_wise": lambda w: {"t0": table_wise(rank=0, compute_kernel=FUSED), "t1": table_wise(rank=w - 1),
                             "t2": table_wise(rank=0, compute_kernel=FUSED)},
    "column_wise": lambda w: {t: column_wise(ranks=[0, 1 % w], compute_kernel=FUSED) for t in ("t0", "t1", "t2")},
    "row_wise": lambda w: {t: row_wise(compute_kernel=FUSED) for t in ("t0", "t1", "t2")},
    "data_parallel": lambda w: {t: data_parallel() for t in ("t0", "t1", "t2")},
    "mixed": lambda w: {"t0": row_wise(compute_kernel=FUSED), "t1": column_wise(ranks=[1 % w, 0], compute_kernel=FUSED),
                        "t2": data_parallel()},
}


class Model(torch.nn.Module):
    def __init__(self, device) -> None:
        super().__init__()
        self.ec = recom_rec.EmbeddingCollection(tables(), device=device)

    def forward(self, kjt):
        return self.ec(kjt)


def batch(step: int, world: int) -> List[Dict[str, List[int]]]:
    rng = random.Random(step)
    limits = {f: t.num_embeddings for t in tables() for f in t.feature_names}
    return [{f: [rng.randrange(limits[f]) for _ in range(rng.randint(0, 3))] for f in FEATURES}
            for _ in range(BATCH * world)]


def to_kjt(samples: List[Dict[str, List[int]]], device) -> KeyedJaggedTensor:
    lengths = [len(s[f]) for f in FEATURES for s in samples]
    values = [i for f in FEATURES for s in samples for i in s[f]]
    return KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=torch.tensor(values, dtype=torch.int64),
                                               lengths=torch.tensor(lengths)).to(device)


def _rank_rows(jt, rank: int) -> torch.Tensor:
    offsets = jt.offsets()
    return jt.values()[int(offsets[rank * BATCH]):int(offsets[(rank + 1) * BATCH])]


def _loss(out) -> torch.Tensor:
    return sum((jt.values() * torch.arange(1, DIM + 1, device=jt.values().device)).square().sum()
               for jt in out.values())


def run_cases(rank: int, world: int, port: int, cases: List[Tuple[str, str]], backend: str = "gloo") -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _workers.DEV = device  # gather_full's device

    def work() -> None:
        for case, via in cases:
            if via.startswith("checkpoint:"):
                check_checkpoint(rank, world, case, via.split(":", 1)[1], device)
            elif via == "variable_batch":
                check_variable_batch(rank, world, case, device)
            else:
                check_parity(rank, world, case, via, device)

    in_process_group(rank, world, port, backend, work)


def _shard(model: Model, case: str, world: int, device) -> DistributedModelParallel:
    sharder = EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    plan = ShardingPlan({"ec": construct_module_sharding_plan(model.ec, PLANS[case](world), sharder=sharder,
                                                              local_size=world, world_size=world,
                                                              device_type=device.type)})
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                    sharders=[sharder], device=device)


def _full(state, name: str) -> torch.Tensor:
    rows = {t.name: t.num_embeddings for t in tables()}[name]
    return gather_full(state[f"ec.embeddings.{name}.weight"], (rows, DIM))


def check_checkpoint(rank: int, world: int, case: str, path: str, device) -> None:
    """The sharded state_dict (torchrec's layout) saved with torch.distributed.checkpoint after a
    training step and loaded into a differently initialised sharded model: same tables, same
    embeddings; an unsharded checkpoint loads too."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    dmp = _shard(Model(device), case, world, device)
    torch.manual_seed(0)
    ref = Model(device)
    for config in tables():  # the sharded module starts from the unsharded module's weights
        torch.testing.assert_close(_full(dmp.state_dict(), config.name).to(device),
                                   ref.ec.embeddings[config.name].weight.detach())
    samples = batch(0, world)
    out = dmp(to_kjt(samples[rank * BATCH:(rank + 1) * BATCH], device))
    _loss(out.wait() if hasattr(out, "wait") else out).backward()
    dcp.save(dmp.state_dict(), checkpoint_id=path)
    torch.manual_seed(1)
    other = _shard(Model(device), case, world, device)
    assert not torch.allclose(_full(other.state_dict(), "t0"), _full(dmp.state_dict(), "t0"))
    restored = other.state_dict()
    dcp.load(restored, checkpoint_id=path)
    other.load_state_dict(restored)
    for config in tables():
        torch.testing.assert_close(_full(other.state_dict(), config.name), _full(dmp.state_dict(), config.name),
                                   msg=lambda m: f"{case}: {config.name} after load: {m}")
    mine = to_kjt(batch(1, world)[rank * BATCH:(rank + 1) * BATCH], device)
    with torch.no_grad():
        a, b = dmp(mine), other(mine)
        a, b = (x.wait() if hasattr(x, "wait") else x for x in (a, b))
    for key in a:
        torch.testing.assert_close(a[key].values(), b[key].values())
    other.load_state_dict(ref.state_dict())
    for config in tables():
        torch.testing.assert_close(_full(other.state_dict(), config.name).to(device),
                                   ref.ec.embeddings[config.name].weight.detach())
    if rank == 0:
        print(f"EmbeddingCollection checkpoint {case}, world {world}: round trip", flush=True)


def check_parity(rank: int, world: int, case: str, optimizer_via: str, device) -> None:
    torch.manual_seed(0)
    model = Model(device)
    torch.manual_seed(0)
    ref = Model(device)
    ref.ec.enable_fused_optimizer("sgd", lr=LR)
    fused_params = None
    if optimizer_via == "apply_optimizer_in_backward":
        apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": LR})
    else:
        fused_params = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    sharder = EmbeddingCollectionSharder(fused_params=fused_params)
    if case == "default_dmp":  # no plan: torchrec's planner places the tables with our sharder's options
        plan = None
    else:
        plan = ShardingPlan({"ec": construct_module_sharding_plan(model.ec, PLANS[case](world), sharder=sharder,
                                                                  local_size=world, world_size=world,
                                                                  device_type=device.type)})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=device)
    assert type(dmp.module.ec).__name__ == "ShardedFusedEmbeddingCollection", type(dmp.module.ec)
    fused_keys = set(dmp.fused_optimizer.params)
    for name, sharding in dmp.plan.plan["ec"].items():
        if sharding.compute_kernel == FUSED and rank in (sharding.ranks or []):
            assert f"ec.embeddings.{name}.weight" in fused_keys, (name, sorted(fused_keys))
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_opt = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=LR)) if dense else None
    for step in range(STEPS):
        samples = batch(step, world)
        out = dmp(to_kjt(samples[rank * BATCH:(rank + 1) * BATCH], device))
        out = out.wait() if hasattr(out, "wait") else out
        want = ref(to_kjt(samples, device))
        assert sorted(out) == sorted(want), (sorted(out), sorted(want))
        for key in want:
            torch.testing.assert_close(out[key].values(), _rank_rows(want[key], rank), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case} step {step} feature {key}: {m}")
        # torchrec divides model-parallel gradients by the world size (and DDP averages): the
        # sharded model trains on the mean of the ranks' losses.
        _loss(out).backward()
        (_loss(want) / world).backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
    _check_weights(dmp, ref, device, case)
    if rank == 0:
        print(f"EmbeddingCollection {case} ({optimizer_via}), world {world}: parity", flush=True)


def _check_weights(dmp, ref: Model, device, case: str) -> None:
    """Every table of the sharded model, gathered, equals the unsharded model's."""
    state = dmp.state_dict()
    for config in tables():
        full = gather_full(state[f"ec.embeddings.{config.name}.weight"], (config.num_embeddings, DIM))
        torch.testing.assert_close(full.to(device), ref.ec.embeddings[config.name].weight.detach(), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{case}: {config.name} after {STEPS} steps: {m}")



def vbe_batch(step: int, rank: int, device) -> KeyedJaggedTensor:
    """Rank ``rank``'s batch of a step with a batch size per feature (1-5 bags a key, differing by
    key and rank; 0-3 ids a bag)."""
    rng = random.Random(5000 + 17 * step + rank)
    limits = {f: t.num_embeddings for t in tables() for f in t.feature_names}
    bags = {f: [[rng.randrange(limits[f]) for _ in range(rng.randint(0, 3))] for _ in range(rng.randint(1, 5))]
            for f in FEATURES}
    return KeyedJaggedTensor(
        keys=FEATURES, values=torch.tensor([i for f in FEATURES for bag in bags[f] for i in bag], dtype=torch.int64),
        lengths=torch.tensor([len(bag) for f in FEATURES for bag in bags[f]], dtype=torch.int64),
        stride_per_key_per_rank=[[len(bags[f])] for f in FEATURES]).to(device)


def check_variable_batch(rank: int, world: int, case: str, device) -> None:
    """VBE batches through the sharded module: each feature's JaggedTensor (its own bags, its ids'
    rows) equal to the unsharded module's on the rank's batch, and the weights after fused SGD steps
    equal to the unsharded module's trained on the mean of the ranks' losses."""
    torch.manual_seed(0)
    model = Model(device)
    torch.manual_seed(0)
    ref = Model(device)
    ref.ec.enable_fused_optimizer("sgd", lr=LR)
    dmp = _shard(model, case, world, device)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))  # dense-kernel and data-parallel tables
    dense_opt = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=LR)) if dense else None
    for step in range(STEPS):
        mine = vbe_batch(step, rank, device)
        out = dmp(mine)
        out = out.wait() if hasattr(out, "wait") else out
        refs = [ref(vbe_batch(step, r, device)) for r in range(world)]
        for key, want in refs[rank].items():
            assert torch.equal(out[key].lengths(), want.lengths()), (case, step, key, out[key].lengths(), want.lengths())
            torch.testing.assert_close(out[key].values(), want.values(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case} VBE step {step} feature {key}: {m}")
        _loss(out).backward()
        (sum(_loss(r) for r in refs) / world).backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
    _check_weights(dmp, ref, device, f"{case} VBE")
    if rank == 0:
        print(f"EmbeddingCollection {case} with a batch size per feature, world {world}: parity", flush=True)
