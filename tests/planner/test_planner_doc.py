"""docs/planner.md's example runs as written."""
from __future__ import annotations

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def test_planner_doc_example_runs(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert code is not None
    monkeypatch.chdir(tmp_path)
    env: dict[str, object] = {}
    exec(compile(code.group(1), str(DOC), "exec"), env)  # noqa: S102 - the doc's own example
    p = env["p"]
    assert any(b.mode != "keep" for b in p.blocks)  # type: ignore[attr-defined]
    assert (tmp_path / "plan.json").exists()
