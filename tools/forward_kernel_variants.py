"""Variants of the CUDA forward kernel, compared on the same synthetic shapes in one run (GPU).

    python tools/forward_kernel_variants.py --out $OUT/fwd [--variants product all-paths ...]

Each variant is csrc/lookup/pooled_cuda.cu with a textual change (launch bounds) and
nvcc defines (rows in flight; one kernel with every path, as before v17), compiled into tools/forward_kernel_bench.cu by nvcc (seconds, no torch), then run on the
sweep's bandwidth-bound layouts. Prints ms, share of the copy ceiling, registers and blocks per SM.
"""
import argparse
import concurrent.futures
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "lookup" / "pooled_cuda.cu"
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



def _bounds(text, blocks):
    """The forward kernel's launch bounds: minimum blocks an SM (an expression of MAXV, ROWS, I)."""
    end = text.index(" pooled_forward_kernel(")
    start = text.rindex("__launch_bounds__(256", 0, end)
    return text[:start] + f"__launch_bounds__(256, {blocks})" + text[end:]


# name: (source change, nvcc defines)
VARIANTS = {
    "product": (lambda t: t, []),  # 8 rows in flight a lane
    "product-4rows": (lambda t: t, ["-DFORWARD_ROWS=4"]),  # 4 rows at dims <= 128 (the tuner's other launch)
    "all-paths-2blocks": (lambda t: _bounds(t, 2), ["-DFORWARD_MAXV=4"]),  # the kernel before v17
    "all-paths": (lambda t: _bounds(t, 4), ["-DFORWARD_MAXV=4"]),
}


def build(name, out):
    src = out / f"pooled_{name}.cu"
    change, defines = VARIANTS[name]
    src.write_text(change(SOURCE.read_text()))
    exe = out / f"fwd_{name}"
    r = subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-Xptxas=-v",
                        f'-DKERNEL_SOURCE="{src}"', *defines, str(BENCH), "-o", str(exe)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name}: nvcc failed\n{r.stderr[-3000:]}")
    fw, current = [], None  # (instance, registers, spill stores) of each forward kernel
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S*pooled_forward_kernel\S*)'", line)
        current = m.group(1)[-40:] if m else current
        m = re.search(r"(\d+) bytes spill stores", line)
        spill = int(m.group(1)) if m else spill if current else 0
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            fw.append((current, int(m.group(1)), spill))
            current = None
    return name, exe, fw


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/fwd")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        built = list(pool.map(lambda n: build(n, out), args.variants))
    for name, _, fw in built:
        print(f"{name}: spill stores / registers {fw}", flush=True)
    for shape in SHAPES:  # variants of one shape back to back, twice (A B B A), so drift shows
        order = [b for b in built] + [b for b in reversed(built)]
        for name, exe, _ in order:
            r = subprocess.run([str(exe), *map(str, shape), str(args.iters)], capture_output=True, text=True)
            print(f"{name:16s} {(r.stdout or r.stderr).strip()}", flush=True)


if __name__ == "__main__":
    main()
