"""The CUDA backend's backward paths (every row through the sorted pieces, or rows of one lookup
finished in bag order by their own kernel; the pieces at the widest row's lanes, at the fewest, or
each at its own row's fewest, a launch a lane class) give the same bits, so the path the tuner
measures faster per shape never changes results. Needs a GPU: RECOM_TEST_DEVICE=cuda
(tools/gpu_session.sh)."""
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


def _train(case, optimizer, path, monkeypatch, by_width_runs=False):
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
    fallbacks = pooled_cuda.BACKWARD_PATH_TUNER.forced_fallbacks
    for _ in range(3):
        out = module(kjt).values()
        (out * torch.randn(out.shape, generator=g).to(DEVICE)).sum().backward()
    ran_default = pooled_cuda.BACKWARD_PATH_TUNER.forced_fallbacks != fallbacks
    assert not (ran_default and by_width_runs and "lanes by width" in path), \
        f"{path} is a candidate for every group of mixed widths, yet a forced launch ran the default"
    return {k: v.detach().clone() for k, v in module.state_dict().items()} | {
        f"{n}.grad": b.weight.grad.clone() for n, b in module.embedding_bags.items() if b.weight.grad is not None}


PATHS = ("pieces", "singletons", "pieces/fewest lanes", "singletons/fewest lanes", "pieces/lanes by width",
         "singletons/lanes by width")


def _same_bits(runs: dict) -> None:
    first = runs[PATHS[0]]
    for path, result in runs.items():
        assert result.keys() == first.keys(), path
        for key in first:
            assert torch.equal(result[key], first[key]), (path, key)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_every_backward_path_gives_the_same_bits(optimizer, monkeypatch):
    # dims up to 128 take the fewest-lanes paths (4 float4 a lane instead of 1); wider ones share
    # a group with them in some cases; every path must agree in each.
    @settings(max_examples=8, deadline=None)
    @given(case=cases(max_tables=6, max_dim=300, max_rows=400, max_batch=9, max_len=7, allow_mean_weighted=True,
                      data_types=(DataType.FP32, DataType.FP16, DataType.BF16)))
    def run(case):
        _same_bits({path: _train(case, optimizer, path, monkeypatch) for path in PATHS})
    run()


@pytest.mark.parametrize("optimizer", ["dense", "rowwise_adagrad"])
@pytest.mark.parametrize("dims", [(8, 64), (12, 100), (4, 33), (20, 500), (12, 801), (600, 1024)])
def test_rows_of_many_pieces_give_the_same_bits_on_every_path(optimizer, dims, monkeypatch):
    # Hot rows of 1-2100 lookups: one group's pieces, split rows and a block's long rows, at the
    # lanes of each path; row-wise Adagrad's row sum over lanes of 1 and 4 float4 (dim 33: columns);
    # dims 20 and 500: lanes by width in six lane classes, four of them empty; 12 and 801, 600 and
    # 1024: rows past 512 columns in the wide class (eight float4 on 32 lanes), 801 and 12 in the
    # scalar layout (the output width is not a multiple of 4).
    g = torch.Generator().manual_seed(3)
    reads = torch.tensor([2100, 1024, 1025, 33, 1, 0])
    hot = torch.repeat_interleave(torch.arange(len(reads)), reads)
    hot = hot[torch.randperm(hot.numel(), generator=g)]
    cold = torch.randint(0, 300, (200,), generator=g)
    tables = [EmbeddingBagConfig(name="cold", embedding_dim=dims[0], num_embeddings=300, feature_names=["c"]),
              EmbeddingBagConfig(name="hot", embedding_dim=dims[1], num_embeddings=len(reads), feature_names=["h"])]
    lengths = torch.cat([torch.full((40,), 5), torch.full((40,), hot.numel() // 40)])
    lengths[-1] += hot.numel() - int(lengths[40:].sum())
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["c", "h"], values=torch.cat([cold, hot]), lengths=lengths)
    _same_bits({path: _train(Case(tables, kjt, False), optimizer, path, monkeypatch, by_width_runs=True)
                for path in PATHS})


def test_a_row_read_once_by_each_of_two_features_is_not_a_singleton(monkeypatch):
    tables = [EmbeddingBagConfig(name="t", embedding_dim=32, num_embeddings=50, feature_names=["a", "b"])]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.tensor([1, 2, 3, 1, 4, 5, 5]),
                                              lengths=torch.tensor([2, 1, 1, 3]))
    _same_bits({path: _train(Case(tables, kjt, False), "sgd", path, monkeypatch) for path in PATHS})


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_groups_with_rows_past_512_columns_give_the_same_bits_on_every_path(optimizer, monkeypatch):
    # The widest row takes eight float4 a lane; lanes by width gives those rows their own class and
    # the narrower ones four float4 at their own lanes: the same bits, odd widths (scalar) included.
    @settings(max_examples=4, deadline=None)
    @given(case=cases(max_tables=4, max_dim=1024, max_rows=300, max_batch=9, max_len=7, allow_mean_weighted=True,
                      element_budget=10**6, data_types=(DataType.FP32, DataType.FP16, DataType.BF16)))
    def run(case):
        _same_bits({path: _train(case, optimizer, path, monkeypatch) for path in PATHS})
    run()
