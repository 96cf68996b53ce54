"""A pytest plugin that logs what the test process holds after each test: memory mappings (the
kernel caps them at vm.max_map_count), native threads, open files, resident memory, full garbage
collections so far and, where CUDA is up, the caching allocator's bytes; and the seconds since the
plugin loaded. For a suite that dies after hundreds of tests: what grew.
    PYTHONPATH=tools RESOURCE_LOG=/tmp/resources.log python -m pytest -p pytest_resources tests

It also keeps, in RESOURCE_LOG.gc, one line overwritten at every garbage collection's start and
end: a process that dies inside a collection (a finalizer or a C++ destructor of a collected
cycle) leaves "start gen=N during TEST" there. GC_EACH_TEST=1 collects after each test, so that a
deadly finalizer runs right after the test whose garbage it is; GC_EACH_TEST=file, after each test
file (a full collection of a long suite's process takes ~0.1-0.3 s)."""
import gc
import os
import sys
import time

_START = time.monotonic()
_STATE = {"test": "(collection)", "full": 0, "fd": None, "file": None}


def _gc_state(phase, info):
    if phase == "start" and info["generation"] == 2:
        _STATE["full"] += 1
    line = f"{phase} gen={info['generation']} collected={info.get('collected', '-')} during {_STATE['test']}"
    os.pwrite(_STATE["fd"], line.ljust(400)[:400].encode() + b"\n", 0)


def pytest_configure(config):
    path = os.environ.get("RESOURCE_LOG")
    if path:
        _STATE["fd"] = os.open(path + ".gc", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        gc.callbacks.append(_gc_state)


def pytest_runtest_logstart(nodeid, location):
    test_file = nodeid.split("::")[0]
    if os.environ.get("GC_EACH_TEST") == "file" and _STATE["file"] not in (None, test_file):
        _STATE["test"] = f"the collection after {_STATE['file']}"
        gc.collect()
    _STATE["test"], _STATE["file"] = nodeid, test_file


def _count_lines(path):
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return -1


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get("RESOURCE_LOG")
    if not path:
        return
    if os.environ.get("GC_EACH_TEST") == "1":
        _STATE["test"] = f"the collection after {nodeid}"
        gc.collect()
    fields = [f"t={time.monotonic() - _START:.0f}s", f"maps={_count_lines('/proc/self/maps')}",
              f"threads={len(os.listdir('/proc/self/task'))}", f"fds={len(os.listdir('/proc/self/fd'))}",
              f"rss_mib={_rss_mib()}", f"full_gcs={_STATE['full']}"]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        fields += [f"cuda_alloc_mib={torch.cuda.memory_allocated() >> 20}",
                   f"cuda_reserved_mib={torch.cuda.memory_reserved() >> 20}"]
    with open(path, "a") as f:
        f.write(f"{nodeid} {' '.join(fields)}\n")
