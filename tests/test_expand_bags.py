"""The variable-batch expansion (ops/expand_bags.py): the Triton kernels (under the interpreter on
the CPU) against torch's gather and scatter-add, on random shapes; the backward's segmented sum
bit for bit against adding each bag's rows in ascending b; the op's gradient."""
import pytest
import torch

from ebc_cases import DEVICE
from recom_rec.kernels import expand_triton
from recom_rec.ops.expand_bags import expand_bags


def _columns(dims):
    return torch.repeat_interleave(torch.arange(len(dims), dtype=torch.int32), torch.tensor(dims))


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    dims = torch.randint(1, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    batch = int(torch.randint(1, 40, (1,), generator=g))
    bags = int(torch.randint(1, batch + 1, (1,), generator=g))
    pooled = torch.randn(bags, sum(dims), generator=g)
    inverse = torch.randint(0, bags, (len(dims), batch), generator=g)
    return pooled.to(DEVICE), inverse.to(DEVICE), _columns(dims).to(DEVICE)


def _ascending_sum(grad, inverse, col_feature, num_bags):
    """The backward's reference: each output row's gradient added to its bags' rows one row at a
    time, b = 0, 1, ..., in fp32 from zero (so each bag's rows in ascending b)."""
    grad, inverse, col_feature = grad.cpu(), inverse.cpu(), col_feature.cpu().long()
    out = torch.zeros(num_bags, grad.shape[1], dtype=torch.float32)
    columns = torch.arange(grad.shape[1])
    for b in range(grad.shape[0]):
        out[inverse[col_feature, b], columns] += grad[b]  # one element a column: no index repeats
    return out


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty's float tensors filled with NaN while a test runs: an output element the kernel
    failed to write shows (the backward writes every bag row rather than clearing the output)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _check_backward(grad, inverse, col_feature, num_bags):
    grad, inverse, col_feature = grad.to(DEVICE), inverse.to(DEVICE), col_feature.to(DEVICE)
    got = expand_triton.backward(grad, inverse, col_feature, num_bags)
    assert got.shape == (num_bags, grad.shape[1]) and got.dtype == torch.float32
    assert torch.equal(got.cpu(), _ascending_sum(grad, inverse, col_feature, num_bags))
    return got


@pytest.mark.parametrize("seed", range(6))
def test_triton_kernels_match_gather_and_scatter_add(seed, poisoned_empty):
    pooled, inverse, col_feature = _case(seed)
    rows = inverse.index_select(0, col_feature.long()).t()
    assert torch.equal(expand_triton.forward(pooled, inverse, col_feature), pooled.gather(0, rows))
    grad = torch.randn(inverse.shape[1], pooled.shape[1], device=pooled.device)
    expected = torch.zeros_like(pooled).scatter_add_(0, rows, grad)
    got = _check_backward(grad, inverse, col_feature, pooled.shape[0])
    torch.testing.assert_close(got, expected)


def _random(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dims,batch,num_bags", [
    ([7], 1, 1),                      # one feature, batch 1
    ([5, 130, 3], 1, 4),              # batch 1, bags never referenced
    ([128], 37, 5),                   # one feature, a block's worth of columns, bags of ~7 rows
    ([1, 3, 17, 40, 130, 16, 5], 23, 9),  # mixed dims, blocks straddling features
    ([16] * 12, 19, 19),              # small dims: the narrowest column block
])
def test_backward_sums_each_bag_in_ascending_order(dims, batch, num_bags, poisoned_empty):
    g = torch.Generator().manual_seed(batch * 1000 + num_bags)
    inverse = torch.randint(0, num_bags, (len(dims), batch), generator=g)
    _check_backward(_random((batch, sum(dims)), 1), inverse, _columns(dims), num_bags)


def test_backward_empty_and_unreferenced_bags_are_zero(poisoned_empty):
    dims, batch, num_bags = [33, 64, 9], 29, 40
    g = torch.Generator().manual_seed(3)
    # Feature 0 takes bags {2, 5} only; feature 1 is a smaller batch padded to num_bags (bags 0..6
    # used, the rest padding); feature 2 takes one bag with every row (a long segment, not a
    # multiple of the unroll).
    choice = torch.tensor([2, 5])
    inverse = torch.stack([choice[torch.randint(0, 2, (batch,), generator=g)],
                           torch.randint(0, 7, (batch,), generator=g),
                           torch.full((batch,), 11)])
    got = _check_backward(_random((batch, sum(dims)), 2), inverse, _columns(dims), num_bags).cpu()
    c0, c1 = dims[0], dims[0] + dims[1]
    used = {0: {2, 5}, 1: set(range(7)), 2: {11}}
    for f, (lo, hi) in enumerate([(0, c0), (c0, c1), (c1, sum(dims))]):
        for s in range(num_bags):
            if s not in used[f]:
                assert torch.equal(got[s, lo:hi], torch.zeros(hi - lo)), (f, s)


def test_backward_identity_inverse_is_the_gradient(poisoned_empty):
    """A full-batch feature's inverse indices are 0..B-1: each bag is one row, its gradient exactly."""
    dims, batch = [24, 40], 33
    inverse = torch.arange(batch).repeat(len(dims), 1)
    grad = _random((batch, sum(dims)), 4)
    got = _check_backward(grad, inverse, _columns(dims), batch)
    assert torch.equal(got.cpu(), grad)
    # and a larger pooled batch (padding bags past the batch stay zero)
    got = _check_backward(grad, inverse, _columns(dims), batch + 5).cpu()
    assert torch.equal(got[:batch], grad) and torch.equal(got[batch:], torch.zeros(5, sum(dims)))


def test_backward_columns_in_any_feature_order(poisoned_empty):
    """``col_feature`` need not group a feature's columns: each block sums every feature it holds."""
    g = torch.Generator().manual_seed(5)
    features, cols, batch, num_bags = 4, 45, 17, 6
    col_feature = torch.randint(0, features, (cols,), generator=g, dtype=torch.int32)
    inverse = torch.randint(0, num_bags, (features, batch), generator=g)
    _check_backward(_random((batch, cols), 5), inverse, col_feature, num_bags)


def test_backward_is_deterministic():
    pooled, inverse, col_feature = _case(11)
    grad = torch.randn(inverse.shape[1], pooled.shape[1], device=pooled.device)
    first = expand_triton.backward(grad, inverse, col_feature, pooled.shape[0])
    second = expand_triton.backward(grad, inverse, col_feature, pooled.shape[0])
    assert torch.equal(first, second)


def test_backward_without_rows_or_columns():
    assert torch.equal(expand_triton.backward(torch.zeros(0, 5, device=DEVICE),
                                              torch.zeros(2, 0, dtype=torch.int64, device=DEVICE),
                                              _columns([2, 3]).to(DEVICE), 3).cpu(), torch.zeros(3, 5))
    assert expand_triton.backward(torch.zeros(4, 0, device=DEVICE), torch.zeros(0, 4, dtype=torch.int64, device=DEVICE),
                                  torch.zeros(0, dtype=torch.int32, device=DEVICE), 3).shape == (3, 0)


def test_bag_segments_group_rows_by_bag_in_ascending_order():
    inverse = torch.tensor([[1, 0, 1, 1], [2, 2, 0, 2]], device=DEVICE)
    order, seg = expand_triton.bag_segments(inverse, 3)
    # keys f * 3 + bag: [1, 0, 1, 1] and [5, 5, 3, 5]
    assert order.tolist() == [1, 0, 2, 3, 6, 4, 5, 7]
    assert seg.tolist() == [0, 1, 4, 4, 5, 5, 8]  # where keys 0..6 start; 8: the end
    assert seg.dtype == torch.int32


def test_backward_fits_its_int32_positions():
    assert expand_triton.backward_fits(26, 8192, 8192)
    assert not expand_triton.backward_fits(2**12, 2**19, 512)


def test_op_gradient():
    pooled, inverse, col_feature = _case(7)
    pooled = pooled.double().requires_grad_()
    torch.autograd.gradcheck(lambda p: expand_bags(p, inverse, col_feature), (pooled,))
