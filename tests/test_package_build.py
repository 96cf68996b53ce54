"""The package installs like a torch extension package: a clean copy of the sources, installed with
pip, has the parameter-server library built at install time (and loads it, not a first-use build),
ships csrc/ for the row kernels' PTX, and skips the CUDA kernels cleanly where torch has no CUDA."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _clean_copy(dest: Path) -> Path:
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "*.egg-info", "build")
    dest.mkdir()
    shutil.copy(ROOT / "setup.py", dest)
    for folder in ("recom_rec", "csrc"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=skip)
    return dest


@pytest.mark.slow  # (~10-15 s of a 2-core machine: make test-slow; make test stays under 10 min)
def test_pip_install_builds_the_ps_library_and_the_package_loads_it(tmp_path):
    src, site = _clean_copy(tmp_path / "src"), tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-v",
         "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]
    package = site / "recom_rec"
    # Every module of the checkout is installed (a folder without __init__.py imports from a
    # checkout as a namespace package, but setuptools' find_packages leaves it out of an install).
    source_modules = {p.relative_to(ROOT) for p in (ROOT / "recom_rec").rglob("*.py")}
    installed_modules = {p.relative_to(site) for p in package.rglob("*.py")}
    assert source_modules <= installed_modules, sorted(map(str, source_modules - installed_modules))
    built = list((package / "ps").glob("_host*.so"))
    assert len(built) == 1, sorted(p.name for p in (package / "ps").iterdir())
    assert (package / "csrc" / "ps" / "ps_rows.ptx").is_file()
    cuda_built = list((package / "kernels").glob("_lookup_cuda*.so"))
    if torch.version.cuda is None:  # this CI: nvcc is installed, torch is a CPU build
        assert not cuda_built
        assert "torch is a CPU build: the CUDA lookup kernels are not built" in install.stdout + install.stderr

    # Run from elsewhere, so that the installed copy (not this checkout) is imported, with the
    # rest of PYTHONPATH kept (the GPU machine's torchrec and fbgemm are there); an empty cache: a
    # first-use build would have to compile, and say so.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *kept]), "RECOM_REC_CACHE": str(tmp_path / "cache")}
    probe = ("import recom_rec; from recom_rec.ps import host_lib, native; print(recom_rec.__file__); "
             "print(host_lib.where()); print(host_lib.lib().ps_pool_workers() >= 0); print(len(native.ptx_text()) > 0)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    module, where, works, ptx = run.stdout.split("\n")[:4]
    assert module == str(package / "__init__.py")
    assert where == f"{built[0]} (installed)"
    assert works == ptx == "True"
    assert "compiling" not in run.stderr, run.stderr
    assert not (tmp_path / "cache").exists()
