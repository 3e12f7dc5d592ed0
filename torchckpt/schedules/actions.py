"""The actions a checkpoint schedule is made of: small immutable values.

# NOTE [ Schedule actions ]
# A schedule is an iterable of actions; executors (``simulate``, the runtime in
# ``torchckpt.adjoint``) dispatch on the action type. The semantics every executor follows:
# 1. The forward state is numbered by step: state ``n`` is the input of forward step ``n``
#    (``n -> n+1``); state 0 is the initial value x0. There is one *current* state, held by
#    the executor outside any snapshot slot.
# 2. ``Advance(n0, n1)`` runs forward steps ``n0 .. n1-1`` from current state ``n0`` without
#    recording anything for the adjoint; the current state becomes ``n1``. It costs
#    ``n1 - n0`` forward step evaluations: these are what "forward advances" counts.
# 3. ``Adjoint(n)`` reverses forward step ``n`` and needs current state ``n``. The executor
#    re-evaluates step ``n`` with recording (autograd) and back-propagates through it, so the
#    forward evaluation inside an adjoint step is part of the adjoint step and is *not*
#    counted as an advance. Afterwards the current state is undefined: the next state comes
#    from a ``Restore``. Adjoint steps come exactly once each, in order ``n_steps-1 .. 0``.
# 4. The forward sweep stops at state ``n_steps - 1``: ``EndForward`` marks that point, and
#    the first reverse action is ``Adjoint(n_steps - 1)``. Its recorded re-evaluation of step
#    ``n_steps - 1`` produces the output ``x_{n_steps}``; an autograd executor that must hand
#    the output back before backward does that recorded evaluation at ``EndForward`` and
#    keeps its graph for ``Adjoint(n_steps - 1)``, so no step is evaluated twice. This is
#    Griewank and Walther's convention, and with it Revolve's count is exactly
#    ``t*n - C(s+t, s+1)`` (see revolve.py).
# 5. ``Save(n, tier)`` copies the current state (which must be state ``n``) into a snapshot
#    slot of ``tier``; ``Restore(n, tier)`` makes a copy of that snapshot the current state
#    and keeps the snapshot; ``Free(n, tier)`` releases the slot. A snapshot is named by its
#    step and tier: at most one snapshot of state ``n`` per tier.
# 6. ``Prefetch(n, src, dst)`` asks for snapshot ``n`` to be brought from ``src`` to ``dst``
#    ahead of its next ``Restore`` (it starts an asynchronous copy, or, when ``src == dst``,
#    only reserves the resident copy so that nothing evicts it first). It does not change
#    which snapshots a schedule holds: the ``Restore`` that follows still names the tier the
#    schedule saved to (see prefetch.py).
# 7. ``End`` closes the schedule; every snapshot has been freed by then.
# 8. Actions carry no validation of their own (a schedule of 10^5 steps creates ~10^6 of
#    them): ``simulate`` checks a whole schedule. Their ``repr`` is code that rebuilds them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields

__all__ = [
    "Action",
    "Adjoint",
    "Advance",
    "End",
    "EndForward",
    "Free",
    "Prefetch",
    "Restore",
    "Save",
    "Tier",
]


class Tier(enum.Enum):
    """Where a snapshot lives: GPU memory, host memory or disk.

    Example::

        >>> Tier.HOST
        Tier.HOST
    """

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"

    def __repr__(self) -> str:
        return f"Tier.{self.name}"


class Action:
    """Base class of schedule actions; its ``repr`` is a constructor call.

    Example::

        >>> Advance(0, 5)
        Advance(0, 5)
    """

    __slots__ = ()

    def __repr__(self) -> str:
        args = ", ".join(repr(getattr(self, f.name)) for f in fields(self))  # type: ignore[arg-type]
        return f"{type(self).__name__}({args})"


@dataclass(frozen=True, slots=True, repr=False)
class Advance(Action):
    """Run forward steps ``n0 .. n1-1`` without recording; current state becomes ``n1``.

    Args:
        n0: current state's step on entry.
        n1: step of the state reached (``n1 > n0``).

    Example::

        >>> Advance(0, 5).n1 - Advance(0, 5).n0
        5
    """

    n0: int
    n1: int


@dataclass(frozen=True, slots=True, repr=False)
class Save(Action):
    """Copy the current state (state ``n``) into a snapshot slot of ``tier``.

    Args:
        n: step of the current state.
        tier: where the snapshot is kept.

    Example::

        >>> Save(3, Tier.HOST)
        Save(3, Tier.HOST)
    """

    n: int
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True, repr=False)
class Restore(Action):
    """Make (a copy of) snapshot ``n`` held in ``tier`` the current state; keep the snapshot.

    Args:
        n: step of the snapshot.
        tier: tier that holds it.

    Example::

        >>> Restore(3, Tier.GPU)
        Restore(3, Tier.GPU)
    """

    n: int
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True, repr=False)
class Free(Action):
    """Release the slot of snapshot ``n`` in ``tier``.

    Args:
        n: step of the snapshot.
        tier: tier that holds it.

    Example::

        >>> Free(3, Tier.GPU)
        Free(3, Tier.GPU)
    """

    n: int
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True, repr=False)
class Adjoint(Action):
    """Reverse forward step ``n`` (``n -> n+1``); needs current state ``n``.

    The recorded re-evaluation of step ``n`` belongs to this action (NOTE [ Schedule
    actions ] Rule 3).

    Args:
        n: the step to reverse.

    Example::

        >>> Adjoint(7)
        Adjoint(7)
    """

    n: int


@dataclass(frozen=True, slots=True, repr=False)
class Prefetch(Action):
    """Bring snapshot ``n`` from ``src`` to ``dst`` ahead of its next ``Restore``.

    ``src == dst`` reserves an already resident copy (no data moves).

    Args:
        n: step of the snapshot.
        src: tier it is copied from.
        dst: tier it is copied to.

    Example::

        >>> Prefetch(4, Tier.HOST, Tier.GPU)
        Prefetch(4, Tier.HOST, Tier.GPU)
    """

    n: int
    src: Tier = Tier.HOST
    dst: Tier = Tier.GPU


@dataclass(frozen=True, slots=True, repr=False)
class EndForward(Action):
    """The forward sweep has reached state ``n_steps - 1``; the reverse sweep starts.

    Example::

        >>> EndForward()
        EndForward()
    """


@dataclass(frozen=True, slots=True, repr=False)
class End(Action):
    """The schedule is complete; all snapshots have been freed.

    Example::

        >>> End()
        End()
    """
