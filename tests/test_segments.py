"""ops/segments.segment_ids: each position's segment, as repeat_interleave gives it (the VBE
padding, the sharded VBE output order and the sequence backward's gradient rows use it)."""
import pytest
import torch

from ebc_cases import DEVICE
from recom_rec.ops.segments import segment_ids


@pytest.mark.parametrize("seed", range(6))
def test_segment_ids_equal_repeat_interleave(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    counts = torch.randint(0, 5, (n,), generator=g)
    counts[torch.rand(n, generator=g) < 0.3] = 0  # empty segments among the others
    if seed == 0:
        counts[0] = 100_000  # one long segment: the case repeat_interleave serialises on CUDA
    counts = counts.to(DEVICE)
    total = int(counts.sum())
    want = torch.repeat_interleave(torch.arange(n, device=DEVICE), counts)
    assert torch.equal(segment_ids(counts, torch.arange(total, device=DEVICE)), want)


def test_no_segments_or_only_empty_ones():
    none = torch.arange(0, device=DEVICE)
    assert segment_ids(torch.zeros(0, dtype=torch.int64, device=DEVICE), none).numel() == 0
    assert segment_ids(torch.zeros(3, dtype=torch.int64, device=DEVICE), none).numel() == 0


def test_scripted():
    scripted = torch.jit.script(segment_ids)
    counts = torch.tensor([2, 0, 3, 1], device=DEVICE)
    assert scripted(counts, torch.arange(6, device=DEVICE)).tolist() == [0, 0, 2, 2, 2, 3]
