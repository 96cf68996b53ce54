"""Shared by tools/forward_kernel_variants.py and tools/backward_kernel_variants.py: source variants
of csrc/lookup/kernels.cuh compiled by nvcc into a bench (no torch: seconds, not a ~5 min
extension build), their registers and spills from ptxas, and runs of every variant on every shape
in A B B A order, so a drift of the machine shows instead of passing for a difference."""
import concurrent.futures
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "lookup" / "kernels.cuh"


def source_at(revision: str) -> str:
    """The kernels as they were at a git revision (a variant "as it was"): kernels.cuh, or before
    the split into translation units the one pooled_cuda.cu (included the same way)."""
    for path in ("csrc/lookup/kernels.cuh", "csrc/lookup/pooled_cuda.cu"):
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{path}"], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout
    raise SystemExit(f"no kernel source at {revision}: {r.stderr.strip()}")


def build(name, text, defines, bench, out, kernel_pattern):
    """Compiles `bench` with `text` as its kernel source; returns (name, executable, [(kernel,
    registers, spill store bytes)]) for the kernels whose mangled names match `kernel_pattern`."""
    src = out / f"pooled_{name}.cu"
    src.write_text(text)
    exe = out / f"{bench.stem}_{name}"
    # -I: the variant, written under `out`, still includes its neighbours (input_check.cuh, since v56)
    r = subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-Xptxas=-v",
                        f"-I{SOURCE.parent}", f'-DKERNEL_SOURCE="{src}"', *defines, str(bench), "-o", str(exe)],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name}: nvcc failed\n{r.stderr[-3000:]}")
    kernels, current, spill = [], None, 0
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '\S*?(%s)I(\w*?)EE\w*'" % kernel_pattern, line)
        current = f"{m.group(1)}<{m.group(2)}>" if m else current  # the template arguments, mangled
        m = re.search(r"(\d+) bytes spill stores", line)
        spill = int(m.group(1)) if m else spill
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            kernels.append((current, int(m.group(1)), spill))
            current = None
    return name, exe, kernels


# Nsight Compute's counters for where a kernel's time goes: instructions and how often a warp
# issues, occupancy, L1's wavefronts and its global requests and sectors (a 4-byte access of a warp
# whose lanes sit 16 bytes apart touches four lines, as one 16-byte access does), L2's sectors and
# DRAM's bytes each way.
NCU_METRICS = [
    "gpu__time_duration.sum", "smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "l1tex__data_pipe_lsu_wavefronts.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "lts__t_sectors_op_read.sum", "lts__t_sectors_op_write.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
]


def compare(variants, bench, out, kernel_pattern, shapes, iters, ncu=False):
    """Builds every variant (name: (source text, nvcc defines)) in parallel, prints their kernels'
    registers, then runs each shape on every variant, A B B A; with `ncu`, one launch of each
    variant's kernel a shape under Nsight Compute instead (NCU_METRICS), after two unprofiled."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        built = list(pool.map(lambda item: build(item[0], *item[1], bench, out, kernel_pattern), variants.items()))
    for name, _, kernels in built:
        print(f"{name}: (kernel, registers, spill stores) {kernels}", flush=True)
    if ncu:
        if shutil.which("ncu") is None:
            raise SystemExit("--ncu: no ncu (Nsight Compute) on PATH")
        for shape in shapes:
            for name, exe, _ in built:
                r = subprocess.run(["ncu", "--kernel-name", f"regex:{kernel_pattern}", "--launch-skip", "2",
                                    "--launch-count", "1", "--csv", "--metrics", ",".join(NCU_METRICS),
                                    str(exe), *map(str, shape), "3"], capture_output=True, text=True)
                values = [line.split('","') for line in r.stdout.splitlines() if line.startswith('"')]
                got = {v[-3]: v[-1].rstrip('"') for v in values[1:] if len(v) > 3}  # metric -> value
                print(f"{name:18s} {shape}: " + (", ".join(f"{m} {got[m]}" for m in NCU_METRICS if m in got)
                                                 or (r.stderr or r.stdout).strip()[-600:]), flush=True)
        return
    for shape in shapes:
        for name, exe, _ in built + built[::-1]:
            r = subprocess.run([str(exe), *map(str, shape), str(iters)], capture_output=True, text=True)
            print(f"{name:18s} {(r.stdout or r.stderr).strip()}", flush=True)
