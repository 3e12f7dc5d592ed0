"""Revolve attains Griewank and Walther's optimum, for every small case and large ones."""
from __future__ import annotations

import functools
import random
import time
from math import comb

import pytest

from torchckpt.schedules import Revolve, Tier, optimal_forward_steps, repetition_number, simulate


@pytest.mark.parametrize(
    ("n", "s", "expected"), [(100, 5, 316), (1000, 10, 3636), (10000, 100, 24747)]
)
def test_documented_optima(n: int, s: int, expected: int) -> None:
    assert optimal_forward_steps(n, s) == expected
    assert simulate(Revolve(n, s)).forward_steps == expected


@functools.lru_cache(maxsize=None)
def _dp(l: int, c: int) -> int:
    """Least advances by brute force over the first split (independent of the formula)."""
    if l == 1:
        return 0
    if c == 1:
        return l * (l - 1) // 2
    return min(m + _dp(l - m, c - 1) + _dp(m, c) for m in range(1, l))


def test_formula_matches_brute_force_optimum() -> None:
    for l in range(1, 70):
        for c in range(1, 9):
            assert optimal_forward_steps(l, c) == _dp(l, c), (l, c)


def test_forward_count_exhaustive_n500_s30() -> None:
    # Every n <= 500 and s <= 30 with s < n, counted on the planned schedule itself.
    cases = 0
    for n in range(2, 501):
        for s in range(1, min(30, n - 1) + 1):
            plan = Revolve(n, s).pack()
            assert plan.forward_steps() == optimal_forward_steps(n, s), (n, s)
            cases += 1
    assert cases > 10_000


def test_simulate_valid_small_exhaustive() -> None:
    # Full validity (state, order, slot limit) for every n <= 70, s <= 30, s < n.
    for n in range(1, 71):
        for s in range(1, max(1, min(30, n - 1)) + 1):
            r = simulate(Revolve(n, s))
            assert r.forward_steps == optimal_forward_steps(n, s)
            assert r.adjoint_steps == n
            assert r.peak_snapshots[Tier.GPU] <= s
            assert r.peak_snapshots[Tier.GPU] == (min(s, n - 1) if n > 1 else 0)


def test_simulate_valid_random_up_to_500() -> None:
    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(71, 500)
        s = rng.randint(1, 30)
        r = simulate(Revolve(n, s))
        assert r.forward_steps == optimal_forward_steps(n, s)
        assert r.peak_snapshots[Tier.GPU] == s


def test_snapshots_beyond_need() -> None:
    # As many slots as states: store everything once (n - 1 advances); more is refused.
    for n in (1, 2, 5, 40):
        r = simulate(Revolve(n, n))
        assert r.forward_steps == max(n - 1, 0)
        with pytest.raises(ValueError, match="^torchckpt: snapshots="):
            Revolve(n, n + 1)


@pytest.mark.parametrize(
    ("n", "s"), [(20000, 7), (50000, 30), (100000, 2), (100000, 100), (100000, 1000)]
)
def test_forward_count_spot_checks_large(n: int, s: int) -> None:
    assert Revolve(n, s).pack().forward_steps() == optimal_forward_steps(n, s)


def test_simulate_large() -> None:
    r = simulate(Revolve(100000, 100))
    assert r.forward_steps == 294747 == optimal_forward_steps(100000, 100)
    assert r.peak_snapshots[Tier.GPU] == 100


def test_plan_time_n100000_s100() -> None:
    Revolve(1000, 10).pack()  # warm up
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        plan = Revolve(100000, 100).pack()
        times.append(time.perf_counter() - t0)
    best = min(times)
    assert len(list(plan)) == len(plan)
    assert best < 0.5  # target 0.1 s; generous guard for loaded CI machines


def test_repetition_number() -> None:
    for n in range(1, 300):
        for s in (1, 2, 5, 17):
            t = repetition_number(n, s)
            assert comb(s + t, s) >= n
            assert t == 0 or comb(s + t - 1, s) < n


def test_matches_known_sequence() -> None:
    # 5 steps, 2 slots: t = 2, optimum 2*5 - C(4, 3) = 6 advances (2 + 2 + 1 + 1); the
    # smallest optimal first split (m = 2) saves 2 snapshots.
    expected = (
        "[Save(0, Tier.GPU), Advance(0, 2), Save(2, Tier.GPU), Advance(2, 4), EndForward(), "
        "Adjoint(4), Restore(2, Tier.GPU), Advance(2, 3), Adjoint(3), Restore(2, Tier.GPU), "
        "Free(2, Tier.GPU), Adjoint(2), Restore(0, Tier.GPU), Advance(0, 1), Adjoint(1), "
        "Restore(0, Tier.GPU), Free(0, Tier.GPU), Adjoint(0), End()]"
    )
    assert repr(list(Revolve(5, 2))) == expected


def test_fewest_saves_among_optimal_splits() -> None:
    # NOTE [ Binomial reversal ] Rule 4: figures quoted there.
    for n, s, saves in ((100, 5, 52), (10000, 100, 9436)):
        r = simulate(Revolve(n, s))
        assert r.saves[Tier.GPU] - 1 == saves  # x0's save is not a split
        assert r.restores[Tier.GPU] == n - 1
