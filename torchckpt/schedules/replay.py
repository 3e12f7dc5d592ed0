"""One replay of the snapshot cache over a schedule's off-GPU actions: the prefetches NOTE [ Prefetch setup ] plans
and the Saves NOTE [ Write-back ] flushes, for every planner of the package (``PrefetchStream``, ``flush_positions``,
``Planned``; pure Python).

# NOTE [ Cache replay ]
# 1. ``CacheReplay`` is the cache of NOTE [ Snapshot cache ] with the state both plans keep on it: the live
#    snapshots' Saves (their stream positions) and the evicted ones a read would flush. Its drivers read their own
#    form of the schedule (a stream of ``Action`` objects, or a packed schedule's codes, NOTE [ Packed schedules ])
#    and tell it each off-GPU Save, Restore and Free, and each Prefetch the stream already holds.
# 2. Planning (``restores`` given: the off-GPU Restores in order, with the position of the Save each reads, from
#    ``off_gpu_restores``), ``place(i)`` handles the restores NOTE [ Prefetch setup ] Rules 2-3 let it handle before
#    the schedule's position ``i``: each one's prefetch is appended to ``placed`` and takes effect on the cache (a
#    copy admits and pins, a pin pins) as the Prefetch action would. The replay then checks its own plan: a Save with
#    no slot, a planned restore that misses, a freed snapshot still pinned are internal errors. Between two of the
#    replay's events the cache does not change, so what ``place`` can handle there it can handle right after the
#    first (a restore's last-moment prefetch comes at the restore, an event itself): a driver that reads only the
#    events asks right after each and at each (``Planned``; the same streams, tests/schedules/test_planned_equivalence.py).
# 3. Write-back (``flush`` given): the replay calls ``flush(position)`` for each Save NOTE [ Write-back ] Rule 1
#    flushes, with the Save's stream position as the driver gave it (prefetches inserted before it counted), at the
#    read that decides it. Without planning, a restore that misses loads into a slot and a Save that finds every
#    slot pinned flushes at once, as the runtime does.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from torchckpt._errors import CheckpointError, internal_error
from torchckpt.schedules.actions import Restore
from torchckpt.schedules.cache import Cache
from torchckpt.schedules.packed import RESTORE, SAVE

__all__ = ["CacheReplay", "Event", "off_gpu_restores"]

S = TypeVar("S", bound=Hashable)  # where a snapshot lives off the GPU: a Tier, or a packed schedule's slot class
Event = tuple[int, int, int, S]  # (position, SAVE | RESTORE | FREE, step, source): an off-GPU Save, Restore or Free
Placed = tuple[int, int, "S | None"]  # (position, step, source or None for a pin): a prefetch planned before position


def off_gpu_restores(events: Iterator[Event[S]], tier: Callable[[S], object]) -> Iterator[tuple[int, int, S, int]]:
    """``(position, step, source, position of the Save it reads)`` of each off-GPU Restore among ``events``, in order
    (NOTE [ Cache replay ] Rule 2); ``tier(source)`` names the tier in the error for a snapshot never saved."""
    last_save: dict[int, int] = {}
    for r, op, n, k in events:
        if op == SAVE:
            last_save[n] = r
        elif op == RESTORE:
            s = last_save.get(n)
            if s is None:
                raise CheckpointError(
                    f"torchckpt: plan_prefetch: action {r} ({Restore(n, tier(k))!r}) restores a snapshot "  # type: ignore[arg-type]
                    "that was never saved; expected a valid schedule (check it with simulate()).")
            yield r, n, k, s
        else:
            last_save.pop(n, None)


class CacheReplay(Generic[S]):
    """The snapshot cache replayed for the prefetch plan and the write-back (NOTE [ Cache replay ]).

    Args:
        slots: the cache's snapshot slots (>= 1).
        flush: called with the stream position of each Save to flush (``None``: no write-back).
        restores: the off-GPU restores to plan prefetches for (``off_gpu_restores``; ``None``: no planning).

    Example::

        >>> r = CacheReplay(1, restores=iter([(3, 0, "host", 0)]))
        >>> r.save(0, 0)
        >>> r.place(1), r.placed
        (0, [])
        >>> r.place(3), r.placed
        (1, [(3, 0, None)])
    """

    __slots__ = ("cache", "saved_at", "pending", "flush", "placed", "_restores", "_nxt", "_slots", "_ahead",
                 "_planning")

    def __init__(self, slots: int, flush: Callable[[int], None] | None = None,
                 restores: Iterator[tuple[int, int, S, int]] | None = None) -> None:
        self.cache: Cache[int] = Cache(slots)
        self.saved_at: dict[int, int] = {}  # live snapshot -> stream position of its Save
        self.pending: dict[int, int] = {}  # evicted snapshot -> its Save, flushed if a read comes before its end
        self.flush = flush
        self.placed: list[Placed[S]] = []  # what place() planned, for the driver to take
        self._planning = restores is not None
        self._restores = restores
        self._nxt = next(restores, None) if restores is not None else None
        self._slots = slots
        self._ahead = slots - 1  # NOTE [ Prefetch setup ] Rule 3

    def _put(self, n: int) -> None:
        for old in self.cache.admit(n):
            s = self.saved_at.get(old)
            if s is not None:
                self.pending[old] = s

    def _read(self, n: int) -> None:
        s = self.pending.pop(n, None)
        if s is not None and self.flush is not None:
            self.flush(s)

    def save(self, n: int, at: int) -> None:
        """An off-GPU Save of step ``n`` at stream position ``at``."""
        self.pending.pop(n, None)
        self.saved_at[n] = at
        if self.cache.can_take():
            self._put(n)
        elif self._planning:
            raise internal_error("plan_prefetch left no slot for a Save")
        elif self.flush is not None:  # every slot pinned: it goes straight to host
            self.flush(at)

    def restore(self, n: int, at: int) -> None:
        """An off-GPU Restore of step ``n`` (``at``: its position, for the error)."""
        if not self.cache.use(n):
            if self._planning:
                raise internal_error(f"plan_prefetch planned a miss at action {at}")
            self._read(n)
            if self.cache.can_take():
                self._put(n)

    def free(self, n: int) -> None:
        """An off-GPU Free of step ``n``."""
        self.pending.pop(n, None)
        if self.cache.remove(n) and self._planning:
            raise internal_error(f"plan_prefetch pinned freed snapshot {n}")
        self.saved_at.pop(n, None)

    def prefetch(self, n: int, copy: bool) -> None:
        """A Prefetch of step ``n`` the stream holds (``copy``: from another tier; else a pin)."""
        cache = self.cache
        if n in cache:
            cache.pin(n)
        elif copy:
            self._read(n)
            if cache.can_take():
                self._put(n)
                cache.pin(n)

    def place(self, i: int) -> int:
        """Plan the prefetches due before position ``i`` (NOTE [ Prefetch setup ] Rules 2-3): appended to ``placed``;
        returns how many."""
        got = 0
        cache = self.cache
        while self._nxt is not None:
            pos, n, k, saved = self._nxt
            if saved >= i:
                break
            limit = self._slots if pos == i else self._ahead
            if n in cache:  # a pinned n: its slot, counted already, stays pinned (NOTE [ Prefetch setup ] Rule 3)
                if cache.pinned + (not cache.is_pinned(n)) > limit:
                    break
                self.placed.append((i, n, None))
            else:
                if cache.pinned + 1 > limit or not cache.can_take():
                    break
                self._read(n)  # the write-back's read of n (NOTE [ Write-back ] Rule 1)
                self._put(n)
                self.placed.append((i, n, k))
            cache.pin(n)
            got += 1
            self._nxt = next(self._restores, None)  # type: ignore[arg-type]
        return got

    def done(self) -> None:
        """The schedule has ended: every restore must have been handled."""
        if self._nxt is not None:
            raise internal_error("plan_prefetch left restores unhandled")
