"""The row ops a staging job moves rows with (csrc/ps/ps_stage.c on the CPU, ps_cuda.c and
the PTX kernels of ps_rows.cu on a GPU), called directly: store rows out of and into cache slots
of every weight dtype, with optimizer states, and never-seen rows by torchrec's uniform rule,
against torch. RECOM_TEST_DEVICE=cuda runs the CUDA ops."""
from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ebc_cases import DEVICE
from recom_rec import ps
from recom_rec.ps import host_lib, native
from recom_rec.ps.tier import _row_seed, _signed

_P, _I = ctypes.c_void_p, ctypes.c_int64
READ = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _I, _P)
INIT = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _P, _I)
FETCH = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, ctypes.c_int, _I, _P)
PUT_IDS = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _I, _P, ctypes.c_int)
SYNC = ctypes.CFUNCTYPE(ctypes.c_int, _P)
BUFFER = ctypes.CFUNCTYPE(_P, _P, ctypes.c_int, _I)


class Ops:
    """The device's row ops, each callable from Python."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.dev = native.DeviceOps(device, self.stream)
        o = self.dev.ops
        self.ctx = o.ctx
        self.read, self.write = READ(o.read_rows), READ(o.write_rows)
        self.init, self.fetch, self.put_ids = INIT(o.init_rows), FETCH(o.fetch_ids), PUT_IDS(o.put_ids)
        self.sync, self.buffer = SYNC(o.sync), BUFFER(o.host_buffer)

    def host_rows(self, which, k, width):
        address = self.buffer(self.ctx, which, k * width * 4)
        return np.ctypeslib.as_array((ctypes.c_float * (k * width)).from_address(address)).reshape(k, width)

    def check(self, rc):
        assert rc == 0, self.dev.error()

    def done(self):
        self.check(self.sync(self.ctx))


def layout(weight, states, init=None):
    L = native.RowLayout()
    L.weight, L.weight_dtype, L.weight_stride = weight.data_ptr(), native.DTYPES[weight.dtype], weight.stride(0)
    L.dim = weight.shape[1]
    L.n_states = len(states)
    for q, (s, value) in enumerate(states):
        L.state[q], L.state_width[q], L.state_init[q] = s.data_ptr(), (s.shape[1] if s.dim() == 2 else 1), value
    L.width = L.dim + sum(L.state_width[q] for q in range(len(states)))
    if init is not None:
        L.init_uniform, L.init_base, (L.init_a, L.init_b) = 1, init[0], init[1]
    return L


def as_ptr(a: np.ndarray) -> int:
    return host_lib.ptr(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("states", ["none", "rowwise", "adam"])
def test_rows_leave_and_enter_slots_exactly(dtype, states):
    ops = Ops(DEVICE)
    g = torch.Generator().manual_seed(3)
    rows, dim = 50, 12
    weight = torch.randn(rows, dim, generator=g).to(dtype).to(DEVICE)
    st = {"none": [], "rowwise": [(torch.rand(rows, generator=g), 0.5)],
          "adam": [(torch.randn(rows, dim, generator=g), 0.0), (torch.rand(rows, dim, generator=g), 0.0)]}[states]
    st = [(s.to(DEVICE), v) for s, v in st]
    L = layout(weight, st)
    slots = np.array([7, 0, 49, 13, 21], dtype=np.int64)
    out = ops.host_rows(0, slots.size, L.width)
    ops.check(ops.read(ops.ctx, ctypes.byref(L), as_ptr(slots), slots.size, out.ctypes.data))
    at = torch.from_numpy(slots).to(DEVICE)
    parts = [weight[at].float()] + [s[at].reshape(slots.size, -1).float() for s, _ in st]
    expected = torch.cat(parts, 1).cpu().numpy()
    assert np.array_equal(out, expected)
    # write them back shifted by one slot: values round-trip through float32 exactly
    src = ops.host_rows(1, slots.size, L.width)
    src[:] = expected
    targets = np.array([8, 1, 48, 14, 22], dtype=np.int64)
    before = weight.clone()
    ops.check(ops.write(ops.ctx, ctypes.byref(L), as_ptr(targets), targets.size, src.ctypes.data))
    ops.done()
    t = torch.from_numpy(targets).to(DEVICE)
    assert torch.equal(weight[t], before[at])
    for (s, _), part in zip(st, parts[1:]):
        assert torch.equal(s[t].reshape(slots.size, -1).float(), part)
    untouched = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    untouched[t] = False
    assert torch.equal(weight[untouched], before[untouched])


def test_float32_to_half_conversions_round_like_torch():
    lib = host_lib.lib()
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(2000, generator=g) * 10.0 ** torch.randint(-9, 6, (2000,), generator=g),
                        torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e9, -1e9, 2.0**-24, 2.0**-25,
                                      3 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25, float("inf"), -float("inf")])])
    for dtype, to, back in [(torch.float16, lib.ps_f32_to_f16, lib.ps_f16_to_f32),
                            (torch.bfloat16, lib.ps_f32_to_bf16, lib.ps_bf16_to_f32)]:
        bits = torch.tensor([to(float(v)) for v in values], dtype=torch.int32).to(torch.int16)
        expected = values.to(dtype)
        assert torch.equal(bits.view(dtype), expected)
        assert torch.equal(torch.tensor([back(int(b) & 0xFFFF) for b in bits]), expected.float())


@pytest.mark.parametrize("dim", [1, 7, 32, 100])
@pytest.mark.parametrize("bounds", [(-0.01, 0.01), (-3.5, 2.25)])
def test_never_seen_rows_match_init_rows(dim, bounds):
    a, b = bounds
    config = EmbeddingBagConfig(name="tbl", embedding_dim=dim, num_embeddings=10, feature_names=["f"],
                                init_fn=functools.partial(torch.nn.init.uniform_, a=a, b=b))
    g = torch.Generator().manual_seed(dim)
    ids = torch.cat([torch.tensor([0, 2**40 + 3, 2**62 + 11]), torch.randint(0, 2**40, (37,), generator=g)])
    slots = torch.randperm(60, generator=g)[:ids.numel()]
    weight = torch.full((60, dim), 7.0, device=DEVICE)
    state = torch.full((60,), 3.0, device=DEVICE)
    ops = Ops(DEVICE)
    L = layout(weight, [(state, 0.25)], init=(_signed(_row_seed("tbl", 3, 0)), bounds))
    s, i = slots.numpy().astype(np.int64), ids.numpy()
    ops.check(ops.init(ops.ctx, ctypes.byref(L), as_ptr(s), as_ptr(i), ids.numel()))
    ops.done()
    assert torch.equal(weight[slots.to(DEVICE)].cpu(), ps.init_rows(config, ids, seed=3))
    assert (state[slots.to(DEVICE)] == 0.25).all()
    untouched = torch.ones(60, dtype=torch.bool)
    untouched[slots] = False
    assert (weight.cpu()[untouched] == 7.0).all() and (state.cpu()[untouched] == 3.0).all()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_ids_travel_both_ways(dtype):
    ops = Ops(DEVICE)
    ids = torch.tensor([5, 0, 2**31 - 1, 77, 3], dtype=dtype, device=DEVICE)
    got = np.empty(5, dtype=np.int64)
    ops.check(ops.fetch(ops.ctx, ids.data_ptr(), ids.element_size(), 5, as_ptr(got)))
    assert got.tolist() == ids.tolist()
    out = torch.zeros(5, dtype=dtype, device=DEVICE)
    back = np.array([9, 8, 7, 6, 2**31 - 2], dtype=np.int64)
    ops.check(ops.put_ids(ops.ctx, as_ptr(back), 5, out.data_ptr(), out.element_size()))
    ops.done()
    assert out.tolist() == back.tolist()


def test_ptx_comes_from_the_cuda_source_and_assembles():
    native.ptx_text()  # raises when ps_rows.ptx was not regenerated after an edit of ps_rows.cu
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas is not installed (CI machines have it with nvcc)")
    for arch in ("sm_75", "sm_90"):
        done = subprocess.run([ptxas, f"-arch={arch}", str(native.PTX), "-o", "/dev/null"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
