"""recom_rec's build: the Python package and its native code, compiled when the package is built or
installed (the sources and flags: recom_rec/native_build.py).

- recom_rec.ps._host: the parameter-server tier's C library (csrc/ps), on every machine; the
  package loads it with ctypes.
- recom_rec.kernels._lookup_cuda: the CUDA lookup kernels (csrc/lookup), where the installed torch
  is a CUDA build and nvcc is found. Install with ``pip install --no-build-isolation .`` so that
  the build sees that torch (an isolated build would fetch another one). The GPU architectures:
  TORCH_CUDA_ARCH_LIST, by default 9.0 (H100/H200); a few minutes of nvcc (ninja builds its units
  in parallel).

A machine where a library was not built compiles it on first use instead (slower to start, the
same code); csrc/ is shipped inside the package for that.
"""
import os
import runpy
import shutil
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
spec = runpy.run_path(str(ROOT / "recom_rec" / "native_build.py"))
CSRC = ROOT / "csrc"


def ps_extension() -> Extension:
    sha = spec["ps_sha256"](CSRC)
    return Extension(
        spec["PS_EXTENSION"],
        sources=[f"csrc/ps/{name}" for name in spec["PS_SOURCES"]],
        depends=[f"csrc/ps/{name}" for name in spec["PS_HEADERS"]],
        extra_compile_args=[*spec["PS_CFLAGS"], spec["hash_define"](sha)],
        extra_link_args=["-pthread"],
        libraries=spec["PS_LIBRARIES"],
    )


def cuda_extension():
    """The CUDA lookup kernels' extension, or None (with the reason printed) where they cannot be
    built: no torch in the build environment, a CPU-only torch, or no nvcc."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("recom_rec: torch is not importable in the build environment (use pip install "
              "--no-build-isolation): the CUDA lookup kernels are not built now (first use builds them)")
        return None
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        why = "torch is a CPU build" if torch.version.cuda is None else "nvcc (CUDA_HOME) is not found"
        print(f"recom_rec: {why}: the CUDA lookup kernels are not built (the Triton and torch backends run)")
        return None
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or spec["DEFAULT_CUDA_ARCHS"]
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # CUDAExtension reads it; unset, it would build for every arch
    sha = spec["lookup_sha256"](CSRC)
    defines = [spec["hash_define"](sha), f"-D{spec['TARGETS_MACRO']}={spec['targets_token'](archs)}"]
    print(f"recom_rec: building the CUDA lookup kernels for TORCH_CUDA_ARCH_LIST={archs} (a few minutes of nvcc)")
    return cpp_extension.CUDAExtension(
        spec["LOOKUP_EXTENSION"],
        sources=[f"csrc/lookup/{name}" for name in spec["LOOKUP_SOURCES"]],
        depends=[f"csrc/lookup/{name}" for name in spec["LOOKUP_HEADERS"]],
        extra_compile_args={"cxx": ["-O3", *defines], "nvcc": [*spec["LOOKUP_NVCC_FLAGS"], *defines]},
    )


class BuildPy(build_py):
    """Ships csrc/ inside the package (recom_rec/csrc): the row kernels' PTX is read at run time,
    and a library that was not built here is compiled from it on first use."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):  # an editable install reads csrc/ in place
            target = Path(self.build_lib) / "recom_rec" / "csrc"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(CSRC, target, ignore=shutil.ignore_patterns("*.o", "*.so"))


def build_ext_class(with_cuda: bool):
    if not with_cuda:
        return build_ext
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtensions(BuildExtension):
        """torch's BuildExtension for the CUDA kernels only: under ninja it compiles every source
        that is not CUDA as C++, so the C library is built first, by setuptools' own build_ext
        (before BuildExtension rewires the compiler)."""

        def build_extensions(self):
            everything = self.extensions
            try:
                self.extensions = [e for e in everything if e.name != spec["LOOKUP_EXTENSION"]]
                build_ext.build_extensions(self)
                self.extensions = [e for e in everything if e.name == spec["LOOKUP_EXTENSION"]]
                super().build_extensions()
            finally:
                self.extensions = everything

    return BuildExtensions.with_options(use_ninja=shutil.which("ninja") is not None)


cuda = cuda_extension()
setup(
    name="recom_rec",
    version="0.1.0",
    description="Fused, table-batched embedding layers for torchrec models (Triton/CUDA), "
    "with a parameter-server tier and a DistributedModelParallel plugin.",
    packages=find_packages(include=["recom_rec", "recom_rec.*"]),
    # the tuners' priors per GPU architecture (kernels/decision_prior.py), where one has been fitted
    package_data={"recom_rec.kernels": ["priors/*.json"]},
    ext_modules=[ps_extension()] + ([cuda] if cuda is not None else []),
    cmdclass={"build_ext": build_ext_class(cuda is not None), "build_py": BuildPy},
    python_requires=">=3.10",
    # torch, torchrec and fbgemm-gpu are deliberately not listed: their CUDA or CPU builds must
    # be chosen by the user (README: Install), and listing them would make pip pull CUDA wheels.
    install_requires=["numpy", "tqdm"],
    extras_require={"redis": ["redis>=4", "hiredis"], "plot": ["matplotlib"]},
    zip_safe=False,
)
