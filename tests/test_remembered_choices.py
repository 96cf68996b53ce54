"""Launch choices remembered between processes: a previous process's decision is the incumbent the
next one's measurement starts from. Tuners on the fake stream of test_launch_tuner; each "process"
is a new tuner with a new ChoiceMemory over one directory."""
import json
import random
import warnings

import pytest
import torch

from recom_rec.kernels.remembered_choices import ChoiceMemory, portable_key
from test_launch_tuner import B, DEVICE, F, FakeStream, decide_by_launching, launch, noisy, shape


def memory(tmp_path, device_name="Fake GPU 80GB"):
    return ChoiceMemory(directory=lambda: tmp_path, device_name=lambda device: device_name)


def process(tmp_path, ms, **kwargs):
    """A new process's tuner of the forward's launch order, remembering under tmp_path."""
    stream = FakeStream(ms)
    return stream, stream.tuner(name="forward_order", memory=memory(tmp_path), **kwargs)


def test_a_near_tie_keeps_the_choice_an_earlier_process_made(tmp_path):
    stream, first = process(tmp_path, {F: 1.0, B: 0.8})  # bags clearly faster on that run
    decide_by_launching(stream, first)
    assert first.decisions() == {shape(): "bags"}
    # The next runs see the two within the margin: without a memory they would keep the default.
    for seed in range(20):
        rng = random.Random(seed)
        stream, later = process(tmp_path, {F: noisy(1.0, 0.05, rng), B: noisy(1.0, 0.05, rng)})
        decide_by_launching(stream, later)
        assert later.decisions() == {shape(): "bags"}, seed
    stream = FakeStream({F: noisy(1.0, 0.05, random.Random(0)), B: noisy(1.0, 0.05, random.Random(1))})
    fresh = stream.tuner(name="forward_order")  # no memory
    decide_by_launching(stream, fresh)
    assert fresh.decisions() == {shape(): "features"}


def test_a_clearly_faster_candidate_replaces_the_remembered_one_and_is_remembered(tmp_path):
    stream, first = process(tmp_path, {F: 1.0, B: 0.8})
    decide_by_launching(stream, first)
    stream, second = process(tmp_path, {F: 0.8, B: 1.0})
    decide_by_launching(stream, second)
    assert second.decisions() == {shape(): "features"}
    assert memory(tmp_path).recall(DEVICE, "forward_order", shape()) == "features"


def test_undecided_and_captured_launches_run_the_remembered_choice(tmp_path):
    stream, first = process(tmp_path, {F: 1.0, B: 0.5})
    decide_by_launching(stream, first)
    stream, later = process(tmp_path, {F: 1.0, B: 0.5}, min_trials=3)
    stream.capturing = True  # a graph captured before the shape's trials: the remembered choice
    launch(later, stream, 2)
    assert stream.launches == [B, B] and stream.events == 0
    stream.capturing, stream.finished = False, False
    launch(later, stream, 10)  # trials (one untimed each, 3 timed rounds), then waiting: untimed
    assert stream.launches[2:] == [F, B, F, B, B, F, F, B] + [B] * 2


def test_a_remembered_choice_the_shape_cannot_take_falls_back_to_the_default(tmp_path):
    wide = shape(num_features=70000)  # bag-major cannot take more than 65535 features
    memory(tmp_path).remember(DEVICE, "forward_order", wide, "bags")
    stream, tuner = process(tmp_path, {F: 1.0, B: 0.5})
    stream.capturing = True
    launch(tuner, stream, 1, wide)
    assert stream.launches == [F]


def test_the_key_leaves_out_the_weights_address_and_keeps_the_rest():
    a, b = shape()._replace(weights_at=1 << 20), shape()._replace(weights_at=2 << 20)
    assert a != b and portable_key(a) == portable_key(b)
    assert portable_key(shape(lookups=2048)) != portable_key(shape(lookups=1024))
    assert portable_key(shape()._replace(weight_dtype=torch.float16)) != portable_key(shape())
    assert "weights_at" not in portable_key((a, True)) and "torch.float32" in portable_key((a, True))


def test_tuners_and_device_models_are_kept_apart(tmp_path):
    m = memory(tmp_path)
    m.remember(DEVICE, "forward_order", shape(), "bags")
    assert m.recall(DEVICE, "backward_path", shape()) is None
    assert memory(tmp_path, device_name="Other GPU").recall(DEVICE, "forward_order", shape()) is None
    assert memory(tmp_path).recall(DEVICE, "forward_order", shape()) == "bags"
    assert [p.name for p in tmp_path.iterdir()] == ["Fake-GPU-80GB.json"]


def test_processes_writing_other_shapes_meanwhile_keep_theirs(tmp_path):
    one, two = memory(tmp_path), memory(tmp_path)
    one.recall(DEVICE, "forward_order", shape())  # both loaded the (empty) file before either wrote
    two.recall(DEVICE, "forward_order", shape())
    one.remember(DEVICE, "forward_order", shape(lookups=1024), "bags")
    two.remember(DEVICE, "forward_order", shape(lookups=2048), "features/4 rows")
    two.remember(DEVICE, "backward_path", shape(), "singletons")
    third = memory(tmp_path)
    assert third.recall(DEVICE, "forward_order", shape(lookups=1024)) == "bags"
    assert third.recall(DEVICE, "forward_order", shape(lookups=2048)) == "features/4 rows"
    assert third.recall(DEVICE, "backward_path", shape()) == "singletons"
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 99, "choices": {}}), json.dumps([1, 2])])
def test_an_unreadable_file_warns_once_and_the_tuner_starts_from_the_default(tmp_path, content):
    (tmp_path / "Fake-GPU-80GB.json").write_text(content)
    stream, tuner = process(tmp_path, {F: 1.0, B: 1.0})
    with pytest.warns(RuntimeWarning, match="remembered launch choices.*Fake-GPU-80GB.json"):
        decide_by_launching(stream, tuner)
    assert tuner.decisions() == {shape(): "features"}
    assert memory(tmp_path).recall(DEVICE, "forward_order", shape()) == "features"  # rewritten whole


def test_an_unwritable_directory_warns_once_and_the_tuners_go_on(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    stream = FakeStream({F: 1.0, B: 0.5})
    tuner = stream.tuner(name="forward_order",
                         memory=ChoiceMemory(directory=lambda: blocked / "choices", device_name=lambda d: "GPU"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch(tuner, stream, 40)
        launch(tuner, stream, 40, shape(lookups=4096))
    assert tuner.decisions() == {shape(): "bags", shape(lookups=4096): "bags"}
    assert len([w for w in caught if "remembered launch choices" in str(w.message)]) == 1
