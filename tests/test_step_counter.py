"""The fused optimizer's step counter (ops/step_counter.py): plus one a call, on the device, with
the CUDA extension's kernel where it is loaded (or inside the EmbeddingCollection's lookup launch)
and torch's add_ elsewhere; a CUDA graph's replays count too; a module counts once a training
forward."""
import pytest
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from ebc_cases import DEVICE, KERNEL_BACKENDS
from recom_rec.kernels import cuda_ext
from recom_rec.ops import step_counter
from recom_rec.ops.step_counter import count_step


def _extension_loaded() -> bool:
    return DEVICE.type == "cuda" and cuda_ext.build_error() is None and cuda_ext.loaded() is not None


@pytest.mark.parametrize("through_torch", [False, True])
def test_each_call_counts_one(monkeypatch, through_torch):
    if through_torch:
        monkeypatch.setattr(step_counter.cuda_ext, "loaded", lambda: None)
    elif DEVICE.type == "cuda" and not _extension_loaded():
        pytest.skip(f"the CUDA extension is unavailable: {cuda_ext.build_error()}")
    step = torch.full((1,), 41, dtype=torch.int64, device=DEVICE)
    version = step._version
    for _ in range(3):
        count_step(step)
    assert int(step) == 44 and step._version == version + 3


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA graph capture (RECOM_TEST_DEVICE=cuda)")
def test_a_captured_count_counts_each_replay():
    if not _extension_loaded():
        pytest.skip(f"the CUDA extension is unavailable: {cuda_ext.build_error()}")
    step = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        count_step(step)
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    assert int(step) == 4


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("collection", ["EmbeddingCollection", "EmbeddingBagCollection"])
def test_a_module_counts_each_training_forward_once(backend, collection):
    """One count a training forward with two table groups (fp32 and fp16 tables: two lookups, the
    EmbeddingCollection's first one counting in its own launch), an empty batch included; none
    without grad or in eval mode."""
    config = EmbeddingConfig if collection == "EmbeddingCollection" else EmbeddingBagConfig
    tables = [config(name="a", embedding_dim=8, num_embeddings=10, feature_names=["f0"]),
              config(name="b", embedding_dim=8, num_embeddings=10, feature_names=["f1"], data_type=DataType.FP16)]
    module = getattr(recom_rec, collection)(tables=tables, device=DEVICE, backend=backend)
    module.enable_fused_optimizer("sgd", lr=0.1)

    def kjt(lengths):
        lengths = torch.tensor(lengths)
        return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.arange(int(lengths.sum())) % 10,
                                                   lengths=lengths).to(DEVICE)

    full, empty = kjt([2, 1, 3, 0]), kjt([0, 0, 0, 0])

    def values(out):
        return [jt.values() for jt in out.values()] if isinstance(out, dict) else [out.values()]

    for batch in (full, empty, full):
        outs = values(module(batch))
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    with torch.no_grad():
        module(full)
    module.eval()
    module(full)
    assert int(module.fused_optimizer_step) == 3
