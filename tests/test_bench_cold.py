"""--phases cold on the CPU: each peer's first calls timed in a fresh process."""
import torch

from recom_rec.bench.cold import format_cold, run_cold


def test_cold_rows_sum_the_first_calls_of_a_fresh_process():
    rows = run_cold(["dlrm-kaggle"], ["recom_rec", "torchrec"], ["forward"], torch.device("cpu"), small=True, calls=3)
    assert [r["peer"] for r in rows] == ["recom_rec", "torchrec"]
    for row in rows:
        assert "error" not in row, row
        spans = row["cumulative_ms"]
        assert spans["calls"] == 3 and 0 < spans["1"]
    text = format_cold(rows)
    assert "dlrm-kaggle" in text and "1-1:" in text and "x)" in text


def test_drawn_layouts_are_drawn_again_in_each_child_and_summarized():
    from recom_rec.bench.cold import summarize_cold
    from recom_rec.bench.random_layouts import random_workloads

    name = random_workloads(5, 1, small=True)[0].name
    rows = run_cold([name], ["recom_rec", "torchrec"], ["forward"], torch.device("cpu"), small=True, calls=2,
                    draw=(5, 1))
    for row in rows:
        assert "error" not in row, row
        assert row["workload"] == name and row["cumulative_ms"]["calls"] == 2 and row["cumulative_ms"]["2"] > 0
    summary = summarize_cold(rows, [name], ["torchrec"])
    assert summary.startswith("drawn layouts, cold forward (first 100 calls) x torchrec: ") and "geomean" in summary
