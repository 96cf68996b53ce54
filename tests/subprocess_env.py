"""The environment of a test's child Python process: the checkout first on PYTHONPATH, what was
there kept (the GPU machine's stack puts torchrec and fbgemm there)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
