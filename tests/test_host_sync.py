"""A training step queues its work without waiting for the GPU: the forward, the backward and the
fused optimizer's update of EmbeddingCollection and EmbeddingBagCollection make no synchronizing
call once the measured choices are made (``torch.cuda.set_sync_debug_mode("error")``). A host wait
in a step serialises the host's work behind the device's (a copy from pageable memory is one).
(VBE batches: test_variable_batch.)"""
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="a GPU property: whether a step makes the host wait "
                                                              "for the device (torch.cuda.set_sync_debug_mode)")
BACKENDS = [b for b in KERNEL_BACKENDS if b != "torch"] + ["auto"]


def _kjt(keys, rows: int, batch: int, max_len: int, seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    """Every key read by the module (counting unread keys' lookups would sync, pooled_triton.lookup_bases)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights).to(DEVICE)


def _no_sync_steps(module, batches, outputs) -> None:
    """Tunes ``module`` on ``batches``, then runs a training step on each with any sync raising."""
    from recom_rec.kernels.selection import trial_launches

    recom_rec.tune(module, batches, train=True, max_passes=1000)
    trials = trial_launches()
    for kjt in batches:  # (each cache filled, each kernel loaded)
        torch.autograd.backward(outputs(module(kjt)), None)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for kjt in batches:
            torch.autograd.backward(outputs(module(kjt)), None)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert trial_launches() == trials, "a shape was still on trial: the test ran the tuner, not just the step"


def _sums(jagged):
    return [jt.values().sum() for jt in jagged.values()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["sgd", "adam", None])
def test_embedding_collection_training_step_does_not_synchronize(backend, optimizer):
    tables = [EmbeddingConfig(name="item", embedding_dim=16, num_embeddings=40, feature_names=["history", "target"]),
              EmbeddingConfig(name="actions", embedding_dim=16, num_embeddings=7, feature_names=["acts"])]
    ec = recom_rec.EmbeddingCollection(tables=tables, device=DEVICE, backend=backend)
    if optimizer is not None:
        ec.enable_fused_optimizer(optimizer, lr=0.01)
    keys = ["history", "target", "acts"]
    _no_sync_steps(ec, [_kjt(keys, 7, 6, 9, seed) for seed in range(2)], _sums)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", None])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag_collection_training_step_does_not_synchronize(backend, optimizer, weighted):
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=50, feature_names=["f0"]),
              EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=30, feature_names=["f1", "f2"],
                                 pooling=PoolingType.MEAN)]
    ebc = recom_rec.EmbeddingBagCollection(tables, device=DEVICE, backend=backend, is_weighted=weighted)
    if optimizer is not None:
        ebc.enable_fused_optimizer(optimizer, lr=0.01)
    batches = [_kjt(["f0", "f1", "f2"], 30, 8, 5, seed, weighted) for seed in range(2)]
    _no_sync_steps(ebc, batches, lambda kt: [kt.values().sum()])
