"""Variable batch per feature (torchrec's VBE KeyedJaggedTensors) through recom_rec's sharder under
DistributedModelParallel, on real process groups (gloo on the CPU; NCCL over the GPUs with
RECOM_TEST_DEVICE=cuda): every sharding type, forward per key and the weights after a few fused
steps equal the unsharded module fed every rank's bags at once (tests/distributed/_vbe_workers.py)."""
import torch
import torch.multiprocessing as mp

from ebc_cases import DEVICE, SLOW_ON_CPU
from tests.distributed._vbe_workers import run_vbe_cases
from tests.distributed._workers import free_port

EVERY_SHARDING_TYPE = [
    ("table_wise", "sgd"),
    ("column_wise", "sgd"),
    ("column_wise_multi", "sgd"),
    ("data_parallel", "sgd"),
    ("row_wise", "sgd"),
    ("table_row_wise", "sgd"),
    ("table_column_wise", "sgd"),
    ("mixed", "sgd"),
    ("two_kernels", "sgd"),
    ("row_wise", "rowwise_adagrad"),
    ("table_wise", "rowwise_adagrad"),
    ("row_wise", "adagrad"),
    ("row_wise", "adam"),
    ("column_wise", "adam"),
    ("column_wise_multi", "adam"),
    ("weighted_table_wise", "sgd"),
    ("weighted_row_wise", "sgd"),
]


def _spawn(world, cases, backend):
    mp.spawn(run_vbe_cases, args=(world, free_port(), cases, backend), nprocs=world, join=True)


@SLOW_ON_CPU
def test_world_2_every_sharding_type():
    _spawn(2, EVERY_SHARDING_TYPE, "gloo")


if DEVICE.type == "cuda":
    def test_nccl_every_sharding_type_on_all_gpus():
        _spawn(torch.cuda.device_count(), EVERY_SHARDING_TYPE, "nccl")
