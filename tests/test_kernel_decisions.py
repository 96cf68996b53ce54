"""Kernel decisions taken out of a process and put into another (recom_rec.kernel_decisions,
use_kernel_decisions), and shipped with an exported model (save_exported / load_exported) or an
AOTInductor package (aoti_compile_and_package / aoti_load_package). On the CPU, with the launch
tuner's fake stream (tests/test_launch_tuner.py) standing in for the GPU: a fresh tuner stands for
a new process."""
import json
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import recom_rec
from recom_rec.decisions import EXTRA_FILE
from recom_rec.kernels.decision_cache import ENV, shape_class
from recom_rec.kernels.selection import forget_all
from ebc_cases import DEVICE
from test_launch_tuner import B, F, FakeStream, launch, shape

TUNER = "forward_order"
# A context no machine of the test has: another GPU, driver and build.
OTHER_CONTEXT = "NVIDIA H100 80GB HBM3|sm_90|cuda 13.0|driver 13000|build 0123456789abcdef"


@pytest.fixture(autouse=True)
def fresh_decisions(monkeypatch):
    """No decision file; nothing measured or imported before or after the test."""
    monkeypatch.delenv(ENV, raising=False)
    forget_all()
    yield
    forget_all()


def _measured():
    """A tuner that measured "bags" clearly faster for shape()."""
    stream = FakeStream({F: 2.0, B: 1.0})
    tuner = stream.tuner(cache_name=TUNER)
    launch(tuner, stream, 60)
    assert tuner.decisions() == {shape(): "bags"} and tuner.trial_launches > 0
    return tuner


def _decided():
    """The decisions taken out after _measured(); then its "process" ends."""
    tuner = _measured()
    decisions = recom_rec.kernel_decisions()
    tuner.forget()
    return decisions


def _ours(decisions):
    """The decisions of the fake stream's context (cpu) for TUNER: {shape class: choice}."""
    return {cls: choice for context, tuners in decisions["entries"].items() if context.startswith("cpu|")
            for cls, choice in tuners.get(TUNER, {}).items()}


def _other_context_decisions():
    """The shape decided the other way on another GPU and build."""
    return {"version": 1, "entries": {OTHER_CONTEXT: {TUNER: {shape_class(shape()): "features"}}}}


def _fresh_launches(calls=3, s=None):
    """A new process's tuner (another model of the layout: the weights elsewhere): its launches."""
    stream = FakeStream({F: 2.0, B: 1.0})
    tuner = stream.tuner(cache_name=TUNER)
    launch(tuner, stream, calls, s or shape()._replace(weights_at=4096))
    return tuner, stream


def test_decisions_taken_out_are_json_in_the_decision_files_format():
    decisions = _decided()
    assert json.loads(json.dumps(decisions)) == decisions
    assert decisions["version"] == 1
    assert _ours(decisions) == {shape_class(shape()): "bags"}


def test_imported_decisions_run_from_the_first_call_with_no_trial():
    decisions = _decided()
    forget_all()
    tuner, _ = _fresh_launches()
    assert tuner.trial_launches == 3  # without the import: measured
    assert recom_rec.use_kernel_decisions(decisions) == 1
    tuner, stream = _fresh_launches()
    assert stream.launches == [B, B, B] and stream.events == 0 and tuner.trial_launches == 0
    assert tuner.decisions() == {shape()._replace(weights_at=4096): "bags"}


def test_decisions_go_through_a_json_file(tmp_path):
    path = tmp_path / "decisions.json"
    tuner = _measured()
    written = recom_rec.kernel_decisions(path)
    assert json.loads(path.read_text()) == written and _ours(written) == {shape_class(shape()): "bags"}
    tuner.forget()
    recom_rec.use_kernel_decisions(path)
    tuner, stream = _fresh_launches()
    assert stream.launches == [B, B, B] and tuner.trial_launches == 0


def test_a_shape_on_trial_takes_an_imported_decision_at_its_next_call():
    decisions = _decided()
    forget_all()
    stream = FakeStream({F: 2.0, B: 1.0})
    tuner = stream.tuner(cache_name=TUNER)
    launch(tuner, stream, 4)  # on trial
    assert tuner.trial_launches == 4 and tuner.decisions() == {}
    recom_rec.use_kernel_decisions(decisions)
    launch(tuner, stream, 3)
    assert stream.launches[4:] == [B, B, B] and tuner.trial_launches == 4


def test_a_decision_of_another_context_is_ignored_and_the_shape_measured():
    decisions = _decided()
    other = _other_context_decisions()
    forget_all()
    recom_rec.use_kernel_decisions(other)
    with pytest.warns(UserWarning, match="other contexts"):
        tuner, stream = _fresh_launches(60)
    assert tuner.trial_launches > 0 and set(stream.launches) == {F, B}
    assert tuner.decisions() == {shape()._replace(weights_at=4096): "bags"}  # measured
    # and with this context's decisions as well, this context's is the one taken
    forget_all()
    recom_rec.use_kernel_decisions(other)
    recom_rec.use_kernel_decisions(decisions)
    tuner, stream = _fresh_launches()
    assert stream.launches == [B, B, B] and tuner.trial_launches == 0


def test_decisions_taken_out_hold_the_imported_ones_not_used_yet():
    decisions = _decided()
    forget_all()
    other = _other_context_decisions()
    recom_rec.use_kernel_decisions(other)
    recom_rec.use_kernel_decisions(decisions)
    again = recom_rec.kernel_decisions()
    assert again["entries"][OTHER_CONTEXT] == other["entries"][OTHER_CONTEXT]
    assert _ours(again) == _ours(decisions)


@pytest.mark.parametrize("data, message", [
    ([1, 2], "expected a JSON object"),
    ({"entries": {}}, "'version' and 'entries'"),
    ({"version": 99, "entries": {}}, "version 99"),
    ({"version": 1, "entries": []}, "'entries' is a list"),
    ({"version": 1, "entries": {"cpu|x": {TUNER: {"not json": "bags"}}}}, "no shape class"),
    ({"version": 1, "entries": {"cpu|x": {TUNER: {"{}": 3}}}}, "expected a choice's name"),
])
def test_malformed_decisions_are_a_clear_error(data, message):
    with pytest.raises(ValueError, match=message):
        recom_rec.use_kernel_decisions(data)


def test_a_malformed_decisions_file_is_a_clear_error_naming_it(tmp_path):
    path = tmp_path / "decisions.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not recom_rec kernel decisions: not JSON")):
        recom_rec.use_kernel_decisions(path)
    path.write_text(json.dumps({"version": 1, "entries": {"cpu|x": "bags"}}))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*expected an object of tuners"):
        recom_rec.use_kernel_decisions(str(path))


# An exported model: a recom_rec EBC and a linear layer, the KJT passed as values and lengths.
KEYS = ["f0", "f1", "f2"]


class Served(nn.Module):
    def __init__(self):
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20, feature_names=[k])
                  for i, k in enumerate(KEYS)]
        self.ebc = recom_rec.EmbeddingBagCollection(tables, device=DEVICE)
        self.top = nn.Linear(24, 1).to(DEVICE)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.top(self.ebc(KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)).values())


def _inputs(seed: int, batch: int = 4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(KEYS) * batch,), generator=g)
    lengths[0] = 2  # (at least 2 ids: the exported program's smallest)
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    return values.to(DEVICE), lengths.to(DEVICE)


def _exported():
    torch.manual_seed(0)
    model = Served().eval()
    with torch.no_grad():
        return model, torch.export.export(model, _inputs(0),
                                          dynamic_shapes=({0: torch.export.Dim("ids", min=2, max=1024)}, None))


def test_save_exported_and_load_exported_keep_outputs_and_restore_the_decisions(tmp_path):
    model, ep = _exported()
    tuner = _measured()
    path = tmp_path / "served.pt2"
    recom_rec.save_exported(ep, path, extra_files={"notes.txt": "mine"})
    decisions = recom_rec.kernel_decisions()
    tuner.forget()
    forget_all()  # a new process: nothing decided, nothing imported
    assert _ours(recom_rec.kernel_decisions()) == {}
    files = {"notes.txt": ""}
    loaded = recom_rec.load_exported(path, extra_files=files)
    assert files["notes.txt"] == "mine"
    assert _ours(recom_rec.kernel_decisions()) == _ours(decisions)
    tuner, stream = _fresh_launches()
    assert stream.launches == [B, B, B] and tuner.trial_launches == 0
    with torch.no_grad():
        for seed in (1, 2):
            torch.testing.assert_close(loaded.module()(*_inputs(seed)), model(*_inputs(seed)), rtol=0, atol=0)


def test_torch_export_load_reads_a_program_saved_with_decisions_and_load_exported_one_without(tmp_path):
    model, ep = _exported()
    with_decisions, plain = tmp_path / "with.pt2", tmp_path / "plain.pt2"
    recom_rec.save_exported(ep, with_decisions, decisions={"version": 1, "entries": {}})
    torch.export.save(ep, plain)
    inputs = _inputs(3)
    with torch.no_grad():
        for program in (torch.export.load(with_decisions), recom_rec.load_exported(plain)):
            torch.testing.assert_close(program.module()(*inputs), model(*inputs), rtol=0, atol=0)
    assert _ours(recom_rec.kernel_decisions()) == {}


def test_an_exported_program_with_malformed_decisions_is_a_clear_error(tmp_path):
    _, ep = _exported()
    path = tmp_path / "bad.pt2"
    torch.export.save(ep, path, extra_files={EXTRA_FILE: "{not json"})
    with pytest.raises(ValueError, match=re.escape(f"{path}: extra file {EXTRA_FILE}: not recom_rec kernel decisions")):
        recom_rec.load_exported(path)
    with pytest.raises(ValueError, match="version 7"):
        recom_rec.save_exported(ep, tmp_path / "never.pt2", decisions={"version": 7, "entries": {}})


_LOAD_PACKAGE = textwrap.dedent("""
    import json, sys, torch
    import recom_rec
    stock = torch._inductor.aoti_load_package(sys.argv[1])  # torch's loader: the extra file is ignored
    before = recom_rec.kernel_decisions()
    ours = recom_rec.aoti_load_package(sys.argv[1])
    inputs = torch.load(sys.argv[2])
    outputs = [(ours(*args).cpu(), stock(*args).cpu()) for args in inputs]
    torch.save(outputs, sys.argv[3])
    print(json.dumps({"before": before, "after": recom_rec.kernel_decisions()}))
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_aot_inductor_package_carries_the_decisions_to_a_fresh_process(tmp_path):
    model, ep = _exported()
    tuner = _measured()
    decisions = recom_rec.kernel_decisions()
    # the system's g++, as tests/test_quant_serving.py builds packages (docs/quantized.md, Known gaps)
    with torch._inductor.config.patch({"cpp.cxx": (shutil.which("g++") or "g++",)}):
        package = recom_rec.aoti_compile_and_package(ep, package_path=str(tmp_path / "served.pt2"))
    tuner.forget()
    inputs = [tuple(t.cpu() for t in _inputs(seed)) for seed in (1, 2)]
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "load.py"
    script.write_text(_LOAD_PACKAGE)
    result = subprocess.run([sys.executable, "-X", "faulthandler", str(script), package, str(tmp_path / "inputs.pt"),
                             str(tmp_path / "outputs.pt")], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert _ours(report["before"]) == {} and _ours(report["after"]) == _ours(decisions)
    with torch.no_grad():
        for args, (ours, stock) in zip(inputs, torch.load(tmp_path / "outputs.pt")):
            expected = model(*(t.to(DEVICE) for t in args)).cpu()
            torch.testing.assert_close(ours, expected)
            torch.testing.assert_close(stock, expected)
