"""MLPerf DLRM-DCNv2's tables (scaled down) planned by torchrec's planner with our sharder and
estimates (four tables pinned to row-, column-, table-row-wise and data-parallel), then trained with fused SGD under DistributedModelParallel: forward and weights equal
to the unsharded module's. gloo (2 ranks) on the CPU; NCCL over every GPU with
RECOM_TEST_DEVICE=cuda. RECOM_DIST_STEPS sets the steps (3; the multi-GPU session runs 20)."""
import torch
import torch.multiprocessing as mp

from ebc_cases import DEVICE, SLOW_ON_CPU
from tests.distributed._dcnv2_workers import run
from tests.distributed._workers import STEPS, free_port


@SLOW_ON_CPU
def test_planned_dcnv2_trains_like_the_unsharded_module():
    world, backend = (torch.cuda.device_count(), "nccl") if DEVICE.type == "cuda" else (2, "gloo")
    mp.spawn(run, args=(world, free_port(), STEPS, backend), nprocs=world, join=True)
