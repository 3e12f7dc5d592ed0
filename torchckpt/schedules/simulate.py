"""Run a schedule with no data: check it and count what it costs.

# NOTE [ Simulating a schedule ]
# ``simulate`` is a driver of the one executor (NOTE [ Executor ]), as the runtimes are: it follows
# NOTE [ Schedule actions ] exactly, holding step numbers instead of states.
# 1. It raises ``CheckpointError`` (messages start with ``torchckpt:``) on the first action
#    an executor could not carry out: an advance or save from another state than the
#    current one, a restore or free of a snapshot never saved or already freed, a second
#    save of a held snapshot, an adjoint step out of order (they must be n-1 .. 0, each
#    once) or from another state, an ``EndForward`` anywhere but at state n-1 before the
#    first adjoint, a slot limit exceeded, snapshots still held at ``End``, or no ``End``.
# 2. ``n_steps`` comes from the schedule (its ``n_steps``), or from the argument, or else
#    from the first adjoint step (which must be ``n_steps - 1``).
# 3. Bytes: a ``Save`` writes ``snapshot_bytes`` into its tier, a ``Restore`` reads them
#    out of it, a ``Prefetch`` moves them from ``src`` to ``dst`` (none when they are the
#    same: a pin of a cached copy, whose snapshot must be held in some tier). Prefetches
#    do not change which snapshots are held (NOTE [ Schedule actions ] Rule 6).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from torchckpt._errors import CheckpointError, internal_error
from torchckpt.schedules.actions import (
    Action,
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
from torchckpt.schedules.execute import Walker, walk
from torchckpt.schedules.schedule import check_int

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True, slots=True)
class SimResult:
    """What a schedule costs, per ``simulate``. Per-tier figures are read-only mappings.

    Attributes:
        n_steps: steps reversed.
        forward_steps: forward step evaluations by ``Advance`` (adjoint steps excluded).
        adjoint_steps: adjoint steps taken (== n_steps).
        actions: number of actions.
        peak_snapshots: most snapshots held at once, per tier.
        saves: ``Save`` count per tier.
        restores: ``Restore`` count per tier.
        bytes_saved: bytes written into each tier by saves.
        bytes_restored: bytes read out of each tier by restores.
        prefetches: ``Prefetch`` actions that move data (src != dst).
        bytes_prefetched: bytes those prefetches move.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> r = simulate(Revolve(10, 3), snapshot_bytes=8)
        >>> r.forward_steps, r.peak_snapshots[Tier.GPU]
        (15, 3)
    """

    n_steps: int
    forward_steps: int
    adjoint_steps: int
    actions: int
    peak_snapshots: Mapping[Tier, int] = field(hash=False)
    saves: Mapping[Tier, int] = field(hash=False)
    restores: Mapping[Tier, int] = field(hash=False)
    bytes_saved: Mapping[Tier, int] = field(hash=False)
    bytes_restored: Mapping[Tier, int] = field(hash=False)
    prefetches: int = 0
    bytes_prefetched: int = 0

    @property
    def recompute_ratio(self) -> float:
        """Forward advances per step: 1.0 means each step advanced once on average."""
        return self.forward_steps / self.n_steps

    @property
    def peak_total(self) -> int:
        """Most snapshots held at once, summed over tiers' peaks (an upper bound)."""
        return sum(self.peak_snapshots.values())


def _fail(i: int, act: Action, what: str) -> CheckpointError:
    return CheckpointError(f"torchckpt: invalid schedule at action {i} ({act!r}): {what}.")


class _Sim(Walker):
    """``simulate``'s driver: step numbers instead of states (NOTE [ Simulating a schedule ])."""

    def __init__(self, n_steps: int | None, limits: dict[Tier, int]) -> None:
        self.n_steps = n_steps
        self.limits = limits
        self.held: dict[Tier, set[int]] = {t: set() for t in Tier}
        self.count: dict[Tier, int] = {t: 0 for t in Tier}
        self.peak = dict(self.count)
        self.saves = dict(self.count)
        self.restores = dict(self.count)
        self.moved = self.forward = self.adjoints = 0
        self.cur: int | None = 0
        self.next_adjoint = None if n_steps is None else n_steps - 1
        self.ended_forward = self.ended = False

    def advance(self, act: Advance, i: int) -> None:
        if self.cur != act.n0:
            raise _fail(i, act, f"expected to advance from the current state {self.cur}, "
                                f"found a start at state {act.n0}")
        if act.n1 <= act.n0:
            raise _fail(i, act, "expected n1 > n0")
        if self.n_steps is not None and act.n1 > self.n_steps - 1:
            raise _fail(i, act, f"expected to stay at or below state n_steps-1 = "
                                f"{self.n_steps - 1} (the last step is taken by Adjoint)")
        self.forward += act.n1 - act.n0
        self.cur = act.n1

    def save(self, act: Save, i: int) -> None:
        if self.cur != act.n:
            raise _fail(i, act, f"expected to save the current state {self.cur}, found state {act.n}")
        slots = self.held[act.tier]
        if act.n in slots:
            raise _fail(i, act, f"snapshot {act.n} is already held in {act.tier!r}; "
                                "free it before saving it again")
        slots.add(act.n)
        c = self.count[act.tier] = self.count[act.tier] + 1
        limit = self.limits.get(act.tier)
        if limit is not None and c > limit:
            raise _fail(i, act, f"expected at most {limit} snapshots in {act.tier!r}, found {c}")
        if c > self.peak[act.tier]:
            self.peak[act.tier] = c
        self.saves[act.tier] += 1

    def restore(self, act: Restore, i: int) -> None:
        if act.n not in self.held[act.tier]:
            raise _fail(i, act, f"snapshot {act.n} is not held in {act.tier!r} "
                                "(never saved, or already freed)")
        self.restores[act.tier] += 1
        self.cur = act.n

    def free(self, act: Free, i: int) -> None:
        slots = self.held[act.tier]
        if act.n not in slots:
            raise _fail(i, act, f"snapshot {act.n} is not held in {act.tier!r} "
                                "(never saved, or already freed)")
        slots.remove(act.n)
        self.count[act.tier] -= 1

    def adjoint(self, act: Adjoint, i: int) -> None:
        if self.next_adjoint is None:
            if act.n < 0:
                raise _fail(i, act, "expected a step >= 0")
            self.n_steps = act.n + 1
            self.next_adjoint = act.n
        if act.n != self.next_adjoint:
            raise _fail(i, act, f"expected Adjoint({self.next_adjoint}) next (adjoint steps "
                                "run once each, from n_steps-1 down to 0)")
        if self.cur != act.n:
            raise _fail(i, act, f"expected the current state to be state {act.n}, found {self.cur}")
        if not self.ended_forward:
            raise _fail(i, act, "expected EndForward() before the first adjoint step")
        self.adjoints += 1
        self.next_adjoint -= 1
        self.cur = None

    def prefetch(self, act: Prefetch, i: int) -> None:
        if act.src is not act.dst:
            if act.n not in self.held[act.src]:
                raise _fail(i, act, f"snapshot {act.n} is not held in {act.src!r}")
            self.moved += 1
        elif not any(act.n in slots for slots in self.held.values()):
            raise _fail(i, act, f"snapshot {act.n} is not held in any tier")

    def end_forward(self, act: EndForward, i: int) -> None:
        if self.ended_forward:
            raise _fail(i, act, "expected a single EndForward()")
        if self.n_steps is not None and self.cur != self.n_steps - 1:
            raise _fail(i, act, f"expected the forward sweep to end at state "
                                f"{self.n_steps - 1}, found {self.cur}")
        self.ended_forward = True

    def end(self, act: End, i: int) -> None:
        if self.next_adjoint != -1:
            raise _fail(i, act, f"expected all adjoint steps before End(), "
                                f"Adjoint({self.next_adjoint}) is missing")
        left = sorted((t.name, n) for t, ns in self.held.items() for n in ns)
        if left:
            raise _fail(i, act, f"expected every snapshot freed before End(), "
                                f"found {len(left)} held, e.g. {left[:3]}")
        self.ended = True

    def unknown(self, act: object, i: int) -> TypeError:
        return TypeError(
            f"torchckpt: simulate() expected schedule actions, found "
            f"{type(act).__name__} {act!r} at position {i}; pass a Schedule or actions "
            "from torchckpt.schedules."
        )


def simulate(
    schedule: Iterable[Action],
    snapshot_bytes: int = 1,
    *,
    n_steps: int | None = None,
    capacity: Mapping[Tier, int] | None = None,
) -> SimResult:
    """Check a schedule action by action and count its costs (NOTE [ Simulating a schedule ]).

    Args:
        schedule: a ``Schedule`` or any iterable of actions.
        snapshot_bytes: size of one snapshot, for the byte counts.
        n_steps: steps to be reversed, when ``schedule`` does not say (NOTE [ Simulating a schedule ] Rule 2).
        capacity: slot limit per tier, when ``schedule`` does not say.

    Returns:
        A ``SimResult``.

    Raises:
        CheckpointError: the schedule cannot be executed (NOTE [ Simulating a schedule ] Rule 1).

    Example::

        >>> from torchckpt.schedules import Uniform
        >>> simulate(Uniform(8, 2)).forward_steps
        16
    """
    check_int("snapshot_bytes", snapshot_bytes, 0, "pass the size in bytes of one snapshot")
    if n_steps is None:
        n_steps = getattr(schedule, "n_steps", None)
    if capacity is None:
        capacity = getattr(schedule, "capacity", None)
    sim = _Sim(n_steps, dict(capacity) if capacity is not None else {})
    actions = iter(schedule)
    count = walk(actions, sim)  # stops after End() (NOTE [ Executor ] Rule 2)
    if not sim.ended:
        raise CheckpointError(
            f"torchckpt: invalid schedule: expected it to finish with End(), found "
            f"{count} actions without one; a schedule must be complete to be simulated."
        )
    for act in actions:  # NOTE [ Simulating a schedule ] Rule 1
        raise _fail(count, act, "expected nothing after End(), found another action")
    n_steps = sim.n_steps
    if n_steps is None:  # End() checked that every adjoint step ran, which sets it.
        raise internal_error("simulate() finished without knowing n_steps")
    peak, saves, restores, moved, forward, adjoints, i = (sim.peak, sim.saves, sim.restores, sim.moved, sim.forward,
                                                          sim.adjoints, count - 1)
    b = snapshot_bytes
    ro = MappingProxyType
    return SimResult(
        n_steps=n_steps,
        forward_steps=forward,
        adjoint_steps=adjoints,
        actions=i + 1,
        peak_snapshots=ro(peak),
        saves=ro(saves),
        restores=ro(restores),
        bytes_saved=ro({t: v * b for t, v in saves.items()}),
        bytes_restored=ro({t: v * b for t, v in restores.items()}),
        prefetches=moved,
        bytes_prefetched=moved * b,
    )
