"""``Planned``'s stream is the one the separate planners give: the same actions, prefetches and flush bits.

NOTE [ Planned stream ] Rules 1-4: ``Planned`` scouts the schedule, records the prefetches and flush bits at its
first Save and merges them back into the stream; a packed schedule's in one replay over its codes, read at its
events only. The reference here is the plain pair over ``Action`` objects, read at every action: ``PrefetchStream``
for the actions and ``flush_positions`` (a replay of that stream) for the flush bits. All of them drive one
``CacheReplay`` (NOTE [ Cache replay ]), so the last test also holds every case to the digest of what the separate
replays gave before it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchckpt.schedules import (
    Adjoint, Advance, End, EndForward, Free, Multistage, Restore, Revolve, Save, Tier, Uniform, ZCut, simulate, simulate_cache,
)
from torchckpt._errors import CheckpointError
from torchckpt.schedules.packed import PackedBuilder
from torchckpt.schedules.planned import Planned
from torchckpt.schedules.prefetch import PrefetchStream, flush_positions

H, D, G = Tier.HOST, Tier.DISK, Tier.GPU


def _reference(acts: list[object], slots: int, prefetch: bool) -> tuple[list[tuple[int, object]], list[bool]]:
    """The planned stream and each position's flush bit, as the separate planners give them."""
    i0 = next((i for i, a in enumerate(acts) if type(a) is Save), -1)
    if i0 < 0:
        return list(enumerate(acts)), [False] * len(acts)
    rest = list(PrefetchStream(acts[i0:], slots)) if prefetch else acts[i0:]
    stream = acts[:i0] + rest
    flushes = {f + i0 for f in flush_positions(rest, slots)}
    return list(enumerate(stream)), [i in flushes for i in range(len(stream))]


def _read(p: Planned, slots: int) -> tuple[list[tuple[int, object]], list[bool]]:
    """What an executor reads: ``start`` at the first Save, each Save's flush bit asked as it comes."""
    out = []
    for i, a in p:
        if type(a) is Save:
            p.start(slots)
        out.append((i, a))
    return out, [p.flush(i) for i in range(len(out))]


def _mixed() -> list[object]:
    """GPU, HOST and DISK snapshots interleaved, with a snapshot saved again after a Free."""
    return [Save(0, H), Advance(0, 2), Save(2, H), Advance(2, 4), Save(4, G), Advance(4, 6), Save(6, D),
            Advance(6, 8), Save(8, H), EndForward(), Adjoint(8), Restore(6, D), Advance(6, 7), Save(7, H), Free(8, H),
            Adjoint(7), Free(7, H), Restore(6, D), Free(6, D), Adjoint(6), Restore(4, G), Advance(4, 5), Save(5, D),
            Adjoint(5), Free(5, D), Restore(4, G), Free(4, G), Adjoint(4), Restore(2, H), Advance(2, 3), Save(3, H),
            Adjoint(3), Free(3, H), Restore(2, H), Free(2, H), Adjoint(2), Restore(0, H), Advance(0, 1), Adjoint(1),
            Restore(0, H), Free(0, H), Adjoint(0), End()]


SCHEDULES = [
    Revolve(40, 5, tier=H), Revolve(57, 3, tier=D), Revolve(120, 7, tier=H), Revolve(9, 1, tier=H),
    Revolve(20, 4), ZCut(60, tier=H), ZCut(200, tier=H), ZCut(90, tier=D), ZCut(30),
    Uniform(33, 4, tier=H), Uniform(100, 10, tier=D), Uniform(17, 17, tier=H), Uniform(33, 4),
    Multistage(80, gpu_slots=2, host_slots=3, disk_slots=2), Multistage(50, gpu_slots=0, host_slots=2, disk_slots=3),
    Multistage(150, gpu_slots=3, host_slots=4), Multistage(40, gpu_slots=1, host_slots=1, disk_slots=1),
]


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("slots", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_planned_stream_and_flushes_match_the_separate_planners(schedule: object, slots: int,
                                                               prefetch: bool) -> None:
    want = _reference(list(schedule.pack()), slots, prefetch)  # type: ignore[attr-defined]
    for acts in (schedule.pack(), list(schedule.pack())):  # type: ignore[attr-defined]
        assert _read(Planned(acts, prefetch), slots) == want


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_mixed_tiers_and_no_save(slots: int, prefetch: bool) -> None:
    acts = _mixed()
    assert _read(Planned(acts, prefetch), slots) == _reference(acts, slots, prefetch)
    plain = [Advance(0, 3), EndForward(), Adjoint(2), End()]
    assert _read(Planned(plain, prefetch), slots) == _reference(plain, slots, prefetch)


def test_the_reference_flushes_something() -> None:
    """The comparison is not vacuous: some schedules here flush some Saves and insert copying prefetches."""
    stream, bits = _reference(list(Revolve(120, 7, tier=H).pack()), 2, True)
    assert any(bits) and not all(b for (_, a), b in zip(stream, bits) if type(a) is Save)
    assert any(type(a).__name__ == "Prefetch" and a.src is not a.dst for _, a in stream)  # type: ignore[attr-defined]


def test_a_restore_never_saved_raises_as_before() -> None:
    """The packed path's scout (over cache events) names the same action as ``PrefetchStream``'s."""
    b = PackedBuilder((H,))
    b.save(0)
    b.advance(3)
    b.end_forward()
    b.restore(2)
    b.adjoint()
    packed = b.build()
    messages = []
    for acts in (packed, list(packed)):
        p = Planned(acts, True)
        with pytest.raises(CheckpointError) as e:
            _read(p, 2)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "Restore(2, Tier.HOST)" in messages[0]


def test_one_slot_and_a_snapshot_restored_twice_around_another_save() -> None:
    """NOTE [ Prefetch setup ] Rule 3: with one slot, the DISK snapshot 6 restored twice with Save(7) between is not
    pinned again ahead of its second restore while pinned for the first (that left Save(7) no slot: an internal
    error on a valid schedule); every restore still hits, and Planned gives the same stream."""
    acts = _mixed()
    assert simulate(acts).adjoint_steps == 9  # a valid schedule: simulate checks every action
    planned = list(PrefetchStream(acts, 1))
    assert simulate_cache(planned, 1).misses == 0
    for prefetch in (True, False):
        assert _read(Planned(acts, prefetch), 1) == _reference(acts, 1, prefetch)


def _digest(stream_and_bits: object) -> str:
    return hashlib.sha256(repr(stream_and_bits).encode()).hexdigest()[:16]


def test_every_planner_gives_the_streams_it_gave_before_one_cache_replay() -> None:
    """NOTE [ Cache replay ]: ``PrefetchStream``, ``flush_positions`` and ``Planned`` all replay one ``CacheReplay``
    now; each case's planned stream and flush bits are the ones the separate replays gave before (their digests,
    recorded from commit 477d495's ``PrefetchStream`` and ``_WriteBack`` in data/planned_streams.json)."""
    want = json.loads((Path(__file__).parent / "data" / "planned_streams.json").read_text())
    got = {}
    for schedule in SCHEDULES:
        for slots in (1, 2, 3, 4, 7):
            for prefetch in (True, False):
                acts = list(schedule.pack())  # type: ignore[attr-defined]
                ref = _reference(acts, slots, prefetch)
                assert _read(Planned(schedule.pack(), prefetch), slots) == ref  # type: ignore[attr-defined]
                got[f"{schedule!r}|{slots}|{prefetch}"] = _digest(ref)
    for slots in (1, 2, 3):
        for prefetch in (True, False):
            got[f"mixed|{slots}|{prefetch}"] = _digest(_reference(_mixed(), slots, prefetch))
    assert got == want


@st.composite
def _schedules(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from(["revolve", "uniform", "zcut", "multistage"]))
    n = draw(st.integers(1, 300))
    if kind == "revolve":
        return Revolve(n, draw(st.integers(1, min(20, n))), tier=draw(st.sampled_from([H, D, G])))
    if kind == "uniform":
        return Uniform(n, draw(st.integers(1, min(20, n))), tier=draw(st.sampled_from([H, D])))
    if kind == "zcut":
        return ZCut(n, segment=draw(st.none() | st.integers(1, 50)), tier=draw(st.sampled_from([H, D])))
    return Multistage(n, draw(st.integers(0, 5)), draw(st.integers(1, 8)), draw(st.integers(0, 4)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=_schedules(), slots=st.integers(1, 8), prefetch=st.booleans())
def test_property_the_packed_replay_at_events_gives_the_per_action_streams(schedule: object, slots: int,
                                                                           prefetch: bool) -> None:
    """NOTE [ Cache replay ] Rule 2: ``Planned``'s packed path, which asks the replay for prefetches at the cache's
    events only, places every prefetch and flush bit where the per-action drivers do, on schedules drawn at random."""
    want = _reference(list(schedule.pack()), slots, prefetch)  # type: ignore[attr-defined]
    assert _read(Planned(schedule.pack(), prefetch), slots) == want  # type: ignore[attr-defined]
