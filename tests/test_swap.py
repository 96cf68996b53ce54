"""swap_modules puts the fused module into torchrec's own models without changing a number."""
import copy
import warnings

import pytest
import torch
import torchrec
from torch import nn
from torchrec import EmbeddingBagConfig
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM, DLRM_DCN

import recom_rec
from ebc_cases import DEVICE, make_kjt


def _tables(dim=8):
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=20 + 7 * i, feature_names=[f"f{i}"])
            for i in range(4)]


def _models():
    torch.manual_seed(0)
    return {
        "DLRM": lambda: DLRM(embedding_bag_collection=torchrec.EmbeddingBagCollection(_tables()), dense_in_features=5,
                             dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]),
        "DLRM_DCN": lambda: DLRM_DCN(embedding_bag_collection=torchrec.EmbeddingBagCollection(_tables()),
                                     dense_in_features=5, dense_arch_layer_sizes=[16, 8],
                                     over_arch_layer_sizes=[16, 1], dcn_num_layers=2, dcn_low_rank_dim=4),
        "DeepFM": lambda: SimpleDeepFMNN(num_dense_features=5,
                                         embedding_bag_collection=torchrec.EmbeddingBagCollection(_tables()),
                                         hidden_layer_size=16, deep_fm_dimension=4),
    }


def _swapped_and_backward(name, **swap_kwargs):
    """A torchrec model and its swapped copy, their outputs on one batch checked equal, both
    differentiated."""
    torch.manual_seed(1)
    model = _models()[name]().to(DEVICE)
    swapped = recom_rec.swap_modules(copy.deepcopy(model), **swap_kwargs)
    dense = torch.randn(6, 5, device=DEVICE)
    kjt = make_kjt(_tables(), batch_size=6, max_len=3, seed=2, is_weighted=False, shuffle_keys=False).to(DEVICE)
    a, b = model(dense, kjt), swapped(dense, kjt)
    torch.testing.assert_close(b, a)
    a.sum().backward()
    b.sum().backward()
    return model, swapped


@pytest.mark.parametrize("name", ["DLRM", "DLRM_DCN", "DeepFM"])
def test_swap_keeps_outputs_and_gradients(name):
    model, swapped = _swapped_and_backward(name)
    stock = [m for m in model.modules() if isinstance(m, torchrec.EmbeddingBagCollection)]
    fused = [m for m in swapped.modules() if isinstance(m, recom_rec.EmbeddingBagCollection)]
    assert len(fused) == len(stock) == 1
    assert not any(type(m) is torchrec.EmbeddingBagCollection for m in swapped.modules())
    grads = {n: p.grad for n, p in swapped.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=lambda m: f"{n}: {m}")


def test_swap_with_group_parameters_gives_the_tables_gradients_as_one_per_group():
    model, swapped = _swapped_and_backward("DLRM", group_parameters=True)
    ebc = swapped.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, recom_rec.EmbeddingBagCollection) and ebc._group_parameters
    flat = ebc._flat(ebc._groups[0])
    want = torch.cat([model.sparse_arch.embedding_bag_collection.embedding_bags[s.name].weight.grad.reshape(-1)
                      for s in ebc._groups[0].slots])
    torch.testing.assert_close(flat.grad, want)
    assert list(swapped.state_dict()) == list(model.state_dict())


def test_swap_with_group_parameters_refuses_what_a_group_cannot_train():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    partly = torchrec.EmbeddingBagCollection(_tables(), device=DEVICE)
    partly.embedding_bags["t1"].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"tables \['t1'\] are frozen"):
        recom_rec.swap_modules(partly, group_parameters=True)
    fused = torchrec.EmbeddingBagCollection(_tables(), device=DEVICE)
    apply_optimizer_in_backward(torch.optim.SGD, fused.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match="apply_optimizer_in_backward"):
        recom_rec.swap_modules(fused, group_parameters=True)
    frozen = torchrec.EmbeddingBagCollection(_tables(), device=DEVICE)
    for p in frozen.parameters():
        p.requires_grad_(False)
    new = recom_rec.swap_modules(frozen, group_parameters=True)
    assert not any(p.requires_grad for p in new.parameters())


def test_swap_nested_shared_dtypes_and_optimizer_in_backward():
    from torch.distributed.optim import _apply_optimizer_in_backward

    shared = torchrec.EmbeddingBagCollection(_tables())
    half = torchrec.EmbeddingBagCollection(_tables(4)).half()
    _apply_optimizer_in_backward(torch.optim.SGD, shared.parameters(), {"lr": 0.5})

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.towers = nn.ModuleList([nn.ModuleDict({"a": shared, "b": half}), nn.Sequential(shared)])

    model = Holder()
    reference = copy.deepcopy(half.state_dict())
    recom_rec.swap_modules(model)
    first, second = model.towers[0]["a"], model.towers[1][0]
    assert isinstance(first, recom_rec.EmbeddingBagCollection) and first is second  # still shared
    fused_half = model.towers[0]["b"]
    assert isinstance(fused_half, recom_rec.EmbeddingBagCollection)
    for key, value in reference.items():
        assert fused_half.state_dict()[key].dtype == torch.float16
        torch.testing.assert_close(fused_half.state_dict()[key], value)
    # The optimizer asked for with apply_optimizer_in_backward is fused into the new module.
    kjt = make_kjt(_tables(), batch_size=3, max_len=2, seed=0, is_weighted=False)
    before = first.embedding_bags["t0"].weight.detach().clone()
    first(kjt).values().sum().backward()
    assert first.fused_optimizer is not None and first.fused_optimizer.spec.name == "sgd"
    assert first.embedding_bags["t0"].weight.grad is None
    assert not torch.equal(first.embedding_bags["t0"].weight, before)


def test_swap_leaves_rng_and_returns_new_module_for_a_bare_ebc():
    ebc = torchrec.EmbeddingBagCollection(_tables())
    state = torch.get_rng_state()
    new = recom_rec.swap_modules(ebc)
    assert torch.equal(torch.get_rng_state(), state)
    assert isinstance(new, recom_rec.EmbeddingBagCollection)
    for key, value in ebc.state_dict().items():
        torch.testing.assert_close(new.state_dict()[key], value)
