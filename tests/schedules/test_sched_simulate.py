"""simulate() checks schedules action by action and counts their costs."""
from __future__ import annotations

import pytest

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
    simulate,
    zcut_cost,
)

G, H = Tier.GPU, Tier.HOST


def _all_schedules():
    for n in (1, 2, 3, 7, 31, 100, 257):
        for s in sorted({min(s, n) for s in (1, 2, 3, 8, 40)}):
            yield Revolve(n, s)
            yield Uniform(n, s)
            yield Revolve(n, s, tier=H)
        yield ZCut(n)
        for seg in (1, 2, 5, 16, n):
            yield ZCut(n, segment=seg)
        for g, h in ((1, 0), (0, 1), (1, 1), (2, 5), (5, 2), (0, 7)):
            yield Multistage(n, g, h)


@pytest.mark.parametrize("sch", list(_all_schedules()), ids=repr)
def test_every_schedule_is_valid(sch) -> None:
    r = simulate(sch, snapshot_bytes=64)
    assert r.adjoint_steps == r.n_steps == sch.n_steps
    assert r.forward_steps >= sch.n_steps - 1
    for tier, peak in r.peak_snapshots.items():
        assert peak <= sch.capacity.get(tier, 0)
        assert r.bytes_saved[tier] == 64 * r.saves[tier]
        assert r.bytes_restored[tier] == 64 * r.restores[tier]
    if isinstance(sch, ZCut):
        assert (r.forward_steps, r.peak_snapshots[G]) == zcut_cost(sch.n_steps, sch.segment_length)
    # Works on a bare list too (n_steps inferred, no capacity).
    assert simulate(list(sch)).forward_steps == r.forward_steps


def test_uniform_counts() -> None:
    # k = ceil(7/2) = 4, snapshots 0 and 4: 7 forward + (2+1) + (3+2+1) recomputed.
    r = simulate(Uniform(8, 2))
    assert r.forward_steps == 7 + 3 + 6
    assert r.peak_snapshots[G] == 2
    # Revolve with the same slots never recomputes more.
    for n in range(1, 80):
        for s in sorted({min(s, n) for s in (1, 2, 4, 9)}):
            assert simulate(Revolve(n, s)).forward_steps <= simulate(Uniform(n, s)).forward_steps


def test_zcut_default_is_sqrt_like() -> None:
    for n in (100, 1000, 10000):
        z = ZCut(n)
        r = simulate(z)
        assert r.forward_steps < 2 * n
        assert r.peak_snapshots[G] <= 2 * int(n ** 0.5) + 2
    z = ZCut(1000, memory_slots=100)
    assert simulate(z).peak_snapshots[G] <= 100
    assert z.forward_steps <= ZCut(1000).forward_steps
    with pytest.raises(ValueError, match="memory_slots >= "):
        ZCut(1000, memory_slots=10)
    with pytest.raises(ValueError, match="segment=None"):
        ZCut(1000, segment=3, memory_slots=50)


OK = [Save(0, G), Advance(0, 2), EndForward(), Adjoint(2), Restore(0, G), Advance(0, 1),
      Adjoint(1), Restore(0, G), Free(0, G), Adjoint(0), End()]


def test_ok_baseline() -> None:
    r = simulate(OK, snapshot_bytes=10)
    assert (r.n_steps, r.forward_steps, r.adjoint_steps) == (3, 3, 3)
    assert r.restores[G] == 2 and r.bytes_restored[G] == 20


def _replace(i: int, *new) -> list:
    return OK[:i] + list(new) + OK[i + 1:]


@pytest.mark.parametrize(
    ("actions", "match"),
    [
        (_replace(4, Restore(1, G)), "not held"),  # never saved
        (OK[:8] + [Free(0, G), Restore(0, G), Adjoint(0), End()], "not held"),  # freed
        (_replace(3, Adjoint(1)), "Adjoint\\(2\\) next"),  # order
        (_replace(6, Adjoint(0)), "Adjoint\\(1\\) next"),  # skipped
        (_replace(5, Advance(0, 2)), "current state to be state 1"),  # wrong state
        (_replace(1, Advance(1, 2)), "advance from the current state"),
        (_replace(0, Save(1, G)), "save the current state"),
        ([Save(0, G), Save(0, G)] + OK[1:], "already held"),
        (OK[:2] + OK[3:], "EndForward"),
        (_replace(2, Advance(2, 3)), "n_steps-1"),
        (OK[:-1], "End\\(\\)"),
        (OK[:-2] + [End()], "every snapshot freed|Adjoint\\(0\\) is missing"),
        (OK + [End()], "nothing after End"),
        (_replace(4, Prefetch(0, H, G), Restore(0, G)), "not held in Tier.HOST"),
    ],
)
def test_invalid_schedules_raise(actions, match) -> None:
    with pytest.raises(CheckpointError, match=match) as info:
        simulate(actions, n_steps=3)
    assert str(info.value).startswith("torchckpt: ")


def test_slot_limit() -> None:
    acts = [Save(0, G), Advance(0, 1), Save(1, G), Advance(1, 2), EndForward(), Adjoint(2),
            Restore(1, G), Free(1, G), Adjoint(1), Restore(0, G), Free(0, G), Adjoint(0), End()]
    assert simulate(acts).peak_snapshots[G] == 2
    with pytest.raises(CheckpointError, match="at most 1 snapshots"):
        simulate(acts, capacity={G: 1})


def test_unknown_action_type() -> None:
    with pytest.raises(TypeError, match="^torchckpt: "):
        simulate([Save(0, G), "Advance(0, 1)"])  # type: ignore[list-item]


def test_multistage_tiers_bytes() -> None:
    r = simulate(Multistage(200, 2, 3), snapshot_bytes=1 << 20)
    assert r.peak_snapshots[G] <= 2 and r.peak_snapshots[H] <= 3
    assert r.bytes_saved[H] == r.saves[H] << 20


@pytest.mark.parametrize("make", [Revolve, Uniform])
def test_more_snapshots_than_steps_is_refused(make) -> None:
    with pytest.raises(ValueError, match="^torchckpt: snapshots=9 is more than n_steps=5"):
        make(5, 9)
