"""Probe (GPU): would piece lists by lane width pay at the mixed workload? Runs mixed's tables split
by the lanes their rows need at four float4 a lane (1, 2, 4, 8), each subset as its own module, its
piece kernel at its own fewest lanes and at mixed's 8, dense backward, path pieces/fewest lanes.

    python tools/piece_classes_probe.py
"""
import torch

import recom_rec.kernels.pooled_cuda as pooled_cuda
from profile_step import kernel_times
from recom_rec.bench.peers import make_peer
from recom_rec.bench.workloads import Workload, get_workload
from recom_rec.kernels.pooled_cuda import BACKWARD_PATH_TUNER


def main():
    dev = torch.device("cuda")
    w = get_workload("mixed", False)
    real = pooled_cuda.fewest_piece_lanes
    lanes_of = [real(d) for d in w.dims]
    BACKWARD_PATH_TUNER.force("pieces/fewest lanes")
    for cls in (1, 2, 4, 8, None):
        idx = [i for i, g in enumerate(lanes_of) if cls is None or g == cls]
        sub = Workload(f"mixed-G{cls}", [w.rows[i] for i in idx], [w.dims[i] for i in idx], w.batch_size,
                       [w.pooling_factors[i] for i in idx])
        kjt = sub.make_input(dev)
        grad = torch.ones(sub.batch_size, sum(sub.dims), device=dev)
        peer = make_peer("recom_rec:group-params", sub, dev, "none", backend="cuda")
        for lanes in sorted({cls or 8, 8}):
            pooled_cuda.fewest_piece_lanes = lambda max_dim, lanes=lanes: lanes
            step = lambda: peer.train_step(kjt, grad)  # noqa: E731
            for _ in range(3):
                step()
            ks = kernel_times(step)
            piece = sum(us for k, (us, _) in ks.items() if "piece_kernel" in k)
            total = sum(us for us, _ in ks.values())
            print(f"{sub.name}: {len(idx)} tables, lanes {lanes}: piece kernel {piece:8.1f} us, kernels {total:8.1f} us",
                  flush=True)
        pooled_cuda.fewest_piece_lanes = real
        del peer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
