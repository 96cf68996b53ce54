"""recom_rec.EmbeddingBagCollection against torchrec's own EmbeddingBagCollection: same keys,
values and weight gradients, on random configurations, on the CPU path and the Triton path
(interpreter here, the GPU on the device machine)."""
import pytest
import torch
import torchrec
from hypothesis import given, settings
from torchrec.modules.embedding_configs import DataType

import recom_rec
from ebc_cases import DEVICE, cases

INTERPRETED = DEVICE.type == "cpu"
# Interpreted Triton runs a numpy program per block: keep its shapes small.
SHAPES = {
    "torch": dict(max_tables=40, max_dim=256, max_rows=10**5, max_batch=12),
    "triton": dict(max_tables=8, max_dim=64, max_rows=10**4, max_batch=6)
    if INTERPRETED else dict(max_tables=40, max_dim=256, max_rows=10**5, max_batch=64),
}


def _pair(case, backend, device=DEVICE):
    ref = torchrec.EmbeddingBagCollection(case.fresh_tables(), is_weighted=case.is_weighted, device=device)
    ours = recom_rec.EmbeddingBagCollection(
        case.fresh_tables(), is_weighted=case.is_weighted, device=device, backend=backend
    )
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _check(case, backend, atol=1e-5, rtol=1e-5):
    ref, ours = _pair(case, backend)
    kjt = case.kjt.to(DEVICE)
    a, b = ref(kjt), ours(kjt)
    assert b.keys() == a.keys()
    assert b.length_per_key() == a.length_per_key()
    assert b.values().dtype == torch.float32
    torch.testing.assert_close(b.values(), a.values(), atol=atol, rtol=rtol)
    g = torch.randn(a.values().shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    (a.values() * g).sum().backward()
    (b.values() * g).sum().backward()
    for name, table in ref.embedding_bags.items():
        torch.testing.assert_close(
            ours.embedding_bags[name].weight.grad.float(), table.weight.grad.float(),
            atol=atol * 10, rtol=rtol * 10, msg=lambda m: f"table {name}: {m}",
        )


def _fp32_test(backend):
    @settings(max_examples=30 if backend == "torch" else 12)
    @given(case=cases(**SHAPES[backend]))
    def run(case):
        _check(case, backend)
    return run


def test_parity_fp32_torch():
    _fp32_test("torch")()


def test_parity_fp32_triton():
    _fp32_test("triton")()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_parity_fp16_weights(backend):
    # torchrec pools fp16 tables in fp16 and rounds the result; we accumulate in fp32, so the
    # outputs agree to fp16 precision.
    @settings(max_examples=10)
    @given(case=cases(**SHAPES[backend], data_types=(DataType.FP16,), weighted=False))
    def run(case):
        _check(case, backend, atol=2e-3, rtol=2e-2)
    run()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_same_seed_same_weights_as_torchrec(backend):
    tables = [
        torchrec.EmbeddingBagConfig(name="a", embedding_dim=5, num_embeddings=17, feature_names=["x"]),
        torchrec.EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=40, feature_names=["y"],
                                    weight_init_min=-0.5, weight_init_max=2.0),
        torchrec.EmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=9, data_type=DataType.FP16),
    ]
    torch.manual_seed(7)
    ref = torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(**vars(t)) for t in tables])
    torch.manual_seed(7)
    ours = recom_rec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(**vars(t)) for t in tables], backend=backend)
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
