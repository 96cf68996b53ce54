"""The kernel benches of tools/ (the CUDA forward and backward kernels built without torch, for
comparing source variants on a GPU) compile against the current kernels: a kernel whose
signature or launch shape changes must take its bench along."""
import pathlib
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bench", ["forward_kernel_bench.cu", "backward_kernel_bench.cu"])
def test_kernel_bench_compiles_for_sm90(tmp_path, bench):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed (CI machines have it)")
    source = ROOT / "csrc" / "lookup" / "kernels.cuh"
    result = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90",
                             f'-DKERNEL_SOURCE="{source}"', str(ROOT / "tools" / bench), "-o", str(tmp_path / "bench")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "bench").stat().st_size > 0
