"""Input errors under DistributedModelParallel (real process groups: gloo on the CPU, NCCL with
RECOM_TEST_DEVICE=cuda): a bad id is raised by the sharded module's check_inputs() on the rank whose
lookup read it, naming the feature and the table, once, and on no other rank."""
import pytest
import torch.multiprocessing as mp

from ebc_cases import DEVICE, SLOW_ON_CPU
from tests.distributed._error_workers import run_errors
from tests.distributed._workers import free_port, two_rank_world


@pytest.mark.timeout(600)
@SLOW_ON_CPU
def test_a_bad_id_is_raised_by_the_rank_that_read_it():
    world, backend = two_rank_world(DEVICE)
    mp.spawn(run_errors, args=(world, free_port(), backend), nprocs=world, join=True)
