"""The Example:: blocks of torchckpt.schedules run as doctests."""
from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "actions", "plan", "schedule", "revolve", "uniform", "zcut", "multistage",
    "simulate", "prefetch",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    module = importlib.import_module(f"torchckpt.schedules.{name}")
    result = doctest.testmod(module, extraglobs=vars(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0


def test_all_is_complete() -> None:
    import torchckpt.schedules as s

    assert len(set(s.__all__)) == len(s.__all__)
    for name in s.__all__:
        assert getattr(s, name).__module__.startswith("torchckpt.schedules.")
    # __init__ re-exports only: every public name of a module it exports is in __all__.
    exported = {n for n in vars(s) if not n.startswith("_") and not isinstance(getattr(s, n), type(s))}
    assert exported == set(s.__all__)
