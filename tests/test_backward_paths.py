"""The CUDA backend's two backward paths (every row through the sorted pieces, or rows of one lookup
finished in bag order by their own kernel) give the same bits, so the path the tuner measures
faster per shape never changes results. Needs a GPU: RECOM_TEST_DEVICE=cuda (tools/gpu_session.sh)."""
import pytest
import torch
from hypothesis import given, settings
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

import recom_rec
from ebc_cases import DEVICE, Case, cases

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA backend runs on a GPU only "
                                "(RECOM_TEST_DEVICE=cuda); CI compiles its kernels: test_kernels_compile.py")

OPTIMIZERS = {"dense": None, "sgd": {"lr": 0.1}, "rowwise_adagrad": {"lr": 0.1}, "adagrad": {"lr": 0.1},
              "adam": {"lr": 0.01, "weight_decay": 0.01}}


def _train(case, optimizer, path, monkeypatch):
    from recom_rec.kernels import pooled_cuda

    monkeypatch.setattr(pooled_cuda.BACKWARD_PATH_TUNER, "forced_order", None)  # restored after the test
    pooled_cuda.BACKWARD_PATH_TUNER.force(path)
    torch.manual_seed(0)
    module = recom_rec.EmbeddingBagCollection(case.fresh_tables(), is_weighted=case.is_weighted, device=DEVICE,
                                              backend="cuda")
    if OPTIMIZERS[optimizer] is not None:
        module.enable_fused_optimizer(optimizer, **OPTIMIZERS[optimizer])
    kjt = case.kjt.to(DEVICE)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        out = module(kjt).values()
        (out * torch.randn(out.shape, generator=g).to(DEVICE)).sum().backward()
    return {k: v.detach().clone() for k, v in module.state_dict().items()} | {
        f"{n}.grad": b.weight.grad.clone() for n, b in module.embedding_bags.items() if b.weight.grad is not None}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_both_backward_paths_give_the_same_bits(optimizer, monkeypatch):
    @settings(max_examples=8, deadline=None)
    @given(case=cases(max_tables=6, max_dim=300, max_rows=400, max_batch=9, max_len=7, allow_mean_weighted=True,
                      data_types=(DataType.FP32, DataType.FP16, DataType.BF16)))
    def run(case):
        pieces = _train(case, optimizer, "pieces", monkeypatch)
        singles = _train(case, optimizer, "singletons", monkeypatch)
        assert pieces.keys() == singles.keys()
        for key in pieces:
            assert torch.equal(pieces[key], singles[key]), key
    run()


def test_a_row_read_once_by_each_of_two_features_is_not_a_singleton(monkeypatch):
    tables = [EmbeddingBagConfig(name="t", embedding_dim=32, num_embeddings=50, feature_names=["a", "b"])]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.tensor([1, 2, 3, 1, 4, 5, 5]),
                                              lengths=torch.tensor([2, 1, 1, 3]))
    case = Case(tables, kjt, False)
    pieces, singles = (_train(case, "sgd", path, monkeypatch) for path in ("pieces", "singletons"))
    assert all(torch.equal(pieces[k], singles[k]) for k in pieces)
