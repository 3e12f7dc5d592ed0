"""The RTM example runs end to end on the CPU, exact without a codec and within its PSNR check with one."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("codec", ["none", "quant8"])
def test_adjoint_wave_example(codec: str, tmp_path: object) -> None:
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "adjoint_wave.py"), "--device", "cpu", "--grid", "24",
         "--steps", "80", "--snapshots", "5", "--codec", codec, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.strip().endswith("PASS")
    if codec != "none":
        assert "image PSNR" in res.stdout and "ratio" in res.stdout
