import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

# Kernels are compared on random shapes; individual examples can be slow under the Triton
# interpreter, so no per-example deadline. CI runs the "ci" profile.
settings.register_profile(
    "ci", deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The parameter-server tier's host library runs large store batches on a pool of threads sized by
# the cores; CI machines have two, which gives no pool: ask for two workers so the suite runs the
# threaded path everywhere (the library reads this once, when it is first loaded).
os.environ.setdefault("RECOM_REC_PS_THREADS", "2")


# A sticky CUDA error (an illegal address, a device-side assert) ends the process's CUDA context:
# every later CUDA call fails with it. The suite stops there and names the test, instead of
# reporting each later test as failed (v50: one such error failed 259 tests after it).
_STICKY_CUDA_ERRORS = ("an illegal memory access was encountered", "device-side assert triggered",
                       "misaligned address", "unspecified launch failure")


def _cuda_context_lost() -> bool:
    """Whether this process's CUDA context is gone (the error's text alone may be a child's)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any error here is the lost context's
        return True
    return False


def pytest_runtest_makereport(item, call):
    if (call.excinfo is not None and any(e in str(call.excinfo.value) for e in _STICKY_CUDA_ERRORS)
            and _cuda_context_lost()):
        item.session.shouldstop = (f"the CUDA context was lost during {item.nodeid} ({call.when}): "
                                   "the tests after it cannot run in this process")
