"""The parameter-server tier's initial rows written on the GPU: torchrec's default uniform init,
exactly as ``recom_rec.ps.tier.init_rows`` computes it, straight into the rows' cache slots.

Why: most misses of a fresh table are ids never seen, whose rows would otherwise be computed on the
host (64 hashes per 32-wide row) and copied over; here one launch writes them.

Bits: h = splitmix(splitmix(id * M2 + base) + col * GOLDEN) in uint64, u = (h >> 11) * 2^-53,
value = float32(a + (b - a) * u) in float64 without fused multiply-add (the launch turns fusion
off), the same bits as the torch and C versions (tested against ``init_rows``).
"""
import torch
import triton
import triton.language as tl

_M1 = tl.constexpr(0xBF58476D1CE4E5B9)  # uint64 constants (above int64's range)
_M2 = tl.constexpr(0x94D049BB133111EB)
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_BOUNDS = {}


@triton.jit
def _splitmix(x):
    x = (x ^ (x >> 30)) * _M1
    x = (x ^ (x >> 27)) * _M2
    return x ^ (x >> 31)


@triton.jit
def _init_uniform_rows(ids_ptr, slots_ptr, n, out_ptr, row_stride, base, bounds_ptr, DIM: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n
    ids = tl.load(ids_ptr + rows, mask=live, other=0).to(tl.uint64, bitcast=True)
    slots = tl.load(slots_ptr + rows, mask=live, other=0)
    a = tl.load(bounds_ptr)
    span = tl.load(bounds_ptr + 1)
    h1 = _splitmix(ids * _M2 + base.to(tl.uint64, bitcast=True))
    c = tl.arange(0, BLOCK_D)
    h = _splitmix(h1[:, None] + c[None, :].to(tl.uint64) * _GOLDEN)
    u = (h >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)
    value = (a + span * u).to(tl.float32)
    tl.store(out_ptr + slots[:, None] * row_stride + c[None, :], value, mask=live[:, None] & (c[None, :] < DIM))


def init_uniform_rows(out: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, base: int, a: float,
                      b: float) -> None:
    """``out[slots[k], :]`` (float32, rows contiguous) = the init of ``ids[k]``."""
    n = ids.numel()
    if n == 0:
        return
    dim = out.shape[1]
    key = (out.device, a, b)
    bounds = _BOUNDS.get(key)
    if bounds is None:  # kept per device and bounds: a copy to the device is a host sync's worth of time
        bounds = _BOUNDS[key] = torch.tensor([a, b - a], dtype=torch.float64).to(out.device)
    block_d = triton.next_power_of_2(dim)
    block_n = max(1, 2048 // block_d)
    grid = (triton.cdiv(n, block_n),)
    kwargs = {} if out.device.type == "cpu" else {"enable_fp_fusion": False}
    _init_uniform_rows[grid](ids, slots, n, out, out.stride(0), base, bounds, DIM=dim, BLOCK_N=block_n,
                             BLOCK_D=block_d, **kwargs)
