"""The ``Example::`` blocks in the package's docstrings run as written (CPU only).

Each docstring is its own test. The few examples that need something an install may lack (the
native extension ``torchckpt._C``, nvCOMP, the ``torchckpt._zfp`` extension) skip, with the
package's own reason, where it is missing: the pure-Python install that README.md offers
(``TORCHCKPT_USE_CPP=0``, no nvCOMP) passes this file. ``test_pure_python_install`` checks that
in a child process with all three hidden.
"""
from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

def _native_host_pool() -> str | None:
    from torchckpt._native import host_pool_available, native_error

    if host_pool_available():
        return None
    return f"needs the native host pool of torchckpt._C ({native_error() or 'built without host_pool.cpp'})"


def _nvcomp() -> str | None:
    from torchckpt.codecs import Bitcomp

    return Bitcomp().unavailable_reason()


def _zfp() -> str | None:
    from torchckpt.codecs import ZFP

    return ZFP().unavailable_reason()


# Docstrings whose examples need more than the pure-Python package: name -> why not here (None: runs).
REQUIRES: dict[str, Callable[[], str | None]] = {
    "torchckpt.memory.lazy_pool.LazyHostPool": _native_host_pool,
    "torchckpt.codecs.bitcomp.Bitcomp": _nvcomp,
    "torchckpt.codecs.zfp.ZFP": _zfp,
}


def _doctests(name: str) -> list[doctest.DocTest]:
    mod = importlib.import_module(name)
    found = doctest.DocTestFinder().find(mod, extraglobs={"torch": torch})
    runs = [t for t in found if any(not ex.options.get(doctest.SKIP) for ex in t.examples)]  # not GPU-only
    return sorted(runs, key=lambda t: t.name)


def _package_modules() -> list[str]:
    """Every module of the package that has runnable examples (found by walking it, so a new
    module's examples run here without being listed)."""
    import torchckpt

    names = []
    for info in pkgutil.walk_packages(torchckpt.__path__, "torchckpt."):
        if info.name in ("torchckpt.__main__", "torchckpt._C", "torchckpt._zfp", "torchckpt.codecs._quant_triton"):
            # the CLI, the compiled extensions, and Triton kernels (no examples)
            continue
        names.append(info.name)
    return [n for n in sorted(names) if _importable(n) and _doctests(n)]


def _importable(name: str) -> bool:
    """An integration whose framework is not installed says so on import (its ``torchckpt:`` error): skipped here;
    any other import error fails."""
    try:
        importlib.import_module(name)
    except ImportError as e:
        if name.startswith("torchckpt.integrations.") and str(e).startswith("torchckpt:"):
            return False
        raise
    return True


MODULES = _package_modules()


def _all_names() -> list[str]:
    return [t.name for mod in MODULES for t in _doctests(mod)]


@pytest.mark.parametrize("name", ["torchckpt.api", "torchckpt.adjoint.run", "torchckpt.store.saved",
                                  "torchckpt.store.snapshots", "torchckpt.schedules.revolve",
                                  "torchckpt.codecs.quant", "torchckpt.memory.host_pool"])
def test_public_modules_have_examples(name: str) -> None:
    assert name in MODULES, f"{name} has no examples"


def test_requirements_name_real_examples() -> None:
    names = set(_all_names())
    assert set(REQUIRES) <= names, f"REQUIRES names docstrings with no example: {sorted(set(REQUIRES) - names)}"


@pytest.mark.parametrize("name", _all_names())
def test_docstring_example(name: str) -> None:
    need = REQUIRES.get(name)
    why = need() if need is not None else None
    if why is not None:
        pytest.skip(why)
    test = _find(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out: list[str] = []
    res = runner.run(test, out=out.append)
    assert res.attempted > 0
    assert res.failed == 0, "".join(out)


def _find(name: str) -> doctest.DocTest:
    for mod in MODULES:
        if name == mod or name.startswith(mod + "."):
            for t in _doctests(mod):
                if t.name == name:
                    return t
    raise LookupError(name)


# Run in a child process: the extensions and nvCOMP are hidden before torchckpt is imported, as
# in an install made with TORCHCKPT_USE_CPP=0 and without nvidia-libnvcomp-cu13.
_PURE = """
import sys
sys.modules["torchckpt._C"] = None      # import torchckpt._C raises ImportError
sys.modules["torchckpt._zfp"] = None
import torchckpt._native.nvcomp as nv
nv._candidates = lambda: ["/nonexistent/libnvcomp.so.6"]
import pytest
sys.exit(pytest.main(["-v", "-rs", "-p", "no:cacheprovider", sys.argv[1], "-k", "not pure_python_install"]))
"""


def test_pure_python_install() -> None:
    res = subprocess.run([sys.executable, "-c", _PURE, os.path.abspath(__file__)], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    skipped = {line.split("[", 1)[1].split("]", 1)[0] for line in res.stdout.splitlines()
               if line.startswith("tests/test_doctests.py::test_docstring_example[") and " SKIPPED" in line}
    assert skipped == set(REQUIRES), tail  # exactly the examples that need what is hidden
    reasons = [line for line in res.stdout.splitlines() if line.startswith("SKIPPED [")]
    for why in ("native host pool of torchckpt._C", "Bitcomp needs nvCOMP", "ZFP needs the optional extension"):
        assert any(why in line for line in reasons), tail
