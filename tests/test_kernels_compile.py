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


def test_all_kernel_variants_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "recom_rec.kernels.compile_check", "--arch", "90"],
                            env=env, capture_output=True, text=True, timeout=900)
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
    const int64_t*, const uint32_t*, const float*, PieceArgs, int64_t, int64_t, bool, {w}*, int64_t);
}}
'''


@pytest.mark.parametrize("weight,index", [("float", "int64_t"), ("__half", "int32_t"), ("__nv_bfloat16", "int64_t")])
def test_cuda_kernels_compile_for_sm90_without_spills(tmp_path, weight, index):
    """The CUDA C++ backend's kernels (csrc) build for the H100 with nvcc, every
    optimizer, every accumulator width (1, 4, 8 float4 a lane); the V=1 variants (dims <= 128, the common case) keep
    their accumulators in registers."""
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
            if v == 1:
                spills = re.findall(r"(\d+) bytes spill stores", result.stderr)
                assert spills and max(map(int, spills)) <= 16, result.stderr


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
