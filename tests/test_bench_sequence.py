"""The sequence benchmark's training step: a kept upstream gradient (bench/gradients.py) trains as a
fresh one does."""
import torch

from ebc_cases import DEVICE
from recom_rec.bench.sequence import SequenceWorkload, _Ours


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
