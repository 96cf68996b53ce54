"""The CUDA runtime calls a drawn sequence layout's training step makes on the host, ours against
fbgemm's: each call's count and host microseconds a step (torch.profiler's CUPTI records of
cudaLaunchKernel, cudaMemsetAsync, the occupancy and attribute queries...), and the step's kernels.
host_breakdown.py times the Python functions; this looks inside the C++ calls it cannot split
(perf-notes v63: one extension call of ~6 launches took 165-183 us of a step).

    python3 tools/runtime_api_costs.py [--layout SEED:INDEX] [--steps 50]
"""
import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from step_host_costs import layout_peers


def runtime_costs(peer, kjt, steps: int, device: torch.device):
    """({runtime call: (calls, us) a step}, {kernel: calls a step}) over ``steps`` warm steps."""
    for _ in range(20):
        peer.train_step(kjt)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            peer.train_step(kjt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    calls, kernels = defaultdict(lambda: [0, 0.0]), defaultdict(int)
    for e in prof.events():
        if e.name.startswith("cuda") or e.name.startswith("cu"):  # runtime and driver API records
            if e.device_type == torch.autograd.DeviceType.CPU:
                calls[e.name][0] += 1
                calls[e.name][1] += e.cpu_time_total
        elif e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
    return ({n: (c / steps, us / steps) for n, (c, us) in calls.items()},
            {n: c / steps for n, c in kernels.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="1517231538:0", metavar="SEED:INDEX")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    w, kjt, peers = layout_peers(args.layout, device)
    print(f"{w.label()}: {w.describe()}")
    for name, peer in peers.items():
        calls, kernels = runtime_costs(peer, kjt, args.steps, device)
        total = sum(us for _, us in calls.values())
        print(f"  {name}: runtime calls {total:.1f} us a step, {sum(kernels.values()):.1f} kernels a step")
        for call, (count, us) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
            print(f"    {us:8.1f} us  {count:5.1f} calls  {call}")
        for kernel, count in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
            print(f"             {count:5.1f} x  {kernel[:110]}")


if __name__ == "__main__":
    main()
