"""The examples run end to end (a few steps each) and say what they claim."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_dlrm_demo_same_losses_both_modules():
    out = _run("dlrm_demo.py", "--steps", "20", "--batch-size", "64", "--max-rows", "300")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("torchrec", "recom_rec"))}
    stock, fused = rows["torchrec"], rows["recom_rec"]
    # columns: name, "EBC", loss, AUC, steps/s
    assert abs(float(stock[2]) - float(fused[2])) < 1e-3, out
    assert abs(float(stock[3]) - float(fused[3])) < 2e-2, out
    assert "speed-up" in out
