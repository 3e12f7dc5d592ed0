"""The one executor of schedule actions, shared by ``checkpointed_loop`` and ``run_schedule``.

# NOTE [ Adjoint executor ]
# One schedule (torchckpt.schedules) drives both adjoints, with the semantics of NOTE
# [ Schedule actions ]; snapshots go through a ``SnapshotStore`` (NOTE [ Snapshot store ]).
# 1. ``execute`` dispatches one action (``functools.singledispatch`` on its class) to a
#    *driver*: the object that knows what Advance, Save, Restore, Adjoint, Prefetch, Free and
#    EndForward mean for one kind of adjoint (the user's callbacks for ``run_schedule``, the
#    autograd Function's forward and backward for ``checkpointed_loop``). ``End`` stops the run;
#    a driver may also stop it by returning False from ``end_forward``.
# 2. ``Planned`` (schedules/planned.py, NOTE [ Planned stream ] Rule 1) is the action stream the
#    executor reads: the schedule's actions with prefetches and write-back planned once the
#    driver's first ``save`` gave the store's slot count (``Planned.start(slots)``).
# 3. Planning streams (NOTE [ Planned stream ] Rule 2): no list of planned actions is built;
#    memory beyond the schedule's packed ints is the snapshots alive and the cache's slots.
# 4. Bad arguments (``store``, ``schedule``, ``slots``, the callbacks) raise at the call,
#    naming the argument and what to pass (``torchckpt/adjoint/args.py``).
"""
from __future__ import annotations

import functools
import sys
import time
from collections.abc import Iterator
from typing import Protocol

from torchckpt.schedules import Action, Adjoint, Advance, End, EndForward, Free, Prefetch, Restore, Save, Tier

__all__ = ["Driver", "execute", "run"]


class Driver(Protocol):
    """What one kind of adjoint does for each action (NOTE [ Adjoint executor ] Rule 1)."""

    def advance(self, n0: int, n1: int) -> None: ...
    def save(self, i: int, n: int, tier: Tier) -> None: ...
    def restore(self, n: int, tier: Tier) -> None: ...
    def adjoint(self, n: int) -> None: ...
    def prefetch(self, n: int, src: Tier, dst: Tier) -> None: ...
    def free(self, n: int, tier: Tier) -> None: ...
    def end_forward(self) -> bool: ...
    def end(self) -> None: ...


@functools.singledispatch
def execute(action: Action, driver: Driver, i: int) -> bool:
    """Execute ``action`` (at position ``i`` of the stream) on ``driver``; False stops the run."""
    raise TypeError(f"torchckpt: unknown schedule action {action!r}; a schedule holds actions of "
                    "torchckpt.schedules (Save, Advance, Restore, Adjoint, ...).")


@execute.register
def _(a: Advance, driver: Driver, i: int) -> bool:
    driver.advance(a.n0, a.n1)
    return True


@execute.register
def _(a: Save, driver: Driver, i: int) -> bool:
    driver.save(i, a.n, a.tier)
    return True


@execute.register
def _(a: Restore, driver: Driver, i: int) -> bool:
    driver.restore(a.n, a.tier)
    return True


@execute.register
def _(a: Adjoint, driver: Driver, i: int) -> bool:
    driver.adjoint(a.n)
    return True


@execute.register
def _(a: Prefetch, driver: Driver, i: int) -> bool:
    driver.prefetch(a.n, a.src, a.dst)
    return True


@execute.register
def _(a: Free, driver: Driver, i: int) -> bool:
    driver.free(a.n, a.tier)
    return True


@execute.register
def _(a: EndForward, driver: Driver, i: int) -> bool:
    return driver.end_forward()


@execute.register
def _(a: End, driver: Driver, i: int) -> bool:
    driver.end()
    return False


def run(actions: Iterator[tuple[int, Action]], driver: Driver) -> None:
    """Execute ``(position, action)`` pairs from ``actions`` until one stops the run or they end."""
    for i, a in actions:
        if not execute(a, driver, i):
            return


class Progress:
    """Adjoint progress on stderr every 10% (``progress=True``)."""

    def __init__(self, enabled: bool, n: int) -> None:
        self.enabled, self.n, self.done, self.t0, self.next = enabled, n, 0, time.perf_counter(), 0.1

    def adjoint(self) -> None:
        self.done += 1
        if self.enabled and self.done >= self.next * self.n:
            self.next += 0.1
            dt = time.perf_counter() - self.t0
            print(f"torchckpt: adjoint {self.done}/{self.n} steps, {dt:.1f} s", file=sys.stderr, flush=True)
