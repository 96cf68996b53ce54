"""The fused ops are torch custom ops with fake implementations: torch.compile keeps one graph,
torchrec's fx tracer records the lookup, meta tensors flow through."""
import pytest
import torch
import torchrec
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import recom_rec
from ebc_cases import DEVICE, make_kjt


def _tables():
    return [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=20, feature_names=["x", "y"]),
        EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=15, feature_names=["z"],
                           pooling=PoolingType.MEAN),
    ]


class Tower(nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        self.proj = nn.Linear(11, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        kt = self.ebc(kjt)
        return self.proj(torch.cat([kt["x"], kt["y"], kt["z"]], dim=1)).squeeze(1)


def _batch(seed):
    return make_kjt(_tables(), batch_size=6, max_len=3, seed=seed, is_weighted=False, shuffle_keys=False).to(DEVICE)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_fullgraph_forward_and_backward_match_eager(backend):
    torch.manual_seed(0)
    eager = Tower(recom_rec.EmbeddingBagCollection(_tables(), backend=backend, device=DEVICE)).to(DEVICE)
    torch.manual_seed(0)
    compiled_model = Tower(recom_rec.EmbeddingBagCollection(_tables(), backend=backend, device=DEVICE)).to(DEVICE)
    compiled = torch.compile(compiled_model, fullgraph=True, dynamic=False)
    for seed in range(2):
        kjt = _batch(seed)
        a, b = eager(kjt), compiled(kjt)
        torch.testing.assert_close(b, a)
        a.sum().backward()
        b.sum().backward()
    for name in ("a", "b"):
        torch.testing.assert_close(compiled_model.ebc.embedding_bags[name].weight.grad,
                                   eager.ebc.embedding_bags[name].weight.grad)


def test_compile_counts_one_graph():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    model = Tower(recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)).to(DEVICE)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        compiled(_batch(0))
    assert counter.frame_count == 1
    assert "recom_rec.pooled_embedding_forward" in str(torch.ops.recom_rec.pooled_embedding_forward)


def test_torchrec_fx_symbolic_trace():
    model = Tower(recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)).to(DEVICE)
    gm = torchrec.fx.symbolic_trace(model)
    assert "_fused_lookup" in gm.code
    kjt = _batch(3)
    torch.testing.assert_close(gm(kjt), model(kjt))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    module = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)
    kjt = _batch(1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = module(kjt)
        assert out.values().shape == (6, 11)
