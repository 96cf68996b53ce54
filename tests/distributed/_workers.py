"""Worker processes for the multi-process sharding tests: gloo on the CPU, NCCL on GPUs (one
process per GPU) when the test passes backend "nccl".

Each worker builds the same model under one seed, shards it with DistributedModelParallel,
trains a few fused-SGD steps on its slice of a global batch and checks, against an unsharded
reference trained on the whole batch, the forward outputs (per key) and the weights."""
import os
import random
import socket
import sys
import traceback
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as TorchrecSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import recom_rec
from recom_rec.distributed import EmbeddingBagCollectionSharder

LR = 0.1
EMB_OPT = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
           "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "adam": EmbOptimType.ADAM}
OPT_KWARGS = {"sgd": {}, "adagrad": {"eps": 1e-8}, "rowwise_adagrad": {"eps": 1e-8},
              "adam": {"eps": 1e-8, "betas": (0.8, 0.95)}}
FUSED_EXTRA = {"sgd": {}, "adagrad": {"eps": 1e-8}, "rowwise_adagrad": {"eps": 1e-8},
               "adam": {"eps": 1e-8, "beta1": 0.8, "beta2": 0.95}}
STEPS = int(os.environ.get("RECOM_DIST_STEPS", "3"))
BATCH = 3  # per rank
FEATURES = ["f0", "f1", "f2", "f3", "f4"]
DEV = torch.device("cpu")  # this worker's device: set by run_cases (cuda:rank under NCCL)


def two_rank_world(device: torch.device) -> Tuple[int, str]:
    """(world, backend) of a two-rank test: gloo on the CPU; NCCL on up to two GPUs when the suite
    runs with CUDA tensors (one GPU: a world of one)."""
    if device.type == "cuda":
        return min(2, torch.cuda.device_count()), "nccl"
    return 2, "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_tables() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=20, embedding_dim=4, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", num_embeddings=17, embedding_dim=6, feature_names=["f1", "f2"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t2", num_embeddings=13, embedding_dim=12, feature_names=["f3"]),
    ]


def torchrec_tables() -> List[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="tr", num_embeddings=11, embedding_dim=4, feature_names=["f4"])]


ROWS = {"f0": 20, "f1": 17, "f2": 17, "f3": 13, "f4": 11}


class Model(nn.Module):
    """Our module next to torchrec's, as in a real model."""

    def __init__(self, weighted: bool = False, device=None, group_parameters: bool = False) -> None:
        super().__init__()
        device = torch.device(device or DEV)
        self.ebc = recom_rec.EmbeddingBagCollection(ours_tables(), is_weighted=weighted, device=device,
                                                    group_parameters=group_parameters)
        self.tebc = TorchrecEBC(torchrec_tables(), device=device)

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt), self.tebc(kjt)


def batch(step: int, world: int) -> List[Dict[str, List[int]]]:
    """The global batch of a step: per sample, per feature, a bag of ids (some empty)."""
    rng = random.Random(1000 + step)
    return [{f: [rng.randrange(ROWS[f]) for _ in range(rng.randrange(0, 4))] for f in FEATURES}
            for _ in range(world * BATCH)]


def to_kjt(samples: List[Dict[str, List[int]]], weighted: bool = False) -> KeyedJaggedTensor:
    values, lengths = [], []
    for f in FEATURES:
        for s in samples:
            values.extend(s[f])
            lengths.append(len(s[f]))
    ids = torch.tensor(values, dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=FEATURES, values=ids, lengths=torch.tensor(lengths, dtype=torch.int64),
        weights=(0.5 + 0.25 * (ids % 3)).float() if weighted else None).to(DEV)


def loss_of(kts) -> torch.Tensor:
    """A loss that depends on keys, not on column order (a sharded module's KeyedTensor may
    order its keys differently: torchrec groups them by sharding)."""
    total = 0
    for kt in kts:
        for key, value in kt.to_dict().items():
            total = total + (value * torch.linspace(-1.0, 1.5, value.shape[1], device=value.device) * (1 + FEATURES.index(key) / 4)).sum()
    return total


def table_column_wise(ranks: List[int]):
    """torchrec has no plan helper for table-column-wise: column-wise shards typed as such (the
    planner proposes TWCW as column shards on the ranks of one host)."""
    def generate(param, local_size, world_size, device_type, sharder):
        sharding = column_wise(ranks=ranks, compute_kernel="fused")(param, local_size, world_size, device_type, sharder)
        sharding.sharding_type = ShardingType.TABLE_COLUMN_WISE.value
        return sharding
    return generate


# Ranks are taken modulo the world size: on one GPU every shard lands on rank 0.
PLANS = {
    "table_wise": lambda w: {"t0": table_wise(rank=0, compute_kernel="fused"),
                             "t1": table_wise(rank=1 % w, compute_kernel="fused"),
                             "t2": table_wise(rank=w - 1, compute_kernel="fused")},
    "column_wise": lambda w: {"t0": column_wise(ranks=[0, 1 % w], compute_kernel="fused"),
                              "t1": column_wise(ranks=list(range(w)), compute_kernel="fused"),
                              "t2": column_wise(ranks=[w - 1, 0], compute_kernel="fused")},
    # two column shards of t2 on rank 0 (the planner makes such plans for wide tables)
    "column_wise_multi": lambda w: {"t0": table_wise(rank=1 % w, compute_kernel="fused"),
                                    "t1": column_wise(ranks=[1 % w, 0], compute_kernel="fused"),
                                    "t2": column_wise(ranks=[0, 1 % w, 0], compute_kernel="fused")},
    # a dense and fused tables on one rank: two local modules, columns re-ordered after
    "two_kernels": lambda w: {"t0": table_wise(rank=0, compute_kernel="dense"),
                              "t1": table_wise(rank=0, compute_kernel="fused"),
                              "t2": table_wise(rank=0, compute_kernel="dense")},
    "data_parallel": lambda w: {"t0": data_parallel(), "t1": data_parallel(), "t2": data_parallel()},
    "mixed": lambda w: {"t0": table_wise(rank=w - 1, compute_kernel="fused"),
                        "t1": column_wise(ranks=[1 % w, 0], compute_kernel="fused"),
                        "t2": data_parallel()},
    "row_wise": lambda w: {"t0": row_wise(compute_kernel="fused"), "t1": row_wise(compute_kernel="fused"),
                           "t2": row_wise(compute_kernel="fused")},
    "table_column_wise": lambda w: {"t0": table_column_wise([0, 1 % w]), "t1": table_column_wise([1 % w, 0]),
                                    "t2": table_column_wise([w - 1, 0, 1 % w])},
    "table_row_wise": lambda w: {"t0": table_row_wise(host_index=0), "t1": table_row_wise(host_index=0),
                                 "t2": table_row_wise(host_index=0)},
}


def gather_full(value, shape) -> torch.Tensor:
    """A state_dict entry (ShardedTensor or plain tensor) as the full table on every rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        full = torch.zeros(shape, device=DEV)
        for shard in value.local_shards():
            r, c = shard.metadata.shard_offsets
            rows, cols = shard.metadata.shard_sizes
            full[r:r + rows, c:c + cols] = shard.tensor
        dist.all_reduce(full)
        return full
    return value.detach().clone()


def _wait(x):
    from torchrec.distributed.types import LazyAwaitable

    return x.wait() if isinstance(x, LazyAwaitable) else x


def exit_worker() -> None:
    """Ends a worker that succeeded without running C++ static destructors: now and then one of
    them (a library's background thread still joinable at exit) calls std::terminate after all
    the work is done - "terminate called without an active exception", SIGABRT - and spawn would
    report the passed worker as failed. Output is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def in_process_group(rank: int, world: int, port: int, backend: str, work: Callable[[], None]) -> None:
    """Runs ``work`` in a process group of ``world`` workers (TCP rendezvous on ``port``), then
    ends the worker (see exit_worker); a failure is printed and re-raised for spawn to report."""
    if backend != "nccl":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        work()
    except Exception:
        traceback.print_exc()
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    exit_worker()


def run_cases(rank: int, world: int, port: int, cases: List[Tuple[str, str]], tmpdir: str = "",
              backend: str = "gloo") -> None:
    """Entry point of a spawned worker: one process group (gloo on the CPU, NCCL on GPU ``rank``),
    then each (plan, optimizer_via) case (optimizer_via "checkpoint" runs the checkpoint round
    trip of that plan instead)."""
    global DEV
    if backend == "nccl":
        DEV = torch.device("cuda", rank)
        torch.cuda.set_device(DEV)

    def work() -> None:
        for case, optimizer_via in cases:
            if optimizer_via == "checkpoint":
                check_checkpoint(rank, world, case, os.path.join(tmpdir, case))
            else:
                check_parity(rank, world, case, optimizer_via)

    in_process_group(rank, world, port, backend, work)


class TorchrecSharderWithoutDense(TorchrecSharder):
    """torchrec's sharder for its own module, without data-parallel: that runs fbgemm's dense-table
    backward, whose device code the GPU stack's fbgemm leaves out (../shared/gpu/make-stack.sh), so
    torchrec's planner must not pick it for torchrec's table there. Our tables are unaffected."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [t for t in super().sharding_types(compute_device_type) if t != ShardingType.DATA_PARALLEL.value]


def _shard(model: "Model", case: str, world: int) -> DistributedModelParallel:
    ours = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, PLANS[case](world), sharder=ours, local_size=world, world_size=world, device_type=DEV.type)})
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                    sharders=[ours, TorchrecSharder()], device=DEV)


def check_checkpoint(rank: int, world: int, case: str, path: str) -> None:
    """state_dict in torchrec's conventions (ShardedTensor per model-parallel table, the full
    tensor for data-parallel ones), saved with torch.distributed.checkpoint and loaded into a
    differently initialised sharded model: same weights, same outputs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    torch.manual_seed(0)
    full = Model()
    dmp = _shard(full, case, world)
    torch.manual_seed(0)
    ref = Model()
    state = dmp.state_dict()
    for config in ours_tables():
        value = state[f"ebc.embedding_bags.{config.name}.weight"]
        shape = (config.num_embeddings, config.embedding_dim)
        if isinstance(value, ShardedTensor):
            assert tuple(value.size()) == shape, (config.name, value.size())
        else:
            assert tuple(value.shape) == shape, (config.name, value.shape)
        # the sharded module starts from the unsharded module's weights
        torch.testing.assert_close(gather_full(value, shape), ref.ebc.embedding_bags[config.name].weight.detach())
    kinds = {name: type(state[f"ebc.embedding_bags.{name}.weight"]).__name__ for name in ("t0", "t1", "t2")}
    # one training step so that the checkpoint differs from the initial weights
    samples = batch(0, world)
    out, _ = (_wait(o) for o in dmp(to_kjt(samples[rank * BATCH:(rank + 1) * BATCH])))
    loss_of([out]).backward()
    dcp.save(dmp.state_dict(), checkpoint_id=path)

    torch.manual_seed(1)
    other = _shard(Model(), case, world)
    before = gather_full(other.state_dict()["ebc.embedding_bags.t0.weight"], (20, 4))
    assert not torch.allclose(before, gather_full(dmp.state_dict()["ebc.embedding_bags.t0.weight"], (20, 4)))
    restored = other.state_dict()
    dcp.load(restored, checkpoint_id=path)
    other.load_state_dict(restored)
    for config in ours_tables():
        key, shape = f"ebc.embedding_bags.{config.name}.weight", (config.num_embeddings, config.embedding_dim)
        torch.testing.assert_close(gather_full(other.state_dict()[key], shape), gather_full(dmp.state_dict()[key], shape),
                                   msg=lambda m: f"{case}: {key} after load: {m}")
    samples = batch(1, world)
    mine = to_kjt(samples[rank * BATCH:(rank + 1) * BATCH])
    with torch.no_grad():
        a, _ = (_wait(o) for o in dmp(mine))
        b, _ = (_wait(o) for o in other(mine))
    for key in a.keys():
        torch.testing.assert_close(a[key], b[key])
    # an unsharded checkpoint (full tensors, e.g. from the single-process model) loads too
    other.load_state_dict(ref.state_dict())
    for config in ours_tables():
        key, shape = f"ebc.embedding_bags.{config.name}.weight", (config.num_embeddings, config.embedding_dim)
        torch.testing.assert_close(gather_full(other.state_dict()[key], shape),
                                   ref.ebc.embedding_bags[config.name].weight.detach(),
                                   msg=lambda m: f"{case}: {key} from an unsharded checkpoint: {m}")
    if rank == 0:
        print(f"checkpoint {case}: {kinds}", flush=True)


def check_parity(rank: int, world: int, case: str, optimizer_via: str) -> None:
    """Sharded forward (per key) and weights after STEPS fused-SGD steps == unsharded.
    ``weighted_<plan>``: the module is weighted and the batches carry per-id weights."""
    weighted = case.startswith("weighted_")
    case = case[len("weighted_"):] if weighted else case
    # ``meta_<plan>``: the model is built on the meta device (no memory), sharded, then loaded
    # from an unsharded checkpoint
    meta = case.startswith("meta_")
    case = case[len("meta_"):] if meta else case
    # ``groups_<plan>``: our module built with one Parameter per dtype group (group_parameters)
    groups = case.startswith("groups_")
    case = case[len("groups_"):] if groups else case
    torch.manual_seed(0)
    model = Model(weighted, device="meta" if meta else DEV, group_parameters=groups)
    torch.manual_seed(0)
    ref = Model(weighted)
    ref_checkpoint = {k: v.clone() for k, v in ref.state_dict().items()}
    if not meta:
        for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
            assert torch.equal(a, b)
    # "fused_params:adam" etc.: another fused optimizer (then torchrec's module, whose fused
    # kernels are fbgemm's, is left out of the loss and of the comparison).
    optimizer_via, _, opt = optimizer_via.partition(":")
    opt = opt or "sgd"
    ref.ebc.enable_fused_optimizer(opt, lr=LR, **OPT_KWARGS[opt])
    ref_opt = torch.optim.SGD(ref.tebc.parameters(), lr=LR)
    # torchrec's sharded module (unweighted) pools a weighted KJT with its weights: not compared then
    with_torchrec = opt == "sgd" and not weighted

    fused_params = None
    if optimizer_via == "apply_optimizer_in_backward":
        assert opt == "sgd"
        apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": LR})
    else:
        fused_params = {"optimizer": EMB_OPT[opt], "learning_rate": LR, **FUSED_EXTRA[opt]}
    ours = EmbeddingBagCollectionSharder(fused_params=fused_params)
    # fbgemm's CPU kernels lack some optimizers: torchrec's module keeps SGD when it is not compared
    theirs = TorchrecSharder(fused_params=fused_params if with_torchrec else
                             {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharders = [ours, theirs]
    if case == "default_dmp":
        # No plan: DistributedModelParallel plans with torchrec's own planner; our sharder
        # first, then torchrec's defaults.
        from torchrec.distributed.sharding_plan import get_default_sharders

        plan = None
        sharders = [ours, *get_default_sharders()]
        if DEV.type == "cuda":
            sharders = [TorchrecSharderWithoutDense() if type(s) is TorchrecSharder else s for s in sharders]
    elif case == "planner":
        # The planner plugin places the tables (constraints pin a variety of sharding types).
        from torchrec.distributed.planner import ParameterConstraints
        from recom_rec.distributed.planner import build_plan

        constraints = {"t0": ParameterConstraints(sharding_types=["row_wise"]),
                       "t1": ParameterConstraints(sharding_types=["column_wise"]),
                       "t2": ParameterConstraints(sharding_types=["table_wise"]),
                       "tr": ParameterConstraints(sharding_types=["table_wise"])}
        plan = build_plan(model, [ours, theirs], world_size=world, batch_size=BATCH, compute_device=DEV.type,
                          constraints=constraints, print_plan=rank == 0)
        for table, kind in [("t0", "row_wise"), ("t1", "column_wise"), ("t2", "table_wise")]:
            assert plan.plan["ebc"][table].sharding_type == kind, plan
    else:
        plan = ShardingPlan({
            "ebc": construct_module_sharding_plan(model.ebc, PLANS[case](world), sharder=ours,
                                                  local_size=world, world_size=world, device_type=DEV.type),
            "tebc": construct_module_sharding_plan(
                model.tebc, {"tr": table_wise(rank=world - 1, compute_kernel="fused")}, sharder=theirs,
                local_size=world, world_size=world, device_type=DEV.type),
        })
    dmp = DistributedModelParallel(model, env=env, plan=plan, sharders=sharders, device=DEV)
    assert type(dmp.module.ebc).__name__ == "ShardedFusedEmbeddingBagCollection", type(dmp.module.ebc)
    if meta:
        dmp.load_state_dict(ref_checkpoint)
    # torchrec's own sharded module (tebc) starts from its own init: align it.
    with torch.no_grad():
        ref.tebc.embedding_bags["tr"].weight.copy_(
            gather_full(dmp.state_dict()["tebc.embedding_bags.tr.weight"], (11, 4)))
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    # Data-parallel tables get dense gradients (as in torchrec): a dense optimizer of the same
    # kind trains them (Adagrad with zero-gradient rows is a no-op there, so it matches the
    # fused one; dense Adam does not, so Adam cases have no data-parallel tables).
    dense_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[opt] if opt in ("sgd", "adagrad") else None
    dense_opt = KeyedOptimizerWrapper(dense, lambda ps: dense_cls(ps, lr=LR, **OPT_KWARGS[opt])) \
        if dense and dense_cls else None
    if dense and dense_cls is None:
        assert all("tebc" in name for name in dense), f"{opt}: no dense equivalent for {sorted(dense)}"

    fused_keys = set(dmp.fused_optimizer.params)
    for config in ours_tables():
        sharding = dmp.plan.plan["ebc"][config.name]
        if sharding.compute_kernel == "fused" and rank in (sharding.ranks or []):
            assert f"ebc.embedding_bags.{config.name}.weight" in fused_keys, (config.name, sorted(fused_keys))
    for step in range(STEPS):
        if step == STEPS - 1:
            # an lr schedule: torchrec's param_groups of the combined fused optimizer reach our kernel
            for optimizer in [dmp.fused_optimizer, ref.ebc.fused_optimizer, ref_opt] + ([dense_opt] if dense_opt else []):
                for group in optimizer.param_groups:
                    group["lr"] = LR / 2
            dmp.fused_optimizer.step()  # torchrec's fused TBEs pick the new lr up on step()
        samples = batch(step, world)
        mine = samples[rank * BATCH:(rank + 1) * BATCH]
        out_ebc, out_t = (_wait(o) for o in dmp(to_kjt(mine, weighted)))
        ref_ebc, ref_t = ref(to_kjt(samples, weighted))
        for key in ref_ebc.keys():
            got = out_ebc[key]
            want = ref_ebc[key][rank * BATCH:(rank + 1) * BATCH]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case} step {step} key {key}: {m}")
        if with_torchrec:
            torch.testing.assert_close(out_t["f4"], ref_t["f4"][rank * BATCH:(rank + 1) * BATCH])
        # torchrec divides model-parallel gradients by the world size (and DDP averages):
        # the sharded model trains on the mean of the ranks' losses.
        loss_of([out_ebc, out_t] if with_torchrec else [out_ebc]).backward()
        (loss_of([ref_ebc, ref_t] if with_torchrec else [ref_ebc]) / world).backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()

    state = dmp.state_dict()
    for config in ours_tables():
        key = f"ebc.embedding_bags.{config.name}.weight"
        full = gather_full(state[key], (config.num_embeddings, config.embedding_dim))
        want = ref.ebc.embedding_bags[config.name].weight.detach()
        torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{case}: weights of {config.name} after {STEPS} steps: {m}")
    full = gather_full(state["tebc.embedding_bags.tr.weight"], (11, 4))
    if with_torchrec:
        torch.testing.assert_close(full, ref.tebc.embedding_bags["tr"].weight.detach(), rtol=1e-5, atol=1e-6)
