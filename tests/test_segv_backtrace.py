"""tools/segv_backtrace.c (the GPU session's NATIVE_BACKTRACE=1): a process that dies of SIGSEGV inside a
pytest test prints its native frames and then Python's (faulthandler's), although pytest points
fd 2 at its capture file during the test."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "segv_backtrace.c"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="builds the tool with gcc")
def test_a_crash_in_a_test_prints_native_then_python_frames(tmp_path):
    library = tmp_path / "segv_backtrace.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(TOOL), "-ldl"], check=True)
    (tmp_path / "test_crash.py").write_text("import ctypes\n\ndef test_crash():\n    ctypes.string_at(0)\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_crash.py"],
                         # (no third-party plugins: under the tool, pytest-benchmark 5.2.3 on the
                         # GPU image ended the process without faulthandler's frames)
                         cwd=tmp_path, env={**os.environ, "LD_PRELOAD": str(library),
                                            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert run.returncode == -11, run.stdout[-2000:]
    native = run.stdout.find("=== native backtrace")
    python = run.stdout.find("Fatal Python error: Segmentation fault")
    assert 0 <= native < python, run.stdout[-2000:]
    assert "=== end of native backtrace ===" in run.stdout
    assert "test_crash.py\", line 4 in test_crash" in run.stdout
