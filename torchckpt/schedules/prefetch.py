"""Prefetch planning for a GPU snapshot cache: a dry run of the schedule.

Maltempi, T. et al. (2025), GPUZIP: a GPU cache of N snapshot slots in front of host
memory; since a schedule is deterministic, a dry run with a dummy cache predicts every
miss, and its Prefetch Setup Algorithm turns each into a prefetch issued early enough to
overlap the copy with computation.

# NOTE [ Snapshot cache ]
# The snapshot cache is the ``Cache`` of NOTE [ Cache model ] with every snapshot of size 1,
# shared by ``plan_prefetch``, ``plan_flushes``, ``simulate_cache`` and the runtime store.
# 1. The cache has ``cache_slots`` slots of one snapshot each. It fronts the snapshots a
#    schedule keeps off the GPU (tier HOST or DISK); snapshots saved to Tier.GPU are
#    already on the device and bypass it. A snapshot is named by its step (a schedule
#    holds a step in at most one off-GPU tier at a time).
# 2. ``Save(n, HOST)`` puts n in the cache as most recently used, and the store flushes it
#    to host memory behind the computation. Its slot is an empty one, else the least
#    recently used *unpinned* one (evicted: the host copy stays valid).
# 3. ``Prefetch(n, HOST, GPU)`` copies n from host into a slot chosen as in Rule 2 and
#    *pins* it; ``Prefetch(n, GPU, GPU)`` pins n where it already is (no copy). A pin
#    belongs to one future ``Restore`` of n and ends there; pinned slots are never
#    evicted, so a prefetched snapshot is never evicted before its use.
# 4. ``Restore(n, HOST)`` hits if n is in the cache (it becomes most recently used), else
#    misses: a synchronous host-to-device copy into a slot chosen as in Rule 2 (so that a
#    later restore of n hits), or straight into the state when every slot is pinned.
#    ``Free(n, HOST)`` drops n.
#
# NOTE [ Prefetch setup ]
# ``plan_prefetch`` replays the schedule on the cache of NOTE [ Snapshot cache ] and
# inserts one ``Prefetch`` per off-GPU ``Restore``: a copy where the restore would miss,
# a pin where it would hit (without the pin, a later Save could evict it).
# 1. Restores are handled in the order they occur. Handling one means emitting its
#    Prefetch, which pins its snapshot until that restore.
# 2. A restore is handled at the earliest point where: every earlier restore has been
#    handled; its snapshot's Save has run; and a slot can be given up. Every unpinned slot
#    qualifies, because everything needed before this restore is pinned (Rule 1): its
#    content is not needed again before the restore.
# 3. Ahead of its restore a handling may leave at most ``cache_slots - 1`` slots pinned, so
#    a Save always finds a slot. Right before its restore it may take the last one; by
#    then nothing else is pinned (Rule 1), so that always succeeds. A snapshot pinned
#    again for a later restore while pinned for an earlier one takes no new slot, but
#    keeps its slot pinned past the earlier restore, so it counts as one pinned slot
#    against the same limit (with one slot and another Save between two restores of one
#    snapshot, pinning it again ahead left the Save no slot: an internal error on a
#    valid schedule, tests/schedules/test_planned_equivalence.py).
# 4. Hence every restore hits, for any ``cache_slots >= 1``. With 1 slot every prefetch is
#    issued just before its restore (no overlap); ``cache_slots >= 2`` is the useful
#    minimum, and more slots let prefetches start earlier (see ``CacheStats.mean_lead``).
# 5. The dry run of GPUZIP without prefetches is ``simulate_cache(schedule, slots)``:
#    its misses are what the plan turns into copies.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torchckpt.schedules.cache import Cache
from torchckpt.schedules.actions import (
    Action,
    Adjoint,
    Advance,
    Free,
    Prefetch,
    Restore,
    Save,
    Tier,
)
from torchckpt.schedules.execute import Walker, bind
from torchckpt.schedules.packed import FREE, RESTORE, SAVE
from torchckpt.schedules.replay import CacheReplay, Event, off_gpu_restores
from torchckpt.schedules.schedule import check_int

__all__ = ["CacheStats", "PrefetchStream", "PrefetchedSchedule", "flush_positions", "plan_flushes", "plan_prefetch",
           "simulate_cache"]


@dataclass(frozen=True, slots=True)
class PrefetchedSchedule:
    """A schedule with prefetches inserted (NOTE [ Prefetch setup ]); iterate it for actions.

    Attributes:
        actions: the schedule's actions with ``Prefetch`` actions inserted.
        cache_slots: the cache size planned for.
        copies: prefetches that copy a snapshot host-to-device (would-be misses).
        pins: prefetches that only pin a resident snapshot (would-be hits).

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> p = plan_prefetch(Revolve(20, 4, tier=Tier.HOST), cache_slots=2)
        >>> simulate_cache(p, 2).misses
        0
    """

    actions: tuple[Action, ...]
    cache_slots: int
    copies: int
    pins: int

    def __iter__(self) -> Iterator[Action]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)


def _two_iterators(actions: Iterable[Action]) -> tuple[Iterator[Action], Iterator[Action]]:
    """Two independent iterators over ``actions``: fresh ones where it can be read again, else a tee."""
    if isinstance(actions, PrefetchedSchedule):
        actions = actions.actions
    first = iter(actions)
    if first is actions:  # read once: the tee buffers only the actions between its two readers
        a, b = itertools.tee(first)
        return a, b
    return first, iter(actions)


def _cached(act: Save | Restore | Free) -> bool:
    return act.tier is not Tier.GPU


class _Events(Walker):
    """The replay's event of each action a scout reads (NOTE [ Cache replay ] Rule 1): an off-GPU Save, Restore or
    Free, with its tier."""

    def __init__(self) -> None:
        self.found: Event[Tier] | None = None

    def save(self, act: Save, i: int) -> None:
        if _cached(act):
            self.found = (i, SAVE, act.n, act.tier)

    def restore(self, act: Restore, i: int) -> None:
        if _cached(act):
            self.found = (i, RESTORE, act.n, act.tier)

    def free(self, act: Free, i: int) -> None:
        if _cached(act):
            self.found = (i, FREE, act.n, act.tier)


def _events(scout: Iterator[Action]) -> Iterator[Event[Tier]]:
    """The replay's events of a stream of actions, as a scout reads it (up to ``End``)."""
    w = _Events()
    step = bind(w)  # NOTE [ Executor ] Rule 6: one lookup of the walker's methods for the whole scout
    for i, a in enumerate(scout):
        go = step(a, i)
        if w.found is not None:
            yield w.found
            w.found = None
        if not go:  # End
            return


class _Follow(Walker):
    """Tells a ``CacheReplay`` each off-GPU Save, Restore and Free of a stream and, with ``prefetches``, each
    Prefetch it holds (NOTE [ Cache replay ] Rule 1)."""

    def __init__(self, replay: CacheReplay[Tier], prefetches: bool) -> None:
        self.replay = replay
        self.prefetches = prefetches

    def save(self, act: Save, i: int) -> None:
        if _cached(act):
            self.replay.save(act.n, i)

    def restore(self, act: Restore, i: int) -> None:
        if _cached(act):
            self.replay.restore(act.n, i)

    def free(self, act: Free, i: int) -> None:
        if _cached(act):
            self.replay.free(act.n)

    def prefetch(self, act: Prefetch, i: int) -> None:
        if self.prefetches:
            self.replay.prefetch(act.n, act.src is not act.dst)


def _same(tier: Tier) -> Tier:
    return tier


class PrefetchStream:
    """A schedule's actions with prefetches inserted, planned as they are read (NOTE [ Prefetch setup ]).

    Iterate it once for the actions. It reads the schedule through two iterators, one at the
    action being emitted and one scouting for the next restore to handle (NOTE [ Prefetch setup ] Rule 2), so it holds
    the snapshots alive and the cache's slots, not the schedule: its memory does not grow with
    the number of actions. ``copies`` and ``pins`` count the prefetches emitted so far.

    Args:
        actions: a schedule or its actions; read twice if it can be (a ``Schedule``, a list),
            else through ``itertools.tee``.
        cache_slots: snapshot slots of the GPU cache (>= 1; >= 2 to overlap copies).

    Raises:
        CheckpointError: while iterating, a restore of a snapshot that was never saved.

    Example::

        >>> from torchckpt.schedules import Uniform
        >>> s = PrefetchStream(Uniform(30, 3, tier=Tier.HOST).pack(), 2)
        >>> n = sum(1 for _ in s)
        >>> s.copies, s.pins
        (1, 28)
    """

    __slots__ = ("copies", "pins", "_it")

    def __init__(self, actions: Iterable[Action], cache_slots: int) -> None:
        check_int("cache_slots", cache_slots, 1,
                  "pass how many snapshots the GPU cache holds (2 or more to overlap copies)")
        self.copies = self.pins = 0
        main, scout = _two_iterators(actions)
        self._it = self._plan(main, scout, cache_slots)

    def __iter__(self) -> Iterator[Action]:
        return self._it

    def _plan(self, main: Iterator[Action], scout: Iterator[Action], cache_slots: int) -> Iterator[Action]:
        replay: CacheReplay[Tier] = CacheReplay(cache_slots, restores=off_gpu_restores(_events(scout), _same))
        place, placed = replay.place, replay.placed
        follow = bind(_Follow(replay, prefetches=False))  # NOTE [ Cache replay ] Rule 2: the replay checks its plan
        gpu = Tier.GPU
        for i, act in enumerate(main):
            if place(i):  # NOTE [ Prefetch setup ] Rule 2
                for _, n, src in placed:
                    if src is None:
                        yield Prefetch(n, gpu, gpu)
                        self.pins += 1
                    else:
                        yield Prefetch(n, src, gpu)
                        self.copies += 1
                placed.clear()
            yield act
            follow(act, i)
        replay.done()


def plan_prefetch(schedule: Iterable[Action], cache_slots: int) -> PrefetchedSchedule:
    """Insert prefetches so that every off-GPU restore hits the cache (NOTE [ Prefetch setup ]).

    The whole plan at once; ``PrefetchStream`` plans the same actions as they are read.

    Args:
        schedule: a schedule or its actions; snapshots on HOST/DISK go through the cache.
        cache_slots: snapshot slots of the GPU cache (>= 1; >= 2 to overlap copies).

    Returns:
        A ``PrefetchedSchedule``.

    Raises:
        CheckpointError: a restore of a snapshot that was never saved.

    Example::

        >>> from torchckpt.schedules import Uniform
        >>> plan = plan_prefetch(Uniform(30, 3, tier=Tier.HOST), cache_slots=2)
        >>> plan.copies, plan.pins
        (1, 28)
    """
    s = PrefetchStream(schedule, cache_slots)
    acts = tuple(s)
    return PrefetchedSchedule(acts, cache_slots, s.copies, s.pins)


def flush_positions(actions: Iterable[Action], cache_slots: int) -> Iterator[int]:
    """Positions of the off-GPU Saves to copy to host (NOTE [ Write-back ]), found as the actions are read.

    A position may come more than once, and comes after its Save was read: the first read
    that follows an eviction of the snapshot decides it. Memory is the snapshots alive and
    the cache's slots, whatever the number of actions.

    Args:
        actions: a schedule's actions, normally a ``PrefetchStream``.
        cache_slots: the GPU cache's slots.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> sorted(set(flush_positions(Revolve(6, 2, tier=Tier.HOST), 1)))
        [0]
    """
    check_int("cache_slots", cache_slots, 1, "pass how many snapshots the GPU cache holds")
    out: list[int] = []
    step = bind(_Follow(CacheReplay(cache_slots, flush=out.append), prefetches=True))  # NOTE [ Cache replay ] Rule 3
    for i, act in enumerate(actions):
        step(act, i)
        if out:
            yield from out
            out.clear()


def plan_flushes(actions: Iterable[Action], cache_slots: int) -> frozenset[int]:
    """Positions of the off-GPU ``Save`` actions whose snapshot must be copied to host (write-back).

    # NOTE [ Write-back ]
    # GPUZIP flushes every snapshot to host as it is saved. A snapshot that is freed, saved
    # again or never read again while it still sits in its slot needs no host copy at all.
    # Replaying the actions on the cache of NOTE [ Snapshot cache ] tells which snapshots are
    # evicted while a later Restore or Prefetch still reads them: only their Saves flush.
    # 1. A Save flushes when, after an eviction of its snapshot, a read of it (a Restore
    #    that misses, a copying Prefetch) comes before the snapshot's next Save or Free; a
    #    Save that finds every slot pinned flushes too (it goes straight to host).
    # 2. The runtime flushes any other snapshot at the moment it is evicted (never lost), so
    #    this plan only decides which copies start early, overlapped with compute.
    # 3. A Save's decision can come long after it (the read may be at the end of the
    #    backward sweep), so an executor reading a stream plans flushes in a pass of its own
    #    before it runs (``flush_positions``), keeping one bit per action.

    Args:
        actions: a schedule's actions, normally after ``plan_prefetch``.
        cache_slots: the GPU cache's slots.

    Returns:
        Indices into ``actions`` of the Saves to flush.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> acts = list(plan_prefetch(Revolve(6, 2, tier=Tier.HOST), 2))
        >>> sorted(plan_flushes(acts, 2)) == sorted(plan_flushes(acts, 2))
        True
    """
    return frozenset(flush_positions(actions, cache_slots))


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What a replay on the snapshot cache saw (NOTE [ Snapshot cache ]).

    Attributes:
        restores: off-GPU restores.
        hits: restores served by the cache.
        misses: restores that need a synchronous copy.
        saves: off-GPU saves.
        evictions: snapshots evicted to make room (host copy kept).
        copies: prefetches that copied a snapshot in.
        pins: prefetches that pinned a resident snapshot.
        failed_prefetches: prefetches with no slot to use, or pins of an absent snapshot.
        bypassed_saves: saves that found every slot pinned (stored to host only).
        evicted_before_use: prefetched snapshots that left the cache before their restore.
        peak_pinned: most slots pinned at once.
        mean_lead: mean number of steps computed (forward steps advanced plus adjoint
            steps) between a copying prefetch and its restore: the work that can hide the
            copy. 0 for a copy issued right before its restore.
        min_lead: the least such number (0 when there was no copy).

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> simulate_cache(Revolve(20, 4, tier=Tier.HOST), 2).hit_rate < 1
        True
    """

    restores: int
    hits: int
    misses: int
    saves: int
    evictions: int
    copies: int
    pins: int
    failed_prefetches: int
    bypassed_saves: int
    evicted_before_use: int
    peak_pinned: int
    mean_lead: float
    min_lead: int

    @property
    def hit_rate(self) -> float:
        """hits / restores (1.0 when there are no restores)."""
        return self.hits / self.restores if self.restores else 1.0


class _CacheRun(Walker):
    """``simulate_cache``'s driver: the cache model under the actions (NOTE [ Cache model ])."""

    def __init__(self, cache: Cache[int]) -> None:
        self.cache = cache
        self.restores = self.hits = self.saves = self.evictions = self.copies = self.pins = 0
        self.failed = self.bypassed = self.lost = self.peak = 0
        self.work = 0  # steps computed so far
        self.awaiting: dict[int, int] = {}  # step -> work done when its copy was issued, until used
        self.leads: list[int] = []

    def _evicted(self, old: list[int]) -> None:
        for n in old:
            self.evictions += 1
            if self.awaiting.pop(n, None) is not None:
                self.lost += 1

    def advance(self, act: Advance, i: int) -> None:
        self.work += act.n1 - act.n0

    def adjoint(self, act: Adjoint, i: int) -> None:
        self.work += 1

    def save(self, act: Save, i: int) -> None:
        if _cached(act):
            self.saves += 1
            if self.cache.can_take():
                self._evicted(self.cache.admit(act.n))
            else:
                self.bypassed += 1

    def restore(self, act: Restore, i: int) -> None:
        if _cached(act):
            self.restores += 1
            hit = self.cache.use(act.n)
            self.hits += hit
            if not hit and self.cache.can_take():  # NOTE [ Snapshot cache ] Rule 4: the on-demand copy lands in a slot
                self._evicted(self.cache.admit(act.n))
            issued_at = self.awaiting.pop(act.n, None)
            if issued_at is not None:
                self.leads.append(self.work - issued_at)

    def free(self, act: Free, i: int) -> None:
        if _cached(act):
            self.cache.remove(act.n)
            if self.awaiting.pop(act.n, None) is not None:
                self.lost += 1

    def prefetch(self, act: Prefetch, i: int) -> None:
        n, cache = act.n, self.cache
        if n in cache:
            cache.pin(n)
            self.pins += 1
        elif act.src is act.dst or not cache.can_take():
            self.failed += 1
        else:
            self._evicted(cache.admit(n))
            cache.pin(n)
            self.copies += 1
            self.awaiting[n] = self.work
        self.peak = max(self.peak, cache.pinned)


def simulate_cache(actions: Iterable[Action], cache_slots: int) -> CacheStats:
    """Replay actions on a snapshot cache of ``cache_slots`` slots and count what happens.

    With a plain schedule this is GPUZIP's dry run (its misses); with a ``PrefetchedSchedule``
    it checks the plan (NOTE [ Prefetch setup ]).

    Args:
        actions: a schedule, a ``PrefetchedSchedule``, or any actions.
        cache_slots: snapshot slots of the GPU cache (>= 1).

    Returns:
        ``CacheStats``.

    Example::

        >>> from torchckpt.schedules import ZCut
        >>> z = ZCut(50, tier=Tier.HOST)
        >>> simulate_cache(plan_prefetch(z, 4), 4).hit_rate
        1.0
    """
    check_int("cache_slots", cache_slots, 1, "pass how many snapshots the GPU cache holds")
    w = _CacheRun(Cache(cache_slots))
    step = bind(w)
    for i, act in enumerate(actions):
        step(act, i)
    restores, hits, saves, evictions, copies, pins, failed, bypassed, lost, peak, leads = (
        w.restores, w.hits, w.saves, w.evictions, w.copies, w.pins, w.failed, w.bypassed, w.lost, w.peak, w.leads)
    return CacheStats(
        restores=restores,
        hits=hits,
        misses=restores - hits,
        saves=saves,
        evictions=evictions,
        copies=copies,
        pins=pins,
        failed_prefetches=failed,
        bypassed_saves=bypassed,
        evicted_before_use=lost,
        peak_pinned=peak,
        mean_lead=sum(leads) / len(leads) if leads else 0.0,
        min_lead=min(leads) if leads else 0,
    )
