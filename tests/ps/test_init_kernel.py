"""The GPU init of never-seen PS rows (recom_rec/kernels/ps_init.py) against ``init_rows`` (torch):
the same bits, written only into the given slots. On the CPU the Triton kernel runs under
TRITON_INTERPRET=1; RECOM_TEST_DEVICE=cuda runs it compiled."""
from __future__ import annotations

import functools

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recom_rec import ps
from recom_rec.ps.tier import _row_seed, _signed
from ebc_cases import DEVICE

ps_init = pytest.importorskip("recom_rec.kernels.ps_init", reason="needs Triton")


@pytest.mark.parametrize("dim", [1, 7, 32, 100])
@pytest.mark.parametrize("bounds", [(-0.01, 0.01), (-3.5, 2.25)])
def test_device_init_matches_init_rows(dim, bounds):
    a, b = bounds
    config = EmbeddingBagConfig(name="tbl", embedding_dim=dim, num_embeddings=10, feature_names=["f"],
                                init_fn=functools.partial(torch.nn.init.uniform_, a=a, b=b))
    g = torch.Generator().manual_seed(dim)
    ids = torch.cat([torch.tensor([0, 2**40 + 3, 2**62 + 11]), torch.randint(0, 2**40, (37,), generator=g)])
    slots = torch.randperm(60, generator=g)[:ids.numel()]
    out = torch.full((60, dim), 7.0, device=DEVICE)
    ps_init.init_uniform_rows(out, slots.to(DEVICE), ids.to(DEVICE), _signed(_row_seed("tbl", 3, 0)), a, b)
    assert torch.equal(out[slots.to(DEVICE)].cpu(), ps.init_rows(config, ids, seed=3))
    untouched = torch.ones(60, dtype=torch.bool)
    untouched[slots] = False
    assert (out.cpu()[untouched] == 7.0).all()
