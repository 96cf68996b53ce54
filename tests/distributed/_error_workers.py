"""Worker of tests/distributed/test_sharded_errors.py: a bad id under DistributedModelParallel is
raised by the rank whose lookup read it, naming the feature and the table, and by no other rank."""
import re
from typing import List

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import recom_rec
from recom_rec.distributed import EmbeddingBagCollectionSharder
from tests.distributed._workers import in_process_group

BATCH = 2  # per rank


class _Top(nn.Module):
    def __init__(self, device: torch.device, backend: str) -> None:
        super().__init__()
        self.ebc = recom_rec.EmbeddingBagCollection([
            EmbeddingBagConfig(name="ads", num_embeddings=10, embedding_dim=4, feature_names=["ad_id"]),
            EmbeddingBagConfig(name="users", num_embeddings=12, embedding_dim=4, feature_names=["user_id"]),
        ], device=device, backend=backend)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


def _kjt(ad_ids: List[int], device: torch.device) -> KeyedJaggedTensor:
    """BATCH bags of ad_id (one id each: ``ad_ids``) and of user_id (one id each, in range)."""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["ad_id", "user_id"], values=torch.tensor(ad_ids + [3] * BATCH),
        lengths=torch.ones(2 * BATCH, dtype=torch.int64)).to(device)


def _raised(check) -> str:
    try:
        check()
    except ValueError as e:
        return str(e)
    return ""


def run_errors(rank: int, world: int, port: int, backend: str) -> None:
    def work() -> None:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        # On the CPU the Triton kernels (interpreted): their report is deferred like the GPU's, so
        # the step completes on every rank and the error comes from check_inputs().
        model = _Top(device, "auto" if backend == "nccl" else "triton")
        sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                              "learning_rate": 0.1})
        plan = ShardingPlan({"ebc": construct_module_sharding_plan(
            model.ebc, {"ads": table_wise(rank=world - 1), "users": row_wise()}, sharder=sharder,
            local_size=world, world_size=world, device_type=device.type)})
        dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                       sharders=[sharder], device=device)
        sharded = dmp.module.ebc
        owner = world - 1  # the rank whose lookup reads table 'ads'
        with torch.no_grad():
            dmp(_kjt([1, 2], device))
            assert _raised(sharded.check_inputs) == "", rank
            # rank 0's batch holds id 10 for 'ads' (10 rows): the owner's kernel reads it
            dmp(_kjt([1, 10] if rank == 0 else [4, 5], device))
            message = _raised(sharded.check_inputs)
            if rank == owner:
                assert re.search(r"feature 'ad_id' \(table 'ads'\): id 10 at batch index \d+ is out of range "
                                 r"for 10 rows", message), message
            else:
                assert message == "", (rank, message)
            dmp(_kjt([1, 2], device))
            assert _raised(sharded.check_inputs) == "", rank  # raised once, on its rank
        dist.barrier()

    in_process_group(rank, world, port, backend, work)
