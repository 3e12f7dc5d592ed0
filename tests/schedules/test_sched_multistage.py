"""Multistage: Revolve's recomputation over two tiers, with the fewest host transfers."""
from __future__ import annotations

import itertools

import pytest

from torchckpt.schedules import Multistage, PackedSchedule, Revolve, Tier, optimal_forward_steps, simulate
from torchckpt.schedules.revolve import binomial_codes


@pytest.mark.parametrize("n", [1, 2, 3, 10, 57, 100, 500, 2000])
@pytest.mark.parametrize(("g", "h"), [(1, 0), (0, 1), (1, 1), (1, 4), (4, 1), (3, 3), (2, 9), (10, 20)])
def test_forward_count_equals_single_level_revolve(n: int, g: int, h: int) -> None:
    m = Multistage(n, g, h)
    r = simulate(m)
    assert r.forward_steps == simulate(Revolve(n, min(g + h, n))).forward_steps  # Revolve refuses s > n
    assert r.forward_steps == optimal_forward_steps(n, g + h) == m.forward_steps
    assert r.peak_snapshots[Tier.GPU] <= g and r.peak_snapshots[Tier.HOST] <= h


def _host_transfers(n: int, s: int, tiers: tuple[Tier, ...]) -> int:
    r = simulate(PackedSchedule(binomial_codes(n, s), tiers))
    return r.saves[Tier.HOST] + r.restores[Tier.HOST]


@pytest.mark.parametrize(("n", "g", "h"), [(30, 1, 3), (100, 2, 3), (200, 3, 3), (64, 2, 6)])
def test_tier_assignment_is_best_of_all_slot_assignments(n: int, g: int, h: int) -> None:
    m = Multistage(n, g, h)
    s = m.slots_used
    ours = _host_transfers(n, s, m.slot_tiers)
    best = min(
        _host_transfers(n, s, tuple(Tier.GPU if k in gpu else Tier.HOST for k in range(s)))
        for gpu in itertools.combinations(range(s), g)
    )
    assert ours == best
    r = simulate(m)
    assert r.saves[Tier.HOST] + r.restores[Tier.HOST] == ours
    # And strictly better than the worst placement whenever slots differ in traffic.
    worst = max(
        _host_transfers(n, s, tuple(Tier.GPU if k in gpu else Tier.HOST for k in range(s)))
        for gpu in itertools.combinations(range(s), g)
    )
    assert ours <= worst


def test_all_on_one_tier() -> None:
    assert set(Multistage(50, 6, 0).slot_tiers) == {Tier.GPU}
    assert set(Multistage(50, 0, 6).slot_tiers) == {Tier.HOST}
    assert Multistage(3, 5, 5).slots_used == 2
