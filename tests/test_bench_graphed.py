"""``benchmarks/graphed_recompute.py`` end to end on a tiny model of the zoo (CPU, where every block recomputes
eagerly: NOTE [ Graphed recompute ] Rule 6): every method measured in every turn, the ratios, the JSON.

torchvision is not a torchckpt dependency: without it this test skips."""
from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("torchvision")

from bench_run import run_bench  # noqa: E402


def test_graphed_recompute_tiny_measures_every_method(tmp_path: pathlib.Path) -> None:
    res = run_bench("graphed_recompute.py", "--models", "resnet152", "--turns", "2", "--reps", "2",
                    "--out", str(tmp_path))
    with open(tmp_path / "graphed_recompute.json") as f:
        out = json.load(f)
    (m,) = out["models"]
    assert m["model"] == "resnet152" and "error" not in m, m
    rows = {r["method"]: r for r in m["rows"]}
    assert list(rows) == ["none", "library", "Recompute()", "Recompute(reentrant=True)", "Recompute(graphed=True)"]
    for r in rows.values():
        assert len(r["turns_s"]) == 2 and r["step_s"] > 0
        assert r["x_reentrant"] == pytest.approx(r["step_s"] / rows["Recompute(reentrant=True)"]["step_s"])
    st = m["graphed_stats"]
    assert st.get("captures", 0) == 0 and st["eager"] > 0, st  # CPU tensors: no signature
    assert "x reentrant" in res.stdout
