"""``--workloads serving``: the batch-size distributions, the latency summary's arithmetic, the
output check between peers, and the command line end to end on the CPU (small layout)."""
import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from recom_rec.bench import serving
from recom_rec.bench.batch_sizes import DISTRIBUTIONS, MAX_BATCH, draw_batch_sizes
from recom_rec.bench.workloads import serving_layout
from subprocess_env import child_env


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_batch_sizes_are_integers_in_1_to_1024_and_repeat_from_their_seed(name):
    sizes = draw_batch_sizes(name, np.random.default_rng(7), 5000)
    assert sizes.dtype == np.int64 and sizes.shape == (5000,)
    assert sizes.min() >= 1 and sizes.max() <= MAX_BATCH == 1024
    assert np.array_equal(sizes, draw_batch_sizes(name, np.random.default_rng(7), 5000))
    assert not np.array_equal(sizes, draw_batch_sizes(name, np.random.default_rng(8), 5000))


def test_long_tail_is_mostly_small_with_rare_requests_up_to_1024():
    sizes = draw_batch_sizes("long-tail", np.random.default_rng(1), 20000)
    assert np.median(sizes) <= 12 and np.percentile(sizes, 90) <= 64
    large = (sizes >= 512).mean()
    assert 0.001 < large < 0.02, large
    assert sizes.max() >= 900


def test_log_uniform_and_bimodal_shapes():
    log_uniform = draw_batch_sizes("log-uniform", np.random.default_rng(2), 20000)
    assert 25 <= np.median(log_uniform) <= 40  # exp(ln(1025) / 2) = 32
    # as likely in 1-2 (ln 3 / ln 1025 = 0.158) as the log-uniform law says, and in 512-1024 (0.100)
    assert abs((log_uniform <= 2).mean() - 0.158) < 0.015 and abs((log_uniform >= 512).mean() - 0.100) < 0.015
    assert log_uniform.min() == 1 and log_uniform.max() >= 1000
    bimodal = draw_batch_sizes("bimodal", np.random.default_rng(3), 20000)
    assert abs((bimodal >= 200).mean() - 0.3) < 0.02 and ((bimodal > 64) & (bimodal < 200)).mean() < 0.03


def test_streams_repeat_from_the_seed_and_send_the_drawn_batches():
    layout = serving_layout(small=True)
    sizes, stream = serving.draw_stream(layout, "long-tail", seed=11, requests=6)
    again_sizes, again = serving.draw_stream(layout, "long-tail", seed=11, requests=6)
    other_sizes, other = serving.draw_stream(layout, "long-tail", seed=12, requests=6)
    assert sizes == again_sizes and sizes != other_sizes
    for kjt, same, b in zip(stream, again, sizes):
        assert kjt.stride() == b and kjt.keys() == [f"f{i}" for i in range(layout.num_tables)]
        assert torch.equal(kjt.values(), same.values()) and torch.equal(kjt.lengths(), same.lengths())
    assert not all(a.values().shape == b.values().shape and torch.equal(a.values(), b.values())
                   for a, b in zip(stream, other))


def test_summary_on_known_latencies():
    latencies = [float(x) for x in range(1, 1001)]  # 1..1000 ms
    s = serving.summarize(latencies, [2] * 1000, warmup=0)
    assert s["p50_ms"] == pytest.approx(500.5) and s["p99_ms"] == pytest.approx(990.01)
    assert s["p999_ms"] == pytest.approx(999.001) and s["mean_ms"] == pytest.approx(500.5)
    assert s["first_100_ms"] == pytest.approx(5050.0)
    assert s["requests_per_s"] == pytest.approx(1000 / 500.5) and s["samples_per_s"] == pytest.approx(2000 / 500.5)
    # the warm-up leaves the percentiles and throughput, not the first 100
    s = serving.summarize(latencies, list(range(1000)), warmup=100)
    assert s["p50_ms"] == pytest.approx(550.5) and s["steady_requests"] == 900 and s["warmup_requests"] == 100
    assert s["first_100_ms"] == pytest.approx(5050.0)
    busy_s = sum(range(101, 1001)) / 1e3
    assert s["requests_per_s"] == pytest.approx(900 / busy_s)
    assert s["samples_per_s"] == pytest.approx(sum(range(100, 1000)) / busy_s)
    assert serving.warmup_requests(3000) == serving.WARMUP_REQUESTS == 200 and serving.warmup_requests(40) == 10


def test_checked_requests_take_the_largest():
    sizes = [3, 1, 900, 4] + [2] * 50
    picked = serving.checked_requests(sizes)
    assert 2 in picked and 0 in picked and len(sizes) - 1 in picked
    assert len(picked) <= serving.CHECKED_REQUESTS and picked == sorted(set(picked))


def test_stream_latencies_are_each_request_s():
    layout = serving_layout(small=True)
    _, stream = serving.draw_stream(layout, "bimodal", seed=0, requests=5)

    def forward(kjt):
        time.sleep(0.002)
        return kjt.values()

    latencies = serving.answer_stream(forward, stream, torch.device("cpu"))
    assert len(latencies) == 5 and all(2.0 <= ms < 500 for ms in latencies), latencies


def test_peers_take_turns_a_block_of_the_same_requests_at_a_time():
    layout = serving_layout(small=True)
    _, stream = serving.draw_stream(layout, "long-tail", seed=1, requests=5)
    calls = []

    def peer(name):
        def forward(kjt):
            # (a KJT moved to the device it is on keeps its tensors)
            calls.append((name, next(i for i, r in enumerate(stream) if r.values() is kjt.values())))
            return kjt.values()
        return forward

    latencies = serving.answer_streams({"a": peer("a"), "b": peer("b"), "c": peer("c")}, stream,
                                       torch.device("cpu"), block=2)
    # each peer answers every request once, in the stream's order; the peers' order flips each round
    assert calls == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1),
                     ("c", 2), ("c", 3), ("b", 2), ("b", 3), ("a", 2), ("a", 3),
                     ("a", 4), ("b", 4), ("c", 4)]
    assert {name: len(ms) for name, ms in latencies.items()} == {"a": 5, "b": 5, "c": 5}


def test_output_check_fails_loudly_on_a_differing_peer():
    ours = [torch.rand(3, 8), torch.rand(1, 8)]
    close = [t + 1e-7 for t in ours]
    diffs = serving.compare_outputs({"recom_rec": ours, "torchrec": close}, 1e-5, "probe float")
    assert 0 < diffs["torchrec"] < 1e-6
    off = [ours[0].clone(), ours[1].clone()]
    off[1][0, 3] += 1e-3  # one sample's pooled value off by a tenth of a typical row's
    with pytest.raises(serving.OutputMismatch, match="probe float.*fbgemm"):
        serving.compare_outputs({"recom_rec": ours, "torchrec": close, "fbgemm": off}, 1e-5, "probe float")
    with pytest.raises(serving.OutputMismatch, match="torchrec.*inf"):  # an output of another shape
        serving.compare_outputs({"recom_rec": ours, "torchrec": [ours[0], torch.rand(1, 4)]}, 1e-5, "probe")


@pytest.mark.slow  # (~10-15 s of a 2-core machine: make test-slow; make test stays under 10 min)
def test_serving_cli_writes_latency_percentiles_for_every_peer(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "recom_rec.bench", "--workloads", "serving", "--small", "--requests", "12",
         "--distributions", "long-tail", "log-uniform", "--seed", "5", "--out", str(out)],
        env=child_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "batch sizes drawn with --seed 5" in text and "x)" in text, text
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["seed"] == 5
    rows = {(r["distribution"], r["phase"], r["peer"]): r for r in data["results"]}
    expected = {(d, p, peer) for d in ("long-tail", "log-uniform") for p in ("float", "int8")
                for peer in ("recom_rec", "fbgemm", "torchrec")}
    assert set(rows) == expected, set(rows)
    for (dist, precision, peer), r in rows.items():
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["p999_ms"], r
        assert r["first_100_ms"] > 0 and r["requests_per_s"] > 0 and r["samples_per_s"] >= r["requests_per_s"]
        assert r["requests"] == 12 and r["steady_requests"] == 9 and r["seed"] == 5
        if peer != "recom_rec":
            assert r["max_diff"] <= serving.TOLERANCE[precision], r
    # every peer answered the same stream
    assert len({(r["distribution"], r["samples"]) for r in data["results"]}) == 2


def test_the_first_requests_tool_marks_the_requests_that_open_a_shape_class(monkeypatch):
    # tools/serving_first_requests.py splits a stream by the requests that open a class (the first
    # of their batch and lookup buckets, as the tuners round them) on any machine
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
    import serving_first_requests as tool

    layout = serving_layout(small=True)
    sizes, stream = serving.draw_stream(layout, "log-uniform", seed=4232939074, requests=100)
    assert sizes[:10] == [386, 3, 54, 4, 2, 933, 33, 1, 2, 331]
    # 33 shares 54's bucket (64), the second 2 the first's, 331 386's (512); 3 and 4 share 4
    # by batch but not by lookups (fixed-length bags: 3 x and 4 x the sample's ids)
    assert tool.opens_a_class(stream)[:10] == [True, True, True, True, True, True, False, True, False, False]
