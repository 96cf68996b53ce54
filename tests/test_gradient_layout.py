"""The pooled gradient's padded layout (ops/gradient_layout.py): every feature's columns moved,
in order, to a column that is a multiple of 4, values unchanged."""
import pytest
import torch

from ebc_cases import DEVICE
from recom_rec.kernels import cuda_ext
from recom_rec.ops.gradient_layout import aligned_gradient, padded_width
from recom_rec.ops.layout import META_DIM, META_OUT_COL, META_WIDTH


def _meta(dims, order):
    """A group's meta: features of ``dims`` whose output columns come in ``order``."""
    cols, col = [0] * len(dims), 0
    for i in order:
        cols[i], col = col, col + dims[i]
    meta = torch.zeros(len(dims), META_WIDTH, dtype=torch.int64)
    meta[:, META_DIM] = torch.tensor(dims)
    meta[:, META_OUT_COL] = torch.tensor(cols)
    return meta, col


@pytest.mark.parametrize("seed", range(12))
def test_each_feature_moves_to_an_aligned_column_with_its_values(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    dims = torch.randint(1, 40, (n,), generator=g).tolist()
    if all(d % 4 == 0 for d in dims):
        dims[0] += 1  # (aligned columns are passed through: tested below; any odd dim puts a column or the width off)
    meta, width = _meta(dims, torch.randperm(n, generator=g).tolist())
    grad = torch.randn(int(torch.randint(1, 6, (1,), generator=g)), width, generator=g)
    padded, moved = aligned_gradient(grad, meta)
    assert padded.shape == (grad.shape[0], padded_width(width, n))
    spans = []
    for i, d in enumerate(dims):
        src, dst = int(meta[i, META_OUT_COL]), int(moved[i, META_OUT_COL])
        assert dst % 4 == 0
        assert dst + (d + 3) // 4 * 4 <= padded.shape[1]  # (a 16-byte read of the last chunk stays inside)
        assert torch.equal(padded[:, dst:dst + d], grad[:, src:src + d])
        spans.append((dst, dst + d))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= padded.shape[1]
    assert torch.equal(moved[:, [c for c in range(META_WIDTH) if c != META_OUT_COL]],
                       meta[:, [c for c in range(META_WIDTH) if c != META_OUT_COL]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300_001])  # (past 65,535 x 4: the GPU kernel's rows wrap its grid)
def test_the_copy_keeps_every_value_of_each_dtype_on_the_device(dtype, rows):
    if DEVICE.type == "cuda":
        cuda_ext.build_error()  # (loads the extension where it can be: its kernel then copies)
    dims = [3, 8, 5, 1, 13]
    meta, width = _meta(dims, [2, 0, 4, 1, 3])
    meta = meta.to(DEVICE)
    grad = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
    padded, moved = aligned_gradient(grad, meta)
    assert padded.dtype == dtype and padded.device == grad.device
    for i, d in enumerate(dims):
        src, dst = int(meta[i, META_OUT_COL]), int(moved[i, META_OUT_COL])
        assert torch.equal(padded[:, dst:dst + d], grad[:, src:src + d])


def test_an_aligned_gradient_is_passed_through():
    meta, width = _meta([4, 8, 12], [2, 0, 1])
    grad = torch.randn(3, width)
    padded, moved = aligned_gradient(grad, meta)
    assert padded is grad and moved is meta


def test_columns_off_a_multiple_of_4_are_padded_at_a_width_that_is_one():
    """Dims 3 and 5 end at column 8: the width says nothing of the columns between."""
    dims = [3, 5, 4]
    meta, width = _meta(dims, [0, 1, 2])
    assert width % 4 == 0 and int(meta[1, META_OUT_COL]) == 3
    grad = torch.randn(2, width)
    padded, moved = aligned_gradient(grad, meta)
    assert padded is not grad and bool((moved[:, META_OUT_COL] % 4 == 0).all())
    for i, d in enumerate(dims):
        src, dst = int(meta[i, META_OUT_COL]), int(moved[i, META_OUT_COL])
        assert torch.equal(padded[:, dst:dst + d], grad[:, src:src + d])


def test_the_columns_are_worked_out_once_per_meta_and_again_after_it_changes():
    meta, width = _meta([3, 6], [0, 1])
    grad = torch.randn(2, width)
    _, first = aligned_gradient(grad, meta)
    _, again = aligned_gradient(grad, meta)
    assert again is first and first is not meta
    meta[:, META_OUT_COL] = torch.tensor([6, 0])  # the same features, the other order
    padded, moved = aligned_gradient(grad, meta)
    assert moved is not first and int(moved[1, META_OUT_COL]) == 0 and int(moved[0, META_OUT_COL]) == 12
    assert torch.equal(padded[:, 12:15], grad[:, 6:9]) and torch.equal(padded[:, 0:6], grad[:, 0:6])


def test_during_a_capture_the_layout_is_worked_out_on_the_device_and_not_kept(monkeypatch):
    """Under a CUDA graph's capture the meta cannot be read on the host: an odd width still gets
    the padded layout (computed where the meta is), a width that is a multiple of 4 the gradient as
    given; neither is kept, so the first step after the capture reads the meta."""
    from recom_rec.ops import gradient_layout

    dims = [3, 6]
    meta, width = _meta(dims, [1, 0])
    grad = torch.randn(2, width)
    expected, expected_meta = aligned_gradient(grad, meta.clone())
    captured_meta, aligned_width_meta = meta.clone(), _meta([3, 5, 4], [0, 1, 2])[0]
    monkeypatch.setattr(gradient_layout, "_host_meta", lambda m: None)
    padded, moved = aligned_gradient(grad, captured_meta)
    assert torch.equal(moved, expected_meta)
    for i, d in enumerate(dims):
        dst = int(moved[i, META_OUT_COL])
        assert torch.equal(padded[:, dst:dst + d], expected[:, dst:dst + d])
    grad12 = torch.randn(2, 12)
    passed, same = aligned_gradient(grad12, aligned_width_meta)
    assert passed is grad12 and same is aligned_width_meta
    monkeypatch.undo()
    padded, moved = aligned_gradient(grad12, aligned_width_meta)  # read now: dims 3 and 5 put column 3 off
    assert padded is not grad12 and bool((moved[:, META_OUT_COL] % 4 == 0).all())
