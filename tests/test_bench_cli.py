"""The benchmark's command line runs end to end on the CPU (small workloads) and writes its
table, JSON and PNG. It times nothing that a test asserts on. On the GPU machine too its child
processes see no GPU: the GPU runs are tools/gpu_session.sh's bench stages."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # (~10-15 s of a 2-core machine: make test-slow; make test stays under 10 min)
def test_bench_runs_small_workloads_and_the_ps_workload(tmp_path):
    env = child_env(CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "recom_rec.bench", "--workloads", "many-1000", "ps", "--phases", "forward", "sgd",
         "--iters", "2", "--warmup", "1", "--out", str(out), "--ps-urls", "memory://bench", "redis+cluster://local"],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "many-1000" in text and "x torchrec" in text and "x fbgemm" in text and "x fbgemm_unchecked" in text, text
    assert "ps memory://bench" in text and "hit rate" in text, text
    data = json.loads(out.with_suffix(".json").read_text())
    peers = {(r["workload"], r["peer"], r["phase"]) for r in data["results"] if "ms" in r}
    assert ("many-1000", "recom_rec", "forward") in peers and ("many-1000", "fbgemm", "sgd") in peers
    assert ("many-1000", "fbgemm_unchecked", "sgd") in peers
    assert ("ps", "in-device table", "sgd") in peers
    assert "staging ms" in text, text
    staging = [r["staging_ms"] for r in data["results"] if r["peer"] == "ps memory://bench"]
    assert staging and staging[0] > 0
    # the cluster the benchmark started: the store's own time and the RESP bytes per batch
    cluster = [r for r in data["results"] if r["peer"] == "ps redis+cluster://local (3 shards) prefetch 2"]
    assert cluster, text
    timed = cluster[0]["timed_per_batch"]
    assert timed["server_ms"] > 0 and timed["resp_bytes_out"] > timed["pushed_per_batch"] * 32 * 4 > 0
    assert "server ms" in text and "RESP out kB" in text, text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_backward_phase_reports_each_of_ours_against_its_byte_floor(tmp_path):
    """``--phases backward``: ours' dense-gradient steps beside the floor of moving the gradient's
    and the output gradient's bytes once at the measured copy rate."""
    env = child_env(CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "recom_rec.bench", "--workloads", "many-1000", "--peers", "recom_rec",
         "recom_rec:group-params", "fbgemm", "--phases", "backward", "--iters", "2", "--warmup", "1",
         "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    from recom_rec.bench.workloads import get_workload

    floor_ms = get_workload("many-1000", True).dense_gradient_bytes() / (data["meta"]["copy_gbs"] * 1e9) * 1e3
    ours = {r["peer"]: r for r in data["results"] if r["peer"].startswith("recom_rec")}
    assert set(ours) == {"recom_rec", "recom_rec:group-params"}, data["results"]
    for r in ours.values():
        assert abs(r["floor_ms"] - floor_ms) < 1e-9 * floor_ms and abs(r["floor_x"] - r["ms"] / floor_ms) < 1e-9
        # the backward alone, its forward untimed (not compared with the step's time: two CPU
        # timings of a shared machine, which CI once saw in the other order)
        assert r["backward_only_ms"] > 0, r
        assert abs(r["backward_only_floor_x"] - r["backward_only_ms"] / floor_ms) < 1e-9
    assert not any("floor_x" in r or "backward_only_ms" in r for r in data["results"] if r["peer"] == "fbgemm")
    line = next(x for x in result.stdout.splitlines() if x.startswith("backward to dense gradients, x its floor"))
    grouped = ours["recom_rec:group-params"]
    assert f"many-1000 (floor {floor_ms:.2f} ms)" in line, line
    assert f"recom_rec:group-params {grouped['floor_x']:.2f}x ({grouped['backward_only_floor_x']:.2f}x)" in line, line


@pytest.mark.slow  # ~25 s on the 2-core machine
def test_bench_pinned_backend_and_sharded_dlrm_on_gloo(tmp_path):
    """A pinned backend gets its own column and ratio; 'sharded-dlrm' trains torchrec's DLRM under
    DistributedModelParallel in 1 and 2 gloo processes, ours and torchrec's sharder."""
    env = child_env(CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "recom_rec.bench", "--workloads", "many-1000", "sharded-dlrm", "--peers", "recom_rec",
         "recom_rec:torch", "fbgemm", "--phases", "forward", "--iters", "2", "--warmup", "1", "--worlds", "1", "2",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "recom_rec:torch ms" in text and "torch x fbgemm" in text, text
    assert "sharded-dlrm" in text and "x torchrec" in text and "scaling" in text and "weak eff." in text, text
    assert "the plan (table: rank)" in result.stderr and "DCNv2" in text, result.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    dlrm = {(r["world"], r["peer"]) for r in data["results"] if r["workload"] == "sharded-dlrm" and r["ms"] > 0}
    assert dlrm == {(1, "recom_rec"), (1, "torchrec"), (2, "recom_rec"), (2, "torchrec")}, dlrm


@pytest.mark.slow  # ~25 s on the 2-core machine
def test_sweep_small_runs_every_kind_of_point_and_checks_agreement(tmp_path):
    """``--workloads sweep --small``: every point's forward and first training steps agree with
    fbgemm's, each phase has a ratio, the summary and the heatmap are written."""
    env = child_env(CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "recom_rec.bench", "--workloads", "sweep", "--small", "--iters", "1", "--warmup", "0",
         "--min-ms", "5", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "geomean" in result.stdout and "MISMATCH" not in result.stdout, result.stdout
    data = json.loads(out.with_suffix(".json").read_text())
    forward = [r for r in data["results"] if r["phase"] == "forward"]
    compared = [r for r in forward if r["fbgemm"]]
    assert compared and all(r["agree"] for r in compared), [(r["point"], r.get("max_rel_diff")) for r in compared]
    # each training phase's first step, from the same weights: the updated tables agree too
    trained = [r for r in data["results"] if r["phase"] != "forward" and r["fbgemm"]]
    assert len(trained) == 2 * len(compared)
    assert all(r["agree"] and r["update_max_rel_diff"] <= 1e-4 for r in trained), \
        [(r["point"], r["phase"], r.get("update_max_rel_diff")) for r in trained]
    assert {"grid", "zipf", "weighted", "mean", "dtype", "odd dim"} <= {r["axis"] for r in forward}
    assert set(data["summary"]) >= {"forward", "sgd", "rowwise_adagrad"}
    # and against fbgemm without its bounds check (ours runs unchecked), at every point it runs
    assert all(r.get("ratio_unchecked") for r in data["results"] if r.get("ratio"))
    assert data["summary"]["forward vs fbgemm_unchecked"]["points"] == len(compared)
    assert data["summary"]["forward"]["points"] == len(compared)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # ours and fbgemm timed interleaved: each has its sample count; the run's length is recorded
    assert all(r["recom_rec_runs"] >= 1 and r["fbgemm_runs"] >= 1 for r in data["results"] if r.get("ratio"))
    assert data["meta"]["seconds"] > 0 and "the sweep took" in result.stdout
    # the stability report of a run against itself: nothing differs
    same = subprocess.run([sys.executable, "-m", "recom_rec.bench", "--workloads", "sweep", "--compare",
                           str(out.with_suffix(".json")), str(out.with_suffix(".json"))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert same.returncode == 0, same.stdout + same.stderr
    n = len([r for r in data["results"] if r.get("ratio")])
    assert f"median 0.0%, max 0.0%, within 5%: {n} of {n}" in same.stdout, same.stdout


@pytest.mark.slow  # (~10-15 s of a 2-core machine: make test-slow; make test stays under 10 min)
def test_bench_inference_phase_on_the_cpu(tmp_path):
    """``--phases inference``: quantized rows, ours vs fbgemm's IntN TBE vs torchrec's quantized
    EBC, at the workload's batch and at batches 1/16/64 (eager on the CPU); identical outputs."""
    env = child_env(CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "recom_rec.bench", "--phases", "inference", "--workloads", "many-4000",
         "--row-types", "int8", "int4", "--small", "--iters", "1", "--warmup", "0", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "many-4000" in text and "x torchrec" in text and "x fbgemm" in text and "x fbgemm_unchecked" in text, text
    assert "many-4000 int8: bits" in text and "many-4000 int4: bits" in text, text
    data = json.loads(out.with_suffix(".json").read_text())
    timed = {(r["peer"], r["phase"]) for r in data["results"] if "ms" in r}
    for peer in ("recom_rec", "fbgemm", "fbgemm_unchecked", "torchrec"):
        for phase in ("int8 B=64", "int4 B=1 eager", "int4 B=16 eager", "int8 B=64 eager"):
            assert (peer, phase) in timed, (peer, phase, timed)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_update_check_flags_a_step_that_drops_one_lookup():
    """The sweep's training check compares the updated tables of ours and fbgemm after one step
    from the same weights: the same step agrees, a step that loses one lookup's gradient (one
    row off by lr x its gradient) does not."""
    import torch

    from recom_rec.bench import sweep

    dev = torch.device("cpu")
    p = sweep.Point("probe", tables=2, rows=50, dim=8, batch=8, ids=3)
    kjt = sweep.make_kjt(p, dev)
    before = [torch.rand(p.rows, p.dim, generator=torch.Generator().manual_seed(i)) - 0.5 for i in range(p.tables)]
    grad = torch.ones(p.batch, p.tables * p.dim)
    ours, theirs = sweep._Ours(p, dev, "sgd", before, "auto"), sweep._Fbgemm(p, dev, "sgd", before)
    ours.train_step(kjt, grad)
    theirs.train_step(kjt, grad)
    assert sweep._update_agreement(p, before, ours.tables(), theirs.tables()) <= sweep.UPDATE_TOLERANCE["fp32"]
    lost = [t.clone() for t in ours.tables()]
    row = int(kjt.values()[0])
    lost[0][row] += 0.01  # lr x a gradient of ones: that lookup's update undone
    assert sweep._update_agreement(p, before, lost, theirs.tables()) > 0.01
