"""torchrec's wrappers around ``recom_rec.EmbeddingBagCollection`` under DistributedModelParallel:
``ManagedCollisionEmbeddingBagCollection`` (zero-collision hashing: raw ids remapped into the
table's slots) and ``FeatureProcessedEmbeddingBagCollection`` (position-weighted features),
sharded by torchrec's ``ManagedCollisionEmbeddingBagCollectionSharder`` /
``FeatureProcessedEmbeddingBagCollectionSharder`` built on our sharder, against the same wrappers
around torchrec's module sharded by torchrec's sharders (real process groups: gloo on the CPU,
NCCL when the suite runs with RECOM_TEST_DEVICE=cuda). One spawn runs several cases."""
import pytest
import torch.multiprocessing as mp

from ebc_cases import DEVICE, SLOW_ON_CPU
from tests.distributed._workers import free_port, two_rank_world
from tests.distributed._wrapped_workers import run_wrapped

# torchrec shards managed-collision modules row-wise only.
CASES = [
    ("mc", "row_wise", "device"),
    ("fp", "table_wise", "device"),
    ("fp", "row_wise", "device"),
    ("mc", "row_wise", "meta"),
    ("fp", "table_wise", "meta"),
]


@pytest.mark.timeout(600)
@SLOW_ON_CPU
def test_wrapped_modules_world_2():
    world, backend = two_rank_world(DEVICE)
    # A fused optimizer with per-row state, whose rows the eviction resets: fbgemm's reset
    # (torchrec's side of the comparison) runs on CUDA only. On the CPU the eviction path is
    # checked with SGD here and the reset itself in tests/test_torchrec_compat.py.
    cases = CASES + ([("mc", "row_wise", "device", "rowwise_adagrad")] if backend == "nccl" else [])
    mp.spawn(run_wrapped, args=(world, free_port(), cases, backend), nprocs=world, join=True)
