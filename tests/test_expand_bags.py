"""The variable-batch expansion (ops/expand_bags.py): the Triton kernels (under the interpreter on
the CPU) against torch's gather and scatter-add, on random shapes; the op's gradient."""
import pytest
import torch

from ebc_cases import DEVICE
from recom_rec.kernels import expand_triton
from recom_rec.ops.expand_bags import expand_bags


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    dims = torch.randint(1, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    batch = int(torch.randint(1, 40, (1,), generator=g))
    bags = int(torch.randint(1, batch + 1, (1,), generator=g))
    pooled = torch.randn(bags, sum(dims), generator=g)
    inverse = torch.randint(0, bags, (len(dims), batch), generator=g)
    col_feature = torch.repeat_interleave(torch.arange(len(dims), dtype=torch.int32), torch.tensor(dims))
    return pooled.to(DEVICE), inverse.to(DEVICE), col_feature.to(DEVICE)


@pytest.mark.parametrize("seed", range(6))
def test_triton_kernels_match_gather_and_scatter_add(seed):
    pooled, inverse, col_feature = _case(seed)
    rows = inverse.index_select(0, col_feature.long()).t()
    assert torch.equal(expand_triton.forward(pooled, inverse, col_feature), pooled.gather(0, rows))
    grad = torch.randn(inverse.shape[1], pooled.shape[1], device=pooled.device)
    expected = torch.zeros_like(pooled).scatter_add_(0, rows, grad)
    torch.testing.assert_close(expand_triton.backward(grad, inverse, col_feature, pooled.shape[0]), expected)


@pytest.mark.parametrize("seed", range(4))
def test_backward_of_features_at_the_full_batch(seed):
    # VBE's features at the full batch come with the identity as inverse indices (their rows are
    # their bags: stored, not added); mixed with a permuted one and ones that share bags
    pooled, inverse, col_feature = _case(seed)
    batch, features = inverse.shape[1], inverse.shape[0]
    g = torch.Generator().manual_seed(100 + seed)
    inverse = torch.randint(0, batch, (features, batch), generator=g)
    kinds = torch.randint(0, 3, (features,), generator=g).tolist()  # identity, permutation, shared bags
    for f, kind in enumerate(kinds):
        if kind == 0:
            inverse[f] = torch.arange(batch)
        elif kind == 1:
            inverse[f] = torch.randperm(batch, generator=g)
    inverse = inverse.to(DEVICE)
    rows = inverse.index_select(0, col_feature.long()).t()
    grad = torch.randn(batch, pooled.shape[1], generator=g).to(DEVICE)
    got = expand_triton.backward(grad, inverse, col_feature, batch)
    torch.testing.assert_close(got, torch.zeros(batch, pooled.shape[1], device=DEVICE).scatter_add_(0, rows, grad))
    identity = torch.tensor([kinds[f] == 0 for f in col_feature.tolist()], device=DEVICE)
    assert torch.equal(got[:, identity], grad[:, identity])


def test_op_gradient():
    pooled, inverse, col_feature = _case(7)
    pooled = pooled.double().requires_grad_()
    torch.autograd.gradcheck(lambda p: expand_bags(p, inverse, col_feature), (pooled,))


@pytest.mark.parametrize("seed", range(4))
def test_eager_path_gives_the_op_s_bits_forward_and_backward(seed):
    """expand_rows' eager path (the op's bodies in a plain autograd Function, no custom-op layers)
    against the registered op, and against gather's gradient. The forward copies: the same bits. The
    backward adds a bag's rows by fp32 atomics on a GPU, in an order no run fixes (three rows or more
    can round differently from run to run, the same path too): the same sums within fp32 rounding."""
    from recom_rec.ops.expand_bags import eager_expand_bags
    from recom_rec.ops.variable_batch import expand_rows

    pooled, inverse, col_feature = _case(seed)
    dims = torch.bincount(col_feature.long().cpu()).tolist()
    grad = torch.randn(inverse.shape[1], pooled.shape[1], device=pooled.device)
    results = []
    for run in (lambda p: expand_bags(p, inverse, col_feature), lambda p: eager_expand_bags(p, inverse, col_feature),
                lambda p: expand_rows(p, inverse, dims)):
        p = pooled.clone().requires_grad_()
        out = run(p)
        out.backward(grad)
        results.append((out.detach(), p.grad))
    for out, g in results[1:]:
        assert torch.equal(out, results[0][0])
        if DEVICE.type == "cuda":
            torch.testing.assert_close(g, results[0][1])
        else:  # (torch's scatter-add, in order)
            assert torch.equal(g, results[0][1])
    rows = inverse.index_select(0, col_feature.long()).t()
    torch.testing.assert_close(results[0][1], torch.zeros_like(pooled).scatter_add_(0, rows, grad))


def test_the_eager_path_skips_the_registered_op():
    """(the host time the eager path saves is the op's layers: a plain call must not reach them,
    a compiled one must)"""
    from recom_rec.ops.variable_batch import expand_rows

    pooled, inverse, col_feature = _case(1)
    dims = torch.bincount(col_feature.long().cpu()).tolist()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        expand_rows(pooled.clone().requires_grad_(), inverse, dims).sum().backward()
    names = {e.name for e in prof.events()}
    assert not any(n.startswith("recom_rec::expand_bags") for n in names), sorted(names)


def test_a_second_derivative_raises_on_both_paths():
    """The expansion has no double backward: asked for one, the op and the eager path both raise
    (the CUDA kernel's gradient carries no graph; a silent zero would be a wrong answer)."""
    from recom_rec.ops.expand_bags import eager_expand_bags

    pooled, inverse, col_feature = _case(3)
    for expand in (expand_bags, eager_expand_bags):
        p = pooled.double().requires_grad_()
        out = expand(p, inverse, col_feature)
        (g,) = torch.autograd.grad((out * out).sum(), p, create_graph=True)
        with pytest.raises(RuntimeError):
            g.sum().backward()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA kernels run on a GPU (CI compiles them: test_kernels_compile)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dims", [[4, 8, 16], [128, 128, 64, 32], [3, 5, 1], [8, 24, 6], [2, 2, 2, 2]])
def test_cuda_extension_kernels_match_gather_and_scatter_add(dims, dtype):
    """csrc/lookup/expand.cu (the eager path where the lookup runs on the CUDA kernels): each dims'
    greatest common divisor takes a path (16-byte units or single elements), against torch; the
    gradient in fp32 with identity, permuted and shared-bag features mixed."""
    from recom_rec.ops.variable_batch import expand_rows

    g = torch.Generator().manual_seed(sum(dims))
    batch = 37
    bags = batch
    inverse = torch.randint(0, bags, (len(dims), batch), generator=g)
    inverse[0] = torch.arange(batch)
    if len(dims) > 1:
        inverse[1] = torch.randperm(batch, generator=g)
    inverse = inverse.to(DEVICE)
    pooled = torch.randn(bags, sum(dims), generator=g).to(DEVICE, dtype)
    col_feature = torch.repeat_interleave(torch.arange(len(dims), dtype=torch.int32), torch.tensor(dims)).to(DEVICE)
    rows = inverse.index_select(0, col_feature.long()).t()
    p = pooled.clone().requires_grad_()
    out = expand_rows(p, inverse, dims, "cuda")
    assert torch.equal(out, pooled.gather(0, rows))
    if dtype == torch.float32:
        grad = torch.randn(batch, sum(dims), generator=g).to(DEVICE)
        out.backward(grad)
        expected = torch.zeros_like(pooled).scatter_add_(0, rows, grad)
        torch.testing.assert_close(p.grad, expected)
        assert torch.equal(p.grad[:, :dims[0]], grad[:, :dims[0]])  # the identity feature's rows stored
    # an empty batch
    assert expand_rows(pooled, inverse[:, :0], dims, "cuda").shape == (0, sum(dims))


def test_kernels_stay_in_bounds_with_bad_inverse_indices():
    """An inverse index outside the pooled bags reads bag 0 and adds nothing out of bounds (the
    module checks them on the CPU; on a GPU the kernels cannot raise without a sync)."""
    pooled, inverse, col_feature = _case(2)
    bad = inverse.clone()
    bad[0, 0], bad[-1, -1] = pooled.shape[0] + 5, -3
    rows = bad.clamp(0, pooled.shape[0] - 1).index_select(0, col_feature.long()).t()
    rows = torch.where(bad.index_select(0, col_feature.long()).t() == rows, rows, torch.zeros_like(rows))
    assert torch.equal(expand_triton.forward(pooled, bad, col_feature), pooled.gather(0, rows))
    grad = torch.randn(bad.shape[1], pooled.shape[1], device=pooled.device)
    expected = torch.zeros_like(pooled).scatter_add_(0, rows, grad)
    torch.testing.assert_close(expand_triton.backward(grad, bad, col_feature, pooled.shape[0]), expected)


def _expansions():
    """The forward's kernels: Triton's (under the interpreter on the CPU) and, on a GPU, the CUDA
    extension's (csrc/lookup/expand.cu; CI compiles it: test_kernels_compile)."""
    runs = [("triton", lambda p, inv, cf, check: expand_triton.forward(p, inv, cf, check))]
    if DEVICE.type == "cuda":
        from recom_rec.kernels import cuda_ext

        def cuda(p, inv, cf, check):
            limits, report = check
            return cuda_ext.extension().expand_rows_forward(p, inv, cf, False, limits, report.claim, report.words)

        runs.append(("cuda", cuda))
    return runs


@pytest.mark.parametrize("run", [name for name, _ in _expansions()])
@pytest.mark.parametrize("where", ["padded", "past the bags", "negative", "none"])
def test_the_forward_reports_an_inverse_index_outside_its_feature_s_bags(run, where):
    """With each feature's bag count in the batch (its limit: a variable batch pads every feature's
    bags to the largest count), the first index outside [0, limit) is reported to the input
    check's words (kind 4, feature, output row, bag, limit); the output's bits are the unchecked
    kernel's either way."""
    from recom_rec.ops.input_check import KernelReport

    expand = dict(_expansions())[run]
    pooled, inverse, col_feature = _case(5)
    features, batch = inverse.shape
    bags = pooled.shape[0]
    assert bags >= 3  # (so that the feature's limit lies inside the padded bags)
    limits = torch.full((features,), bags, dtype=torch.int64)
    f, b = features - 1, batch // 2
    limits[f] = max(1, bags - 2)
    bad = inverse.clone()
    bad[f] = bad[f].clamp(max=int(limits[f]) - 1)
    bag = {"padded": int(limits[f]), "past the bags": bags + 3, "negative": -2, "none": None}[where]
    if bag is not None:
        bad[f, b] = bag
    report = KernelReport(DEVICE, "")
    out = expand(pooled, bad, col_feature, (limits.to(DEVICE), report))
    assert torch.equal(out, expand_triton.forward(pooled, bad, col_feature))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    expected = (0,) * 6 if bag is None else (4, f, b, bag, int(limits[f]), -1)
    assert tuple(int(w) for w in report.words) == expected


def _padded_case(seed: int, dims, dtype):
    """A lookup's pooled rows as a variable batch pads them: S == B rows, each feature's bags past
    its own count empty (zeros). Features: identity (the full batch), permuted (the full batch),
    fewer bags (shared), and the full batch whose rows take other features' bag counts."""
    g = torch.Generator().manual_seed(seed)
    batch = 53
    counts, inverse = [], torch.empty(len(dims), batch, dtype=torch.int64)
    for f in range(len(dims)):
        kind = f % 3
        if kind == 0:
            counts.append(batch)
            inverse[f] = torch.arange(batch)
        elif kind == 1:
            counts.append(batch)
            inverse[f] = torch.randperm(batch, generator=g)
        else:
            counts.append(int(torch.randint(1, batch // 2, (1,), generator=g)))
            inverse[f] = torch.randint(0, counts[-1], (batch,), generator=g)
    col_feature = torch.repeat_interleave(torch.arange(len(dims), dtype=torch.int32), torch.tensor(dims))
    pooled = torch.randn(batch, sum(dims), generator=g)
    pooled[torch.arange(batch).unsqueeze(1) >= torch.tensor(counts)[col_feature.long()].unsqueeze(0)] = 0
    return (pooled.to(DEVICE, dtype), inverse.to(DEVICE), col_feature.to(DEVICE),
            torch.tensor(counts, dtype=torch.int64, device=DEVICE))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA kernels run on a GPU (CI compiles them: test_kernels_compile)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dims", [[4, 8, 16], [128, 128, 64, 32, 128], [3, 5, 1], [8, 24, 6, 12], [2, 2, 2, 2]])
def test_the_in_place_expansion_gives_the_gathers_bits(dims, dtype):
    """csrc/lookup/expand.cu's expansion in place (S == B: a one-group module's lookup output):
    the gather's bits for identity, permuted and fewer-bag features; the moved flags it returns
    give the backward the bits it finds without them (integer-valued gradients: exact sums)."""
    import math

    from recom_rec.kernels import cuda_ext

    ext = cuda_ext.extension()
    pooled, inverse, col_feature, counts = _padded_case(sum(dims), dims, dtype)
    rows = inverse.index_select(0, col_feature.long()).t()
    expected = pooled.gather(0, rows)
    whole = math.gcd(*dims) * pooled.element_size() % 16 == 0
    out, moved = ext.expand_rows_forward_in_place(pooled.clone(), inverse, col_feature, counts, whole, None, None)
    assert torch.equal(out, expected)
    assert moved.tolist() == [int(f % 3 != 0) for f in range(len(dims))]
    if dtype == torch.float32:
        grad = torch.randint(-8, 8, (inverse.shape[1], sum(dims)), device=DEVICE).float()
        want = torch.zeros_like(pooled).scatter_add_(0, rows, grad)
        for flags in (moved, None):
            got = ext.expand_rows_backward(grad, inverse, col_feature, pooled.shape[0], math.gcd(*dims) % 4 == 0, flags)
            assert torch.equal(got, want)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA kernels run on a GPU")
@pytest.mark.parametrize("where", ["padded", "past the bags", "negative", "none"])
def test_the_in_place_expansion_reports_as_the_gather(where):
    """In place, an inverse index outside its feature's bags is reported as the gather reports it
    (kind 4, feature, output row, bag, limit), and the output keeps the gather's bits."""
    from recom_rec.kernels import cuda_ext
    from recom_rec.ops.input_check import KernelReport

    dims = [4, 8, 4]
    pooled, inverse, col_feature, counts = _padded_case(9, dims, torch.float32)
    f, b = 2, 7  # (a fewer-bag feature)
    bag = {"padded": int(counts[f]), "past the bags": pooled.shape[0] + 3, "negative": -2, "none": None}[where]
    if bag is not None:
        inverse[f, b] = bag
    expected = cuda_ext.extension().expand_rows_forward(pooled, inverse, col_feature, False, None, None, None)
    report = KernelReport(DEVICE, "")
    out, _ = cuda_ext.extension().expand_rows_forward_in_place(pooled.clone(), inverse, col_feature, counts, True,
                                                               report.claim, report.words)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    want = (0,) * 6 if bag is None else (4, f, b, bag, int(counts[f]), -1)
    assert tuple(int(w) for w in report.words) == want
