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


def test_sequence_and_vbe_draws_follow_their_distribution_and_caps():
    from recom_rec.bench.random_layouts import (
        MAX_OUTPUT_BYTES,
        MAX_UNPOOLED_WEIGHT_BYTES,
        draw_sequence,
        draw_vbe,
    )

    rng = np.random.default_rng(4)
    sequences = [draw_sequence(rng, i, small=False) for i in range(200)]
    for w in sequences:
        lo, hi = w.history
        assert 1 <= lo <= hi <= 4000 and 16 <= w.batch_size <= 2048 and w.dim % 4 == 0 and 16 <= w.dim <= 512
        assert (w.item_rows + sum(w.side_rows)) * w.dim * 4 <= MAX_UNPOOLED_WEIGHT_BYTES
        assert w.batch_size * (3 * (lo + hi) / 2 + 1) * w.dim * 4 <= MAX_OUTPUT_BYTES or w.batch_size <= 16
    vbes = [draw_vbe(rng, i, small=False) for i in range(200)]
    for w in vbes:
        tables = w.user_features + w.item_features
        assert 1 <= w.user_features <= 16 and 1 <= w.item_features <= 32 and 2 <= w.divisor <= 128
        assert w.dim % 4 == 0 and 1 <= w.multi_hot <= 100 and 256 <= w.batch_size <= 65536
        assert tables * w.rows * w.dim * 4 <= MAX_UNPOOLED_WEIGHT_BYTES
        assert w.batch_size * tables * w.dim * 4 <= MAX_OUTPUT_BYTES or w.batch_size <= 256
    assert len({w.divisor for w in vbes}) == 7 and len({w.dim for w in sequences}) > 20


def test_unpooled_draws_reproduce_and_leave_the_pooled_draw_of_a_seed_alone():
    from recom_rec.bench.random_layouts import random_unpooled_workloads

    a, b = random_unpooled_workloads(11, 8, small=False), random_unpooled_workloads(11, 8, small=False)
    assert [w.describe() for w in a[0] + a[1]] == [w.describe() for w in b[0] + b[1]]
    assert len(a[0]) == len(a[1]) == 2 and a[0][1].label() == "random-seq-1" and a[1][0].label() == "random-vbe-0"
    other = random_unpooled_workloads(12, 8, small=False)
    assert [w.describe() for w in a[0]] != [w.describe() for w in other[0]]
    # the pooled layouts of seed 11 as drawn before the unpooled ones existed (v51)
    assert random_workloads(11, 1, small=False)[0].description == draw_layout(np.random.default_rng(11), 0, False).description


def test_small_unpooled_draws_run_through_their_benchmarks():
    import torch

    from recom_rec.bench.random_layouts import random_unpooled_workloads
    from recom_rec.bench.sequence import run_sequence
    from recom_rec.bench.vbe import run_vbe

    sequences, vbes = random_unpooled_workloads(5, 1, small=True)
    cpu = torch.device("cpu")
    rows = run_sequence(cpu, True, iters=1, warmup=1, drawn=sequences) + run_vbe(cpu, True, iters=1, warmup=1, drawn=vbes)
    timed = {(r["workload"], r["peer"], r["phase"]) for r in rows if "ms" in r}
    assert {("random-seq-0", "recom_rec", "forward"), ("random-seq-0", "recom_rec", "sgd"),
            ("random-seq-0", "torchrec", "int8"), ("random-vbe-0", "recom_rec", "sgd"),
            ("random-vbe-0", "torchrec", "forward")} <= timed
    assert all(r["identical"] for r in rows if r["phase"] == "forward" and "identical" in r)


def test_unpooled_benches_take_the_peer_and_phase_filters():
    import torch

    from recom_rec.bench.random_layouts import random_unpooled_workloads
    from recom_rec.bench.sequence import run_sequence
    from recom_rec.bench.vbe import run_vbe

    sequences, vbes = random_unpooled_workloads(6, 1, small=True)
    cpu = torch.device("cpu")
    narrow = dict(iters=1, warmup=1, peers=["recom_rec"], phases=["sgd"])
    rows = run_sequence(cpu, True, drawn=sequences, **narrow) + run_vbe(cpu, True, drawn=vbes, **narrow)
    assert {(r["peer"], r["phase"]) for r in rows} == {("recom_rec", "sgd")} and len(rows) == 2


def test_a_failed_peer_is_a_row_of_its_own_in_the_table():
    from recom_rec.bench.report import format_peers

    rows = [{"workload": "random-seq-0", "phase": "forward", "peer": "recom_rec", "ids": 10, "ms": 1.0},
            {"workload": "random-seq-0", "phase": "forward", "peer": "fbgemm", "ids": 10, "error": "out of memory"}]
    text = format_peers("sequence", rows)
    assert "error: random-seq-0 forward fbgemm: out of memory" in text and "1.000" in text
