"""--phases cold on the CPU: each peer's first calls timed in a fresh process."""
import pytest
import torch

from recom_rec.bench.cold import format_cold, run_cold, summarize_cold
from recom_rec.bench.random_layouts import random_workloads


@pytest.mark.slow  # (two child processes: make test-slow)
def test_cold_rows_sum_the_first_calls_of_fresh_processes_over_a_drawn_layout(capsys):
    """One test, two children (each imports the whole stack: ~20 s on the GPU machine): a drawn
    layout, drawn again in each child from the seed; the spans, each row printed as its process
    ends (a run cut off by a time limit keeps them), the table and the summary."""
    name = random_workloads(5, 1, small=True)[0].name
    rows = run_cold([name], ["recom_rec", "torchrec"], ["forward"], torch.device("cpu"), small=True, calls=3,
                    draw=(5, 1))
    assert [r["peer"] for r in rows] == ["recom_rec", "torchrec"]
    for row in rows:
        assert "error" not in row, row
        spans = row["cumulative_ms"]
        assert row["workload"] == name and spans["calls"] == 3 and 0 < spans["1"] <= spans["3"]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(name)]
    assert len(printed) == 2 and "recom_rec" in printed[0] and "torchrec" in printed[1] and "x)" in printed[1]
    text = format_cold(rows)
    assert name in text and "1-1:" in text and "1-3:" in text and "x)" in text
    summary = summarize_cold(rows, [name], ["torchrec"])
    assert summary.startswith("drawn layouts, cold forward (first 100 calls) x torchrec: 1/1 at or above") or \
        summary.startswith("drawn layouts, cold forward (first 100 calls) x torchrec: 0/1 at or above")
    assert "geomean" in summary and f"({name})" in summary
