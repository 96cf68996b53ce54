"""A sharded module's checkpoint (torch.distributed.checkpoint: the weights and the fused optimizer
state, in torchrec's sharded layout) saved at one world size and loaded at others: the same
tensors, and the same step after. gloo on the CPU (saved at 2 ranks, loaded at 1 and 3); NCCL
over the GPUs when the suite runs with RECOM_TEST_DEVICE=cuda (saved at 2, or 1 on one GPU,
loaded at 1 and at every GPU)."""
import torch
import torch.multiprocessing as mp

from ebc_cases import DEVICE, SLOW_ON_CPU
from tests.distributed._reshard_workers import run
from tests.distributed._workers import free_port

# (the fused tables' optimizer state: row-wise, per element, of column shards, Adam's two moments)
CASES = [("mixed", "rowwise_adagrad"), ("row_wise", "adagrad"), ("column_wise_multi", "rowwise_adagrad"),
         ("table_wise", "adam")]


def _spawn(world, phase, path, backend):
    mp.spawn(run, args=(world, free_port(), phase, CASES, str(path), backend), nprocs=world, join=True)


@SLOW_ON_CPU
def test_checkpoint_saved_at_one_world_size_loads_at_others(tmp_path):
    if DEVICE.type == "cuda":
        gpus, backend = torch.cuda.device_count(), "nccl"
        saving, loading = min(2, gpus), sorted({1, gpus})
    else:
        backend, saving, loading = "gloo", 2, [1, 3]
    _spawn(saving, "save", tmp_path, backend)
    for world in loading:
        _spawn(world, "load", tmp_path, backend)
