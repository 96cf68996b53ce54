"""Worker processes of the variable-batch (VBE) sharding tests: gloo on the CPU, NCCL on GPUs.

Each rank feeds DistributedModelParallel its own VBE KeyedJaggedTensor (a bag count per key that
differs by key and by rank, inverse indices mapping the rank's rows to bags). The reference is
the unsharded module fed one VBE KJT holding every rank's bags (each key's bags rank after rank,
the inverse indices shifted to them): the sharded output of rank r is the reference's rows of
rank r, and the weights after a few fused steps equal the reference's trained on the mean of the
ranks' losses. The reference itself is checked against torchrec's unsharded EmbeddingBagCollection."""
import random
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import recom_rec
from recom_rec.distributed import EmbeddingBagCollectionSharder
from tests.distributed import _workers
from tests.distributed._workers import (
    EMB_OPT, FUSED_EXTRA, LR, OPT_KWARGS, PLANS, ROWS, STEPS, gather_full, in_process_group, loss_of, ours_tables,
)

BATCH = 4  # output rows per rank
KEYS = ["f2", "f0", "f3", "f1"]  # not the tables' order: the sharded module permutes keys and inverse indices


class Model(nn.Module):
    def __init__(self, weighted: bool, device: torch.device) -> None:
        super().__init__()
        tables = ours_tables()
        if weighted:  # torchrec refuses weighted MEAN row-wise, and its unsharded module weighted MEAN
            tables = [EmbeddingBagConfig(**{**vars(t), "pooling": PoolingType.SUM}) for t in tables]
        self.ebc = recom_rec.EmbeddingBagCollection(tables, is_weighted=weighted, device=device)

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt)


Bags = Dict[str, List[List[int]]]  # key -> its bags of ids


def rank_batches(step: int, world: int, rows: Optional[Dict[str, int]] = None,
                 batch: int = BATCH) -> List[Tuple[Bags, Dict[str, List[int]]]]:
    """Per rank: (each key's bags, each key's bag of each of the rank's ``batch`` rows), for the keys
    of ``rows`` (key -> its table's rows; KEYS by default). Bag counts from 1 to batch + 1, so keys
    and ranks differ (some keys have more bags than rows)."""
    rows = rows if rows is not None else {key: ROWS[key] for key in KEYS}
    rng = random.Random(2000 + step)
    out = []
    for _ in range(world):
        bags, inverse = {}, {}
        for key in rows:
            count = rng.randint(1, batch + 1)
            bags[key] = [[rng.randrange(rows[key]) for _ in range(rng.randrange(0, 4))] for _ in range(count)]
            inverse[key] = [rng.randrange(count) for _ in range(batch)]
        out.append((bags, inverse))
    return out


def to_vbe_kjt(parts: List[Tuple[Bags, Dict[str, List[int]]]], weighted: bool, device) -> KeyedJaggedTensor:
    """One VBE KJT of ``parts`` (one rank's, or every rank's for the reference): each key's bags
    part after part, its inverse indices shifted by the bags of the parts before."""
    keys = list(parts[0][0])
    values, lengths, strides, inverse = [], [], [], []
    for key in keys:
        shift, rows = 0, []
        for bags, inv in parts:
            for bag in bags[key]:
                values.extend(bag)
                lengths.append(len(bag))
            rows.extend(shift + i for i in inv[key])
            shift += len(bags[key])
        strides.append(shift)
        inverse.append(rows)
    ids = torch.tensor(values, dtype=torch.int64)
    return KeyedJaggedTensor(
        keys=keys, values=ids, lengths=torch.tensor(lengths, dtype=torch.int64),
        weights=(0.5 + 0.25 * (ids % 3)).float() if weighted else None,
        stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(keys, torch.tensor(inverse))).to(device)


def check_vbe_parity(rank: int, world: int, case: str, opt: str) -> None:
    """``case``: a plan of _workers.PLANS, ``weighted_<plan>`` for per-id weights; ``opt``: the
    fused optimizer (sgd, rowwise_adagrad)."""
    dev = _workers.DEV
    weighted = case.startswith("weighted_")
    plan_name = case[len("weighted_"):] if weighted else case
    torch.manual_seed(0)
    model = Model(weighted, dev)
    torch.manual_seed(0)
    ref = Model(weighted, dev)
    ref.ebc.enable_fused_optimizer(opt, lr=LR, **OPT_KWARGS[opt])
    theirs = TorchrecEBC(ref.ebc.embedding_bag_configs(), is_weighted=weighted, device=dev)

    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EMB_OPT[opt], "learning_rate": LR,
                                                          **FUSED_EXTRA[opt]})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, PLANS[plan_name](world), sharder=sharder, local_size=world, world_size=world,
        device_type=dev.type)})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=dev)
    # Data-parallel tables train by dense gradients: a dense SGD (the only cases with them use SGD).
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    assert not dense or opt == "sgd", (case, opt, sorted(dense))
    dense_opt = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=LR)) if dense else None

    for step in range(STEPS):
        parts = rank_batches(step, world)
        out = dmp(to_vbe_kjt(parts[rank:rank + 1], weighted, dev))
        out = out.wait() if hasattr(out, "wait") else out
        whole = to_vbe_kjt(parts, weighted, dev)
        want = ref(whole)
        if step == 0:
            with torch.no_grad():
                for c in ref.ebc.embedding_bag_configs():
                    theirs.embedding_bags[c.name].weight.copy_(ref.ebc.embedding_bags[c.name].weight)
                torch.testing.assert_close(theirs(whole).to_dict(), want.to_dict(), rtol=1e-5, atol=1e-6)
        assert sorted(out.keys()) == sorted(want.keys()), (out.keys(), want.keys())
        for key in want.keys():
            torch.testing.assert_close(out[key], want[key][rank * BATCH:(rank + 1) * BATCH], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case} {opt} step {step} key {key}: {m}")
        # torchrec divides model-parallel gradients by the world size: the mean of the ranks' losses
        loss_of([out]).backward()
        (loss_of([want]) / world).backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()

    state = dmp.state_dict()
    for config in ref.ebc.embedding_bag_configs():
        key = f"ebc.embedding_bags.{config.name}.weight"
        full = gather_full(state[key], (config.num_embeddings, config.embedding_dim))
        torch.testing.assert_close(full, ref.ebc.embedding_bags[config.name].weight.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{case} {opt}: {config.name} after {STEPS} steps: {m}")
    if rank == 0:
        print(f"vbe {case} {opt}: ok", flush=True)


def run_vbe_cases(rank: int, world: int, port: int, cases: List[Tuple[str, str]], backend: str = "gloo") -> None:
    """Entry point of a spawned worker: one process group, then each (plan, optimizer) case."""
    if backend == "nccl":
        _workers.DEV = torch.device("cuda", rank)
        torch.cuda.set_device(_workers.DEV)

    def work() -> None:
        for case, opt in cases:
            check_vbe_parity(rank, world, case, opt)

    in_process_group(rank, world, port, backend, work)
