"""Variants of the CUDA forward kernel, compared on the same synthetic shapes in one run (GPU).

    python tools/forward_kernel_variants.py --out $OUT/fwd [--variants product all-paths ...]

Each variant is csrc/lookup/kernels.cuh with a textual change (launch bounds) and
nvcc defines (rows in flight; one kernel with every path, as before v17), compiled into tools/forward_kernel_bench.cu by nvcc (seconds, no torch), then run on the
sweep's bandwidth-bound layouts. Prints ms, share of the copy ceiling, registers and blocks per SM.
"""
import argparse
import pathlib

from kernel_variants import ROOT, SOURCE, compare, source_at

BENCH = ROOT / "tools" / "forward_kernel_bench.cu"

# T ROWS DIM BATCH IDS ZIPF BAG_MAJOR: the sweep's forward points under 85% of the copy ceiling
SHAPES = [
    (4000, 3906, 64, 400, 10, 0, 1), (4000, 3906, 64, 400, 10, 0, 0),
    (500, 31250, 64, 3200, 10, 0, 1), (500, 31250, 64, 3200, 10, 0, 0),
    (16, 100000, 64, 4096, 10, 1, 0), (16, 100000, 64, 4096, 10, 1, 1),
    (16, 100000, 256, 4096, 50, 1, 1),
    (16, 100000, 64, 65536, 10, 0, 1), (16, 100000, 64, 4096, 10, 0, 1),
    (16, 100000, 128, 4096, 10, 0, 1), (16, 100000, 512, 4096, 1, 0, 0),
    (16, 100000, 512, 4096, 10, 0, 1), (16, 61035, 1024, 4096, 10, 0, 1),
    (16, 100000, 32, 4096, 50, 0, 1), (16, 100000, 16, 4096, 50, 0, 1),
    (26, 1000000, 128, 65536, 1, 0, 0),
]
# Narrow rows (2-8 lanes a bag) and their neighbours: v23 tried loading a group's ids together there.
NARROW_SHAPES = [
    (16, 100000, 4, 4096, 200, 0, 1), (16, 100000, 4, 4096, 200, 0, 0),
    (16, 100000, 8, 4096, 200, 0, 1), (16, 100000, 8, 4096, 200, 0, 0),
    (16, 100000, 8, 4096, 50, 0, 0), (16, 100000, 8, 4096, 10, 0, 1), (16, 100000, 8, 4096, 1, 0, 0),
    (16, 100000, 16, 4096, 50, 0, 1), (16, 100000, 16, 4096, 200, 0, 1), (16, 100000, 16, 4096, 1, 0, 0),
    (16, 100000, 16, 4096, 10, 1, 1),
    (16, 100000, 32, 4096, 10, 0, 0), (16, 100000, 32, 4096, 50, 0, 1), (16, 100000, 32, 4096, 200, 0, 1),
    (16, 100000, 64, 4096, 10, 0, 1), (16, 100000, 64, 4096, 50, 0, 1),
    (1000, 50000, 16, 512, 4, 0, 1), (500, 100000, 32, 2048, 10, 0, 1),
]



def _bounds(text, blocks):
    """The forward kernel's launch bounds: minimum blocks an SM (an expression of MAXV, ROWS, I)."""
    end = text.index(" pooled_forward_kernel(")
    start = text.rindex("__launch_bounds__(256", 0, end)
    return text[:start] + f"__launch_bounds__(256, {blocks})" + text[end:]


def _replace_all(pairs):
    """Textual replacements, each of which must be in the source."""
    def change(text):
        for old, new in pairs:
            if old not in text:
                raise SystemExit(f"variant: {old!r} is not in the source")
            text = text.replace(old, new)
        return text
    return change


# The rounds kernel's passes of rows past 256 columns (kernels.cuh), in every launch
_WIDE_PASSES = [("pool_vec<W, I, 4, ROUNDS ? 3 : 2, false>", "pool_vec<W, I, 4, 4, false>"),
                ("pool_vec<W, I, 2, ROUNDS && MAXV >= 4 ? 8 : 4, false>",
                 "pool_vec<W, I, 2, MAXV >= 4 ? 8 : 4, false>"),
                ("pool_realigned<W, I, MAXV == 1 ? 4 : ROUNDS && MAXV >= 4 ? 8 : 2>",
                 "pool_realigned<W, I, MAXV == 1 ? 4 : MAXV >= 4 ? 8 : 2>")]
_TWO_BLOCKS = [("__launch_bounds__(256, ROUNDS ? 2 :", "__launch_bounds__(256, ROUNDS || MAXV >= 4 ? 2 :")]


# name: (source change, nvcc defines)
VARIANTS = {
    "product": (lambda t: t, []),  # 8 rows in flight a lane
    "product-4rows": (lambda t: t, ["-DFORWARD_ROWS=4"]),  # 4 rows at dims <= 128 (the tuner's other launch)
    "no-report": (lambda t: t, ["-DFORWARD_NO_REPORT"]),  # ids clamped, the report off (validate_inputs=False)
    "all-paths-2blocks": (lambda t: _bounds(t, 2), ["-DFORWARD_MAXV=4"]),  # the kernel before v17
    "all-paths": (lambda t: _bounds(t, 4), ["-DFORWARD_MAXV=4"]),
    # v59: rows wider than 256 columns (MAXV = 4) in every launch at the rounds kernel's deeper
    # passes (4 rows of 4 chunks here, 8 of 2), in 64 registers (it spilled 1.7 KB) or at two blocks
    # an SM (small batches 12-31% faster, an odd dim at B = 4,096 30% slower: so only the rounds
    # kernel takes them, at 3 rows of 4 chunks), and the odd rows' realigned passes at 8 rows
    "wide-rows2x": (_replace_all(_WIDE_PASSES[:2]), []),
    "wide-rows2x-2blocks": (_replace_all(_WIDE_PASSES[:2] + _TWO_BLOCKS), []),
    "wide-rows2x-odd8-2blocks": (_replace_all(_WIDE_PASSES + _TWO_BLOCKS), []),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/fwd")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--old", default="", help="also these kernels ('old', 'old-4rows'): a git revision, or a file "
                   "holding them (the device machine's copy of the tree has no git history)")
    p.add_argument("--narrow", action="store_true", help="the narrow-row shapes instead of the default ones")
    p.add_argument("--extra", nargs="*", default=[], metavar="NAME=FILE",
                   help="more variants: kernel sources in files (a change tried without editing this script)")
    p.add_argument("--shape", action="append", default=[], metavar="T,ROWS,DIM,BATCH,IDS,ZIPF,BAG_MAJOR",
                   help="these shapes instead of a list above (repeat the option for more)")
    args = p.parse_args()
    text = SOURCE.read_text()
    chosen = {name: (VARIANTS[name][0](text), VARIANTS[name][1]) for name in args.variants}
    if args.old:
        old = pathlib.Path(args.old).read_text() if pathlib.Path(args.old).is_file() else source_at(args.old)
        chosen = {"old": (old, []), "old-4rows": (old, ["-DFORWARD_ROWS=4"]), **chosen}
    for item in args.extra:  # each with its 4-rows launch too
        name, _, path = item.partition("=")
        chosen[name] = (pathlib.Path(path).read_text(), [])
        chosen[f"{name}-4rows"] = (chosen[name][0], ["-DFORWARD_ROWS=4"])
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] or (NARROW_SHAPES if args.narrow else SHAPES)
    compare(chosen, BENCH, args.out, "pooled_forward_kernel", shapes, args.iters)


if __name__ == "__main__":
    main()
