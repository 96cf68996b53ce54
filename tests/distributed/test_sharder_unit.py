"""Single-process checks of the sharder's contract (no process group needed)."""
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise

import recom_rec
from recom_rec.distributed import (
    EmbeddingBagCollectionSharder,
    ShardedFusedEmbeddingBagCollection,
    optimizer_from_fused_params,
)


def test_sharder_contract():
    sharder = EmbeddingBagCollectionSharder()
    assert sharder.module_type is recom_rec.EmbeddingBagCollection
    assert sharder.sharded_module_type is ShardedFusedEmbeddingBagCollection
    assert {"data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise"} <= set(
        sharder.sharding_types("cpu"))
    assert sharder.compute_kernels("data_parallel", "cpu") == ["dense"]
    assert sharder.compute_kernels("row_wise", "cpu") == ["fused", "dense"]


@pytest.mark.parametrize("fused, expected", [
    ({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5}, ("sgd", {"lr": 0.5})),
    ({"optimizer": EmbOptimType.EXACT_SGD, "lr": 0.25}, ("sgd", {"lr": 0.25})),  # apply_optimizer_in_backward
    ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-6},
     ("rowwise_adagrad", {"lr": 0.1, "eps": 1e-6})),
    ({"optimizer": EmbOptimType.ADAM, "learning_rate": 0.1, "beta1": 0.8, "beta2": 0.9, "weight_decay": 0.01},
     ("adam", {"lr": 0.1, "weight_decay": 0.01, "betas": (0.8, 0.9)})),
    ({"output_dtype": "fp32"}, None),
    (None, None),
])
def test_fused_params_map_to_our_optimizers(fused, expected):
    assert optimizer_from_fused_params(fused) == expected


def test_unsupported_fused_optimizer_is_named():
    with pytest.raises(ValueError, match="(?i)lamb"):
        optimizer_from_fused_params({"optimizer": EmbOptimType.LAMB, "learning_rate": 0.1})


def test_weighted_mean_tables_are_not_sharded_row_wise():
    ebc = recom_rec.EmbeddingBagCollection([
        EmbeddingBagConfig(name="m", num_embeddings=10, embedding_dim=4, feature_names=["f"],
                           pooling=PoolingType.MEAN)], is_weighted=True)
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(ebc, {"m": row_wise()}, sharder=sharder, local_size=2, world_size=2,
                                          device_type="cpu")
    with pytest.raises(ValueError, match="weighted MEAN"):
        sharder.shard(ebc, plan, env=None, device=torch.device("cpu"))


def test_rank_major_vbe_layout():
    """The lookup's VBE output: rank, then key, then the key's bags from that rank, each its dim
    values (fbgemm's VBE TBE layout), from the padded [bags, columns] pooled output where key k's
    bags are rank 0's, then rank 1's, in its columns."""
    from recom_rec.distributed.variable_batch import rank_major

    strides = [[2, 0, 1], [1, 3, 2]]  # key, rank: bags (a key with no bags from rank 1)
    dims = [2, 3]
    pooled = torch.arange(6 * 5, dtype=torch.float32).view(6, 5)
    want = []
    for r in range(3):
        for k, dim in enumerate(dims):
            first = sum(strides[k][:r])
            col = sum(dims[:k])
            want.append(pooled[first:first + strides[k][r], col:col + dim].reshape(-1))
    assert torch.equal(rank_major(pooled, strides, dims), torch.cat(want))


def test_vbe_expansion_matches_fbgemms():
    """The sharded module's VBE expansion equals torchrec's (fbgemm's batch_index_select_dim0),
    values and gradients."""
    from recom_rec.distributed.variable_batch import expand_by_inverse

    bags, dims, batch = [3, 1, 4], [2, 5, 3], 6
    gen = torch.Generator().manual_seed(0)
    pooled = torch.randn(sum(b * d for b, d in zip(bags, dims)), generator=gen, requires_grad=True)
    indices = torch.stack([torch.randint(b, (batch,), generator=gen) for b in bags])
    ours = expand_by_inverse(pooled, indices, bags, dims)
    theirs = torch.ops.fbgemm.batch_index_select_dim0(
        inputs=pooled, indices=indices.view(-1), input_num_indices=[batch] * len(dims), input_rows=bags,
        input_columns=dims, permute_output_dim_0_1=True).view(batch, -1)
    assert torch.equal(ours, theirs)
    grad = torch.randn(ours.shape, generator=gen)
    (a,) = torch.autograd.grad(ours, pooled, grad)
    (b,) = torch.autograd.grad(theirs, pooled, grad)
    torch.testing.assert_close(a, b)
