"""The executor's and the planned stream's shortcuts (issue 26, Deliver 2) give what the plain paths give.

NOTE [ Executor ] Rule 6 (one lookup of a driver's methods per walk) and NOTE [ Planned stream ] Rule 2 (the
prefetches recorded at ``start`` and merged back in, not planned twice).
"""
from __future__ import annotations

import pytest

from torchckpt.schedules import (
    Adjoint, Advance, End, EndForward, Free, Multistage, Prefetch, Restore, Revolve, Save, Tier, Uniform, ZCut,
)
from torchckpt.schedules.execute import Walker, bind, execute, run, walk
from torchckpt.schedules.planned import Planned, _varint
from torchckpt.schedules.prefetch import PrefetchStream

H, D, G = Tier.HOST, Tier.DISK, Tier.GPU


def _executed(planned: Planned) -> list[tuple[int, object]]:
    """What an executor reads from ``planned``: positions and actions, ``start`` called at the first Save."""
    out = []
    for i, a in planned:
        if type(a) is Save:
            planned.start(planned_slots[id(planned)])
        out.append((i, a))
    return out


planned_slots: dict[int, int] = {}


def _expected(acts: object, slots: int) -> list[tuple[int, object]]:
    """The planned stream as ``PrefetchStream`` plans it (what ``Planned`` read before it recorded prefetches)."""
    acts = list(acts)  # type: ignore[call-overload]
    i0 = next(i for i, a in enumerate(acts) if type(a) is Save)
    return list(enumerate(acts[:i0] + list(PrefetchStream(acts[i0:], slots))))


BIG = 2**22 + 5  # steps whose varints take four bytes


def _big_steps() -> list[object]:
    return [Advance(0, 3), Save(3, H), Advance(3, BIG), Save(BIG, D), Advance(BIG, BIG + 1), Save(BIG + 1, G),
            EndForward(), Adjoint(BIG + 1), Restore(BIG, D), Adjoint(BIG), Free(BIG, D), Restore(3, H),
            Free(3, H), Free(BIG + 1, G), Adjoint(3), End()]


@pytest.mark.parametrize("slots", [1, 2, 3, 5])
@pytest.mark.parametrize("schedule", [
    Revolve(40, 5, tier=H), Revolve(57, 3, tier=D), ZCut(60, tier=H), Uniform(33, 4, tier=H), Revolve(20, 4),
    Multistage(80, gpu_slots=2, host_slots=3, disk_slots=2), Multistage(50, gpu_slots=0, host_slots=2, disk_slots=3),
], ids=repr)
def test_planned_stream_is_the_prefetch_stream(schedule: object, slots: int) -> None:
    """The recorded prefetches come back at the same positions, with the same steps and tiers, as a second
    ``PrefetchStream`` would plan them; packed and list schedules alike."""
    want = _expected(schedule.pack(), slots)  # type: ignore[attr-defined]
    for acts in (schedule.pack(), list(schedule.pack())):  # type: ignore[attr-defined]
        p = Planned(acts, True)
        planned_slots[id(p)] = slots
        assert _executed(p) == want


def test_planned_stream_with_large_steps_and_no_prefetch() -> None:
    """Steps past 2**21 (multi-byte varints), DISK and GPU tiers; ``prefetch=False`` reads the actions as they are."""
    acts = _big_steps()
    for slots in (1, 2):
        p = Planned(acts, True)
        planned_slots[id(p)] = slots
        got = _executed(p)
        assert got == _expected(acts, slots)
        assert any(a.__class__.__name__ == "Prefetch" and a.n == BIG for _, a in got)  # type: ignore[attr-defined]
    p = Planned(acts, False)
    planned_slots[id(p)] = 2
    assert _executed(p) == list(enumerate(acts))


def test_planned_stream_resumes_where_it_stopped() -> None:
    """A forward walk stops at EndForward, a backward walk goes on from there (NOTE [ Executor ] Rule 2)."""
    sched = Revolve(30, 4, tier=H)
    p = Planned(sched.pack(), True)
    planned_slots[id(p)] = 2
    first = []
    for i, a in p:
        if type(a) is Save:
            p.start(2)
        first.append((i, a))
        if type(a) is EndForward:
            break
    assert first + list(p) == _expected(sched.pack(), 2)


def test_varint() -> None:
    for v in (0, 1, 127, 128, 300, 2**14, 2**21 - 1, 2**21, 2**40 + 3):
        buf = bytearray()
        _varint(buf, v)
        assert len(buf) == max(1, (v.bit_length() + 6) // 7)
        assert sum((b & 127) << (7 * k) for k, b in enumerate(buf)) == v
        assert all(b >= 128 for b in buf[:-1]) and buf[-1] < 128


class _Log(Walker):
    def __init__(self, stop_at: type | None = None) -> None:
        self.log: list[tuple[str, object, int]] = []
        self.stop_at = stop_at

    def _note(self, name: str, a: object, i: int) -> bool | None:
        self.log.append((name, a, i))
        return False if type(a) is self.stop_at else None

    def advance(self, a: Advance, i: int) -> bool | None:
        return self._note("advance", a, i)

    def save(self, a: Save, i: int) -> bool | None:
        return self._note("save", a, i)

    def restore(self, a: Restore, i: int) -> bool | None:
        return self._note("restore", a, i)

    def adjoint(self, a: Adjoint, i: int) -> bool | None:
        return self._note("adjoint", a, i)

    def free(self, a: Free, i: int) -> bool | None:
        return self._note("free", a, i)

    def end_forward(self, a: EndForward, i: int) -> bool | None:
        return self._note("end_forward", a, i)

    def end(self, a: End, i: int) -> bool | None:
        return self._note("end", a, i)


class _MySave(Save):
    """A subclass of an action: dispatched by ``singledispatch`` to ``save``, as before the table."""

    __slots__ = ()


def _reference(acts: list[object], driver: _Log) -> tuple[int, bool, list[bool], list[tuple[str, object, int]]]:
    """``walk``'s count, ``run``'s result, each action's result and the calls, through ``execute`` alone."""
    n, stopped, results = 0, False, []
    for n, a in enumerate(acts, 1):
        results.append(execute(a, driver, n - 1))  # type: ignore[arg-type]
        if not results[-1]:
            stopped = True
            break
    return n, stopped, results, driver.log


@pytest.mark.parametrize("stop_at", [None, EndForward, Restore])
def test_run_walk_and_bind_dispatch_as_execute(stop_at: type | None) -> None:
    acts: list[object] = list(Revolve(12, 3, tier=H))
    acts.insert(1, _MySave(0, H))
    n_ref, stopped, results, log_ref = _reference(acts, _Log(stop_at))
    assert ("save", acts[1], 1) in log_ref and stopped
    w = _Log(stop_at)
    assert walk(acts, w) == n_ref and w.log == log_ref
    w = _Log(stop_at)
    it = enumerate(acts)
    assert run(it, w) is stopped and w.log == log_ref
    assert next(it, (None,))[0] == (n_ref if n_ref < len(acts) else None)  # the walk left the rest unread
    w = _Log(stop_at)
    step = bind(w)
    assert [step(a, i) for i, a in enumerate(acts[:n_ref])] == results  # type: ignore[arg-type]
    assert w.log == log_ref


def test_run_raises_on_what_is_not_an_action_and_on_a_missing_method() -> None:
    with pytest.raises(TypeError, match="unknown schedule action 'Advance"):
        walk([Save(0), "Advance(0, 1)"], Walker())

    class NoSave:
        def advance(self, a: object, i: int) -> None:
            return None

    with pytest.raises(AttributeError, match="save"):
        run(enumerate([Advance(0, 1), Save(1)]), NoSave())


@pytest.mark.parametrize("schedule", [Revolve(20, 4), ZCut(30), Uniform(33, 4)], ids=repr)
def test_planned_stream_of_a_gpu_only_schedule_is_its_actions(schedule: object) -> None:
    """NOTE [ Planned stream ] Rule 3: with every slot class on the GPU nothing is planned; the stream is what
    ``PrefetchStream`` would give (the schedule's actions) and no Save flushes."""
    for prefetch in (True, False):
        p = Planned(schedule.pack(), prefetch)  # type: ignore[attr-defined]
        planned_slots[id(p)] = 2
        got = _executed(p)
        assert got == _expected(schedule.pack(), 2) == list(enumerate(schedule.pack()))  # type: ignore[attr-defined]
        assert not any(p.flush(i) for i, _ in got) and not p._flushes and not p._pf


# -- NOTE [ Planned stream ] Rule 5: a schedule run again is not planned again -------------------------------------
def _stream_of(schedule: object, slots: int, prefetch: bool = True) -> tuple[list[tuple[int, object]], list[bool]]:
    p = Planned.of(schedule, prefetch)  # type: ignore[arg-type]
    planned_slots[id(p)] = slots
    got = _executed(p)
    return got, [p.flush(i) for i, _ in got]


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_schedule_run_again_reads_its_plan_and_gets_the_same_stream(monkeypatch: pytest.MonkeyPatch,
                                                                      prefetch: bool) -> None:
    import torchckpt.schedules.planned as planned

    monkeypatch.setattr(planned, "_kept", planned.OrderedDict())
    calls: list[int] = []
    real = planned._plan_packed
    monkeypatch.setattr(planned, "_plan_packed", lambda *a: (calls.append(a[2]), real(*a))[1])
    s = ZCut(60, tier=H)
    first = _stream_of(s, 3, prefetch)
    assert calls == [3] and any(first[1]) and (any(type(a) is Prefetch for _, a in first[0]) or not prefetch)
    assert _stream_of(ZCut(60, tier=H), 3, prefetch) == first  # an equal schedule: the same value
    assert calls == [3]
    assert _stream_of(s, 2, prefetch) != first and calls == [3, 2]  # another slot count: planned for it
    assert _stream_of(s, 3, prefetch) == first and _stream_of(s, 2, prefetch)[0] and calls == [3, 2]
    monkeypatch.setattr(planned, "_kept", planned.OrderedDict())
    assert _stream_of(s, 3, prefetch) == first and calls == [3, 2, 3]  # planned afresh: the same


def test_only_the_last_schedules_keep_their_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchckpt.schedules.planned as planned

    monkeypatch.setattr(planned, "_kept", planned.OrderedDict())
    runs = [Revolve(30 + k, 3, tier=H) for k in range(planned._KEPT + 1)]
    for s in runs:
        _stream_of(s, 2)
    assert runs[0] not in planned._kept and all(s in planned._kept for s in runs[1:])
    _stream_of(runs[1], 2)  # used again: the last one dropped next
    _stream_of(Revolve(80, 3, tier=H), 2)
    assert runs[1] in planned._kept and runs[2] not in planned._kept


def test_a_schedule_that_does_not_hash_is_planned_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import torchckpt.schedules.planned as planned
    from torchckpt.schedules.schedule import Schedule

    @dataclasses.dataclass(frozen=True)
    class Listed(Schedule):  # a field that does not hash
        inner: list
        n_steps: int = 0

        @property
        def capacity(self) -> dict:
            return self.inner[0].capacity

        def pack(self):  # type: ignore[no-untyped-def]
            return self.inner[0].pack()

    calls: list[int] = []
    real = planned._plan_packed
    monkeypatch.setattr(planned, "_plan_packed", lambda *a: (calls.append(a[2]), real(*a))[1])
    s = Listed([ZCut(40, tier=H)])
    assert _stream_of(s, 2) == _stream_of(s, 2) and calls == [2, 2]
