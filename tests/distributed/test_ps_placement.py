"""The planner's parameter-server tier: a table that does not fit in HBM is planned on the PS
kernel (when the sharder has a store), trains under DistributedModelParallel exactly like the
unsharded module, stays out of the state_dict (its store holds it) and loads from a checkpoint;
with every rank's shards in one real Redis cluster, through a master killed and restarted."""
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torchrec.distributed.planner.types import PlannerError
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import recom_rec
from recom_rec.distributed import EmbeddingBagCollectionSharder
from recom_rec.distributed.planner import build_plan
from recom_rec.distributed.ps_placement import PS_KERNEL
from tests.distributed._ps_workers import CAP, REMOTE, run, tables
from tests.distributed._workers import free_port
from ebc_cases import DEVICE, SLOW_ON_CPU

# The world of two: NCCL over two GPUs when the suite runs with CUDA tensors on a host that has them
# (each rank's row cache in its GPU); gloo on the CPU otherwise.
BACKEND = "nccl" if DEVICE.type == "cuda" and torch.cuda.device_count() >= 2 else "gloo"


class _Meta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = recom_rec.EmbeddingBagCollection(tables(), device="meta")


def _kernels(device, cap, ps_url):
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1},
                                            ps_url=ps_url, ps_cache_load_factor=0.25)
    caps = {"hbm_cap": cap, "ddr_cap": 1 << 34} if device == "cuda" else {"ddr_cap": cap}
    plan = build_plan(_Meta(), [sharder], world_size=2, batch_size=3, compute_device=device, print_plan=False, **caps)
    return {t: p.compute_kernel for t, p in plan.plan["ebc"].items()}


def test_planner_puts_only_the_table_that_does_not_fit_into_the_ps_tier():
    # GPU plan: HBM holds the cache, host memory the embedded store.
    assert _kernels("cuda", CAP, "memory://plan") == {"t0": "fused", "big": PS_KERNEL, "t2": "fused"}
    # When it fits, the faster fused kernel wins.
    assert _kernels("cuda", 50 * CAP, "memory://plan") == {"t0": "fused", "big": "fused", "t2": "fused"}
    # CPU plan with a store elsewhere: the cache in host memory.
    assert _kernels("cpu", CAP, f"{REMOTE}://plan") == {"t0": "fused", "big": PS_KERNEL, "t2": "fused"}


@pytest.mark.parametrize("device,ps_url", [("cuda", None), ("cpu", "memory://plan")])
def test_no_plan_when_nothing_fits(device, ps_url):
    # No store, or (CPU plan) an embedded store that needs the same host memory as the table.
    with pytest.raises(PlannerError):
        _kernels(device, CAP, ps_url)


def test_sharder_rejects_bad_ps_settings():
    with pytest.raises(ValueError, match="ps_cache_load_factor"):
        EmbeddingBagCollectionSharder(ps_url="memory://x", ps_cache_load_factor=0)
    with pytest.raises(ValueError, match="url"):
        EmbeddingBagCollectionSharder(ps_url="not-a-url")


def test_world_2_ps_shards_train_like_the_unsharded_module():
    # The planner's row-wise PS shards, then column-wise PS shards placed by hand (two column
    # slices of the table on one rank, each its own cache and store name).
    mp.spawn(run, args=(2, free_port(), ["planner", "column_wise"], None, None, False, BACKEND), nprocs=2, join=True)


@SLOW_ON_CPU
def test_world_2_ps_shards_take_variable_batch_per_feature():
    # VBE KJTs (torchrec's stride_per_key_per_rank and inverse indices) through the same plans
    mp.spawn(run, args=(2, free_port(), ["planner", "column_wise"], None, None, True, BACKEND), nprocs=2, join=True)


@SLOW_ON_CPU
def test_world_2_ps_shards_share_one_redis_cluster_through_a_master_restart(tmp_path):
    """The planner's PS shards of both ranks in one real 3-master redis+cluster:// store (append-only
    files on); before step 1 a master is killed (SIGKILL), and restarted 1.5 s into that step: the
    ranks' store operations wait it out (retried), the run trains exactly as the unsharded module
    and the store holds every trained row after a flush."""
    import threading
    import time

    from tests.redis_server import RedisClusterProcesses

    cluster = RedisClusterProcesses(tmp_path / "cluster", n=3, appendonly=True).start()
    signals = tmp_path / "signals"
    signals.mkdir()
    errors = []

    def outage():  # the test's side of _ps_workers._outage
        try:
            while not (signals / "reached").exists():
                time.sleep(0.05)
            cluster.servers[1].stop()
            (signals / "killed").touch()
            time.sleep(1.5)
            cluster.servers[1].start()  # its append-only file replays the acknowledged rows
            cluster.wait_until_ok()
        except Exception as e:  # (reported by the assertion below)
            errors.append(e)

    killer = threading.Thread(target=outage, daemon=True)
    killer.start()
    try:
        url = cluster.url(prefix="dmp", retry_timeout=30)
        mp.spawn(run, args=(2, free_port(), ["planner"], url, str(signals), False, BACKEND), nprocs=2, join=True)
        killer.join(timeout=60)
        assert not errors and not killer.is_alive(), errors
    finally:
        cluster.stop()
