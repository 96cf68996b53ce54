"""The ``sharded-dlrm`` workload: a DLRM training step under DistributedModelParallel.

torchrec's ``DLRM`` model with MLPerf DLRM-DCNv2's tables (26 Criteo-1TB tables, rows capped,
D=128, its multi-hot sizes; random_layouts.dcnv2), a batch of 16384 per GPU (256 per process on
the CPU, the tables scaled down), one process per GPU (NCCL; gloo on the CPU). Two embedding
modules go through the same plan (every table table-wise, tables spread over the ranks by size,
greedily; printed): recom_rec's module with our sharder, and torchrec's module with torchrec's
default sharder (fbgemm's TBE). Both fuse SGD into the backward; the dense part trains with
torch.optim.SGD under DDP, as DMP sets it up. Reported: median step time (the slowest rank's),
global samples per second, our speed-up, the scaling from the smallest world to each larger and
the weak-scaling efficiency (samples per second per GPU against the smallest world's). On GPUs
also each step's device time split into the embedding lookup (forward, backward and update
kernels), the all-to-alls (NCCL's send/receive kernels) and the rest (dense layers, DDP's
all-reduce, copies), from a profile of a few steps on rank 0: device time per category, so parts
that overlap on streams each count in full.
"""
import os
import socket
import sys
import tempfile
import time
import re
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DENSE_IN = 13
DENSE_LAYERS = [512, 256, 128]
OVER_LAYERS = [1024, 1024, 512, 256, 1]
LR = 0.01
PROFILED_STEPS = 5
# Kernel names of the embedding lookups, forward and backward (ours: Triton's and csrc/lookup's,
# every one of which a test checks here; fbgemm's TBE: split_embedding_*, linearize_index_*,
# bounds_check_*) and their index sorts; NCCL's kernels that carry the all-to-alls.
LOOKUP_KERNELS = re.compile(r"embedding|pooled|piece|plan_kernel|split_row|long_row|singleton|zero_untouched|expand_|moved_features|pad_offsets|pad_columns|count_step"
                            r"|_row_key|linearize|bounds_check|radix|sort|lookup|bag", re.I)
TOP_KERNELS = 12  # the costliest kernels kept per module (rank 0), to check the split against
ALL_TO_ALL_KERNELS = re.compile(r"nccl.*(sendrecv|alltoall)", re.I)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table_wise_ranks(rows: List[int], world: int) -> List[int]:
    """Each table's rank: largest tables first, each to the rank holding the fewest rows so far."""
    load = [0] * world
    ranks = [0] * len(rows)
    for t in sorted(range(len(rows)), key=lambda i: -rows[i]):
        r = min(range(world), key=lambda k: load[k])
        ranks[t] = r
        load[r] += rows[t]
    return ranks


def plan_of(workload, world: int) -> Dict[str, int]:
    """Each table's rank, by name (table-wise, by size): the plan both modules run."""
    return {t.name: r for t, r in zip(workload.tables(), table_wise_ranks(workload.rows, world))}


def kernel_category(name: str) -> str:
    """Which part of a training step a CUDA kernel (by name) belongs to."""
    if ALL_TO_ALL_KERNELS.search(name):
        return "all-to-all"
    if LOOKUP_KERNELS.search(name) and "nccl" not in name.lower():
        return "lookup"
    return "rest"


def step_split(step, device: torch.device, steps: int = PROFILED_STEPS) -> Dict[str, object]:
    """Device ms per step in each kernel_category, from a profile of ``steps`` steps; under the key
    ``kernels`` the TOP_KERNELS costliest kernels' ms per step (a {name: ms} dict)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    split = {"lookup": 0.0, "all-to-all": 0.0, "rest": 0.0}
    kernels: Dict[str, float] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            ms = event.time_range.elapsed_us() / 1e3 / steps
            split[kernel_category(event.name)] += ms
            kernels[event.name[:120]] = kernels.get(event.name[:120], 0.0) + ms
    split["kernels"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS])
    return split


def _build(impl: str, workload, world: int, device: torch.device):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection as TorchrecEBC
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as TorchrecSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM

    import recom_rec
    from recom_rec.distributed import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    tables = workload.tables()
    meta = torch.device("meta")
    if impl == "recom_rec":
        ebc = recom_rec.EmbeddingBagCollection(tables, device=meta)
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    else:
        ebc = TorchrecEBC(tables, device=meta)
        sharder = TorchrecSharder(fused_params=fused)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=DENSE_LAYERS,
                 over_arch_layer_sizes=OVER_LAYERS, dense_device=device)
    per_table = {name: table_wise(rank=r, compute_kernel="fused") for name, r in plan_of(workload, world).items()}
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type=device.type)})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=device)
    return dmp


def _worker(rank: int, world: int, port: int, small: bool, iters: int, warmup: int, result_path: str) -> None:
    from .random_layouts import dcnv2
    from .timing import time_ms

    cuda = torch.cuda.is_available() and not small
    if cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        workload = dcnv2(small)
        kjt = workload.make_input(device, seed=rank)
        gen = torch.Generator().manual_seed(rank)
        dense = torch.randn(workload.batch_size, DENSE_IN, generator=gen).to(device)
        labels = (torch.rand(workload.batch_size, generator=gen) < 0.25).float().to(device)
        results: Dict[str, float] = {}
        splits: Dict[str, Optional[Dict[str, object]]] = {}

        def any_rank(flag: bool) -> bool:  # the warm-up goes on while any rank's tuners are deciding
            t = torch.tensor([int(flag)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return bool(t.item())

        for impl in ("recom_rec", "torchrec"):
            torch.manual_seed(0)
            dmp = _build(impl, workload, world, device)
            dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "embedding_bag" not in n], lr=LR)
            loss_fn = torch.nn.BCEWithLogitsLoss()

            def step():
                logits = dmp(dense, kjt).squeeze(-1)
                loss_fn(logits, labels).backward()
                dense_opt.step()
                dense_opt.zero_grad(set_to_none=True)

            ms = torch.tensor([time_ms(step, device, warmup=warmup, iters=iters, any_rank=any_rank)], device=device)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
            results[impl] = float(ms.item())
            splits[impl] = step_split(step, device) if cuda else None  # (every rank steps: collectives)
            del dmp, dense_opt
            if cuda:
                torch.cuda.empty_cache()
        if rank == 0:
            plan = plan_of(workload, world)
            torch.save({"world": world, "batch_per_rank": workload.batch_size, "ms": results, "split": splits,
                        "plan": plan, "workload": workload.description,
                        "device": torch.cuda.get_device_name(device) if cuda else "cpu"}, result_path)
    finally:
        dist.destroy_process_group()
    # Skip C++ static destructors: a library thread still joinable at exit can call std::terminate
    # after the work is done (seen with gloo on the CPU), and spawn would report a failed worker.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_sharded_dlrm(worlds: List[int], small: bool, iters: int = 20, warmup: int = 5) -> List[dict]:
    """One spawned process group per world size; rows of results (one per world x module)."""
    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.pt")
            t0 = time.perf_counter()
            mp.spawn(_worker, args=(world, _free_port(), small, iters, warmup, path), nprocs=world, join=True)
            res = torch.load(path)
        print(f"sharded-dlrm world {world}: {res['ms']} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        print(f"sharded-dlrm world {world}, the plan (table: rank): "
              + ", ".join(f"{t}: {r}" for t, r in res["plan"].items()), file=sys.stderr)
        for impl, split in res["split"].items():
            for name, ms in list((split or {}).get("kernels", {}).items())[:8]:
                print(f"  world {world} {impl:>9} {ms:7.3f} ms  {kernel_category(name):>10}  {name[:90]}", file=sys.stderr)
        for impl, ms in res["ms"].items():
            rows.append({"workload": "sharded-dlrm", "phase": f"train step, {world} rank(s)", "peer": impl,
                         "world": world, "batch_per_rank": res["batch_per_rank"], "ms": ms,
                         "samples_per_s": world * res["batch_per_rank"] / (ms * 1e-3), "device": res["device"],
                         "split_ms": res["split"][impl], "plan": res["plan"], "tables": res["workload"]})
    return rows


def format_sharded(rows: List[dict]) -> str:
    if not rows:
        return ""
    smallest = min(x["world"] for x in rows)
    base = {r["peer"]: r for r in rows if r["world"] == smallest}
    lines = [f"sharded-dlrm: torchrec DLRM, {rows[0].get('tables', 'dlrm tables')}, table-wise (same plan), fused "
             f"SGD, batch {rows[0]['batch_per_rank']} per rank, {rows[0]['device']}",
             f"{'ranks':>5}  {'module':>9}  {'step ms':>8}  {'samples/s':>11}  {'x torchrec':>10}  {'scaling':>7}  "
             f"{'weak eff.':>9}  device ms a step: lookup / all-to-all / rest"]
    by_world: Dict[int, Dict[str, dict]] = {}
    for r in rows:
        by_world.setdefault(r["world"], {})[r["peer"]] = r
    for world, peers in sorted(by_world.items()):
        for impl, r in peers.items():
            speedup = peers["torchrec"]["ms"] / r["ms"] if "torchrec" in peers else float("nan")
            scaling = r["samples_per_s"] / base[impl]["samples_per_s"] if impl in base else float("nan")
            efficiency = scaling * smallest / world
            split = r.get("split_ms")
            parts = " / ".join(f"{split[k]:.2f}" for k in ("lookup", "all-to-all", "rest")) if split else "-"
            lines.append(f"{world:>5}  {impl:>9}  {r['ms']:>8.2f}  {r['samples_per_s']:>11,.0f}  {speedup:>10.2f}  "
                         f"{scaling:>7.2f}  {efficiency:>9.0%}  {parts}")
    return "\n".join(lines)


def default_worlds(small: bool) -> List[int]:
    if small or not torch.cuda.is_available():
        return [1, 2]
    n = torch.cuda.device_count()
    return sorted({1, n})

