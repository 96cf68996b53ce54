"""Variants of the CUDA backward's piece kernel, compared on the same synthetic layouts in one
run (GPU), each checked first (one update against its exact value, tools/backward_kernel_bench.cu).

    python tools/backward_kernel_variants.py --out $OUT/bwd [--variants product old ...] [--old-source F]

Each variant is csrc/lookup/kernels.cuh with a textual change (launch bounds, where the row's
weights are read, which groups share their sources) or as it was at a git revision, compiled
into tools/backward_kernel_bench.cu by nvcc (seconds, no torch), then run on the sweep's training
layouts that fbgemm wins (docs/perf-notes.md v18). Prints the plan's and the update's ms, the
update's share of the copy ceiling, the piece kernel's registers and blocks an SM.
"""
import argparse

from kernel_variants import ROOT, SOURCE, compare, source_at

BENCH = ROOT / "tools" / "backward_kernel_bench.cu"

# T ROWS DIM BATCH IDS ZIPF OPT (0 SGD, 2 row-wise Adagrad)
SHAPES = [
    (16, 100000, 4, 4096, 200, 0, 0), (16, 100000, 16, 4096, 50, 0, 0), (16, 100000, 32, 4096, 200, 0, 0),
    (16, 100000, 64, 4096, 200, 0, 0), (16, 100000, 64, 4096, 50, 0, 0), (16, 100000, 128, 4096, 200, 0, 0),
    (16, 100000, 256, 4096, 200, 0, 0), (16, 100000, 256, 4096, 50, 1, 0), (16, 100000, 256, 4096, 10, 0, 2),
    (16, 100000, 512, 4096, 10, 0, 2), (16, 61035, 1024, 4096, 10, 0, 2), (500, 31250, 64, 3200, 10, 0, 0),
    (4000, 3906, 64, 400, 10, 0, 2), (16, 100000, 64, 4096, 1, 0, 0),
]


def _replace(old, new):
    def change(text):
        if old not in text:
            raise SystemExit(f"variant: {old!r} is not in the source")
        return text.replace(old, new)
    return change


# name: source change
VARIANTS = {
    "product": lambda t: t,
    "old": None,  # --old-source, or the source at --old-revision (default: before v18's piece kernel)
    "share-all-groups": _replace("G >= 2 * U", "G >= U"),  # groups of 4 lanes share their sources too
    "late-weights-v4": _replace("LATE_WEIGHTS = V >= 8", "LATE_WEIGHTS = V >= 4"),  # no spill at V = 4
    "v4-3blocks": lambda t: _replace("LATE_WEIGHTS = V >= 8", "LATE_WEIGHTS = V >= 4")(
        _replace("V >= 8 ? 2 : V == 1 ? 4 : 0", "V >= 8 ? 2 : V == 1 ? 4 : 3")(t)),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/bwd")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--old-revision", default="8d1ad2a", help="git revision of the 'old' variant's source")
    p.add_argument("--old-source", help="the 'old' variant's source file (where the git history is not at hand, "
                                        "as on the device machine: write it with git show and carry it)")
    args = p.parse_args()
    text = SOURCE.read_text()

    def old():
        return open(args.old_source).read() if args.old_source else source_at(args.old_revision)

    chosen = {name: (old() if name == "old" else VARIANTS[name](text), []) for name in args.variants}
    compare(chosen, BENCH, args.out, "piece_kernel", SHAPES, args.iters)


if __name__ == "__main__":
    main()
