"""A pytest plugin that logs what the test process holds after each test: memory mappings (the
kernel caps them at vm.max_map_count), native threads, open files, resident memory and, where CUDA
is up, the caching allocator's bytes; and the seconds since the plugin loaded. For a suite that dies after hundreds of tests: what grew.
    PYTHONPATH=tools RESOURCE_LOG=/tmp/resources.log python -m pytest -p pytest_resources tests"""
import os
import sys
import time

_START = time.monotonic()


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
    fields = [f"t={time.monotonic() - _START:.0f}s", f"maps={_count_lines('/proc/self/maps')}", f"threads={len(os.listdir('/proc/self/task'))}",
              f"fds={len(os.listdir('/proc/self/fd'))}", f"rss_mib={_rss_mib()}"]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        fields += [f"cuda_alloc_mib={torch.cuda.memory_allocated() >> 20}",
                   f"cuda_reserved_mib={torch.cuda.memory_reserved() >> 20}"]
    with open(path, "a") as f:
        f.write(f"{nodeid} {' '.join(fields)}\n")
