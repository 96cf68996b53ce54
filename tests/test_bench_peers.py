"""The benchmark's fbgemm peer on layouts its kernels cannot run as drawn: dims that are not a
multiple of 4 are padded (as a user of fbgemm must), the real columns answer as torchrec's module
does, a training step takes the padded output's gradient, and the report says it was padded."""
import pytest
import torch

from recom_rec.bench.peers import fbgemm_available, make_peer
from recom_rec.bench.report import format_table
from recom_rec.bench.workloads import Workload

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not fbgemm_available(CPU), reason="fbgemm_gpu is not installed")


def _mixed() -> Workload:
    return Workload("mixed", rows=[50, 40, 30], dims=[6, 8, 3], batch_size=5, pooling_factors=[2, 3, 1])


def test_fbgemm_pads_dims_and_its_real_columns_match_torchrec():
    w = _mixed()
    kjt = w.make_input(CPU)
    torch.manual_seed(0)
    theirs = make_peer("torchrec", w, CPU, "none")
    fbgemm = make_peer("fbgemm", w, CPU, "sgd")
    fbgemm.load(theirs.tables())
    assert fbgemm.padded and fbgemm.output_width == 8 + 8 + 4
    out = fbgemm.forward(kjt)
    assert out.shape == (w.batch_size, fbgemm.output_width)
    real = torch.cat([out[:, 0:6], out[:, 8:16], out[:, 16:19]], dim=1)
    torch.testing.assert_close(real, theirs.forward(kjt).detach())


def test_fbgemm_trains_on_the_padded_output_and_moves_only_rows_it_read():
    w = _mixed()
    kjt = w.make_input(CPU)
    fbgemm = make_peer("fbgemm", w, CPU, "sgd")
    before = [t.detach().clone() for t in fbgemm.tables()]
    fbgemm.train_step(kjt, torch.ones(w.batch_size, fbgemm.output_width))
    for t, (table, old) in enumerate(zip(fbgemm.tables(), before)):
        assert table.shape == old.shape == (w.rows[t], w.dims[t])
        read = set(kjt[f"f{t}"].values().tolist())
        moved = {int(r) for r in (table != old).any(dim=1).nonzero().flatten()}
        assert moved == read


def test_a_layout_of_multiples_of_4_runs_unpadded():
    w = Workload("aligned", rows=[20, 20], dims=[4, 16], batch_size=3, pooling_factors=[1, 2])
    fbgemm = make_peer("fbgemm", w, CPU, "sgd")
    assert not fbgemm.padded and fbgemm.output_width == 20


def test_the_report_names_the_layouts_fbgemm_ran_padded():
    meta = {"device": "cpu", "torch": "x", "copy_gbs": 1.0, "backend": "auto", "small": True}
    results = [{"workload": "random-0", "phase": "forward", "peer": "recom_rec", "ms": 1.0},
               {"workload": "random-0", "phase": "forward", "peer": "fbgemm", "ms": 2.0, "padded": True},
               {"workload": "random-0", "phase": "sgd", "peer": "fbgemm", "ms": 3.0, "padded": True},
               {"workload": "random-1", "phase": "forward", "peer": "fbgemm", "ms": 2.0}]
    text = format_table(meta, results, ["recom_rec", "fbgemm"])
    assert "fbgemm: dims padded up to a multiple of 4" in text and text.rstrip().endswith("in random-0")
