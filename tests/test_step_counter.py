"""The fused optimizer's step counter (ops/step_counter.py): plus one a call, on the device, with
the CUDA extension's kernel where it is loaded and torch's add_ elsewhere; a CUDA graph's replays
count too."""
import pytest
import torch

from ebc_cases import DEVICE
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
