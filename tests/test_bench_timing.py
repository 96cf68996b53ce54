"""The benchmark's timing (interleaved A B B A rounds, time-bound sample counts, the warm-up that
waits for the product's tuners) and the sweep stability report, on the CPU with fake steps."""
import json
import time

import pytest
import torch

from recom_rec.bench import stability, timing
from recom_rec.bench.__main__ import main as bench_main

CPU = torch.device("cpu")


def recording_steps(names, log, ms=None):
    def make(name):
        def step():
            log.append(name)
            if ms:
                time.sleep(ms[name] / 1e3)
        return step
    return {n: make(n) for n in names}


def visits(log):
    """The log's runs collapsed to visits: [("a", 3), ("b", 3), ...]."""
    out = []
    for name in log:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return [tuple(v) for v in out]


def test_interleaved_rounds_go_a_b_b_a_with_an_untimed_lead_in_per_visit():
    log = []
    samples = timing.time_interleaved(recording_steps("ab", log), CPU, warmup=2, min_iters=4, min_ms=0.0, block=2)
    # warm-up of each (2 runs), then rounds a b | b a, each visit 1 untimed + 2 timed
    assert visits(log) == [("a", 2), ("b", 2), ("a", 3), ("b", 6), ("a", 3)]
    assert {n: len(s) for n, s in samples.items()} == {"a": 4, "b": 4}


def test_rounds_end_on_a_whole_a_b_b_a_pair():
    log = []
    samples = timing.time_interleaved(recording_steps("ab", log), CPU, warmup=0, min_iters=3, min_ms=0.0, block=1)
    # 3 samples each are there after three rounds (a b | b a | a b): a fourth (b a) completes the pair
    assert visits(log) == [("a", 2), ("b", 4), ("a", 4), ("b", 4), ("a", 2)]
    assert {n: len(s) for n, s in samples.items()} == {"a": 4, "b": 4}


def test_three_steps_interleave_in_order_then_reversed():
    log = []
    timing.time_interleaved(recording_steps("abc", log), CPU, warmup=0, min_iters=1, min_ms=0.0, block=1)
    assert visits(log) == [("a", 2), ("b", 2), ("c", 4), ("b", 2), ("a", 2)]


def test_sample_counts_are_time_bound_so_a_fast_step_gets_more_runs():
    log = []
    samples = timing.time_interleaved(recording_steps("fs", log, ms={"f": 1.0, "s": 6.0}), CPU, warmup=0,
                                      min_iters=2, min_ms=24.0, block=1)
    assert sum(samples["f"]) >= 24.0 and sum(samples["s"]) >= 24.0
    assert len(samples["f"]) > 2 * len(samples["s"])
    assert all(x >= 1.0 for x in samples["f"])


def test_max_iters_bounds_a_step_that_would_need_more():
    samples = timing.time_interleaved({"x": lambda: None}, CPU, warmup=0, min_iters=1, min_ms=1e9, block=1,
                                      max_iters=50)
    assert len(samples["x"]) == 50


class _SleepyPeer:
    """A peer whose forward returns ``value`` and whose steps sleep ``ms()`` milliseconds; ``fail``:
    it cannot be built."""

    def __init__(self, value, ms, log, name, fail=False):
        if fail:
            raise RuntimeError("out of memory")
        self.value, self.ms, self.log, self.name = value, ms, log, name

    def forward(self, kjt):
        self.log.append(self.name)
        time.sleep(self.ms() / 1e3)
        return torch.tensor([self.value])

    def train_step(self, kjt):
        self.forward(kjt)


def test_each_peer_is_timed_beside_ours_and_its_ratio_takes_ours_of_the_same_rounds():
    from recom_rec.bench.report import format_peers, speedup

    log = []

    def drifting():  # the host slows to a third of its speed once ours and fbgemm are done
        return 1.0 if "torchrec" not in log else 3.0

    peers = {"recom_rec": lambda: _SleepyPeer(1.0, drifting, log, "recom_rec"),
             "fbgemm": lambda: _SleepyPeer(1.0, lambda: 2.0 * drifting(), log, "fbgemm"),
             "torchrec": lambda: _SleepyPeer(2.0, lambda: 2.0 * drifting(), log, "torchrec"),
             "broken": lambda: _SleepyPeer(0, None, log, "broken", fail=True)}
    rows = timing.time_beside_ours(list(peers), lambda n: peers[n](), None, "forward", CPU, warmup=1, iters=4,
                                   comparable=lambda n, p: (lambda out: out), row={"workload": "w", "phase": "forward"},
                                   annotate=lambda n, p, r: r.update(seen=n))
    by = {r["peer"]: r for r in rows}
    assert by["broken"]["error"] == "out of memory" and "ms" not in by["broken"]
    assert by["recom_rec"]["identical"] and by["fbgemm"]["identical"] and not by["torchrec"]["identical"]
    assert by["fbgemm"]["seen"] == "fbgemm" and by["recom_rec"]["seen"] == "recom_rec"
    # ours ran beside fbgemm, then beside torchrec (each pair in alternating rounds)
    first_torchrec = log.index("torchrec")
    assert {"recom_rec", "fbgemm"} == set(log[:first_torchrec]) and "fbgemm" not in log[first_torchrec:]
    # the host's slowdown fell on both of torchrec's rounds' peers: its ratio is ~2x, as fbgemm's,
    # though ours' median over all its samples is between its two speeds
    assert 1.6 < speedup(by["recom_rec"], by["fbgemm"]) < 2.4
    assert 1.6 < speedup(by["recom_rec"], by["torchrec"]) < 2.4
    assert by["torchrec"]["ms"] / by["recom_rec"]["ms"] > 4  # what a ratio of medians taken apart reads
    assert by["torchrec"]["recom_rec_ms"] > 2.5 * by["fbgemm"]["recom_rec_ms"]
    text = format_peers("t", [dict(r, ids=1) for r in rows], peers=("recom_rec", "fbgemm", "torchrec"))
    assert "error: w forward broken: out of memory" in text


def test_a_training_phase_has_no_identity_and_ours_alone_is_timed_alone():
    log = []
    rows = timing.time_beside_ours(["recom_rec"], lambda n: _SleepyPeer(1.0, lambda: 1.0, log, n), None, "sgd", CPU,
                                   warmup=0, iters=3, comparable=lambda n, p: (lambda out: out),
                                   row={"workload": "w", "phase": "sgd"})
    assert len(rows) == 1 and "identical" not in rows[0] and rows[0]["ms"] >= 1.0 and "recom_rec_ms" not in rows[0]


def test_speedup_falls_back_to_ours_own_median_for_a_peer_timed_apart():
    from recom_rec.bench.report import speedup

    assert speedup({"ms": 2.0}, {"ms": 4.0}) == 2.0
    assert speedup({"ms": 2.0}, {"ms": 4.0, "recom_rec_ms": 1.0}) == 4.0
    assert speedup({"ms": 2.0}, {"error": "x"}) is None and speedup(None, {"ms": 1.0}) is None


def test_second_half_timing_counts_the_second_step_alone_and_hands_it_the_first_ones_result():
    seen = []
    ms = timing.time_second_half_ms(lambda: time.sleep(0.03) or "out", lambda x: seen.append(x) or time.sleep(0.002),
                                    CPU, iters=5)
    assert seen == ["out"] * 5
    assert 2.0 <= ms < 15.0, ms  # the 30 ms first half is outside every sample


def test_settle_on_a_gpu_runs_until_a_run_launches_nothing_on_trial(monkeypatch):
    """The warm-up goes on while the product's tuners still have a shape on trial (here the fake
    step makes trial launches on its first 7 runs), waiting for the device after each run."""
    from recom_rec.kernels import selection

    state = {"runs": 0, "trial_launches": 0, "syncs": 0}

    def step():
        state["runs"] += 1
        if state["runs"] <= 7:
            state["trial_launches"] += 2  # a forward and a backward launch of undecided shapes

    monkeypatch.setattr(selection, "trial_launches", lambda: state["trial_launches"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: state.__setitem__("syncs", state["syncs"] + 1))
    runs = timing.settle(step, torch.device("cuda"), warmup=3)
    assert runs == state["runs"] == 8  # 3 warm-up runs, 4 more on trial, one clean
    assert state["syncs"] == 5
    assert timing.settle(step, CPU, warmup=3) == 3  # no tuners on the CPU


def test_settle_goes_on_while_any_rank_has_trials(monkeypatch):
    from recom_rec.kernels import selection

    runs = []
    monkeypatch.setattr(selection, "trial_launches", lambda: 0)  # this rank decided at once
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    other_rank_on_trial = iter([True, True, True, False])
    seen = []

    def any_rank(flag):
        seen.append(flag)
        return flag or next(other_rank_on_trial)

    assert timing.settle(lambda: runs.append(1), torch.device("cuda"), warmup=1, any_rank=any_rank) == 5
    assert len(runs) == 5 and seen == [False] * 4


def sweep_rows(ratios, choices=None, old_format=False):
    rows = []
    for i, ratio in enumerate(ratios):
        row = {"point": f"p{i}", "phase": "sgd", "recom_rec_ms": 1.0, "fbgemm_ms": ratio, "ratio": ratio}
        choice = (choices or {}).get(i, "pieces")
        if old_format:
            row["choice"] = choice
        else:
            row["choices"] = {"forward": "cuda:features", "backward_path": choice}
        rows.append(row)
    return rows


def test_compare_counts_differing_choices_and_moved_ratios():
    a = sweep_rows([1.0, 2.0, 1.0, 0.5, 1.0])
    b = sweep_rows([1.02, 2.0, 1.2, 0.45, 1.0], choices={2: "singletons"})
    b.append({"point": "only-b", "phase": "sgd"})
    c = stability.compare(a, b)
    assert c["common"] == 5 and c["only_in_one"] == 1
    assert c["with_choices"] == 5
    assert [k for k, _, _ in c["choices_differ"]] == [("p2", "sgd")]
    assert c["ratios"] == 5 and c["ratios_within"] == 3  # 2%, 0%, 0% in; 20% and 10% out
    assert c["ratio_median"] == pytest.approx(0.02) and c["ratio_max"] == pytest.approx(0.2)
    assert c["most_moved"][0][0] == ("p2", "sgd")
    assert c["peers"]["recom_rec"]["median"] == 0.0 and c["peers"]["fbgemm"]["within"] == 3
    text = stability.format_comparison(c)
    assert "choices: 1 of 5 differ" in text
    assert "p2 sgd: backward_path pieces, forward cuda:features -> backward_path singletons" in text
    assert "median 2.0%, max 20.0%, within 5%: 3 of 5" in text
    assert "p2 sgd: 1.000 -> 1.200 (moved 20.0%)" in text and "p0 sgd" not in text
    assert "10th percentile" not in text  # rows without it (sweeps before v20)


def test_compare_reports_the_ratios_of_the_tenth_percentiles_where_recorded():
    a, b = sweep_rows([1.0, 2.0]), sweep_rows([1.5, 2.0])
    for row, p10 in zip(a + b, (1.0, 2.0, 1.02, 2.2)):
        row["ratio_p10"] = p10
    text = stability.format_comparison(stability.compare(a, b))
    assert "10th percentile: |B/A - 1| median 6.0%, max 10.0%, within 5%: 1 of 2" in text


def test_compare_reports_how_far_the_forwards_device_time_ratios_moved():
    a, b = sweep_rows([1.0, 2.0, 1.0]), sweep_rows([1.0, 2.0, 1.0])
    for row, (ours, theirs, unchecked) in zip(a + b, ((0.10, 0.15, 0.12), (0.20, 0.30, None), (None, None, None),
                                                      (0.10, 0.153, 0.12), (0.20, 0.36, None), (None, None, None))):
        row.update({k: v for k, v in (("recom_rec_graph_ms", ours), ("fbgemm_graph_ms", theirs),
                                      ("fbgemm_unchecked_graph_ms", unchecked)) if v is not None})
    c = stability.compare(a, b)
    assert c["device_ratios"]["fbgemm"]["points"] == 2 and c["device_ratios"]["fbgemm"]["within"] == 1
    assert c["device_ratios"]["fbgemm"]["max"] == pytest.approx(0.2)
    assert c["device_ratios"]["fbgemm_unchecked"] == {"points": 1, "median": 0.0, "max": 0.0, "within": 1}
    text = stability.format_comparison(c)
    assert ("forward device-time ratios (fbgemm graph ms / ours): 2 compared, |B/A - 1| median 11.00%, "
            "max 20.00%, within 5%: 1 of 2") in text


def test_compare_reads_sweeps_written_before_the_choices_record():
    c = stability.compare(sweep_rows([1.0, 1.0], old_format=True),
                          sweep_rows([1.0, 1.0], choices={1: "singletons"}, old_format=True))
    assert c["with_choices"] == 2 and len(c["choices_differ"]) == 1


def test_compare_cli_prints_the_report_and_refuses_other_json(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"meta": {}, "results": sweep_rows([1.0, 1.5])}))
    b.write_text(json.dumps({"meta": {}, "results": sweep_rows([1.01, 1.5], choices={0: "singletons"})}))
    bench_main(["--workloads", "sweep", "--compare", str(a), str(b)])
    out = capsys.readouterr().out
    assert "choices: 1 of 2 differ" in out and "within 5%: 2 of 2" in out, out
    other = tmp_path / "bench.json"
    other.write_text(json.dumps({"meta": {}, "results": [{"workload": "zipf", "peer": "fbgemm", "ms": 1.0}]}))
    with pytest.raises(SystemExit, match="not a sweep JSON"):
        bench_main(["--compare", str(a), str(other)])


def test_a_peer_that_does_not_fit_beside_ours_is_timed_alone_and_ours_comes_back(monkeypatch):
    """The pooled runner keeps two peers' tables resident; a peer whose tables do not fit beside
    ours is built and timed alone, then ours is built again for the next peer."""
    import argparse
    import weakref

    import recom_rec.bench.__main__ as bench

    live, built = weakref.WeakSet(), []

    class Peer:
        output_width = 1

        def __init__(self, name):
            self.name = name

        def forward(self, kjt):
            time.sleep(0.001)

        def train_step(self, kjt, grad):
            time.sleep(0.001)

    def make_peer(name, w, device, optimizer, backend):
        if name == "big" and len(live):
            raise torch.OutOfMemoryError("CUDA out of memory")
        peer = Peer(name)
        live.add(peer)
        built.append(name)
        return peer

    class W:
        name, batch_size = "w", 2

        def lookup_bytes(self):
            return 1

    monkeypatch.setattr(bench, "make_peer", make_peer)
    args = argparse.Namespace(backend="auto", warmup=0, iters=2)
    rows = list(bench._run_peers(["recom_rec", "small", "big", "other"], W(), None, CPU, "none", ["forward"], args,
                                 1.0))
    by = {r["peer"]: r for r in rows}
    assert built == ["recom_rec", "small", "big", "recom_rec", "other"]
    assert by["big"]["timed_apart"] and "recom_rec_ms" not in by["big"] and "error" not in by["big"]
    assert "recom_rec_ms" in by["small"] and "recom_rec_ms" in by["other"] and "timed_apart" not in by["other"]
    assert by["recom_rec"]["ms"] > 0 and all("ms" in r for r in rows)
    from recom_rec.bench.report import format_table

    meta = {"device": "cpu", "torch": torch.__version__, "copy_gbs": 1.0, "backend": "auto", "small": True}
    text = format_table(meta, rows, ["recom_rec", "small", "big", "other"])
    assert "timed alone, not beside ours (the two peers' tables do not fit together): w big" in text
