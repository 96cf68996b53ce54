"""The backward's padded gradient copy: the CUDA extension's pad_gradient_columns against torch's
index_copy_ (what ops/gradient_layout.py ran before v60), same output, device time and GB/s, on the
gradients of drawn layouts (perf-notes v60 section 5). GPU only.

    python3 tools/padded_copy_bench.py [--layouts 1517231538:2 456743741:0]
"""
import argparse

import torch

from recom_rec.bench.random_layouts import random_workloads
from recom_rec.kernels import cuda_ext
from recom_rec.ops.gradient_layout import _padded_columns, padded_width
from recom_rec.ops.layout import META_DIM, META_OUT_COL, META_WIDTH


def _ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=["1517231538:2", "456743741:0"], metavar="SEED:INDEX")
    args = p.parse_args()
    ext = cuda_ext.extension()
    for spec in args.layouts:
        seed, index = (int(x) for x in spec.split(":"))
        w = random_workloads(seed, index + 1, False)[index]
        dims = [t.embedding_dim for t in w.tables() for _ in t.feature_names]
        meta = torch.zeros(len(dims), META_WIDTH, dtype=torch.int64)
        meta[:, META_DIM] = torch.tensor(dims)
        meta[:, META_OUT_COL] = torch.tensor([sum(dims[:i]) for i in range(len(dims))])
        width = sum(dims)
        _, columns = _padded_columns(meta, width)
        columns = columns.cuda()
        grad = torch.randn(w.batch_size, width, device="cuda")
        theirs = grad.new_empty(w.batch_size, padded_width(width, len(dims)))
        ours = torch.empty_like(theirs)
        runs = {"index_copy_": lambda: theirs.index_copy_(1, columns, grad),
                "pad_gradient_columns": lambda: ext.pad_gradient_columns(grad, columns, ours)}
        for fn in runs.values():
            fn()
        same = torch.equal(theirs[:, columns], ours[:, columns])
        ms = {name: min(_ms(fn) for _ in range(2)) for name, fn in runs.items()}  # (each timed twice, the faster kept)
        gb = grad.numel() * grad.element_size() * 2 / 1e9
        print(f"{w.name} of {seed}: [{w.batch_size:,} x {width}] -> {theirs.shape[1]} columns, same {same}: " + ", ".join(
            f"{name} {t * 1e3:.1f} us ({gb / (t / 1e3):.0f} GB/s)" for name, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
