"""Measured choices kept on disk (RECOM_REC_CACHE) and made ahead of time (recom_rec.tune): on the
CPU, with the launch tuner's fake stream (tests/test_launch_tuner.py) standing in for the GPU."""
import json
import multiprocessing

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import recom_rec
from recom_rec.kernels.decision_cache import ENV, FILE_NAME, DecisionCache, shape_class
from recom_rec.kernels.launch_tuner import ForwardLaunchShape
from ebc_cases import SLOW_ON_CPU
from test_launch_tuner import B, F, FakeStream, launch, shape

DEVICE = torch.device("cpu")


def test_decisions_go_to_the_file_and_a_new_process_starts_from_them(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    stream = FakeStream({F: 2.0, B: 1.0})
    tuner = stream.tuner(cache_name="forward_order")
    launch(tuner, stream, 60)
    assert tuner.decisions() == {shape(): "bags"}
    entries = json.loads((tmp_path / FILE_NAME).read_text())["entries"]
    (context,) = entries
    assert entries[context]["forward_order"] == {shape_class(shape()): "bags"}
    # a new process (a fresh tuner) of another model of the same layout (the weights elsewhere):
    # decided at its first call, no trial launch, the cached choice
    fresh_stream = FakeStream({F: 2.0, B: 1.0})
    fresh = fresh_stream.tuner(cache_name="forward_order")
    other_model = shape()._replace(weights_at=12345)
    launch(fresh, fresh_stream, 3, other_model)
    assert fresh.trial_launches == 0 and fresh_stream.events == 0
    assert fresh_stream.launches == [B, B, B]


def test_without_the_variable_nothing_is_written_or_read(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    stream = FakeStream({F: 2.0, B: 1.0})
    launch(stream.tuner(cache_name="forward_order"), stream, 60)
    assert not list(tmp_path.iterdir())


def test_another_batch_class_or_dtype_is_another_class_and_is_measured(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    stream = FakeStream({F: 2.0, B: 1.0})
    launch(stream.tuner(cache_name="forward_order"), stream, 60)
    fresh_stream = FakeStream({F: 1.0, B: 2.0})
    fresh = fresh_stream.tuner(cache_name="forward_order")
    for other in (shape()._replace(batch_bucket=4096), shape()._replace(weight_dtype=torch.float16)):
        launch(fresh, fresh_stream, 60, other)
        assert fresh.decisions()[other] == "features"
    assert fresh.trial_launches > 0


def test_a_cached_name_the_tuner_does_not_know_is_measured(tmp_path, monkeypatch):
    path = tmp_path / FILE_NAME
    monkeypatch.setenv(ENV, str(tmp_path))
    stream = FakeStream({F: 2.0, B: 1.0})
    tuner = stream.tuner(cache_name="forward_order")
    DecisionCache(str(path)).record("forward_order", DEVICE, shape(), "no such launch")
    launch(tuner, stream, 60)
    assert tuner.decisions() == {shape(): "bags"} and tuner.trial_launches > 0


def test_a_corrupt_file_is_read_as_empty_and_rewritten(tmp_path, monkeypatch):
    path = tmp_path / FILE_NAME
    path.write_text("{not json")
    monkeypatch.setenv(ENV, str(tmp_path))
    stream = FakeStream({F: 2.0, B: 1.0})
    launch(stream.tuner(cache_name="forward_order"), stream, 60)
    assert json.loads(path.read_text())["version"] == 1


def _record(path: str, k: int) -> None:
    cache = DecisionCache(path)
    for j in range(20):
        s = ForwardLaunchShape(0, 26, 64 * (k * 20 + j + 1), 3328, 128, 1024, torch.float32, torch.int64, False)
        cache.record("forward", torch.device("cpu"), s, f"choice {k}")


@SLOW_ON_CPU
def test_processes_writing_at_once_lose_no_decision(tmp_path):
    """Ranks deciding together: every process's decisions end up in the file."""
    path = str(tmp_path / FILE_NAME)
    workers = [multiprocessing.get_context("spawn").Process(target=_record, args=(path, k)) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    (context,) = json.loads(open(path).read())["entries"].values()
    assert len(context["forward"]) == 80


def _tables():
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20, feature_names=[f"f{i}"])
            for i in range(3)]


def _kjt(seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (3 * 4,), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.randint(0, 20, (int(lengths.sum()),),
                                               generator=g), lengths=lengths)


def test_tune_runs_the_model_and_leaves_a_trained_model_as_it_was():
    torch.manual_seed(0)
    model = recom_rec.EmbeddingBagCollection(_tables())
    model.enable_fused_optimizer("adagrad", lr=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = recom_rec.tune(model, [_kjt(s) for s in range(3)], train=True)
    assert report["passes"] >= 1
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    recom_rec.tune(model, [_kjt(0)])  # inference: no backward
    model(_kjt(0)).values().sum().backward()  # a real step does move the weights tune put back
    assert not all(torch.equal(before[k], model.state_dict()[k]) for k in before)


def test_tune_refuses_to_train_parameter_server_tables():
    from recom_rec.ps import PSConfig

    model = recom_rec.EmbeddingBagCollection(_tables(), ps={"t0": PSConfig("memory://tune-test", 10)})
    with pytest.raises(ValueError, match="parameter-server"):
        recom_rec.tune(model, [_kjt(0)], train=True)
