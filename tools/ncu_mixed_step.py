"""Probe (GPU, under Nsight Compute): five dense-backward steps of a workload (default mixed) with
group_parameters=True on the path pieces/fewest lanes, for ncu to profile a launch of the step's
kernels, e.g. (perf-notes v35):

    ncu --clock-control none --kernel-name regex:"piece_kernel|zero_untouched" --launch-skip 6 \
        --launch-count 2 --section SpeedOfLight --section WarpStateStats --section Occupancy \
        --section MemoryWorkloadAnalysis python3 tools/ncu_mixed_step.py [workload]
"""
import sys
import torch
from recom_rec.bench.peers import make_peer
from recom_rec.bench.workloads import get_workload
from recom_rec.kernels.pooled_cuda import BACKWARD_PATH_TUNER

dev = torch.device("cuda")
w = get_workload(sys.argv[1] if len(sys.argv) > 1 else "mixed", False)
kjt = w.make_input(dev)
grad = torch.ones(w.batch_size, sum(w.dims), device=dev)
peer = make_peer("recom_rec:group-params", w, dev, "none", backend="cuda")
BACKWARD_PATH_TUNER.force("pieces/fewest lanes")
for _ in range(5):
    peer.train_step(kjt, grad)
torch.cuda.synchronize()
print("done", flush=True)
