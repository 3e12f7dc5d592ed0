"""The public names: ``torchckpt.__all__`` is small and every package's ``__all__`` is exact."""
from __future__ import annotations

import importlib

import pytest

import torchckpt


def test_top_level_names_are_few_and_resolve() -> None:
    assert len(torchckpt.__all__) <= 16, torchckpt.__all__  # the classes and functions a user starts from
    assert len(set(torchckpt.__all__)) == len(torchckpt.__all__)
    for name in torchckpt.__all__:
        assert getattr(torchckpt, name) is not None


@pytest.mark.parametrize("pkg", ["torchckpt.schedules", "torchckpt.store", "torchckpt.memory", "torchckpt.codecs",
                                 "torchckpt.adjoint"])
def test_package_all_is_exact(pkg: str) -> None:
    s = importlib.import_module(pkg)
    assert len(set(s.__all__)) == len(s.__all__)
    for name in s.__all__:
        obj = getattr(s, name)
        assert getattr(obj, "__module__", pkg).startswith(pkg + "."), (name, obj)
    # __init__ re-exports only: every public non-module name it holds is in __all__.
    exported = {n for n in vars(s) if not n.startswith("_") and not isinstance(getattr(s, n), type(s))}
    assert exported == set(s.__all__)


@pytest.mark.parametrize("mod", ["torchckpt", "torchckpt.adjoint"])
def test_auto_is_a_deprecated_alias_of_auto_schedule(mod: str) -> None:
    """The adjoint's ``Auto`` is ``AutoSchedule`` now (``torchckpt.auto`` plans a model): the old name warns."""
    from torchckpt.adjoint import AutoSchedule
    with pytest.warns(FutureWarning, match="torchckpt.adjoint.AutoSchedule"):
        assert getattr(importlib.import_module(mod), "Auto") is AutoSchedule
    assert "Auto" not in torchckpt.__all__ and "AutoSchedule" in torchckpt.adjoint.__all__


def test_subpackages_stay_attributes() -> None:
    assert {torchckpt.codecs.__name__, torchckpt.planner.__name__, torchckpt.schedules.__name__} == {
        "torchckpt.codecs", "torchckpt.planner", "torchckpt.schedules"}
