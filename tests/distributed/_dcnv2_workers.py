"""Workers of test_planned_dcnv2_parity.py: MLPerf DLRM-DCNv2's 26 tables (scaled to the CPU's
size: random_layouts.dcnv2(small=True)), planned by torchrec's planner with our sharder and its
estimates, trained with fused SGD under DistributedModelParallel against the unsharded module."""
import random
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import recom_rec
from recom_rec.bench.random_layouts import dcnv2
from recom_rec.distributed import EmbeddingBagCollectionSharder
from recom_rec.distributed.planner import build_plan
from tests.distributed import _workers as W

BATCH = 8  # per rank
LR = 0.05
FORCED = {"t2": "row_wise", "t11": "column_wise", "t15": "table_row_wise", "t0": "data_parallel"}


class Holder(nn.Module):
    def __init__(self, device) -> None:
        super().__init__()
        self.ebc = recom_rec.EmbeddingBagCollection(dcnv2(small=True).tables(), device=device)

    def forward(self, kjt):
        return self.ebc(kjt)


def _samples(step: int, world: int) -> List[Dict[str, List[int]]]:
    """The global batch of a step: per sample and feature a bag of up to the multi-hot size ids."""
    layout = dcnv2(small=True)
    rng = random.Random(3000 + step)
    return [{f"f{i}": [rng.randrange(rows) for _ in range(rng.randint(0, hot))]
             for i, (rows, hot) in enumerate(zip(layout.rows, layout.pooling_factors))}
            for _ in range(world * BATCH)]


def _kjt(samples) -> KeyedJaggedTensor:
    keys = [f"f{i}" for i in range(26)]
    values = [v for k in keys for s in samples for v in s[k]]
    lengths = [len(s[k]) for k in keys for s in samples]
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                                               lengths=torch.tensor(lengths, dtype=torch.int64)).to(W.DEV)


def _loss(kt) -> torch.Tensor:
    return sum((kt[k] * torch.linspace(-1.0, 1.0, kt[k].shape[1], device=kt[k].device)).sum() * (1 + i / 26)
               for i, k in enumerate(sorted(kt.keys())))


def check(rank: int, world: int, steps: int) -> None:
    torch.manual_seed(0)
    model, ref = Holder(W.DEV), Holder(W.DEV)
    ref.load_state_dict(model.state_dict())
    ref.ebc.enable_fused_optimizer("sgd", lr=LR)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    # a rank's memory: three quarters of the tables, so that several ranks must shard them
    cap = int(dcnv2(small=True).weight_bytes() * (0.75 if world > 1 else 1.5))
    caps = {"hbm_cap": cap} if W.DEV.type == "cuda" else {"ddr_cap": cap}
    # the planner places the tables; four are pinned to the other sharding types, one each
    plan = build_plan(model, [sharder], world_size=world, batch_size=BATCH, compute_device=W.DEV.type,
                      constraints={t: ParameterConstraints(sharding_types=[kind]) for t, kind in FORCED.items()},
                      print_plan=rank == 0, **caps)
    kinds = {ps.sharding_type for ps in plan.plan["ebc"].values()}
    for table, kind in FORCED.items():
        assert plan.plan["ebc"][table].sharding_type == kind, (table, plan.plan["ebc"][table])
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=W.DEV)
    dense = [p for _, p in dmp.named_parameters() if not getattr(p, "_in_backward_optimizers", None)]
    dense_opt = torch.optim.SGD(dense, lr=LR) if dense else None  # the data-parallel tables
    for step in range(steps):
        samples = _samples(step, world)
        out = W._wait(dmp(_kjt(samples[rank * BATCH:(rank + 1) * BATCH])))
        want = ref(_kjt(samples))
        for key in want.keys():
            torch.testing.assert_close(out[key], want[key][rank * BATCH:(rank + 1) * BATCH], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"step {step} key {key}: {m}")
        _loss(out).backward()  # (torchrec divides model-parallel gradients by the world size; DDP averages)
        (_loss(want) / world).backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
    state = dmp.state_dict()
    for config in dcnv2(small=True).tables():
        full = W.gather_full(state[f"ebc.embedding_bags.{config.name}.weight"],
                             (config.num_embeddings, config.embedding_dim))
        torch.testing.assert_close(full, ref.ebc.embedding_bags[config.name].weight.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{config.name} after {steps} steps: {m}")
    if rank == 0:
        print(f"dcnv2 planned ({sorted(kinds)}), {steps} steps on {world} ranks: equal to the unsharded module",
              flush=True)


def run(rank: int, world: int, port: int, steps: int, backend: str = "gloo") -> None:
    if backend == "nccl":
        W.DEV = torch.device("cuda", rank)
        torch.cuda.set_device(W.DEV)
    W.in_process_group(rank, world, port, backend, lambda: check(rank, world, steps))
