"""What the package's native code is built from, in one place: the C/CUDA sources in csrc/, their
flags, and the hash that ties a built library to the sources it was built from.

Read by setup.py (the install-time build; it loads this file by path, before the package can be
imported, so only the standard library is used here) and by the loaders' just-in-time fallback
(ps/host_lib.py, kernels/cuda_ext.py). Adding a C file to the parameter-server library is one line
in PS_SOURCES.
"""
import hashlib
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

# The parameter-server tier's host library (csrc/ps): plain C, a shared library loaded with ctypes.
PS_EXTENSION = "recom_rec.ps._host"
PS_SOURCES = [
    "ps_host.c",
    "ps_mem.c",
    "ps_pool.c",
    "ps_stage.c",
    "ps_cuda.c",
    "ps_resp.c",
    "ps_tls.c",
    "ps_redis.c",
    "ps_build_info.c",
]
PS_HEADERS = ["ps_host.h", "ps_map.h", "ps_redis.h"]
# -ffp-contract=off: the init must round like torch's separate multiply and add. gnu99: POSIX
# threads, clocks and dlopen (ps_cuda.c loads the CUDA driver, ps_tls.c libssl, at run time, never
# at link time).
PS_CFLAGS = ["-O2", "-fPIC", "-ffp-contract=off", "-std=gnu99", "-pthread"]
PS_LIBRARIES = ["dl"]

# The CUDA lookup kernels (csrc/lookup): a torch extension, built where torch has CUDA and nvcc runs.
LOOKUP_EXTENSION = "recom_rec.kernels._lookup_cuda"
# One translation unit per host entry point, and the backward one per optimizer, so that the
# build's nvcc runs in parallel (ninja): ~70 kernel instances a unit instead of ~400 in one.
LOOKUP_SOURCES = [
    "forward.cu",
    "plan.cu",
    "zeros.cu",
    "padded_gradient.cu",
    "step_counter.cu",
    "unpooled.cu",
    "unpooled_backward.cu",
    "expand.cu",
    "pad_offsets.cu",
    "backward.cu",
    "backward_none.cu",
    "backward_sgd.cu",
    "backward_adagrad.cu",
    "backward_rowwise_adagrad.cu",
    "backward_adam.cu",
    "module.cu",
]
LOOKUP_HEADERS = ["kernels.cuh", "input_check.cuh", "backward_launch.cuh", "lookup.h", "workspace.cuh"]
LOOKUP_KERNELS = "kernels.cuh"  # the device code alone (the compile test and tools/ include it)
LOOKUP_NVCC_FLAGS = ["-O3"]
DEFAULT_CUDA_ARCHS = "9.0"  # H100 / H200; TORCH_CUDA_ARCH_LIST="8.0;9.0" builds for more GPUs

# Both libraries carry the hash of their sources and flags (RECOM_REC_SOURCES_SHA256): a checkout
# whose csrc/ changed after the build compiles afresh instead of loading a stale library. The CUDA
# one carries the GPUs it was built for too (RECOM_REC_CUDA_TARGETS). Neither name nor value may
# contain "arch": torch's build then takes the flag for the user's own -gencode and adds none.
SOURCES_HASH_MACRO = "RECOM_REC_SOURCES_SHA256"
TARGETS_MACRO = "RECOM_REC_CUDA_TARGETS"


def csrc_dir() -> Optional[Path]:
    """The C/CUDA sources: csrc/ beside the package in a checkout (an editable install), or the copy
    setup.py puts inside an installed package; None when neither is there."""
    package = Path(__file__).resolve().parent
    for candidate in (package.parent / "csrc", package / "csrc"):
        if (candidate / "ps" / "ps_host.h").is_file():
            return candidate
    return None


def sources_sha256(folder: Path, names: Iterable[str], flags: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    digest.update(" ".join(flags).encode())
    return "h" + digest.hexdigest()[:16]  # a C identifier: the build passes it as a bare token


def ps_sha256(csrc: Path) -> str:
    return sources_sha256(csrc / "ps", PS_SOURCES + PS_HEADERS, PS_CFLAGS + ["-l" + lib for lib in PS_LIBRARIES])


def lookup_sha256(csrc: Path) -> str:
    return sources_sha256(csrc / "lookup", LOOKUP_SOURCES + LOOKUP_HEADERS, LOOKUP_NVCC_FLAGS)


def hash_define(value: str) -> str:
    """The hash as a define. A bare token, stringified in the source: a quoted value would need
    shell quoting on some of the build paths (ninja) and none on others."""
    return f"-D{SOURCES_HASH_MACRO}={value}"


def targets_token(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST ("9.0", "8.0;9.0+PTX") as one bare token ("sm_80_90ptx") the build
    records, for the loader to check the GPU against (:func:`covers`)."""
    entries = [e for e in arch_list.replace(",", ";").replace(" ", ";").split(";") if e]
    return "_".join(["sm"] + [e.replace(".", "").replace("+PTX", "ptx").lower() for e in entries])


def covers(token: str, capability) -> bool:
    """Whether a build recorded as ``token`` runs on a GPU of compute capability ``capability``
    (major, minor): a binary for that GPU, or PTX of an older one, which the driver compiles."""
    for entry in token.split("_")[1:]:
        version, ptx = entry.removesuffix("ptx"), entry.endswith("ptx")
        if not version.isdigit():
            return True  # a named generation ("hopper") or a suffixed one ("90a"): trust the build
        built = (int(version[:-1]), int(version[-1]))
        if built == tuple(capability) or (ptx and built <= tuple(capability)):
            return True
    return False


@contextmanager
def compiling(what: str, expected: str):
    """The just-in-time fallback's progress: a line saying what compiles and about how long it
    takes, the elapsed time while it runs (on a terminal), and a line with the time it took."""
    print(f"recom_rec: compiling {what} ({expected}, once; the result is cached)", file=sys.stderr, flush=True)
    start = time.monotonic()
    done = threading.Event()

    def tick():  # a terminal sees the seconds go by; a log gets the two lines only
        while not done.wait(1.0):
            print(f"\rrecom_rec: compiling... {time.monotonic() - start:.0f} s", end="", file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, daemon=True) if sys.stderr.isatty() else None
    if ticker:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if ticker:
            ticker.join()
            print("\r", end="", file=sys.stderr)
    # reached only when the build succeeded (a failure propagates from the yield)
    print(f"recom_rec: compiled {what} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


def jit_cache_dir(kind: str) -> Path:
    """Where the just-in-time fallback keeps its builds (RECOM_REC_CACHE, default ~/.cache/recom_rec)."""
    root = os.environ.get("RECOM_REC_CACHE") or Path.home() / ".cache" / "recom_rec"
    return Path(root) / kind
