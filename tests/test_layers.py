"""The package's layers: imports point down only, and no module imports another package's private names.

Layers, top to bottom (docs/architecture.md): the public entry points (``torchckpt``, ``api``,
``policies``, ``demo``, ``env``) over ``adjoint`` and ``recompute`` over ``store`` over ``memory``, ``codecs`` and ``distributed``
over ``schedules`` and ``_native``, with ``_errors``/``_args`` at the bottom. ``schedules`` imports no torch.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import torchckpt

ROOT = pathlib.Path(torchckpt.__file__).parent

# What each layer may import from torchckpt (besides itself). Lower layers never import upper ones.
ALLOWED: dict[str, set[str]] = {
    "_errors": set(),
    "_args": {"_errors", "memory"},  # the host-pool type check imports memory lazily
    "_native": {"_errors"},
    "schedules": {"_errors"},
    "codecs": {"_errors", "_native"},
    "memory": {"_errors", "_native", "schedules"},  # schedules' Tier names the tiers a bandwidth belongs to
    "distributed": {"_errors", "schedules"},
    "store": {"_errors", "_args", "_native", "codecs", "memory", "schedules", "distributed"},
    "recompute": {"_errors", "_args", "codecs", "schedules", "store"},
    "adjoint": {"_errors", "_args", "_native", "codecs", "memory", "schedules", "store", "distributed"},
    "policies": {"_errors", "codecs", "recompute", "store"},
    "api": {"_errors", "_args", "policies", "recompute", "schedules", "store"},
    "planner": {"_errors", "_args", "api", "codecs", "memory", "policies", "recompute", "schedules", "store"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        out.append((name, path))
    return out


def _imports(path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every torchckpt import, at any depth in the file."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "torchckpt":
                for a in node.names:  # ``from torchckpt import schedules`` names a subpackage
                    found.append((f"torchckpt.{a.name}", [], node.lineno))
            elif node.module.startswith("torchckpt."):
                found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torchckpt."):
                    found.append((a.name, [], node.lineno))
    return found


MODULES = _modules()


@pytest.mark.parametrize("name,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down(name: str, path: pathlib.Path) -> None:
    layer = _layer(name)
    if layer not in ALLOWED:
        return  # top-level entry points (torchckpt, demo, env, __main__) may import anything
    for module, _, line in _imports(path):
        target = _layer(module)
        if target in ("_C", "_zfp"):
            target = "_native"
        assert target == layer or target in ALLOWED[layer], (
            f"{path.relative_to(ROOT.parent)}:{line} ({layer}) imports {module} ({target}); "
            f"{layer} may import only {sorted(ALLOWED[layer])}")


@pytest.mark.parametrize("name,path", MODULES, ids=[m for m, _ in MODULES])
def test_no_private_names_across_packages(name: str, path: pathlib.Path) -> None:
    pkg = ".".join(name.split(".")[:2])  # torchckpt.<package>, or a top-level module itself
    for module, names, line in _imports(path):
        same_package = ".".join(module.split(".")[:2]) == pkg
        privates = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if module in ("torchckpt._C", "torchckpt._zfp"):  # the compiled extensions: loaded by _native only
            if not name.startswith("torchckpt._native"):
                privates.append(module)
        elif module.split(".")[-1].startswith("_") and not module.split(".")[-1].startswith("__"):
            if module not in ("torchckpt._errors", "torchckpt._args", "torchckpt._native") and not same_package:
                privates.append(module)
        crosses = bool(privates) and (not same_package or any(p in ("torchckpt._C", "torchckpt._zfp") for p in privates))
        assert not crosses, f"{path.relative_to(ROOT.parent)}:{line} imports private {privates} from {module}"


def test_schedules_import_no_torch() -> None:
    for path in (ROOT / "schedules").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not any(m == "torch" or m.startswith("torch.") for m in mods), path


def test_planner_cost_model_imports_no_torch() -> None:
    """The planner's model and search (NOTE [ Step model ], NOTE [ Plan search ]) run on synthetic costs."""
    for f in ("costs.py", "optimize.py"):
        tree = ast.parse((ROOT / "planner" / f).read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not any(m == "torch" or m.startswith("torch.") for m in mods), f
