"""The examples run end to end (a few steps each) and say what they claim."""
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DATA = ROOT / "tests" / "data"


def _run(script, *args):
    env = child_env()
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _sample(name):
    path = SAMPLE_DATA / name
    if not path.exists():
        pytest.fail(f"sample {path} is missing from the checkout (tests/data/README.md lists the samples)")
    return path


def _png(path):
    assert path.exists(), path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


@pytest.mark.parametrize("ps", [[], ["--ps", "memory://demo-test", "--ps-min-rows", "200", "--ps-cache-rows", "64"]])
def test_dlrm_demo_same_losses_both_modules(ps):
    out = _run("dlrm_demo.py", "--steps", "20", "--batch-size", "64", "--max-rows", "300", *ps)
    if ps:
        assert "parameter-server tier: cache hit rate" in out, out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("torchrec", "recom_rec"))}
    stock, fused = rows["torchrec"], rows["recom_rec"]
    # columns: name, "EBC", loss, AUC, steps/s
    assert abs(float(stock[2]) - float(fused[2])) < 1e-3, out
    assert abs(float(stock[3]) - float(fused[3])) < 2e-2, out
    assert "speed-up" in out


@pytest.mark.parametrize("help_of", ["dlrm_criteo.py", "deepfm_movielens.py", "many_columns_inference.py"])
def test_examples_have_help(help_of, capsys, monkeypatch):
    # in this process: a child would spend its time importing the stack (~15 s on the GPU machine)
    monkeypatch.setattr(sys, "argv", [help_of, "--help"])
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # as a script run sees its folder (examples/_common.py)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "examples" / help_of), run_name="__main__")
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--device" in out and "--out" in out


def _check_dlrm(out_dir, out, metrics):
    # The checkpoint (module state_dict with the fused optimizer state + dense optimizer)
    # restores into a fresh model: same held-out loss, and the same again one step later.
    restore = metrics["restore"]
    assert restore["eval_loss"][0] == restore["eval_loss"][1], out
    assert restore["after_one_step"][0] == restore["after_one_step"][1], out
    assert restore["train_loss_one_step"][0] == restore["train_loss_one_step"][1], out
    assert out.count("identical") == 2 and "DIFFERENT" not in out
    assert (out_dir / "checkpoint.pt").exists()
    _png(out_dir / "dlrm_criteo.png")


@pytest.mark.slow
def test_dlrm_criteo_synthetic_learns_and_restores(tmp_path):
    out = _run("dlrm_criteo.py", "--steps", "60", "--batch-size", "128", "--max-rows", "500",
               "--eval-every", "30", "--eval-batches", "4", "--out", str(tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    _check_dlrm(tmp_path, out, metrics)
    first, last = metrics["eval_curve"][0][1], metrics["eval_curve"][-1][1]
    assert last["loss"] < first["loss"], out  # it trains: held-out loss falls
    assert last["auc"] > 0.6, out             # the synthetic signal is learnable
    assert "FusedEmbeddingOptimizer with state ['sum']" in out  # row-wise Adagrad, fused


@pytest.mark.slow  # (24-27 s of a 2-core machine: make test-slow; make test stays under 10 min)
def test_dlrm_criteo_ps_prefetch_trains_the_same_model(tmp_path):
    """--ps-prefetch stages the next batches' rows while one trains: the same held-out loss and
    AUC as staging each batch when it comes."""
    def run(name, *extra):
        out = _run("dlrm_criteo.py", "--steps", "30", "--batch-size", "64", "--max-rows", "400",
                   "--eval-every", "10", "--eval-batches", "3", "--ps", f"memory://{name}", "--ps-min-rows", "200",
                   "--ps-cache-rows", "128", "--out", str(tmp_path / name), *extra)
        return json.loads((tmp_path / name / "metrics.json").read_text())["eval_curve"], out

    plain, _ = run("plain")
    prefetched, out = run("prefetched", "--ps-prefetch", "2")
    assert "parameter-server tier" in out
    assert prefetched == plain


def test_dlrm_criteo_reads_the_criteo_sample_with_fused_adam(tmp_path):
    out = _run("dlrm_criteo.py", "--data", str(_sample("criteo_sample.csv")), "--steps", "6",
               "--batch-size", "32", "--eval-every", "3", "--max-rows", "1000",
               "--fused-optimizer", "adam", "--out", str(tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert "criteo_sample.csv: 5 training batches of 32, 2 held out" in out, out
    assert "exp_avg" in out  # Adam's moments are in the checkpoint and restored
    _check_dlrm(tmp_path, out, metrics)


def test_deepfm_movielens_sample(tmp_path):
    out = _run("deepfm_movielens.py", "--data", str(_sample("movielens_sample.csv")), "--steps", "8",
               "--eval-every", "4", "--out", str(tmp_path))
    assert "weighted genres" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [s for s, _ in metrics["eval_curve"]] == [0, 4, 8]
    assert metrics["eval_curve"][-1][1]["loss"] < metrics["eval_curve"][0][1]["loss"] * 1.5, out
    _png(tmp_path / "deepfm_movielens.png")


def test_deepfm_movielens_reads_an_ml1m_directory(tmp_path):
    from recom_rec.data import write_movielens_1m

    users = [(u, "MF"[u % 2], [1, 18, 25, 35][u % 4], u % 21, f"{10000 + u}") for u in range(1, 41)]
    movies = [(m, f"Movie {m} (1999)", ["Comedy", "Drama", "Action|Thriller"][m % 3]) for m in range(1, 31)]
    ratings = [(1 + i % 40, 1 + (i * 7) % 30, 1 + i % 5, 978300000 + i) for i in range(400)]
    data = write_movielens_1m(tmp_path / "ml-1m", ratings, users, movies)
    out = _run("deepfm_movielens.py", "--data", str(data), "--steps", "4", "--eval-every", "2",
               "--batch-size", "64", "--out", str(tmp_path / "out"))
    assert "5 training batches of 64, 2 held out" in out, out
    _png(tmp_path / "out" / "deepfm_movielens.png")


@pytest.mark.slow  # (~10-15 s of a 2-core machine: make test-slow; make test stays under 10 min)
def test_many_columns_inference_table(tmp_path):
    out = _run("many_columns_inference.py", "--columns", "120", "--batch-size", "16", "--iters", "3",
               "--warmup", "1", "--out", str(tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["median_ms"]) == {"torchrec EBC", "recom_rec EBC", "recom_rec EBC + compile"}
    assert all(ms > 0 for ms in metrics["median_ms"].values())
    assert metrics["max_abs_diff"] < 1e-5, out  # same weights, same outputs (eager and compiled)
    for name in metrics["median_ms"]:
        assert name in out
    assert "median ms" in out
    _png(tmp_path / "many_columns_inference.png")


@pytest.mark.slow  # (24-27 s of a 2-core machine: make test-slow; make test stays under 10 min)
def test_dlrm_criteo_with_large_tables_on_the_parameter_server(tmp_path):
    out = _run("dlrm_criteo.py", "--steps", "30", "--batch-size", "128", "--max-rows", "2000",
               "--eval-every", "15", "--eval-batches", "3", "--ps", "memory://criteo-test",
               "--ps-min-rows", "1000", "--ps-cache-rows", "256", "--out", str(tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert "parameter-server tier: 15 tables of >= 1000 rows on memory://criteo-test" in out, out
    assert "flushed" in out and "dirty rows" in out
    # The restored model reads the flushed rows back from the store: same held-out loss.
    restore = metrics["restore"]
    assert restore["eval_loss"][0] == restore["eval_loss"][1], out
    first, last = metrics["eval_curve"][0][1], metrics["eval_curve"][-1][1]
    assert last["loss"] < first["loss"], out


@pytest.mark.slow  # (~20 s of a 2-core machine: make test-slow; make test stays under 10 min)
def test_dlrm_criteo_reports_quantized_auc(tmp_path):
    out = _run("dlrm_criteo.py", "--steps", "60", "--batch-size", "128", "--max-rows", "500",
               "--eval-every", "60", "--eval-batches", "4", "--quantize", "int8", "int4", "--out", str(tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    q = metrics["quantized"]
    assert set(q) == {"int8", "int4"}, out
    assert "quantized  int8: held-out loss" in out and "quantized  int4" in out, out
    # INT8 rows cost almost nothing in AUC, INT4 a little (the targets: 0.002 and 0.01).
    assert abs(q["int8"]["auc_minus_fp32"]) < 0.002 and abs(q["int4"]["auc_minus_fp32"]) < 0.01, q
