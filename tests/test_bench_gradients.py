"""The benchmarks' upstream gradient: made once per output shape and kept (not part of the timed
embedding work)."""
import torch

from recom_rec.bench.gradients import upstream_ones


class _Peer:
    pass


def test_upstream_ones_are_kept_per_shape():
    peer, outs = _Peer(), [torch.zeros(3, 4), torch.zeros(5, 4)]
    first = upstream_ones(peer, outs)
    assert all(torch.equal(g, torch.ones_like(o)) for g, o in zip(first, outs))
    assert all(a is b for a, b in zip(upstream_ones(peer, outs), first))  # the same tensors again
    other = upstream_ones(peer, [torch.zeros(2, 4)])  # another batch's shapes: new ones
    assert len(other) == 1 and other[0].shape == (2, 4)
