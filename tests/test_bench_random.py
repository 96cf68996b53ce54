"""The random-layout workloads: the draw follows its written-down distribution and a seed
reproduces it; the summary counts, averages and names the worst."""
import numpy as np

from recom_rec.bench.random_layouts import MAX_IDS, MAX_WEIGHT_BYTES, draw_layout, random_workloads, summarize


def test_a_seed_reproduces_its_draw_and_another_seed_differs():
    a = random_workloads(11, 5, small=False)
    b = random_workloads(11, 5, small=False)
    c = random_workloads(12, 5, small=False)
    assert [w.description for w in a] == [w.description for w in b]
    assert [w.description for w in a] != [w.description for w in c]
    assert a[-1].name == "dlrm-dcnv2" and a[-1].num_tables == 26


def test_draws_stay_within_the_distribution_and_the_caps():
    rng = np.random.default_rng(3)
    layouts = [draw_layout(rng, i, small=False) for i in range(200)]
    for w in layouts:
        assert 1 <= w.num_tables <= 64
        assert all(1000 <= r <= 1e8 for r in w.rows) and all(1 <= d <= 1024 for d in w.dims)
        assert all(1 <= h <= 500 for h in w.pooling_factors) and 16 <= w.batch_size <= 131072
        assert sum(r * d for r, d in zip(w.rows, w.dims)) * 4 <= MAX_WEIGHT_BYTES
        assert w.batch_size * sum(w.pooling_factors) <= MAX_IDS or w.batch_size == 16
    dims = [d for w in layouts for d in w.dims]
    assert any(d % 4 for d in dims) and any(d % 4 == 0 for d in dims)  # multiples of 4 and not
    assert any(w.zipf_a for w in layouts) and any(w.zipf_a is None for w in layouts)
    assert len({w.num_tables for w in layouts}) > 20


def test_the_small_draw_builds_an_input():
    import torch

    w = random_workloads(5, 1, small=True)[0]
    kjt = w.make_input(torch.device("cpu"))
    assert kjt.stride() == w.batch_size and len(kjt.keys()) == w.num_tables


def test_summary_counts_geomean_and_worst():
    results = [{"workload": "random-0", "phase": "forward", "peer": "recom_rec", "ms": 1.0},
               {"workload": "random-0", "phase": "forward", "peer": "fbgemm", "ms": 2.0},
               {"workload": "random-1", "phase": "forward", "peer": "recom_rec", "ms": 2.0},
               {"workload": "random-1", "phase": "forward", "peer": "fbgemm", "ms": 1.0}]
    text = summarize(results, ["random-0", "random-1"], ["fbgemm"])
    assert "1/2 at or above 1.0x" in text and "geomean 1.00x" in text and "worst 0.50x (random-1)" in text
