"""Every Triton kernel variant and the CUDA extension's sources compile for the H100 (sm_90),
checked without a GPU: the interpreter the rest of the CPU suite uses never runs Triton's
compiler, and the CUDA extension is only built on a GPU machine."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow


# ~3,000 Triton compiles on two cores from a cold cache. On 2026-12-02 a 2-core machine running
# ~1.7x slower than usual failed this test in a local CI run after about 1,700 s (the old limit);
# the check then passed alone on the cache that run had left. The limit is not what this tests.
@pytest.mark.timeout(3600)
def test_all_kernel_variants_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "recom_rec.kernels.compile_check", "--arch", "90"],
                            env=env, capture_output=True, text=True, timeout=3400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled" in result.stdout


_INSTANTIATE = r'''
#define RECOM_REC_KERNELS_ONLY
#include "{source}"
namespace {{
template __global__ void pooled_forward_kernel<{w}, {i}, {maxv}, {rows}>(const {w}*, const {i}*, const {i}*, const float*,
    const int64_t*, const int64_t*, float*, int64_t, int64_t, bool, int64_t, int64_t, InputCheck);
template __global__ void pooled_forward_kernel<{w}, {i}, 1, 4>(const {w}*, const {i}*, const {i}*, const float*,
    const int64_t*, const int64_t*, float*, int64_t, int64_t, bool, int64_t, int64_t, InputCheck);
template __global__ void pooled_forward_kernel<{w}, {i}, {maxv}, {rows}, true>(const {w}*, const {i}*, const {i}*,
    const float*, const int64_t*, const int64_t*, float*, int64_t, int64_t, bool, int64_t, int64_t, InputCheck);
template __global__ void piece_kernel<{w}, {i}, {opt}, {v}>(const {i}*, const int32_t*, Payload, const float*,
    PieceArgs, {w}*);
template __global__ void split_row_kernel<{w}, {i}, {opt}, {v}>(const {i}*, const int32_t*, Payload, PieceArgs,
    {w}*);
template __global__ void long_row_kernel<{w}, {i}, {opt}, {v}>(const {i}*, const int32_t*, Payload, PieceArgs,
    {w}*);
template __global__ void expand_kernel<{i}, {i}, true>(const {i}*, const {i}*, const float*, const int64_t*,
    const int64_t*, const int64_t*, {i}*, int64_t*, float*, int32_t*, int32_t*, float*, int64_t, int64_t, int,
    int64_t, int64_t, int64_t);
template __global__ void expand_kernel<{i}, {i}, false>(const {i}*, const {i}*, const float*, const int64_t*,
    const int64_t*, const int64_t*, {i}*, int64_t*, float*, int32_t*, int32_t*, float*, int64_t, int64_t, int,
    int64_t, int64_t, int64_t);
template __global__ void plan_kernel<{i}>(const {i}*, int64_t, int64_t*, int64_t*, int32_t*, uint32_t*,
    uint32_t*);
template __global__ void zero_untouched_kernel<{w}>({w}*, int64_t, const uint32_t*, const int64_t*, int);
template __global__ void singleton_kernel<{w}, {i}, {opt}, {v}>(const {i}*, const {i}*, const float*,
    const int64_t*, const uint32_t*, const float*, const int64_t*, PieceArgs, int64_t, int64_t, bool, {w}*, int64_t);
}}
'''


@pytest.mark.parametrize("weight,index", [("float", "int64_t"), ("__half", "int32_t"), ("__nv_bfloat16", "int64_t")])
def test_cuda_kernels_compile_for_sm90_without_spills(tmp_path, weight, index):
    """The CUDA C++ backend's kernels (csrc) build for the H100 with nvcc, every
    optimizer, every accumulator width (1, 4, 8 float4 a lane); the V=1 variants (dims <= 128, the common case) keep
    their accumulators in registers, and so does the piece kernel at V=8 (rows past 512 columns)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed (CI machines have it)")
    from recom_rec.native_build import LOOKUP_KERNELS, csrc_dir

    source = csrc_dir() / "lookup" / LOOKUP_KERNELS

    for opt in (-1, 0, 1, 2, 3):
        for v in (1, 4, 8):
            cu = tmp_path / f"k_{opt}_{v}.cu"
            maxv = {1: 1, 4: 2, 8: 4}[v]  # the forward's chunks a lane at the same widths
            cu.write_text(_INSTANTIATE.format(source=source, w=weight, i=index, opt=opt, v=v, maxv=maxv, rows=8))
            result = subprocess.run([nvcc, "-c", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90",
                                     "-Xptxas=-v", str(cu), "-o", str(tmp_path / "k.o")],
                                    capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, result.stderr
            spills = _spills_by_kernel(result.stderr)
            if v == 1:
                assert spills and max(spills.values()) <= 16, result.stderr
            if v == 8:
                # The piece kernel at eight float4 a lane sits at its 128-register bound with nothing
                # spilled; a row-access change that spilled it there (192 bytes) ran drawn layouts of
                # 543 and 960 columns 1.3-1.4x slower (perf-notes v71).
                pieces = {k: n for k, n in spills.items() if "piece_kernel" in k}
                assert pieces and max(pieces.values()) == 0, (weight, opt, pieces)


def _spills_by_kernel(ptxas_log: str) -> dict:
    """Spill-store bytes by kernel (mangled name) from ptxas -v's log."""
    spills, kernel = {}, None
    for line in ptxas_log.splitlines():
        entry = re.search(r"Compiling entry function '(\S+)'", line)
        if entry:
            kernel = entry.group(1)
        spilled = re.search(r"(\d+) bytes spill stores", line)
        if spilled and kernel is not None:
            spills[kernel] = int(spilled.group(1))
    return spills


# The CUDA libraries' types that torch's CUDA headers name: a CPU-only torch wheel and a bare nvcc
# lack their headers. Enough to compile the extension's host code, which is never linked here.
_CUDA_LIBRARY_STUBS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
}


def test_cuda_host_code_compiles_against_the_installed_torch(tmp_path):
    """The extension's host code (csrc/lookup/*.cu: argument checks, dispatch, launches, bindings)
    compiles with nvcc against the installed torch's headers, no GPU or CUDA build of torch needed:
    a build error shows here rather than in a GPU session's build. The device code goes to PTX
    only (its SASS and spills are the test above)."""
    import torch
    from recom_rec.native_build import LOOKUP_SOURCES, csrc_dir

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed (CI machines have it)")
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    cuda_include = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")
    stubs = tmp_path / "stubs"
    (stubs / "c10" / "cuda" / "impl").mkdir(parents=True)
    for name, text in _CUDA_LIBRARY_STUBS.items():  # only where the real header is missing
        if not os.path.exists(os.path.join(cuda_include, name)):
            (stubs / name).write_text("#pragma once\n" + text)
    if not os.path.exists(os.path.join(torch_include, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        (stubs / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")

    def compile_unit(name):
        return name, subprocess.run(
            [nvcc, "-c", "-std=c++17", "-gencode=arch=compute_90,code=compute_90", "-DTORCH_EXTENSION_NAME=_lookup_cuda",
             f"-I{stubs}", f"-I{torch_include}", f"-I{os.path.join(torch_include, 'torch', 'csrc', 'api', 'include')}",
             f"-I{sysconfig.get_paths()['include']}", str(csrc_dir() / "lookup" / name),
             "-o", str(tmp_path / f"{name}.o")], capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(compile_unit, LOOKUP_SOURCES))
    failed = {name: r.stderr[-3000:] for name, r in results if r.returncode != 0}
    assert not failed, failed


_DIVISION_CHECK = r'''
#define RECOM_REC_KERNELS_ONLY
#include "{source}"
#include <cstdio>
#include <random>
// Every payload o = feature * B + bag is in [0, 2^31): the piece kernels' multiply-and-shift must
// give o / B for each. Divisors: all up to 70000 (batch sizes), powers of two and their neighbours,
// random ones up to 2^31 - 1; numerators: the edges of each quotient and random ones.
int main() {{
  std::mt19937_64 rng(1);
  std::vector<uint32_t> ds;
  for (uint32_t d = 1; d <= 70000; ++d) ds.push_back(d);
  for (int b = 1; b < 31; ++b) for (int64_t e = -1; e <= 1; ++e) ds.push_back((uint32_t)((int64_t(1) << b) + e));
  for (int i = 0; i < 20000; ++i) ds.push_back(1 + (uint32_t)(rng() % 0x7fffffffu));
  ds.push_back(0x7fffffffu);
  int64_t checked = 0;
  for (uint32_t d : ds) {{
    const BatchDivisor div = batch_divisor(d);
    auto check = [&](int64_t n) {{
      if (n < 0 || n > 0x7fffffff) return true;
      ++checked;
      if (div.divide((uint32_t)n) == (uint32_t)(n / d)) return true;
      std::printf("wrong: %lld / %u gave %u\n", (long long)n, d, div.divide((uint32_t)n));
      return false;
    }};
    const int64_t top = 0x7fffffff;
    const int64_t k_top = top / d;
    for (int64_t k : {{int64_t(0), int64_t(1), int64_t(2), k_top / 2, k_top - 1, k_top, k_top + 1}})
      for (int64_t e = -1; e <= 1; ++e)
        if (!check(k * d + e)) return 1;
    for (int i = 0; i < 64; ++i)
      if (!check((int64_t)(rng() % (uint64_t(top) + 1)))) return 1;
    if (!check(top)) return 1;
  }}
  std::printf("ok %lld\n", (long long)checked);
  return 0;
}}
'''


def test_payload_division_by_the_batch_is_exact(tmp_path):
    """The piece kernels split a lookup's payload (feature * batch + bag) by a multiply and a shift
    (kernels.cuh: BatchDivisor); it gives the integer quotient for every payload and batch size,
    run on the host."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed (CI machines have it)")
    from recom_rec.native_build import LOOKUP_KERNELS, csrc_dir

    cu = tmp_path / "division.cu"
    cu.write_text(_DIVISION_CHECK.format(source=csrc_dir() / "lookup" / LOOKUP_KERNELS))
    exe = tmp_path / "division"
    built = subprocess.run([nvcc, "-O2", "-std=c++17", str(cu), "-o", str(exe)], capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.startswith("ok"), ran.stdout + ran.stderr
