"""plan_prefetch makes every off-GPU restore hit the cache; nothing prefetched is evicted."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchckpt._errors import CheckpointError
from torchckpt.schedules import (
    Adjoint,
    Advance,
    End,
    EndForward,
    Free,
    Multistage,
    Prefetch,
    Restore,
    Revolve,
    Save,
    Tier,
    Uniform,
    ZCut,
    plan_prefetch,
    simulate,
    simulate_cache,
)

H = Tier.HOST


def _check(schedule, slots: int):
    plan = plan_prefetch(schedule, slots)
    stats = simulate_cache(plan, slots)
    assert stats.restores > 0 or schedule.n_steps <= 1 or isinstance(schedule, Multistage)
    assert stats.misses == 0 and stats.hits == stats.restores  # 100 % hits
    assert stats.evicted_before_use == 0
    assert stats.failed_prefetches == 0 and stats.bypassed_saves == 0
    assert stats.copies == plan.copies and stats.pins == plan.pins
    assert stats.copies + stats.pins == stats.restores  # one prefetch per restore
    assert stats.peak_pinned <= slots
    # The planned stream is still a valid schedule with the same costs.
    base = simulate(schedule)
    r = simulate(plan, n_steps=schedule.n_steps, capacity=schedule.capacity)
    assert r.forward_steps == base.forward_steps
    assert r.prefetches == plan.copies
    dry = simulate_cache(schedule, slots)  # GPUZIP's dry run: the misses to remove
    assert dry.restores == stats.restores
    return plan, stats, dry


SCHEDULES = [
    Revolve(200, 6, tier=H),
    Revolve(1000, 12, tier=H),
    Uniform(200, 10, tier=H),
    Uniform(500, 7, tier=H),
    ZCut(200, tier=H),
    ZCut(1000, memory_slots=80, tier=H),
    Multistage(200, 2, 4),
    Multistage(1000, 3, 9),
]


@pytest.mark.parametrize("slots", range(2, 9))
@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_all_hits_cache_2_to_8(schedule, slots: int) -> None:
    plan, stats, dry = _check(schedule, slots)
    if dry.misses:
        assert plan.copies > 0


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_one_slot_is_enough_for_correctness(schedule) -> None:
    _, stats, _ = _check(schedule, 1)
    assert stats.min_lead == 0  # every copy is just in time


def test_more_slots_start_copies_earlier() -> None:
    z = ZCut(400, segment=40, tier=H)
    leads = [_check(z, k)[1].mean_lead for k in (2, 4, 8)]
    assert leads[0] < leads[1] < leads[2]


def test_gpu_tier_snapshots_bypass_the_cache() -> None:
    plan = plan_prefetch(Revolve(100, 5), 2)
    assert not any(isinstance(a, Prefetch) for a in plan)
    assert simulate_cache(plan, 2).restores == 0


_kinds = st.sampled_from(["revolve", "uniform", "zcut", "multistage"])


@st.composite
def schedules(draw):
    kind = draw(_kinds)
    n = draw(st.integers(1, 400))
    if kind == "revolve":
        return Revolve(n, draw(st.integers(1, min(25, n))), tier=draw(st.sampled_from([H, Tier.DISK])))
    if kind == "uniform":
        return Uniform(n, draw(st.integers(1, min(25, n))), tier=H)
    if kind == "zcut":
        return ZCut(n, segment=draw(st.none() | st.integers(1, 60)), tier=H)
    return Multistage(n, draw(st.integers(0, 6)), draw(st.integers(1, 12)))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=schedules(), slots=st.integers(1, 8))  # 1: NOTE [ Prefetch setup ] Rule 3's re-pins
def test_property_all_hits(schedule, slots: int) -> None:
    _check(schedule, slots)


def test_detects_eviction_before_use_and_misses() -> None:
    # A hand-made stream: prefetch 0, then free it before its restore; and a restore of a
    # snapshot the cache no longer holds.
    acts = [Save(0, H), Advance(0, 1), Save(1, H), Advance(1, 2), Save(2, H), Advance(2, 3),
            EndForward(), Adjoint(3), Prefetch(0, H, Tier.GPU), Restore(2, H), Free(2, H),
            Adjoint(2), Restore(1, H), Free(1, H), Adjoint(1), Restore(0, H), Free(0, H),
            Adjoint(0), End()]
    stats = simulate_cache(acts, 1)
    assert stats.restores == 3 and stats.misses >= 1
    lost = acts[:9] + [Free(0, H)] + acts[9:]
    assert simulate_cache(lost, 2).evicted_before_use == 1
    # A pin of a snapshot that is not resident fails.
    assert simulate_cache([Prefetch(5, Tier.GPU, Tier.GPU)], 2).failed_prefetches == 1


def test_restore_of_unsaved_snapshot_is_rejected() -> None:
    with pytest.raises(CheckpointError, match="^torchckpt: .*never saved"):
        plan_prefetch([Restore(3, H)], 2)


def test_cache_slots_validated() -> None:
    with pytest.raises(ValueError, match="^torchckpt: cache_slots"):
        plan_prefetch(Revolve(10, 2, tier=H), 0)
