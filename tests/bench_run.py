"""Running a script of ``benchmarks/`` from a test: the repository on ``PYTHONPATH``, no GPU visible."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> <args>`` from the repository's root; asserts it exited 0."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res
