"""Every Triton kernel variant compiles for the H100 (sm_90), checked without a GPU: the
interpreter the rest of the CPU suite uses never runs Triton's compiler."""
import os
import re
import shutil
import subprocess
import sys

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
template __global__ void plan_kernel<{i}>(const {i}*, int64_t, int64_t*, int64_t*, int32_t*, uint32_t*);
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
