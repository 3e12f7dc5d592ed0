"""Actions are frozen, slotted values whose repr is code."""
from __future__ import annotations

import dataclasses

import pytest

import torchckpt.schedules as S
from torchckpt.schedules import (
    Adjoint,
    Advance,
    End,
    EndForward,
    Free,
    Prefetch,
    Restore,
    Save,
    Tier,
)

EXAMPLES = [
    Advance(0, 5), Save(3, Tier.HOST), Restore(3, Tier.GPU), Free(2, Tier.DISK), Adjoint(7),
    Prefetch(4, Tier.HOST, Tier.GPU), EndForward(), End(),
]


@pytest.mark.parametrize("action", EXAMPLES, ids=repr)
def test_repr_round_trips(action: object) -> None:
    assert eval(repr(action), vars(S)) == action


def test_repr_is_positional() -> None:
    assert repr(Advance(0, 5)) == "Advance(0, 5)"
    assert repr(Save(1, Tier.HOST)) == "Save(1, Tier.HOST)"


@pytest.mark.parametrize("action", EXAMPLES, ids=repr)
def test_frozen_and_slotted(action: object) -> None:
    assert dataclasses.is_dataclass(action)
    assert not hasattr(action, "__dict__")
    fields = dataclasses.fields(action)  # type: ignore[arg-type]
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(action, fields[0].name, 1)
    assert hash(action) == hash(eval(repr(action), vars(S)))


def test_schedule_iteration_and_plan_agree() -> None:
    r = S.Revolve(30, 4)
    assert list(r) == r.actions() == list(r.pack())
    assert len(r.pack()) == len(r.actions())


@pytest.mark.parametrize(
    "make",
    [
        lambda: S.Revolve(0, 3),
        lambda: S.Revolve(10, 0),
        lambda: S.Uniform(10, 0),
        lambda: S.ZCut(0),
        lambda: S.ZCut(10, segment=0),
        lambda: S.Multistage(10, 0, 0),
        lambda: S.Multistage(10, -1, 2),
    ],
)
def test_config_validation_raises_value_error(make) -> None:
    with pytest.raises(ValueError, match="^torchckpt: "):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: S.Revolve(10.0, 3),  # type: ignore[arg-type]
        lambda: S.Revolve(10, True),
        lambda: S.Revolve(10, 3, tier="gpu"),  # type: ignore[arg-type]
        lambda: S.Uniform(10, "2"),  # type: ignore[arg-type]
        lambda: S.ZCut(10, segment=2.5),  # type: ignore[arg-type]
    ],
)
def test_config_validation_raises_type_error(make) -> None:
    with pytest.raises(TypeError, match="^torchckpt: "):
        make()


def test_schedules_are_frozen_values() -> None:
    r = S.Revolve(10, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.snapshots = 4  # type: ignore[misc]
    assert r == S.Revolve(10, 3)
    assert eval(repr(r), vars(S)) == r
    z = S.ZCut(100, memory_slots=30)
    assert eval(repr(z), vars(S)) == z
