"""recom_rec's EmbeddingBagCollection under torchrec's DistributedModelParallel, with real
process groups - gloo on the CPU, NCCL with one process per GPU when the suite runs with
RECOM_TEST_DEVICE=cuda: every sharding type's forward (per key) and the weights after a few
fused-SGD steps equal the unsharded module trained on the whole batch. Each test spawns one
group and runs several plans in it (imports dominate the cost on a 2-core machine)."""
import torch
import torch.multiprocessing as mp

from ebc_cases import DEVICE, SLOW_ON_CPU
from tests.distributed._workers import free_port, run_cases

EVERY_SHARDING_TYPE = [
    ("table_wise", "fused_params"),
    ("column_wise", "fused_params"),
    ("data_parallel", "fused_params"),
    ("row_wise", "fused_params"),
    ("table_row_wise", "apply_optimizer_in_backward"),
    ("table_column_wise", "fused_params"),
    ("planner", "fused_params"),
    ("default_dmp", "apply_optimizer_in_backward"),
    ("column_wise", "fused_params:adam"),
    ("row_wise", "fused_params:rowwise_adagrad"),
    ("column_wise_multi", "fused_params"),
    ("meta_mixed", "fused_params"),
    ("groups_table_wise", "fused_params"),
    ("groups_row_wise", "fused_params"),
]


def _spawn(world, cases, tmpdir="", backend="gloo"):
    mp.spawn(run_cases, args=(world, free_port(), cases, str(tmpdir), backend), nprocs=world, join=True)


if DEVICE.type == "cuda":
    # The GPU machine: NCCL over every GPU it has (1, 2, ...), every sharding type, checkpoints.
    def test_nccl_every_sharding_type_on_all_gpus(tmp_path):
        world = torch.cuda.device_count()
        _spawn(world, EVERY_SHARDING_TYPE + [("mixed", "apply_optimizer_in_backward"), ("two_kernels", "fused_params"),
                                             ("weighted_mixed", "fused_params"), ("mixed", "fused_params:adagrad")],
               backend="nccl")
        _spawn(world, [("mixed", "checkpoint"), ("row_wise", "checkpoint"), ("table_row_wise", "checkpoint"),
                       ("column_wise_multi", "checkpoint")], tmp_path, backend="nccl")


def test_world_2_every_sharding_type():
    _spawn(2, EVERY_SHARDING_TYPE)


@SLOW_ON_CPU
def test_world_3_mixed_plans():
    _spawn(3, [
        ("mixed", "apply_optimizer_in_backward"),
        ("table_wise", "apply_optimizer_in_backward"),
        ("column_wise", "fused_params"),
        ("row_wise", "fused_params"),
        ("mixed", "fused_params:adagrad"),
        ("two_kernels", "fused_params"),
        ("weighted_mixed", "fused_params"),
    ])


@SLOW_ON_CPU
def test_checkpoint_round_trip_world_3(tmp_path):
    """torch.distributed.checkpoint save of the sharded state_dict, load into a differently
    initialised sharded model: same weights and outputs (the directory is shared by the ranks)."""
    _spawn(3, [("mixed", "checkpoint"), ("row_wise", "checkpoint"), ("table_row_wise", "checkpoint"),
                ("column_wise_multi", "checkpoint")], tmp_path)
