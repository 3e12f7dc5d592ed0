"""The package's layers: imports point down only, and no module imports another package's private names.

Layers, top to bottom (docs/architecture.md): the public entry points (``torchckpt``, ``api``,
``policies``, ``demo``, ``env``) over ``adjoint`` and ``recompute`` over ``store`` over ``memory``, ``codecs`` and ``distributed``
over ``schedules`` and ``_native``, with ``_errors``/``_args``/``_streams`` at the bottom. ``schedules`` imports no torch.
Rules are cited by their NOTE (``NOTE [ Name ] Rule N``), and every cited NOTE and rule exists.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

import torchckpt

ROOT = pathlib.Path(torchckpt.__file__).parent

# What each layer may import from torchckpt (besides itself). Lower layers never import upper ones.
ALLOWED: dict[str, set[str]] = {
    "_errors": set(),
    "_streams": {"_errors"},  # NOTE [ Cheap streams ]: torch and the errors only
    "_args": {"_errors", "memory"},  # the host-pool type check imports memory lazily
    "_native": {"_errors"},
    "schedules": {"_errors"},
    "codecs": {"_errors", "_native", "_streams"},
    "memory": {"_errors", "_native", "schedules"},  # schedules' Tier names the tiers a bandwidth belongs to
    "distributed": {"_errors", "schedules"},
    "store": {"_errors", "_args", "_native", "_streams", "codecs", "memory", "schedules", "distributed"},
    "recompute": {"_errors", "_args", "codecs", "schedules", "store"},
    "adjoint": {"_errors", "_args", "_native", "codecs", "memory", "schedules", "store", "distributed"},
    "policies": {"_errors", "codecs", "recompute", "store"},
    "api": {"_errors", "_args", "policies", "recompute", "schedules", "store"},
    "planner": {"_errors", "_args", "api", "codecs", "memory", "policies", "recompute", "schedules", "store"},
    "integrations": {"_errors", "_args", "api", "codecs", "planner", "policies"},
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
            if module not in ("torchckpt._errors", "torchckpt._args", "torchckpt._native", "torchckpt._streams") \
                    and not same_package:
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


# -- NOTE blocks and the references to their rules ------------------------------------------------------------------
# A reference to a rule names its NOTE: ``NOTE [ Name ] Rule N``, ``NOTE [ Name ] Rules N-M``. Only a NOTE block's own
# lines may cite its rules as bare ``Rule N``. The NOTEs are the package's, the tests' (the fuzzer's), the native
# sources' (csrc/) and torch's own ``NOTE [ Nestable Checkpoint ]`` (torch/utils/checkpoint.py), which recompute/
# cites.
TESTS = pathlib.Path(__file__).parent
CSRC = ROOT.parent / "csrc"
_HEAD = re.compile(r"^\s*(?:#|//)\s*NOTE \[ (.+?) \]\s*$")
_ITEM = re.compile(r"^\s*(?:(?:#|//)\s*)?(?:Rule )?(\d+[a-z]?)\.\s")
_SUB = re.compile(r"^\s*(?:#|//)\s+([a-z])\.\s")
_NUM = r"\d+[a-z]?"
_REF = re.compile(rf"\bRules?\s+{_NUM}(?:(?:\s*,\s*(?:and\s+)?|\s+and\s+|\s*-\s*){_NUM}\b)*")
_NAMED = re.compile(r"NOTE \[ ([^\]]+?) \] $")


def _blocks(path: pathlib.Path) -> list[tuple[str, int, int, set[str]]]:
    """(name, first line, end line, rule numbers) of each NOTE block in ``path``; lines 0-based, end excluded.

    A block is its header and the comment lines after it (or, after a header in a docstring, the lines up to the
    docstring's end); its rules are its items ``N.``, ``Nb.``, ``Rule N.`` (torch's) and ``a.`` under an item (``Na``).
    """
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _HEAD.match(line)
        if not m:
            continue
        j, rules, item = i + 1, set(), ""
        comment = j < len(lines) and lines[j].lstrip().startswith(("#", "//"))
        while j < len(lines) and not _HEAD.match(lines[j]) and (
                lines[j].lstrip().startswith(("#", "//")) if comment else '"""' not in lines[j]):
            r, s = _ITEM.match(lines[j]), _SUB.match(lines[j])
            if r:
                item = r.group(1)
                rules.add(item)
            elif s and item:
                rules.add(item + s.group(1))
            j += 1
        out.append((m.group(1), i, j, rules))
    return out


def _sources() -> list[pathlib.Path]:
    return sorted(ROOT.rglob("*.py")) + sorted(TESTS.rglob("*.py"))


def _notes() -> dict[str, set[str]]:
    """Every NOTE a reference may name, and its rule numbers."""
    import torch.utils.checkpoint

    found: dict[str, list[tuple[pathlib.Path, set[str]]]] = {}
    native = sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".cu", ".h", ".cuh")) if CSRC.is_dir() else []
    for path in _sources() + native + [pathlib.Path(torch.utils.checkpoint.__file__)]:
        for name, _, _, rules in _blocks(path):
            found.setdefault(name, []).append((path, rules))
    twice = {n: [str(p) for p, _ in v] for n, v in found.items() if len(v) > 1}
    assert not twice, f"NOTE names defined twice: {twice}"
    return {n: v[0][1] for n, v in found.items()}


def _flat(text: str) -> str:
    """``text`` with comment markers at line starts, line breaks and breaks between string literals gone."""
    text = re.sub(r'"\s*\n\s*[rf]?"', "", text)
    text = re.sub(r"\n\s*(?:#|//)?\s*", " ", text)
    return re.sub(r"\s+", " ", text)


def _numbers(ref: str) -> list[str]:
    """The rule numbers a reference names: a range ``N-M`` is every number from N to M."""
    out: list[str] = []
    for lo, hi in re.findall(rf"({_NUM})(?:\s*-\s*(\d+))?", ref.split(None, 1)[1]):
        out.append(lo)
        if hi:
            out += [str(k) for k in range(int(re.sub(r"\D", "", lo)) + 1, int(hi) + 1)]
    return out


def _references(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """(line, reference, the NOTE it names or None) for every ``Rule N`` in ``path``; line 0-based."""
    text = path.read_text()
    out = []
    for m in _REF.finditer(text):
        named = _NAMED.search(_flat(text[max(0, m.start() - 300):m.start()]))
        out.append((text.count("\n", 0, m.start()), m.group(0), re.sub(r"\s+", " ", named.group(1)) if named else None))
    return out


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_rule_references_name_their_note(path: pathlib.Path) -> None:
    """Outside a NOTE block, a rule is cited as ``NOTE [ Name ] Rule N``: a bare ``Rule N`` leaves the reader to guess."""
    own = [(a, b) for _, a, b, _ in _blocks(path)]
    bare = [f"{path.relative_to(ROOT.parent)}:{line + 1}: {ref!r}" for line, ref, note in _references(path)
            if note is None and not any(a < line < b for a, b in own)]
    assert not bare, "bare rule references; write NOTE [ Name ] Rule N:\n" + "\n".join(bare)


def test_rule_references_exist() -> None:
    """Every ``NOTE [ Name ] Rule N`` names a NOTE that exists, and a rule that NOTE has."""
    notes = _notes()
    wrong = []
    for path in _sources():
        for line, ref, note in _references(path):
            if note is None:
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line + 1}: NOTE [ {note} ] {ref}"
            if note not in notes:
                wrong.append(f"{where}: no such NOTE")
            elif missing := [n for n in _numbers(ref) if n not in notes[note]]:
                wrong.append(f"{where}: the NOTE has no rule {', '.join(missing)} (it has {sorted(notes[note])})")
    assert not wrong, "\n".join(wrong)
