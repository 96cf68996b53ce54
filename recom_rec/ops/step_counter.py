"""The fused optimizer's step counter: a one-element int64 tensor on the tables' device, plus one
for each training forward (as fbgemm counts iterations; Adam's bias correction reads it in the
backward, and a CUDA graph's replay counts too). On a GPU where the CUDA extension is loaded its
one-thread kernel counts it: torch's ``add_`` loaded torch's binary-op kernels at its first launch
in a process, 19-23 ms of a first training step (perf-notes v59-v60)."""
import torch

from ..kernels import cuda_ext


def count_step(step: torch.Tensor) -> None:
    """``step += 1`` in place, on ``step``'s device and the current stream."""
    ext = cuda_ext.loaded() if step.is_cuda and not torch.compiler.is_compiling() else None
    if ext is not None:
        ext.count_step(step)
        torch.autograd.graph.increment_version(step)  # (as add_ would: a mutation autograd can see)
        return
    with torch.no_grad():
        step.add_(1)
