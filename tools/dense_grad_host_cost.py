"""CPU investigation (not a benchmark): the host cost of a dense-gradient training step.

A many-1000-shaped module (tables x D=16, 4 ids a bag; few rows and a small batch) runs forward +
backward + `p.grad = None` on the CPU with the torch backend. The host side is the same Python and
autograd code on the CPU as on a GPU, so step time minus the kernels' time (the torch backend's
bodies called directly) is the per-step host cost a GPU run pays. With --null-kernels the torch
backend's forward and backward are replaced, for this measurement only, by an empty output and a
zero gradient of the right shapes: the step is then all host cost (less noise than a difference). Times are this thread's CPU time (one intra-op thread), the minimum and median of many
steps: the machine is shared, CPU time is what other processes disturb least.
Also measured: the autograd floor of one leaf per table (a Function with N Parameter inputs whose
backward returns N ready views: the engine's N AccumulateGrads).
Usage: PYTHONPATH=. python tools/dense_grad_host_cost.py [--tables 1000] [--steps 200] [--profile]
"""
import argparse
import cProfile
import pstats
import time

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recom_rec
from recom_rec.ops import torch_backend


def cpu_us(fn, steps: int):
    """(min, median) thread CPU time of fn in microseconds."""
    times = []
    for _ in range(steps):
        t0 = time.thread_time_ns()
        fn()
        times.append((time.thread_time_ns() - t0) / 1e3)
    times.sort()
    return times[0], times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=1000)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ids", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions of 20 steps")
    p.add_argument("--null-kernels", action="store_true",
                   help="replace the torch backend's forward/backward by outputs of the right shape")
    a = p.parse_args()
    if a.null_kernels:
        torch_backend.forward = lambda flat, values, offsets, psw, meta, keys, batch, total_dim: \
            flat.new_zeros((batch, total_dim), dtype=torch.float32)
        torch_backend.backward = lambda grad_output, values, offsets, psw, meta, keys, batch, numel, dtype: \
            grad_output.new_zeros((numel,), dtype=dtype)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = a.tables
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=a.dim, num_embeddings=a.rows, feature_names=[f"f{i}"])
               for i in range(n)]
    module = recom_rec.EmbeddingBagCollection(configs, backend="torch", validate_inputs=False)
    params = list(module.parameters())  # held, as a user's optimizer holds them
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(n)], values=torch.randint(0, a.rows, (n * a.batch * a.ids,)),
        lengths=torch.full((n * a.batch,), a.ids))
    grad = torch.randn(a.batch, n * a.dim)

    def step():
        module(kjt).values().backward(grad)
        for w in params:
            w.grad = None

    group = module._groups[0]
    flat, meta = module._flat(group), getattr(module, group.meta_name)
    key_index = torch.arange(n)

    def kernels():
        torch_backend.forward(flat, kjt.values(), kjt.offsets(), None, meta, key_index, a.batch, group.total_dim)
        torch_backend.backward(grad, kjt.values(), kjt.offsets(), None, meta, key_index, a.batch, group.total_numel,
                               flat.dtype)

    leaves = [torch.nn.Parameter(t) for t in torch.zeros(n * a.rows * a.dim).view(-1, a.dim).split(a.rows)]
    ready = torch.zeros(n * a.rows * a.dim)
    x = torch.zeros(1)

    class NLeaves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *ws):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return (None,) + ready.view(-1, a.dim).split(a.rows)

    class NoGrads(NLeaves):
        @staticmethod
        def backward(ctx, g):
            return (None,) * (1 + n)

    c_apply = super(torch.autograd.Function, NLeaves).apply  # as the lookup calls it
    c_apply_none = super(torch.autograd.Function, NoGrads).apply

    def floor():  # one leaf per table: the Function's N inputs, N AccumulateGrads, N `.grad = None`
        c_apply(x, *leaves).sum().backward()
        for w in leaves:
            w.grad = None

    def floor_none():  # the same graph, no gradient returned: no AccumulateGrad runs
        c_apply_none(x, *leaves).sum().backward()

    flat_leaf = torch.zeros(n * a.rows * a.dim, requires_grad=True)
    one = torch.zeros(1, requires_grad=True)

    def one_leaf():  # the rejected design: one flat leaf, its gradient's views assigned in Python
        (x + one).sum().backward()
        for w, g in zip(leaves, ready.view(-1, a.dim).split(a.rows)):
            w.grad = g
        for w in leaves:
            w.grad = None

    for fn in (step, kernels, floor, floor_none, one_leaf):
        fn()
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    results = {name: cpu_us(fn, a.steps) for name, fn in
               (("step", step), ("kernels", kernels), ("floor", floor), ("floor_none", floor_none),
                ("one_leaf", one_leaf))}
    s, k = results["step"], results["kernels"]
    print(f"{n} tables, D={a.dim}, B={a.batch}, {a.ids} ids, thread CPU us (min / median):")
    print(f"  forward+backward+grad=None step {s[0]:9.0f} / {s[1]:9.0f}")
    print(f"  kernels alone (torch backend)   {k[0]:9.0f} / {k[1]:9.0f}")
    print(f"  host cost (step - kernels)      {s[0] - k[0]:9.0f} / {s[1] - k[1]:9.0f}"
          f"   = {(s[0] - k[0]) / n:.2f} / {(s[1] - k[1]) / n:.2f} us a table")
    f, f0, o = results["floor"], results["floor_none"], results["one_leaf"]
    print(f"  floor of one leaf per table: N-input Function + N AccumulateGrads + grad=None "
          f"{f[0]:7.0f} / {f[1]:7.0f} = {f[0] / n:.2f} / {f[1] / n:.2f} us a table")
    print(f"    of which the N-input Function and its graph, no gradient returned "
          f"{f0[0]:7.0f} / {f0[1]:7.0f} = {f0[0] / n:.2f} / {f0[1] / n:.2f} us a table")
    print(f"  one flat leaf, N `.grad` views set in Python (rejected design) "
          f"{o[0]:7.0f} / {o[1]:7.0f} = {o[0] / n:.2f} / {o[1] / n:.2f} us a table")

if __name__ == "__main__":
    main()
