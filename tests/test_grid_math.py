"""The host's launch-grid arithmetic agrees with Triton's helpers it replaces."""
import triton

from recom_rec.kernels.grid_math import cdiv, next_power_of_2


def test_grid_math_matches_tritons_helpers():
    for n in list(range(1, 300)) + [1023, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 128, 1000):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)


def test_cdiv_of_a_symbolic_size_stays_symbolic():
    """A grid over a dynamic batch (torch.export, torch.compile with dynamic shapes) must not be
    specialised to the example's batch."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(lambda x: x.new_zeros(cdiv(x.shape[0], 8)), tracing_mode="symbolic")(torch.zeros(16))
    assert traced(torch.zeros(17)).shape == (3,)
