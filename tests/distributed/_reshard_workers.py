"""Workers of test_checkpoint_resharding.py: a sharded module's weights and fused-optimizer state
saved by torch.distributed.checkpoint at one world size and loaded at another."""
import os
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingEnv, ShardingPlan

import recom_rec
from recom_rec.distributed import EmbeddingBagCollectionSharder
from tests.distributed import _workers as W

# The step after the checkpoint: one global batch, split over whichever world loads it.
NEXT_BATCH = W.batch(7, 2)


class OursOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = recom_rec.EmbeddingBagCollection(W.ours_tables(), device=W.DEV)

    def forward(self, kjt):
        return self.ebc(kjt)


def _sharded(world: int, case: str, opt: str) -> DistributedModelParallel:
    torch.manual_seed(100 + world)  # each world its own initial weights: the load must replace them
    model = OursOnly()
    ours = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": W.EMB_OPT[opt], "learning_rate": W.LR, **W.FUSED_EXTRA[opt]})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, W.PLANS[case](world), sharder=ours, local_size=world, world_size=world, device_type=W.DEV.type)})
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                    sharders=[ours], device=W.DEV)


def _snapshot(dmp) -> Dict[str, torch.Tensor]:
    """Every table's whole weight and optimizer state, by key, on the CPU of every rank. A rank
    holds the optimizer state of its own tables only: the keys are gathered first, so that every
    rank joins every reduction in the same order."""
    local = dict(dmp.state_dict())
    for key, states in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            local[f"{key}/{name}"] = value
    sharded = {k: tuple(v.size()) for k, v in local.items() if isinstance(v, ShardedTensor)}
    plain = {k: v.detach().cpu() for k, v in local.items() if not isinstance(v, ShardedTensor)}
    every: List = [None] * dist.get_world_size()
    dist.all_gather_object(every, (sharded, plain))
    out: Dict[str, torch.Tensor] = {}
    for sizes, values in every:
        for key, value in values.items():  # replicated (data-parallel tables, Adam's step): any rank's
            out.setdefault(key, value)
        sharded.update(sizes)
    for key in sorted(sharded):
        full = torch.zeros(sharded[key], device=W.DEV)
        value = local.get(key)
        for shard in value.local_shards() if value is not None else ():
            index = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
            full[index] = shard.tensor
        dist.all_reduce(full)
        out[key] = full.cpu()
    return out


def _checkpointed(dmp) -> Dict:
    """What a rank saves and loads. A rank may hold no fused table (its optimizer state empty),
    whose empty dict torch.distributed.checkpoint would take for a value of its own."""
    optim = dmp.fused_optimizer.state_dict()
    return {"model": dmp.state_dict(), **({"optim": optim} if optim["state"] else {})}


def _train(dmp, rank: int, world: int, samples: List) -> None:
    """One step on ``samples`` split over the ranks; the loss scaled by the world size so that
    every world size takes the same step (torchrec divides model-parallel gradients by it)."""
    per_rank = len(samples) // world
    out = W._wait(dmp(W.to_kjt(samples[rank * per_rank:(rank + 1) * per_rank])))
    (W.loss_of([out]) * world).backward()


def save(rank: int, world: int, cases: List[Tuple[str, str]], path: str) -> None:
    for case, opt in cases:
        dmp = _sharded(world, case, opt)
        for step in range(2):
            _train(dmp, rank, world, W.batch(step, world))
        where = os.path.join(path, f"{case}-{opt}")
        dcp.save(_checkpointed(dmp), checkpoint_id=where)
        saved = _snapshot(dmp)
        _train(dmp, rank, world, NEXT_BATCH)
        after = _snapshot(dmp)  # (every rank: its reductions need them all)
        if rank == 0:
            torch.save({"saved": saved, "next": after}, where + ".expected.pt")
        dist.barrier()


def load(rank: int, world: int, cases: List[Tuple[str, str]], path: str) -> None:
    for case, opt in cases:
        where = os.path.join(path, f"{case}-{opt}")
        expected = torch.load(where + ".expected.pt")
        dmp = _sharded(world, case, opt)
        fresh = _snapshot(dmp)
        assert set(fresh) == set(expected["saved"]), (sorted(fresh), sorted(expected["saved"]))
        assert any(not torch.equal(fresh[k], v) for k, v in expected["saved"].items())
        state = _checkpointed(dmp)
        dcp.load(state, checkpoint_id=where)
        dmp.load_state_dict(state["model"])
        if "optim" in state:
            dmp.fused_optimizer.load_state_dict(state["optim"])
        loaded = _snapshot(dmp)
        for key, value in expected["saved"].items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0,
                                       msg=lambda m: f"{case}/{opt} at world {world}: {key} as loaded: {m}")
        # the kernels train on from the loaded state (its views): the step the saving world took next
        _train(dmp, rank, world, NEXT_BATCH)
        after = _snapshot(dmp)
        for key, value in expected["next"].items():
            torch.testing.assert_close(after[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case}/{opt} at world {world}: {key} a step later: {m}")
        if rank == 0:
            print(f"resharded {case}/{opt}: saved at another world, loaded at {world}: {len(expected['saved'])} "
                  f"tensors equal, and equal a step later", flush=True)


def run(rank: int, world: int, port: int, phase: str, cases: List[Tuple[str, str]], path: str,
        backend: str = "gloo") -> None:
    if backend == "nccl":
        W.DEV = torch.device("cuda", rank)
        torch.cuda.set_device(W.DEV)
    work = save if phase == "save" else load
    W.in_process_group(rank, world, port, backend, lambda: work(rank, world, cases, path))
