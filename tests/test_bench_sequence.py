"""The sequence benchmark's training step: the upstream gradient is made once per output shape and
kept (not part of the timed embedding work), and a kept gradient trains as a fresh one does."""
import torch

from ebc_cases import DEVICE
from recom_rec.bench.sequence import SequenceWorkload, _Ours, upstream_ones


class _Peer:
    pass


def test_upstream_ones_are_kept_per_shape():
    peer, outs = _Peer(), [torch.zeros(3, 4), torch.zeros(5, 4)]
    first = upstream_ones(peer, outs)
    assert all(torch.equal(g, torch.ones_like(o)) for g, o in zip(first, outs))
    assert all(a is b for a, b in zip(upstream_ones(peer, outs), first))  # the same tensors again
    other = upstream_ones(peer, [torch.zeros(2, 4)])  # another batch's shapes: new ones
    assert len(other) == 1 and other[0].shape == (2, 4)


def test_steps_with_the_kept_gradient_train_as_with_fresh_ones():
    w = SequenceWorkload(4, 500, [50, 8], (2, 6))
    kjt = w.make_input(DEVICE)
    torch.manual_seed(0)
    weights = [torch.empty(t.num_embeddings, 256, device=DEVICE).uniform_(-0.01, 0.01) for t in w.tables()]
    kept, fresh = _Ours(w, DEVICE, train=True), _Ours(w, DEVICE, train=True)
    for peer in (kept, fresh):
        peer.load(weights)
    for _ in range(3):
        kept.train_step(kjt)
        outs = [jt.values() for jt in fresh.module(kjt).values()]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    for a, b in zip(kept.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(kept.module.parameters()), weights[0])  # it trained
