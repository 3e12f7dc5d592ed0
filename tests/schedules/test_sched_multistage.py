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


# -- three tiers (NOTE [ Multi-tier Revolve ] Rule 4) ----------------------------------------------
COST = {Tier.GPU: 0, Tier.HOST: 1, Tier.DISK: 5}


def _cost(n: int, s: int, tiers: tuple[Tier, ...], cost: dict[Tier, int]) -> int:
    r = simulate(PackedSchedule(binomial_codes(n, s), tiers))
    return sum((r.saves[t] + r.restores[t]) * c for t, c in cost.items())


def _assignments(s: int, caps: dict[Tier, int]) -> list[tuple[Tier, ...]]:
    """Every slot-to-tier assignment within the tiers' capacities."""
    return [a for a in itertools.product(list(caps), repeat=s) if all(a.count(t) <= caps[t] for t in caps)]


@pytest.mark.parametrize("n", [1, 2, 3, 10, 57, 100, 500, 2000])
@pytest.mark.parametrize(("g", "h", "d"), [(0, 0, 1), (1, 1, 1), (1, 0, 3), (0, 2, 2), (2, 3, 4), (3, 3, 20)])
def test_three_tiers_forward_count_and_limits(n: int, g: int, h: int, d: int) -> None:
    m = Multistage(n, g, h, d)
    r = simulate(m)  # checks every action and the per-tier limits (m.capacity)
    assert r.forward_steps == optimal_forward_steps(n, g + h + d) == m.forward_steps
    assert r.peak_snapshots[Tier.GPU] <= g and r.peak_snapshots[Tier.HOST] <= h and r.peak_snapshots[Tier.DISK] <= d
    if d and n - 1 > g + h:  # the disk is needed: some snapshot goes there
        assert r.saves[Tier.DISK] > 0


@pytest.mark.parametrize(("n", "g", "h", "d"), [(30, 1, 1, 2), (100, 1, 2, 2), (200, 2, 1, 3), (64, 0, 2, 3),
                                                (12, 1, 1, 3), (5, 2, 2, 2)])
@pytest.mark.parametrize("disk_first", [False, True])
def test_three_tier_placement_is_best_of_all_assignments(n: int, g: int, h: int, d: int, disk_first: bool) -> None:
    ranking = (Tier.GPU, Tier.DISK, Tier.HOST) if disk_first else (Tier.GPU, Tier.HOST, Tier.DISK)
    cost = {Tier.GPU: 0, Tier.HOST: 5, Tier.DISK: 1} if disk_first else COST
    m = Multistage(n, g, h, d, ranking=ranking)
    s = m.slots_used
    costs = [_cost(n, s, a, cost) for a in _assignments(s, dict(m.capacity))]
    ours = _cost(n, s, m.slot_tiers, cost)
    assert ours == min(costs)
    assert len(set(costs)) == 1 or ours < max(costs)  # the placement matters, and ours is not the worst


def test_disk_slots_zero_is_the_two_tier_schedule() -> None:
    for n, g, h in [(100, 2, 3), (57, 1, 4), (10, 0, 3)]:
        two, three = Multistage(n, g, h), Multistage(n, g, h, 0)
        assert two == three and two.slot_tiers == three.slot_tiers and list(two) == list(three)
        assert Tier.DISK not in two.slot_tiers


def test_three_tiers_busiest_on_gpu_then_host() -> None:
    m = Multistage(100, gpu_slots=1, host_slots=2, disk_slots=2)
    assert m.slot_tiers == (Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST, Tier.GPU)
    r = simulate(m)
    per = {t: r.saves[t] + r.restores[t] for t in Tier}
    # Per slot, the GPU's one moves most and each disk slot least.
    assert per[Tier.GPU] >= per[Tier.HOST] / 2 >= per[Tier.DISK] / 2 > 0
    # Fewer slots needed than held: the slowest tier goes short first.
    assert Multistage(4, 1, 1, 5).slot_tiers.count(Tier.DISK) == 1


@pytest.mark.parametrize("bad", [(Tier.GPU, Tier.HOST), (Tier.GPU, Tier.GPU, Tier.DISK), ("gpu", "host", "disk"),
                                 None])
def test_ranking_must_name_each_tier_once(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^torchckpt: Multistage\(ranking=...\) must name each"):
        Multistage(10, 1, 1, 1, ranking=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^torchckpt: disk_slots must be >= 0"):
        Multistage(10, 1, 1, -1)
    with pytest.raises(ValueError, match="^torchckpt: Multistage needs at least one snapshot slot"):
        Multistage(10, 0, 0, 0)
    assert Multistage(10, 1, 1, 1, ranking=[Tier.GPU, Tier.DISK, Tier.HOST]).ranking == (  # type: ignore[arg-type]
        Tier.GPU, Tier.DISK, Tier.HOST)
