"""The one executor of schedule actions, shared by ``checkpointed_loop`` and ``run_schedule``.

# NOTE [ Adjoint executor ]
# One schedule (torchckpt.schedules) drives both adjoints, with the semantics of NOTE
# [ Schedule actions ]; snapshots go through a ``SnapshotStore`` (NOTE [ Snapshot store ]).
# 1. ``execute`` dispatches one action (``functools.singledispatch`` on its class) to a
#    *driver*: the object that knows what Advance, Save, Restore, Adjoint, Prefetch, Free and
#    EndForward mean for one kind of adjoint (the user's callbacks for ``run_schedule``, the
#    autograd Function's forward and backward for ``checkpointed_loop``). ``End`` stops the run;
#    a driver may also stop it by returning False from ``end_forward``.
# 2. ``Planned`` is the action stream: the schedule's actions once, and, unless
#    ``prefetch=False``, with prefetches inserted by ``plan_prefetch`` so that every off-GPU
#    restore has its copy started ahead of time (GPUZIP's Prefetch Setup), and the write-back
#    decided by ``plan_flushes``. Both need the snapshot store's slot count, which a store
#    sized by bytes or holding a codec knows only from the first snapshot; nothing is cached
#    before the first Save (only Advances precede it), so the stream yields up to the first
#    Save unplanned, and the driver's first ``save`` calls ``Planned.start(slots)``, which
#    plans the rest.
# 3. Planning streams: no list of planned actions is built. ``start`` reads the schedule once
#    to decide the write-back (NOTE [ Write-back ] Rule 3; one bit per action), then the
#    stream plans prefetches again as the executor reads it (``PrefetchStream``). Memory
#    beyond the schedule's packed ints is the snapshots alive and the cache's slots.
# 4. Bad arguments (``store``, ``schedule``, ``slots``, the callbacks) raise at the call,
#    naming the argument and what to pass (``torchckpt/adjoint/args.py``).
"""
from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

from torchckpt._errors import CheckpointError
from torchckpt.schedules import (
    Action, Adjoint, Advance, End, EndForward, Free, PackedSchedule, Prefetch, PrefetchStream, Restore, Save, Schedule,
    Tier, flush_positions,
)

__all__ = ["Driver", "Planned", "execute", "run"]


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


class Planned:
    """A schedule's actions as the executor consumes them (NOTE [ Adjoint executor ] Rule 2).

    Iterating yields ``(position, action)``; positions count the planned stream (prefetches
    included). The same iterator continues where a previous loop over it stopped, so a forward
    sweep and a backward sweep can share it. Nothing holds the planned actions: ``start`` reads
    the schedule once to plan the write-back (one bit per action), and the stream plans the
    prefetches again as it is read (``PrefetchStream``).

    Args:
        actions: the schedule's actions, readable more than once (a ``PackedSchedule``, a list).
        prefetch: insert prefetches (``False``: restores load on demand).
    """

    def __init__(self, actions: Iterable[Action], prefetch: bool) -> None:
        self._acts = actions
        self._prefetch = prefetch
        self._i0 = next((i for i, a in enumerate(actions) if type(a) is Save), -1)
        self._slots: int | None = None
        self._flushes = bytearray()
        self._it = self._stream()

    @staticmethod
    def of(schedule: Iterable[Action], prefetch: bool) -> Planned:
        """The stream of a schedule (packed once, so that reading it again does not plan it again) or a list."""
        if isinstance(schedule, Schedule):
            return Planned(schedule.pack(), prefetch)
        return Planned(schedule if isinstance(schedule, (list, tuple, PackedSchedule)) else list(schedule), prefetch)

    def _rest(self) -> Iterator[Action]:
        """A fresh read of the planned actions from the first Save on."""
        slots = self._slots
        assert slots is not None
        if not self._prefetch:
            return itertools.islice(self._acts, self._i0, None)
        return iter(PrefetchStream(_From(self._acts, self._i0), slots))

    def start(self, slots: int) -> None:
        """Plan from the first Save on for a cache of ``slots`` slots (once; later calls do nothing)."""
        if self._slots is not None:
            return
        self._slots = slots
        bits = self._flushes
        for f in flush_positions(self._rest(), slots):
            f += self._i0
            if f >> 3 >= len(bits):
                bits.extend(bytes((f >> 3) + 1 - len(bits)))
            bits[f >> 3] |= 1 << (f & 7)

    def flush(self, i: int) -> bool:
        """Whether the Save at position ``i`` copies its snapshot to host now (NOTE [ Write-back ])."""
        return (i >> 3) < len(self._flushes) and bool(self._flushes[i >> 3] >> (i & 7) & 1)

    def _stream(self) -> Iterator[tuple[int, Action]]:
        it = iter(self._acts)
        if self._i0 < 0:  # no Save: nothing to plan
            yield from enumerate(it)
            return
        for i, a in enumerate(itertools.islice(it, self._i0 + 1)):
            yield i, a
        if self._slots is None:
            raise CheckpointError("torchckpt: the first Save was not executed before the actions after it "
                                  "(internal: the driver's save must call Planned.start)")
        rest = self._rest()
        next(rest)  # the first Save, already yielded (no prefetch precedes it: nothing is saved before it)
        for k, a in enumerate(rest, start=self._i0 + 1):
            yield k, a

    def __iter__(self) -> Iterator[tuple[int, Action]]:
        return self._it


class _From:
    """The actions of ``acts`` from position ``i0`` on, readable more than once."""

    __slots__ = ("acts", "i0")

    def __init__(self, acts: Iterable[Action], i0: int) -> None:
        self.acts, self.i0 = acts, i0

    def __iter__(self) -> Iterator[Action]:
        return itertools.islice(self.acts, self.i0, None)


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
