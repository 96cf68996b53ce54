"""Bad input raises a ValueError naming the feature and the table, on every backend."""
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS

TABLES = [
    EmbeddingBagConfig(name="users", embedding_dim=4, num_embeddings=10, feature_names=["user_id"]),
    EmbeddingBagConfig(name="item_table", embedding_dim=3, num_embeddings=6, feature_names=["item_id", "shared"]),
    EmbeddingBagConfig(name="tags", embedding_dim=2, num_embeddings=100, feature_names=["shared"]),
]
BACKENDS = KERNEL_BACKENDS


def _module(backend, **kw):
    return recom_rec.EmbeddingBagCollection(
        [EmbeddingBagConfig(**{**vars(t), "feature_names": list(t.feature_names)}) for t in TABLES],
        backend=backend, device=DEVICE, **kw)


def _kjt(values, lengths, keys=("user_id", "item_id", "shared"), weights=None):
    return KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values), lengths=torch.tensor(lengths),
                             weights=weights).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_id_out_of_range_names_feature_and_table(backend):
    with pytest.raises(ValueError, match=r"feature 'item_id' \(table 'item_table'\): id 6 at batch index 1 .*\[0, 6\)"):
        _module(backend)(_kjt([1, 2, 0, 6, 3, 4], [1, 1, 1, 1, 1, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_feature_checked_against_the_smaller_table(backend):
    # 'shared' feeds items (6 rows) and tags (100 rows): id 50 is fine for tags, not for items.
    with pytest.raises(ValueError, match=r"feature 'shared' \(table 'item_table'\): id 50"):
        _module(backend)(_kjt([1, 2, 0, 1, 50, 4], [1, 1, 1, 1, 1, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_id(backend):
    with pytest.raises(ValueError, match=r"feature 'user_id' \(table 'users'\): id -3 .* negative"):
        _module(backend)(_kjt([-3, 2, 0, 1, 3, 4], [1, 1, 1, 1, 1, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [[1, 1, 1, 1, 1, 2], [1, 1, 1, 0, 1, 1], [3, 3, 1, 0, 0, 0]])
def test_lengths_that_do_not_add_up(backend, lengths):
    with pytest.raises(ValueError, match=r"lengths add up to \d+ but there are 6 values: feature '\w+' \(table"):
        _module(backend)(_kjt([1, 2, 0, 1, 3, 4], lengths))


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_feature(backend):
    with pytest.raises(ValueError, match=r"missing feature\(s\) 'item_id' \(table 'item_table'\)"):
        _module(backend)(_kjt([1, 2, 0, 1], [1, 1, 1, 1], keys=("user_id", "shared")))


def test_weighted_module_needs_weights():
    with pytest.raises(ValueError, match="weighted but the KeyedJaggedTensor has no weights"):
        _module("torch", is_weighted=True)(_kjt([1, 2, 0, 1, 3, 4], [1, 1, 1, 1, 1, 1]))


def test_float_ids_rejected():
    kjt = KeyedJaggedTensor(keys=["user_id", "item_id", "shared"], values=torch.tensor([1.0, 2.0, 0.0]),
                            lengths=torch.tensor([1, 1, 1])).to(DEVICE)
    with pytest.raises(ValueError, match="integer ids"):
        _module("torch")(kjt)


def test_checks_can_be_switched_off():
    module = _module("torch", validate_inputs=False)
    good = _kjt([1, 2, 0, 1, 3, 4], [1, 1, 1, 1, 1, 1])
    checked = _module("torch")
    checked.load_state_dict(module.state_dict())
    torch.testing.assert_close(module(good).values(), checked(good).values())
    module.validate_inputs = True
    with pytest.raises(ValueError):
        module(_kjt([1, 2, 0, 6, 3, 4], [1, 1, 1, 1, 1, 1]))


def test_extra_keys_are_ignored_like_torchrec():
    module = _module("torch")
    kjt = _kjt([1, 2, 0, 1, 9, 9, 2, 3], [1] * 8, keys=("user_id", "item_id", "extra", "shared"))
    out = module(kjt)
    assert out.keys() == ["user_id", "item_id", "shared@item_table", "shared@tags"]
