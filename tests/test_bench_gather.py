"""The sweep's bare gather (recom_rec/bench/gather.py) against its torch reference, and the sweep's
report of the forwards measured beside it."""
import pytest
import torch
from ebc_cases import DEVICE

from recom_rec.bench import sweep
from recom_rec.bench.gather import flat_rows, gather_sum, gather_sum_reference, gathers


@pytest.mark.parametrize("dim", [4, 8, 17, 64])
@pytest.mark.parametrize("lookups", [1, 130, 600])
@pytest.mark.parametrize("block,warps", [(128, 2), (256, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_sum_matches_reference(dim, lookups, block, warps, dtype):
    gen = torch.Generator().manual_seed(dim * 1000 + lookups)
    weights = torch.randn(300, dim, generator=gen).to(dtype).to(DEVICE)
    rows = torch.randint(0, 300, (lookups,), generator=gen, dtype=torch.int32).to(DEVICE)
    out = gather_sum(weights, rows, block, warps)
    torch.testing.assert_close(out, gather_sum_reference(weights, rows, block), atol=1e-4, rtol=1e-4)
    assert out.shape == (-(-lookups // block), 1 << (dim - 1).bit_length())


def test_flat_rows_and_the_gather_peer_read_the_points_rows():
    """A sweep point's table-major KJT: each lookup's row in the stacked tables, and the gather
    peers (one a block size) sum exactly those rows."""
    p = sweep.Point("probe", tables=3, rows=40, dim=8, batch=5, ids=4)
    kjt = sweep.make_kjt(p, DEVICE)
    rows = flat_rows(kjt.values(), kjt.lengths(), p.tables, p.rows)
    per_table = kjt.lengths().view(p.tables, -1).sum(1).tolist()
    expected = torch.cat([kjt.values()[sum(per_table[:t]):sum(per_table[:t + 1])] + t * p.rows
                          for t in range(p.tables)])
    assert rows.dtype == torch.int32 and torch.equal(rows.long(), expected)
    weights = torch.randn(p.tables * p.rows, p.dim, device=DEVICE)
    total = weights[expected].sum(0)
    for name, peer in gathers(weights, kjt, p.tables, p.rows):
        torch.testing.assert_close(peer.forward(kjt).sum(0)[:p.dim], total, atol=1e-4, rtol=1e-4, msg=name)


def test_summary_reports_forwards_below_the_target_beside_the_gather():
    row = {"point": "16x100000 D=4 B=4096 ~200 ids fp32", "phase": "forward", "rows_read_bytes": 2e8,
           "lookup_bytes": 2.01e8, "ceiling_share": 0.40, "graph_ceiling_share": 0.45, "recom_rec_graph_ms": 0.16,
           "gather_graph_ms": 0.113, "gather_ceiling_share": 0.63, "of_gather": 0.71, "ratio": 2.0}
    fast = dict(row, point="16x100000 D=64 B=4096 ~50 ids fp32", ceiling_share=1.2, graph_ceiling_share=1.3)
    for key in ("gather_graph_ms", "gather_ceiling_share", "of_gather"):
        del fast[key]
    summary = sweep.summarize([row, fast])
    s = summary["forward_bandwidth_bound"]
    assert s["graph_below_85pct"] == [(row["point"], 0.45)]
    assert s["gather"] == [(row["point"], 0.45, 0.63, 0.71)]
    text = sweep.format_results({"device": "probe", "copy_gbs": 3000.0}, [row, fast], summary)
    assert f"{row['point']}: ours 45% of copy; a bare gather of its rows 63%, ours at 71% of the gather's rate" \
        in text
