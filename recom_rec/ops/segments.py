"""Which segment each position of back-to-back segments falls in, on any device.

``segment_ids(counts, torch.arange(total))`` equals
``torch.repeat_interleave(torch.arange(len(counts)), counts)`` (``total`` = ``counts.sum()``, known to
the caller, so that no device-to-host sync is needed; the callers use the positions themselves too). torch's CUDA
``repeat_interleave`` writes each segment's positions from one thread, so a few segments of
millions of positions serialise: two of them took 800 us of a 5.2 ms sequence training step at
batch 1024 (one item feature, 3.2M rows; perf-notes v51). A binary search per position over the
segments' ends runs every position in parallel. (TorchScript-compatible.)
"""
import torch


def segment_ids(counts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64, one per position (int64, on ``counts``' device; ``torch.arange(total)`` for every
    position): the index of the segment holding it; segments of ``counts[i]`` positions
    (non-negative) lie back to back, empty ones hold none."""
    return torch.searchsorted(torch.cumsum(counts.to(torch.int64), 0), positions, right=True)


def segment_of_each_position(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``segment_ids(counts, torch.arange(total))``: on the CPU by one ``repeat_interleave`` pass
    (the binary search a position cost ~1 ms of a 520-key batch's id check, perf-notes v61), on a
    GPU by the search (see above)."""
    if counts.device.type == "cpu":
        return torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=total)
    return segment_ids(counts, torch.arange(total, device=counts.device))
