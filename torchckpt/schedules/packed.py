"""A schedule's actions packed one int each, decoded into action objects on demand.

# NOTE [ Packed schedules ]
# A schedule of 10^5 steps has ~5*10^5 actions. Building that many Python objects costs
# ~0.4 s in CPython, half of it in the cyclic garbage collector scanning them, while
# planning itself (the decisions) takes a few tens of milliseconds. So schedules plan into
# a ``PackedSchedule``: a list of ints, one per action, and executors iterate it, which creates each
# action as it is consumed (O(1) memory per action for a streaming executor).
# 1. An action code is ``value << 3 | op``. The state an ``Advance`` starts from, and the
#    state a ``Save`` or ``Adjoint`` applies to, is the current state, tracked while
#    decoding (a valid schedule never does otherwise, NOTE [ Schedule actions ]).
# 2. Snapshots are placed by a *slot class* k, an index into ``PackedSchedule.tiers``: ``Save``'s
#    value is k; ``Restore``/``Free`` carry ``n * len(tiers) + k``. Revolve uses one class
#    per slot, so a two-tier variant (Multistage) only changes ``tiers``.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from torchckpt._errors import internal_error
from torchckpt.schedules.actions import (
    Action,
    Adjoint,
    Advance,
    End,
    EndForward,
    Free,
    Restore,
    Save,
    Tier,
)

__all__ = ["PackedSchedule", "PackedBuilder"]

ADVANCE, SAVE, RESTORE, FREE, ADJOINT, END_FORWARD, END = range(7)


@dataclass(frozen=True, slots=True)
class PackedSchedule:
    """Packed actions of a schedule (NOTE [ Packed schedules ]); iterate it for the actions.

    Args:
        codes: one int per action (NOTE [ Packed schedules ] Rule 1).
        tiers: tier of each slot class (NOTE [ Packed schedules ] Rule 2).

    Returns:
        An iterable of actions with a length.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> p = Revolve(3, 2).pack()
        >>> len(p), next(iter(p))
        (13, Save(0, Tier.GPU))
    """

    codes: list[int] = field(repr=False, hash=False)
    tiers: tuple[Tier, ...]

    def __len__(self) -> int:
        return len(self.codes)

    def __iter__(self) -> Iterator[Action]:
        tiers = self.tiers
        k_count = len(tiers)
        cur = 0
        for code in self.codes:
            op = code & 7
            v = code >> 3
            if op == ADVANCE:
                yield Advance(cur, v)
                cur = v
            elif op == ADJOINT:
                yield Adjoint(cur)
            elif op == RESTORE:
                cur, k = divmod(v, k_count)
                yield Restore(cur, tiers[k])
            elif op == SAVE:
                yield Save(cur, tiers[v])
            elif op == FREE:
                n, k = divmod(v, k_count)
                yield Free(n, tiers[k])
            elif op == END_FORWARD:
                yield EndForward()
            elif op == END:
                yield End()
            else:
                raise internal_error(f"unknown action code {code} in a packed plan")

    def forward_steps(self) -> int:
        """Forward step evaluations by its advances, counted without building actions.

        Returns:
            The sum of ``n1 - n0`` over its ``Advance`` actions.

        Example::

            >>> from torchckpt.schedules import Revolve
            >>> Revolve(100, 5).pack().forward_steps()
            316
        """
        k_count = len(self.tiers)
        cur = total = 0
        for code in self.codes:
            op = code & 7
            if op == ADVANCE:
                v = code >> 3
                total += v - cur
                cur = v
            elif op == RESTORE:
                cur = (code >> 3) // k_count
        return total


class PackedBuilder:
    """Accumulates action codes for a ``PackedSchedule`` (NOTE [ Packed schedules ]).

    Args:
        tiers: tier of each slot class.

    Example::

        >>> b = PackedBuilder((Tier.GPU,))
        >>> b.end_forward(); b.adjoint()
        >>> list(b.build())
        [EndForward(), Adjoint(0), End()]
    """

    __slots__ = ("codes", "tiers", "_k")

    def __init__(self, tiers: tuple[Tier, ...]) -> None:
        self.codes: list[int] = []
        self.tiers = tiers
        self._k = len(tiers)

    def advance(self, n1: int) -> None:
        """``Advance(current, n1)``."""
        self.codes.append(n1 << 3 | ADVANCE)

    def save(self, k: int = 0) -> None:
        """``Save(current, tiers[k])``."""
        self.codes.append(k << 3 | SAVE)

    def restore(self, n: int, k: int = 0) -> None:
        """``Restore(n, tiers[k])``."""
        self.codes.append((n * self._k + k) << 3 | RESTORE)

    def free(self, n: int, k: int = 0) -> None:
        """``Free(n, tiers[k])``."""
        self.codes.append((n * self._k + k) << 3 | FREE)

    def adjoint(self) -> None:
        """``Adjoint(current)``."""
        self.codes.append(ADJOINT)

    def end_forward(self) -> None:
        """``EndForward()``."""
        self.codes.append(END_FORWARD)

    def build(self) -> PackedSchedule:
        """Append ``End()`` and return the plan."""
        self.codes.append(END)
        return PackedSchedule(self.codes, self.tiers)
