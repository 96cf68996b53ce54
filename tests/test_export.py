"""The whole DLRM with recom_rec's module under torch.compile(fullgraph=True), training (fused
optimizer in the backward + dense optimizer) and inference, and torch.export of the inference
model (KJT passed as values/lengths tensors and rebuilt inside a wrapper)."""
import copy

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

import recom_rec
from recom_rec.data import synthetic_criteo_batches
from ebc_cases import DEVICE

HASH_SIZES = [40 + 3 * i for i in range(26)]
KEYS = [f"C{i + 1}" for i in range(26)]


def _dlrm(seed=0, fused="rowwise_adagrad"):
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=n, feature_names=[k])
              for k, n in zip(KEYS, HASH_SIZES)]
    torch.manual_seed(seed)
    ebc = recom_rec.EmbeddingBagCollection(tables, device=DEVICE)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[16, 8],
                 over_arch_layer_sizes=[16, 1]).to(DEVICE)
    if fused:
        ebc.enable_fused_optimizer(fused, lr=0.1)
    opt = torch.optim.Adagrad([p for n, p in model.named_parameters() if ".embedding_bags." not in n], lr=0.05)
    return model, opt


def _batches(n, batch_size=16, seed=0):
    return [b.to(DEVICE) for b in synthetic_criteo_batches(n, batch_size, HASH_SIZES, seed=seed)]


def _train(model, opt, batches):
    losses = []
    for b in batches:
        opt.zero_grad()
        logits = model(b.dense_features, b.sparse_features).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("fused", ["rowwise_adagrad", None])
def test_compile_fullgraph_training_matches_eager(fused):
    batches = _batches(4)
    eager, eager_opt = _dlrm(fused=fused)
    model, opt = _dlrm(fused=fused)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    torch.testing.assert_close(_train(compiled, opt, batches), _train(eager, eager_opt, batches),
                               rtol=1e-5, atol=1e-5)
    # Same weights (and fused optimizer state) after training.
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    if fused:
        state = model.sparse_arch.embedding_bag_collection.fused_optimizer.state
        assert all(s["sum"].abs().sum() > 0 for s in list(state.values())[:3])


def test_compile_fullgraph_inference_matches_eager():
    model, _ = _dlrm()
    model.eval()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for b in _batches(3, batch_size=16, seed=5):
            torch.testing.assert_close(compiled(b.dense_features, b.sparse_features),
                                       model(b.dense_features, b.sparse_features))


class ExportableDLRM(nn.Module):
    """torch.export takes tensors, not KJTs: the KJT goes in as (values, lengths) and is
    rebuilt here, with the key order fixed at construction."""

    def __init__(self, model: nn.Module, keys):
        super().__init__()
        self.model = model
        self.keys = list(keys)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths)
        return self.model(dense, kjt)


def _inputs(b):
    return b.dense_features, b.sparse_features.values(), b.sparse_features.lengths()


def test_export_inference_matches_eager(tmp_path):
    model, opt = _dlrm()
    _train(model, opt, _batches(2))  # trained weights, not the initial ones
    model.eval()
    wrapper = ExportableDLRM(model, KEYS)
    example = _batches(1, batch_size=16, seed=7)[0]
    with torch.no_grad():
        ep = torch.export.export(wrapper, _inputs(example))
    assert "recom_rec.pooled_embedding_forward" in str(ep.graph)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*_inputs(example)), model(example.dense_features, example.sparse_features))
        # Other ids (same shapes) through the exported program still match eager.
        other = _batches(1, batch_size=16, seed=8)[0]
        torch.testing.assert_close(ep.module()(*_inputs(other)), model(other.dense_features, other.sparse_features))
    # Saved and loaded, it still runs and matches.
    path = tmp_path / "dlrm.pt2"
    torch.export.save(ep, str(path))
    loaded = torch.export.load(str(path))
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(*_inputs(example)), model(example.dense_features, example.sparse_features))


@pytest.mark.parametrize("fused", ["rowwise_adagrad", None])
def test_exporting_leaves_the_module_training_as_before(fused):
    """Exporting a serving snapshot mid-training changes nothing the module trains with: the
    exported module and its twin that was not exported train on with the same losses and weights
    (torch.export's trace swaps fake tensors into the module's parameters and leaves its table
    modules new parameter dicts)."""
    batches = _batches(4)
    (model, opt), (twin, twin_opt) = _dlrm(fused=fused), _dlrm(fused=fused)
    _train(model, opt, batches[:2]), _train(twin, twin_opt, batches[:2])
    with torch.no_grad():
        torch.export.export(ExportableDLRM(model, KEYS), _inputs(batches[0]))
    torch.testing.assert_close(_train(model, opt, batches[2:]), _train(twin, twin_opt, batches[2:]), rtol=0, atol=0)
    for (name, a), b in zip(twin.state_dict().items(), model.state_dict().values()):
        assert type(b) is torch.Tensor and torch.equal(b, a), name


def test_export_with_dynamic_batch_size():
    model, _ = _dlrm(fused=None)
    model.eval()
    wrapper = ExportableDLRM(model, KEYS)
    example = _batches(1, batch_size=16, seed=7)[0]
    batch = torch.export.Dim("batch", min=2, max=4096)
    n_values = torch.export.Dim("n_values", min=2, max=4096 * 26)
    n_lengths = 26 * batch
    with torch.no_grad():
        ep = torch.export.export(wrapper, _inputs(example),
                                 dynamic_shapes=({0: batch}, {0: n_values}, {0: n_lengths}))
        for size in (5, 33):
            b = _batches(1, batch_size=size, seed=size)[0]
            torch.testing.assert_close(ep.module()(*_inputs(b)), model(b.dense_features, b.sparse_features))


def test_checkpoint_restores_apply_optimizer_in_backward_state_before_any_forward():
    """The restore path of examples/dlrm_criteo.py: apply_optimizer_in_backward on a fresh
    model, load_state_dict before its first forward: the fused state must be restored (it used
    to be dropped with a warning, since the optimizer was only picked up at the first forward)."""
    import warnings

    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    def build(seed):
        model, opt = _dlrm(seed=seed, fused=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.embedding_bag_collection.parameters(),
                                        {"lr": 0.1})
        return model, opt

    batches = _batches(3)
    model, opt = build(0)
    _train(model, opt, batches[:2])
    restored, restored_opt = build(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "fused-optimizer state ... ignored"
        restored.load_state_dict(model.state_dict())
    restored_opt.load_state_dict(opt.state_dict())
    torch.testing.assert_close(_train(restored, restored_opt, batches[2:]), _train(model, opt, batches[2:]),
                               rtol=0, atol=0)
