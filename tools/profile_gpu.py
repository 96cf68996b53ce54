"""Device-side investigation (not a benchmark): where the Triton backend's time goes on a workload,
with sweeps of its forward and backward launch shapes.
Usage: python tools/profile_gpu.py OUT_DIR [WORKLOAD ...] [--backward-sweep] [--no-forward-sweep]"""
import json
import sys

import torch

from recom_rec.bench.timing import time_ms
from recom_rec.bench.workloads import get_workload
from recom_rec.kernels import pooled_triton

import recom_rec

flags = {a for a in sys.argv[1:] if a.startswith("--")}
out_dir, *workloads = [a for a in sys.argv[1:] if not a.startswith("--")]
dev = torch.device("cuda")
default_piece_launch = pooled_triton.piece_launch
report = {}
for wname in workloads or ["many-1000", "dlrm-kaggle", "many-500"]:
    w = get_workload(wname, False)
    kjt = w.make_input(dev)
    m = recom_rec.EmbeddingBagCollection(w.tables(), device=dev, validate_inputs=False)
    g = m._groups[0]
    flat, meta = m._flat(g), getattr(m, g.meta_name)
    keys = torch.arange(w.num_tables, device=dev)
    values, offsets = kjt.values(), kjt.offsets()
    # 1. kernel alone vs whole module call
    kernel_only = lambda bb=None, nw=None: pooled_triton.forward(flat, values, offsets, None, meta, keys, w.batch_size,
                                                                 sum(w.dims), max(w.dims), bb, nw)
    with torch.no_grad():
        module_ms = time_ms(lambda: m(kjt), dev, iters=30)
    rep = {"module_forward_ms": module_ms, "kernel_default_ms": time_ms(kernel_only, dev, iters=30)}
    # 2. launch-shape sweep
    sweep = {}
    for bb in (8, 16, 32, 64, 128) if "--no-forward-sweep" not in flags else ():
        for nw in (1, 2, 4, 8):
            if bb * pooled_triton._block_d(max(w.dims)) > 16384:
                continue
            try:
                sweep[f"bb{bb}_w{nw}"] = [round(time_ms(lambda: kernel_only(bb, nw), dev, iters=30), 4)
                                          for _ in range(2)]
            except Exception as e:  # noqa: BLE001 - report and continue the sweep
                sweep[f"bb{bb}_w{nw}"] = str(e)[:80]
    rep["forward_sweep_ms"] = sweep
    # 3. profile of forward and of a fused-SGD training step
    m.enable_fused_optimizer("sgd", lr=0.01)
    grad = torch.ones(w.batch_size, sum(w.dims), device=dev)
    step = lambda: m(kjt).values().backward(grad)
    rep["fused_sgd_step_ms"] = time_ms(step, dev, iters=20)
    bsweep = {}
    block_d = pooled_triton._block_d(max(w.dims))
    for br in (1, 2, 4, 8, 16, 32) if "--backward-sweep" in flags else ():
        for unroll in (2, 4, 8):
            for nw in (2, 4, 8):
                if not 512 <= br * unroll * block_d <= 8192:
                    continue
                pooled_triton.piece_launch = lambda _, shape=(br, unroll, nw): shape
                try:
                    bsweep[f"br{br}_u{unroll}_w{nw}"] = round(time_ms(step, dev, iters=10), 3)
                except Exception as e:  # noqa: BLE001
                    bsweep[f"br{br}_u{unroll}_w{nw}"] = str(e)[:60]
    pooled_triton.piece_launch = default_piece_launch
    rep["backward_sweep_step_ms"] = bsweep
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    rep["profile_train"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    rep["profile_train_cpu"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            for _ in range(5):
                m(kjt)
        torch.cuda.synchronize()
    rep["profile_forward"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15)
    report[wname] = rep
    print(wname, {k: v for k, v in rep.items() if not k.startswith("profile")}, flush=True)
    del m, flat, kjt
    torch.cuda.empty_cache()
json.dump(report, open(f"{out_dir}/profile.json", "w"), indent=1)
for wname, rep in report.items():
    print("=" * 30, wname)
    print(rep["profile_train"])
    print(rep["profile_train_cpu"])
    print(rep["profile_forward"])
