"""The CUDA lookup kernels' extension (csrc/lookup), loaded once per process: the build made when
the package was installed (``recom_rec.kernels._lookup_cuda``, setup.py), else a just-in-time
build with nvcc, cached under ``~/.cache/recom_rec/cuda`` (``RECOM_REC_CACHE``) per source, torch
version and GPU architecture. The fallback runs when the install made no CUDA build (a CPU torch or
no nvcc then), made it for other GPUs, or the sources changed since (a checkout).
:func:`build_error` says in one line why the kernels cannot be used here, if they cannot.

    python -m recom_rec.kernels.cuda_ext    # where the kernels load from here, or the full reason
"""
import hashlib
import importlib
import importlib.util
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

import torch

from .. import native_build as spec

_lock = threading.Lock()


def _gpu_arch() -> Tuple[int, int]:
    if not torch.cuda.is_available():
        raise RuntimeError(f"the CUDA kernels need a CUDA build of torch and a GPU (torch {torch.__version__}"
                           f"{'' if torch.version.cuda else ', a CPU build'})")
    return torch.cuda.get_device_capability()


def _installed(arch: Tuple[int, int]):
    """(module, None) for a usable install-time build, else (None, why not)."""
    try:
        module = importlib.import_module(spec.LOOKUP_EXTENSION)
    except ModuleNotFoundError:
        return None, "no build was made at install time"
    except ImportError as e:  # built against another torch, a missing CUDA runtime, ...
        return None, f"the installed build does not load ({str(e).splitlines()[0][:200]})"
    if not spec.covers(module.cuda_targets, arch):
        return None, f"the installed build is for other GPUs ({module.cuda_targets}, not sm_{arch[0]}{arch[1]})"
    csrc = spec.csrc_dir()
    if csrc is not None and module.sources_sha256 != spec.lookup_sha256(csrc):
        return None, ("csrc/lookup changed since the package was built "
                      "(pip install --no-build-isolation -e . builds it ahead)")
    return module, None


def _gencode(arch: Tuple[int, int]):
    return f"-gencode=arch=compute_{arch[0]}{arch[1]},code=sm_{arch[0]}{arch[1]}"


def jit_cache_dir(arch: Tuple[int, int], sha: str) -> Path:
    """The fallback's build folder for these sources, torch version and GPU architecture: a new
    source or torch gives a new folder, so a stale build is never loaded."""
    key = hashlib.sha256(f"{sha}|{torch.__version__}|{torch.version.cuda}|{_gencode(arch)}".encode()).hexdigest()
    return spec.jit_cache_dir("cuda") / f"sm{arch[0]}{arch[1]}-{key[:16]}"


def _jit_build(arch: Tuple[int, int], why: str, verbose: bool = False):
    csrc = spec.csrc_dir()
    if csrc is None:
        raise RuntimeError(f"{why}, and the sources (csrc/lookup) are missing: reinstall recom_rec")
    sha = spec.lookup_sha256(csrc)
    name = f"recom_rec_lookup_cuda_sm{arch[0]}{arch[1]}"
    folder = jit_cache_dir(arch, sha)
    built = folder / f"{name}.so"
    if built.exists():  # built before for this exact source: load it without ninja or nvcc
        module_spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError(f"{why}, and nvcc (CUDA_HOME) is not found to compile csrc/lookup")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"recom_rec: {why}", file=sys.stderr, flush=True)
    with spec.compiling(f"the CUDA lookup kernels for sm_{arch[0]}{arch[1]} into {folder}",
                        "a few minutes with nvcc"):
        return cpp_extension.load(name=name, sources=[str(csrc / "lookup" / s) for s in spec.LOOKUP_SOURCES],
                                  extra_cuda_cflags=[*spec.LOOKUP_NVCC_FLAGS, _gencode(arch), spec.hash_define(sha)],
                                  build_directory=str(folder), verbose=verbose)


@lru_cache(maxsize=None)
def _load():
    """(the extension module, where it came from)."""
    arch = _gpu_arch()
    with _lock:
        module, why_not = _installed(arch)
        if module is not None:
            return module, f"installed ({module.__file__})"
        return _jit_build(arch, f"the CUDA lookup kernels have no usable installed build: {why_not}"), \
            f"compiled on first use ({jit_cache_dir(arch, spec.lookup_sha256(spec.csrc_dir()))})"


def loaded():
    """The extension if this process has loaded it already, else None: never builds or loads it
    (for small kernels whose callers run on any backend, with torch's ops where it is not loaded)."""
    return _load()[0] if _load.cache_info().currsize else None


def extension():
    """The loaded extension (built first by the fallback when needed); raises if it cannot be."""
    return _load()[0]


def where() -> str:
    """Which build of the kernels is loaded and where it came from."""
    return _load()[1]


def _one_line(error: Exception) -> str:
    """A build's failure as one line: the compiler's first error line, not its whole log."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = next((line for line in lines if "error" in line.lower() and not line.startswith("Error building")),
                 lines[0] if lines else type(error).__name__)
    more = "; python -m recom_rec.kernels.cuda_ext prints the full log" if len(lines) > 1 else ""
    return f"{first[:300]}{more}"


@lru_cache(maxsize=None)
def build_error() -> Optional[str]:
    """Why the CUDA kernels cannot be used here (one line), or None when they can (tried once)."""
    try:
        _load()
    except Exception as e:  # noqa: BLE001 - reported to the caller as the reason
        return _one_line(e)
    return None


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Where the CUDA lookup kernels load from here, or why they do not.")
    parser.add_argument("--installed", action="store_true",
                        help="only check the install-time build: exit 1 (saying why) unless it is usable here")
    args = parser.parse_args(argv)
    if args.installed:
        try:
            module, why_not = _installed(_gpu_arch())
        except RuntimeError as e:
            module, why_not = None, str(e)
        print(f"recom_rec CUDA lookup kernels: installed build {module.__file__}" if module is not None
              else f"recom_rec CUDA lookup kernels: no usable installed build: {why_not}")
        return 0 if module is not None else 1
    try:
        _load()
    except Exception:  # noqa: BLE001 - show everything: this is the diagnostic
        try:
            _jit_build(_gpu_arch(), "a verbose build, to show why the kernels do not build", verbose=True)
        except Exception as e:  # noqa: BLE001
            print(f"recom_rec: the CUDA lookup kernels are unavailable:\n{e}", file=sys.stderr)
            return 1
        _load.cache_clear()
    print(f"recom_rec CUDA lookup kernels: {where()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
