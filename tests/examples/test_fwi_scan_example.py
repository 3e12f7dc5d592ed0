"""The FWI example (checkpointed_scan: traces out, misfit outside) runs on the CPU, bit-exact and FD-checked."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fwi_scan_example() -> None:
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "fwi_scan.py"), "--device", "cpu", "--grid", "12",
         "--steps", "30", "--snapshots", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "bit-exact" in res.stdout and res.stdout.strip().endswith("PASS")
