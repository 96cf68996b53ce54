"""Worker processes for the parameter-server placement test: the planner puts a table that does
not fit in HBM into the PS tier; the sharded model trains like the unsharded one. gloo on the CPU;
NCCL with one GPU a rank (each rank's row cache in its GPU's memory) when the suite runs with CUDA
tensors on two GPUs or more."""
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import recom_rec
from recom_rec.distributed import EmbeddingBagCollectionSharder
from recom_rec.distributed.planner import build_plan
from recom_rec.distributed.ps_placement import PS_KERNEL, shard_table_name
from tests.distributed._workers import _wait, in_process_group

LR = 0.1
BATCH = 3  # per rank
STEPS = 4
BIG_ROWS = 200_000
CAP = 2_000_000  # bytes of device memory per rank: the big table (9.6 MB as fp32) does not fit, its cache does
# A store outside the host's memory budget, as a user's own store would be (the embedded memory://
# store counts against host memory, which is the CPU's device memory here): in-process for the test.
REMOTE = "remote"
DEV = torch.device("cpu")  # this worker's device: cuda:rank under NCCL (set by run)


def register_remote_store() -> None:
    from recom_rec.ps import register_store
    from recom_rec.ps.stores.memory import MemoryStore

    register_store(REMOTE, lambda url: MemoryStore(url.split("://", 1)[1]), replace=True)


def tables() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=20, embedding_dim=4, feature_names=["f0"]),
        EmbeddingBagConfig(name="big", num_embeddings=BIG_ROWS, embedding_dim=12, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", num_embeddings=13, embedding_dim=12, feature_names=["f2"]),
    ]


class Model(nn.Module):
    def __init__(self, device="cpu") -> None:
        super().__init__()
        self.ebc = recom_rec.EmbeddingBagCollection(tables(), device=device)

    def forward(self, kjt):
        return self.ebc(kjt)


def sharder(rank: int, placement: str, url: Optional[str] = None) -> EmbeddingBagCollectionSharder:
    """``url``: one store every rank shares (its shards' names keep their rows apart); else one
    in-process store a rank."""
    return EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
                                         # 10 cache slots per 100,000-row shard: rows are evicted
                                         # to the store and pulled back between steps
                                         ps_url=url or f"{REMOTE}://ps-{placement}-{rank}", ps_cache_load_factor=1e-4)


def batch(step: int, world: int) -> List[Dict[str, List[int]]]:
    g = torch.Generator().manual_seed(1000 + step)
    limits = {"f0": 20, "f1": BIG_ROWS, "f2": 13}
    return [{k: torch.randint(0, n, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
             for k, n in limits.items()} for _ in range(BATCH * world)]


def to_kjt(samples) -> KeyedJaggedTensor:
    keys = ["f0", "f1", "f2"]
    values = [i for k in keys for s in samples for i in s[k]]
    lengths = [len(s[k]) for k in keys for s in samples]
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                                               lengths=torch.tensor(lengths, dtype=torch.int64)).to(DEV)


def loss_of(kt) -> torch.Tensor:
    # Per key: a sharded module may order its output keys differently.
    total = 0.0
    for key in sorted(kt.keys()):
        v = kt[key]
        total = total + (v * torch.arange(1, v.shape[1] + 1, dtype=torch.float32, device=v.device)).sum() \
            + 0.1 * v.pow(2).sum()
    return total


def _shard(model, rank: int, world: int, placement: str, url: Optional[str] = None):
    if placement == "planner":
        # the cap on the device's memory: DDR for the CPU, HBM for a GPU
        cap = {"hbm_cap": CAP} if DEV.type == "cuda" else {"ddr_cap": CAP}
        plan = build_plan(model, [sharder(rank, placement, url)], world_size=world, batch_size=BATCH,
                          compute_device=DEV.type, print_plan=rank == 0, **cap)
    else:  # by hand: the big table's columns in three PS shards, two of them on rank 0
        plan = ShardingPlan({"ebc": construct_module_sharding_plan(
            model.ebc, {"t0": table_wise(rank=0, compute_kernel="fused"),
                        "big": column_wise(ranks=[0, 1 % world, 0], compute_kernel=PS_KERNEL),
                        "t2": table_wise(rank=world - 1, compute_kernel="fused")},
            sharder=sharder(rank, placement), local_size=world, world_size=world, device_type=DEV.type)})
    kernels = {t: p.compute_kernel for t, p in plan.plan["ebc"].items()}
    assert kernels == {"t0": "fused", "big": PS_KERNEL, "t2": "fused"}, kernels
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return DistributedModelParallel(model, env=env, plan=plan, sharders=[sharder(rank, placement, url)],
                                    device=DEV)


def _rank_lookups(dmp):
    from recom_rec.distributed.sharder import _unwrap

    return [_unwrap(lookup) for lookup in dmp.module.ebc._lookups]


def _assert_rank_rows(out, want, rank: int, what: str = "") -> None:
    """Every key's output of this rank equals its rows of the unsharded module's output."""
    for key in want.keys():
        torch.testing.assert_close(out[key], want[key][rank * BATCH:(rank + 1) * BATCH], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} key {key}: {m}")


def _assert_store_holds_trained_rows(dmp, ref) -> None:
    """After a flush the store holds the trained rows of this rank's shards of the big table."""
    recom_rec.ps.flush(dmp)
    full = ref.ebc.embedding_bags["big"].weight.detach()
    for lookup in _rank_lookups(dmp):
        for _, table, r0, c0, rows, cols in lookup.ps_shards():
            got = recom_rec.ps.export_table(lookup, shard_table_name(table, r0, c0))
            torch.testing.assert_close(got.cpu(), full[r0:r0 + rows, c0:c0 + cols].cpu(), rtol=1e-5, atol=1e-6)


def _outage(rank: int, signals: str) -> None:
    """Every rank here; rank 0 tells the test's process to kill a store master and waits until it
    has, so that the next step meets the dead master (the test restarts it a moment later)."""
    dist.barrier()
    if rank == 0:
        Path(signals, "reached").touch()
        while not Path(signals, "killed").exists():
            time.sleep(0.05)
    dist.barrier()


def _store_retries(dmp) -> float:
    """The store clients' retried attempts on this rank (a master down: retried until it is back)."""
    return sum(t.store.native_stats()["retries"] for tier in recom_rec.ps.tiers_of(dmp) for t in tier.tables.values())


def check(rank: int, world: int, placement: str, url: Optional[str] = None, signals: Optional[str] = None) -> None:
    """``url`` and ``signals``: the shards' rows in one shared store, one of whose masters is
    killed before step 1 and restarted during it (test_ps_placement's cluster test)."""
    torch.manual_seed(0)
    model = Model()
    ref = Model(DEV)
    ref.load_state_dict(model.state_dict())
    ref.ebc.enable_fused_optimizer("sgd", lr=LR)
    dmp = _shard(model, rank, world, placement, url)
    assert "ebc.embedding_bags.big.weight" not in dmp.state_dict()  # the store holds it
    assert "ebc.embedding_bags.big.weight" in set(dmp.fused_optimizer.params)
    # Its checkpoint works; the PS shards' optimizer state is in the store with their rows.
    assert "ebc.embedding_bags.big.weight" not in dmp.fused_optimizer.state_dict()["state"]
    for step in range(STEPS):
        if signals is not None and step == 1:
            _outage(rank, signals)
        if step == STEPS - 1:  # an lr schedule reaches the PS shards through torchrec's optimizer
            for optimizer in (dmp.fused_optimizer, ref.ebc.fused_optimizer):
                for group in optimizer.param_groups:
                    group["lr"] = LR / 2
        samples = batch(step, world)
        out = _wait(dmp(to_kjt(samples[rank * BATCH:(rank + 1) * BATCH])))
        want = ref(to_kjt(samples))
        _assert_rank_rows(out, want, rank, f"step {step}")
        loss_of(out).backward()
        (loss_of(want) / world).backward()
    # The shards' caches were too small for the run: rows left for the store and came back.
    stats = [t.cache.stats for tier in recom_rec.ps.tiers_of(dmp) for t in tier.tables.values()]
    assert sum(s["pushed"] for s in stats) > 0, stats
    if signals is not None:  # the dead master was met, and waited out, by some rank
        retries = torch.tensor([_store_retries(dmp)], device=DEV)
        dist.all_reduce(retries)
        assert retries.item() > 0, "no store operation met the killed master: the fault was not exercised"
    shards = [s for lookup in _rank_lookups(dmp) for s in lookup.ps_shards()]
    assert shards, "no parameter-server shard on this rank"
    _assert_store_holds_trained_rows(dmp, ref)
    # An unsharded checkpoint loads into a fresh sharded model (its big table into the store).
    torch.manual_seed(1)
    fresh = _shard(Model(), rank, world, placement, url)
    fresh.load_state_dict({f"ebc.{k}": v for k, v in ref.ebc.state_dict().items() if k.startswith("embedding_bags")})
    samples = batch(STEPS, world)
    with torch.no_grad():
        out = _wait(fresh(to_kjt(samples[rank * BATCH:(rank + 1) * BATCH])))
        want = ref(to_kjt(samples))
    _assert_rank_rows(out, want, rank, "after loading the checkpoint")


def check_variable_batch(rank: int, world: int, placement: str) -> None:
    """Variable batch per feature through PS shards: each rank its own VBE KJT (bag counts that
    differ by key and rank, inverse indices), against the unsharded in-HBM module fed every rank's
    bags as one VBE KJT, output by output, then the big table's trained rows in the store."""
    from tests.distributed._vbe_workers import rank_batches, to_vbe_kjt

    rows = {"f1": BIG_ROWS, "f0": 20, "f2": 13}  # keys not in the tables' order
    torch.manual_seed(0)
    model = Model()
    ref = Model(DEV)
    ref.load_state_dict(model.state_dict())
    ref.ebc.enable_fused_optimizer("sgd", lr=LR)
    dmp = _shard(model, rank, world, placement)
    for step in range(STEPS):
        parts = rank_batches(step, world, rows, BATCH)
        out = _wait(dmp(to_vbe_kjt(parts[rank:rank + 1], False, DEV)))
        want = ref(to_vbe_kjt(parts, False, DEV))
        _assert_rank_rows(out, want, rank, f"vbe {placement} step {step}")
        loss_of(out).backward()
        (loss_of(want) / world).backward()
    _assert_store_holds_trained_rows(dmp, ref)


def run(rank: int, world: int, port: int, placements: List[str], url: Optional[str] = None,
        signals: Optional[str] = None, variable_batch: bool = False, backend: str = "gloo") -> None:
    global DEV
    if backend == "nccl":
        DEV = torch.device("cuda", rank)
        torch.cuda.set_device(DEV)
    register_remote_store()

    def work() -> None:
        for placement in placements:
            if variable_batch:
                check_variable_batch(rank, world, placement)
            else:
                check(rank, world, placement, url, signals)

    in_process_group(rank, world, port, backend, work)
