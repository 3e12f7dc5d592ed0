"""torchckpt.schedules is pure Python: no torch (or numpy) import, statically and at run time."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "torchckpt" / "schedules"
FORBIDDEN = {"torch", "numpy", "triton"}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            found.add("__import__")
    return found


MODULES = sorted(PKG.glob("*.py"))


def test_package_has_modules() -> None:
    assert len(MODULES) >= 8, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_torch_import(path: pathlib.Path) -> None:
    bad = _imports(path) & (FORBIDDEN | {"__import__"})
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_only_stdlib_and_own_imports(path: pathlib.Path) -> None:
    allowed = set(sys.stdlib_module_names) | {"torchckpt", "__future__"}
    assert _imports(path) <= allowed, f"{path.name}: {_imports(path) - allowed}"


def test_imports_and_runs_with_torch_blocked() -> None:
    # Load torchckpt.schedules without running torchckpt/__init__.py (which may need torch)
    # and with torch made unimportable, then plan and simulate a schedule.
    root = PKG.parents[1]
    code = f"""
import sys, types
sys.modules["torch"] = None
sys.modules["numpy"] = None
pkg = types.ModuleType("torchckpt")
pkg.__path__ = [{str(root / "torchckpt")!r}]
sys.modules["torchckpt"] = pkg
from torchckpt.schedules import Revolve, simulate, plan_prefetch, simulate_cache, Tier
assert simulate(Revolve(100, 5)).forward_steps == 316
plan = plan_prefetch(Revolve(50, 4, tier=Tier.HOST), 3)
assert simulate_cache(plan, 3).misses == 0
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None and m.split('.')[0] == 'torch']
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
