"""Prefetch and write-back planning stream: the same plan as a whole-list replay, in memory that does
not grow with the schedule (NOTE [ Prefetch setup ], NOTE [ Write-back ] Rule 3, NOTE [ Planned stream ]
Rule 2)."""
from __future__ import annotations

import bisect
import gc
import tracemalloc

import pytest

from torchckpt.schedules.planned import Planned
from torchckpt.schedules import (
    Action,
    Free,
    Multistage,
    Prefetch,
    PrefetchStream,
    Restore,
    Revolve,
    Save,
    Tier,
    Uniform,
    ZCut,
    plan_flushes,
    plan_prefetch,
)
from torchckpt.schedules.cache import Cache

H = Tier.HOST

SCHEDULES = [
    Revolve(1, 1, tier=H),
    Revolve(6, 2, tier=H),
    Revolve(200, 6, tier=H),
    Revolve(300, 3),  # GPU only: nothing to plan
    Uniform(200, 10, tier=H),
    ZCut(200, tier=H),
    ZCut(300, memory_slots=40, tier=H),
    Multistage(200, 2, 4),
    Multistage(300, 3, 9),
]


def _reference_flushes(acts: list[Action], slots: int) -> frozenset[int]:
    """NOTE [ Write-back ] Rule 1 by a replay over the whole list: record every eviction, then look ahead from it."""
    cache: Cache[int] = Cache(slots)
    saved_at: dict[int, int] = {}
    flush: set[int] = set()
    evictions: list[tuple[int, int, int]] = []
    reads: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}

    def put(i: int, n: int) -> None:
        for old in cache.admit(n):
            if old in saved_at:
                evictions.append((i, old, saved_at[old]))

    for i, a in enumerate(acts):
        if isinstance(a, Save) and a.tier is not Tier.GPU:
            ends.setdefault(a.n, []).append(i)
            saved_at[a.n] = i
            if cache.can_take():
                put(i, a.n)
            else:
                flush.add(i)
        elif isinstance(a, Prefetch):
            if a.n in cache:
                cache.pin(a.n)
            elif a.src is not a.dst:
                reads.setdefault(a.n, []).append(i)
                if cache.can_take():
                    put(i, a.n)
                    cache.pin(a.n)
        elif isinstance(a, Restore) and a.tier is not Tier.GPU:
            if not cache.use(a.n):
                reads.setdefault(a.n, []).append(i)
                if cache.can_take():
                    put(i, a.n)
        elif isinstance(a, Free) and a.tier is not Tier.GPU:
            ends.setdefault(a.n, []).append(i)
            cache.remove(a.n)
            saved_at.pop(a.n, None)
    for pos, n, save_pos in evictions:
        r, e = reads.get(n, []), ends.get(n, [])
        k, j = bisect.bisect_right(r, pos), bisect.bisect_right(e, pos)
        if k < len(r) and (j >= len(e) or r[k] < e[j]):
            flush.add(save_pos)
    return frozenset(flush)


@pytest.mark.parametrize("slots", [1, 2, 3, 5])
@pytest.mark.parametrize("sched", SCHEDULES, ids=repr)
def test_flushes_match_a_whole_list_replay(sched, slots: int) -> None:
    for acts in (list(sched), list(plan_prefetch(sched, slots))):
        assert plan_flushes(acts, slots) == _reference_flushes(acts, slots)


@pytest.mark.parametrize("slots", [1, 2, 4])
@pytest.mark.parametrize("sched", SCHEDULES, ids=repr)
def test_stream_reads_a_one_shot_iterator_like_a_list(sched, slots: int) -> None:
    """A generator is read through a tee; a list or a packed schedule through two iterators: same plan."""
    whole = plan_prefetch(list(sched), slots)
    once = PrefetchStream((a for a in sched), slots)
    assert tuple(once) == whole.actions
    assert (once.copies, once.pins) == (whole.copies, whole.pins)
    assert tuple(PrefetchStream(sched.pack(), slots)) == whole.actions


def _drain(plan: Planned, slots: int) -> list[tuple[int, Action, bool]]:
    out = []
    for i, a in plan:
        if type(a) is Save:
            plan.start(slots)
        out.append((i, a, plan.flush(i) if type(a) is Save else False))
    return out


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("slots", [1, 2, 4])
@pytest.mark.parametrize("sched", SCHEDULES, ids=repr)
def test_planned_stream_is_the_whole_plan(sched, slots: int, prefetch: bool) -> None:
    """The executor's stream: the actions of plan_prefetch after the first Save, the flushes of plan_flushes."""
    acts = list(sched)
    i0 = next((i for i, a in enumerate(acts) if type(a) is Save), None)
    if i0 is None:  # Revolve(1, 1) saves nothing
        assert [a for _, a in Planned.of(sched, prefetch)] == acts
        return
    rest = list(plan_prefetch(acts[i0:], slots)) if prefetch else acts[i0:]
    want_acts = acts[:i0] + rest
    want_flush = {f + i0 for f in plan_flushes(rest, slots)}
    got = _drain(Planned.of(sched, prefetch), slots)
    assert [a for _, a, _ in got] == want_acts
    assert [i for i, _, _ in got] == list(range(len(want_acts)))
    assert {i for i, a, f in got if f} == want_flush
    assert _drain(Planned.of(acts, prefetch), slots) == got  # a list of actions plans the same


def test_planned_stream_with_no_save() -> None:
    from torchckpt.schedules import Adjoint, End, EndForward

    acts = [EndForward(), Adjoint(0), End()]
    assert [a for _, a in Planned.of(acts, True)] == acts


def _planning_peak(n_steps: int) -> tuple[int, int]:
    """Traced peak bytes of executing a Revolve schedule's planned stream (the packed schedule excluded)."""
    packed = Revolve(n_steps, 8, tier=H).pack()
    gc.collect()
    tracemalloc.start()
    try:
        plan = Planned(packed, True)
        n = 0
        for _, a in plan:
            if type(a) is Save:
                plan.start(3)
            n += 1
        return tracemalloc.get_traced_memory()[1], n
    finally:
        tracemalloc.stop()


def test_planning_memory_does_not_grow_like_the_schedule() -> None:
    """NOTE [ Planned stream ] Rule 2: beyond one bit per action, memory is the live snapshots and the slots.

    A list of the planned actions (what was built before) costs over 50 bytes per action (an 8-byte
    pointer plus a shared or fresh action object); the stream keeps one bit per action for the
    write-back plus a window, so eight times the steps must not cost eight times the memory.
    """
    small, n_small = _planning_peak(2_000)
    big, n_big = _planning_peak(16_000)
    assert n_big > 7 * n_small
    assert big < 2 * small + 64 * 1024, f"planning {n_small} actions peaked at {small} B, {n_big} at {big} B"
    assert big / n_big < 8, f"{big / n_big:.1f} B per action"
