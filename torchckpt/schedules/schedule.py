"""What every checkpoint schedule offers: a step count, slot capacities, its actions.

# NOTE [ Schedules are values ]
# 1. A schedule is a frozen, slotted dataclass holding its configuration only; it is
#    validated in ``__post_init__`` and raises ``ValueError``/``TypeError`` naming the
#    argument to change. The actions are built when asked for (``actions()`` or ``iter``),
#    fresh each time, so a schedule can be shared and reused.
# 2. ``plan()`` does the planning and returns the actions packed (NOTE [ Packed schedules ]);
#    iterating a schedule decodes its plan action by action; ``actions()`` builds a list.
# 3. ``capacity`` says how many snapshot slots the schedule may hold at once per tier;
#    ``simulate`` checks the actions against it.
"""
from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping

from torchckpt.schedules.actions import Action, Tier
from torchckpt.schedules.packed import PackedSchedule

__all__ = ["Schedule"]


class Schedule(abc.ABC):
    """Base class of schedules: iterate it to get its actions.

    Subclasses are frozen dataclasses with an ``n_steps`` field.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> list(Revolve(2, 1))
        [Save(0, Tier.GPU), Advance(0, 1), EndForward(), Adjoint(1), Restore(0, Tier.GPU), Free(0, Tier.GPU), Adjoint(0), End()]
    """

    __slots__ = ()
    n_steps: int

    @property
    @abc.abstractmethod
    def capacity(self) -> Mapping[Tier, int]:
        """Most snapshots held at once, per tier."""

    @abc.abstractmethod
    def pack(self) -> PackedSchedule:
        """Pack the schedule: its actions packed one int each (NOTE [ Packed schedules ])."""

    def actions(self) -> list[Action]:
        """All actions of the schedule, in order, ending with ``End()``."""
        return list(self.pack())

    def __iter__(self) -> Iterator[Action]:
        return iter(self.pack())


def check_int(name: str, value: object, minimum: int, hint: str) -> int:
    """Validate an integer argument (not bool) with a lower bound; return it.

    Args:
        name: the argument's name, as the user wrote it.
        value: what was passed.
        minimum: smallest allowed value.
        hint: what to pass instead, appended to the message.

    Returns:
        ``value`` as an ``int``.

    Example::

        >>> check_int("n_steps", 3, 1, "pass the number of time steps")
        3
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"torchckpt: {name} must be an int, found {type(value).__name__} {value!r}; {hint}."
        )
    if value < minimum:
        raise ValueError(f"torchckpt: {name} must be >= {minimum}, found {value}; {hint}.")
    return int(value)


def check_steps_snapshots_tier(n_steps: object, snapshots: object, tier: object) -> None:
    """Validate the (n_steps, snapshots, tier) arguments shared by single-tier schedules.

    Example::

        >>> check_steps_snapshots_tier(10, 3, Tier.GPU)
    """
    check_int("n_steps", n_steps, 1, "pass the number of forward steps to reverse")
    check_int("snapshots", snapshots, 1, "pass how many snapshot slots may be used, the one holding x0 included")
    if snapshots > n_steps:  # type: ignore[operator]
        raise ValueError(
            f"torchckpt: snapshots={snapshots} is more than n_steps={n_steps}: a schedule of "
            f"n steps can use at most n snapshots; pass snapshots=min(snapshots, n_steps)."
        )
    if not isinstance(tier, Tier):
        raise TypeError(
            f"torchckpt: tier must be a Tier, found {type(tier).__name__} {tier!r}; pass e.g. Tier.GPU or Tier.HOST."
        )
