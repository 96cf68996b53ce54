"""recom_rec's EmbeddingCollection under torchrec's DistributedModelParallel with our sharder, on
real process groups (gloo on the CPU; NCCL over the GPUs with RECOM_TEST_DEVICE=cuda): every
sharding type torchrec's EmbeddingCollection sharder offers, trained with the optimizer fused
(sharder fused_params or apply_optimizer_in_backward), equals the unsharded module trained on the
whole batch, feature by feature and table by table."""
import torch
import torch.multiprocessing as mp

from ebc_cases import DEVICE, SLOW_ON_CPU
from tests.distributed._ec_workers import run_cases
from tests.distributed._workers import free_port, two_rank_world

CASES = [
    ("table_wise", "fused_params"),
    ("column_wise", "fused_params"),
    ("row_wise", "fused_params"),
    ("data_parallel", "fused_params"),
    ("mixed", "apply_optimizer_in_backward"),
    ("default_dmp", "fused_params"),
]


def test_every_sharding_type_matches_the_unsharded_module():
    world, backend = two_rank_world(DEVICE)
    mp.spawn(run_cases, args=(world, free_port(), CASES, backend), nprocs=world, join=True)


@SLOW_ON_CPU
def test_world_3_mixed_plan():
    if DEVICE.type == "cuda" and torch.cuda.device_count() < 3:
        world, backend = torch.cuda.device_count(), "nccl"
    else:
        world, backend = (3, "gloo") if DEVICE.type != "cuda" else (3, "nccl")
    mp.spawn(run_cases, args=(world, free_port(), [("mixed", "fused_params"), ("row_wise", "fused_params")], backend),
             nprocs=world, join=True)


@SLOW_ON_CPU
def test_checkpoint_round_trip(tmp_path):
    """torch.distributed.checkpoint of the sharded EmbeddingCollection: saved after a step, loaded
    into a differently initialised sharded model (the directory is shared by the ranks)."""
    world, backend = two_rank_world(DEVICE)
    cases = [(plan, f"checkpoint:{tmp_path / plan}") for plan in ("table_wise", "column_wise", "row_wise", "mixed")]
    mp.spawn(run_cases, args=(world, free_port(), cases, backend), nprocs=world, join=True)


@SLOW_ON_CPU
def test_a_batch_size_per_feature_through_every_sharding_type():
    """VBE KJTs (bags per key differing by key and rank) through the sharded EmbeddingCollection:
    each feature's rows as the unsharded module's, and the same weights after fused steps."""
    world, backend = two_rank_world(DEVICE)
    cases = [(plan, "variable_batch") for plan in ("table_wise", "column_wise", "row_wise", "data_parallel", "mixed")]
    mp.spawn(run_cases, args=(world, free_port(), cases, backend), nprocs=world, join=True)
