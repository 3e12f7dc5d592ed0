"""WeightedRevolve: Revolve on equal chains, the brute-force optimum on unequal ones, valid, in budget."""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import time

import pytest

from torchckpt.schedules import (
    Advance,
    Free,
    Revolve,
    Save,
    Tier,
    WeightedRevolve,
    optimal_forward_steps,
    simulate,
)


def _replay(w: WeightedRevolve) -> tuple[float, int, int]:
    """Cost of the advances, most snapshot bytes held and most snapshots held, from the actions."""
    cost = 0.0
    held: dict[int, int] = {}
    peak_bytes = peak_count = 0
    for act in w:
        if isinstance(act, Advance):
            cost += sum(w.step_costs[act.n0:act.n1])
        elif isinstance(act, Save):
            held[act.n] = w.state_bytes[act.n]
            peak_bytes = max(peak_bytes, sum(held.values()))
            peak_count = max(peak_count, len(held))
        elif isinstance(act, Free):
            del held[act.n]
    assert not held
    return cost, peak_bytes, peak_count


def _check(w: WeightedRevolve) -> None:
    """Valid under simulate, within its byte budget, and its actions cost what it claims."""
    n = len(w.step_costs)
    r = simulate(w)  # raises on any invalid action, adjoint order, unfreed snapshot
    assert r.n_steps == r.adjoint_steps == n
    assert r.forward_steps == w.forward_steps == w.pack().forward_steps()
    assert r.peak_snapshots[w.tier] == w.slots_used
    cost, peak_bytes, peak_count = _replay(w)
    assert peak_bytes == w.peak_bytes <= w.memory
    assert peak_count == w.slots_used
    assert cost == pytest.approx(w.forward_cost, rel=1e-12, abs=1e-12)


# -- equal costs and sizes: Revolve (NOTE [ Weighted reversal ] Rule 2) -----------------------------
def test_equal_chain_is_revolve() -> None:
    for n in range(1, 26):
        for s in range(1, 8):
            w = WeightedRevolve([1.0] * n, [24] * n, memory=s * 24)
            r = simulate(w)
            assert r.forward_steps == optimal_forward_steps(n, s), (n, s)
            assert w.forward_cost == r.forward_steps
            rv = simulate(Revolve(n, min(s, n)))
            assert r.saves == rv.saves, (n, s)  # the same tie-breaking as NOTE [ Binomial reversal ] Rule 4
            assert r.peak_snapshots[Tier.GPU] <= s
            if n > 2:
                assert w.memory_unit == 24
            _check(w)


@pytest.mark.parametrize(("cost", "size", "extra"), [(0.1, 1000, 999), (3.0, 7, 0), (1, 1, 0)])
def test_equal_chain_any_cost_unit_and_spare_bytes(cost: float, size: int, extra: int) -> None:
    # Spare bytes below one more snapshot change nothing; float costs do not disturb the count.
    for n, s in [(30, 3), (57, 4), (20, 20), (40, 1)]:
        w = WeightedRevolve([cost] * n, [size] * n, memory=s * size + extra)
        assert simulate(w).forward_steps == optimal_forward_steps(n, s), (n, s)


def test_equal_chain_larger_than_brute_force_range() -> None:
    for n, s in [(100, 5), (64, 10), (90, 3)]:
        w = WeightedRevolve([2.0] * n, [8] * n, memory=8 * s)
        assert simulate(w).forward_steps == optimal_forward_steps(n, s)
        assert w.forward_cost == 2.0 * optimal_forward_steps(n, s)


# -- unequal chains: the optimum of an exhaustive search ----------------------------------------------
def _brute_force(costs: list[float], sizes: list[int], memory: int) -> float:
    """Least advance cost over ALL executable schedules (persistent or not), by Dijkstra over the
    executor's states (current state, snapshots held, next adjoint step), one step per advance."""
    n = len(costs)
    if n == 1:
        return 0.0
    start: tuple[int, frozenset[int], int] = (0, frozenset(), n - 1)  # current -1: none
    dist = {start: 0.0}
    tick = itertools.count()
    queue = [(0.0, next(tick), start)]
    while queue:
        d, _, state = heapq.heappop(queue)
        if d > dist[state]:
            continue
        cur, held, j = state
        if j < 0:
            return d
        moves: list[tuple[float, tuple[int, frozenset[int], int]]] = []
        if cur >= 0:
            if cur < j:
                moves.append((costs[cur], (cur + 1, held, j)))  # advance one step
                if cur not in held and sum(sizes[i] for i in held) + sizes[cur] <= memory:
                    moves.append((0.0, (cur, held | {cur}, j)))  # save
            if cur == j:  # adjoint; snapshots at or above j are of no further use
                moves.append((0.0, (-1, frozenset(i for i in held if i < j), j - 1)))
        for i in held:
            moves.append((0.0, (i, held, j)))  # restore
            moves.append((0.0, (cur, held - {i}, j)))  # free
        for c, nxt in moves:
            if d + c < dist.get(nxt, float("inf")):
                dist[nxt] = d + c
                heapq.heappush(queue, (d + c, next(tick), nxt))
    raise AssertionError("no schedule reverses the chain")


def test_optimal_against_brute_force() -> None:
    rng = random.Random(20240611)
    for _ in range(250):
        n = rng.randint(1, 7)
        costs = [rng.randint(1, 9) for _ in range(n)]
        sizes = [rng.randint(0, 6) for _ in range(n)]
        memory = rng.randint(sizes[0], sizes[0] + sum(sizes[1:-1]) + 1)
        w = WeightedRevolve(costs, sizes, memory)
        assert w.forward_cost == _brute_force(costs, sizes, memory), (costs, sizes, memory)
        _check(w)


def test_optimal_against_brute_force_float_costs() -> None:
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(2, 7)
        costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
        sizes = [rng.choice([1, 2, 3, 8]) * 1024 for _ in range(n)]
        memory = rng.randint(sizes[0], sizes[0] + sum(sizes[1:-1]))
        w = WeightedRevolve(costs, sizes, memory)
        assert w.forward_cost == pytest.approx(_brute_force(costs, sizes, memory), rel=1e-12)


def test_uses_cheap_and_small_states() -> None:
    # Step 2 is expensive and state 3 too big to keep: the plan saves 1 and 4, not 3.
    w = WeightedRevolve([1, 1, 5, 1, 1, 1], [4, 4, 4, 16, 4, 4], memory=12)
    saved = sorted(a.n for a in w if isinstance(a, Save))
    assert 3 not in saved
    assert w.forward_cost == 15.0 and w.peak_bytes == 12
    _check(w)


def test_more_memory_never_costs_more() -> None:
    rng = random.Random(3)
    costs = [rng.uniform(0.5, 2.0) for _ in range(20)]
    sizes = [rng.randint(1, 9) for _ in range(20)]
    last = float("inf")
    for memory in range(sizes[0], sizes[0] + sum(sizes[1:-1]) + 1):
        c = WeightedRevolve(costs, sizes, memory).forward_cost
        assert c <= last
        last = c
    assert last == pytest.approx(sum(costs[:-1]))  # everything fits: one sweep


# -- validity and the byte budget, coarse units included (NOTE [ Weighted reversal ] Rule 3) ----------
def test_valid_and_within_bytes_random() -> None:
    rng = random.Random(11)
    for _ in range(40):
        n = rng.randint(1, 40)
        costs = [rng.uniform(0.1, 3.0) for _ in range(n)]
        sizes = [rng.randint(0, 1 << 20) for _ in range(n)]
        memory = sizes[0] + rng.randint(0, sum(sizes[1:-1]) + 1)
        _check(WeightedRevolve(costs, sizes, memory, tier=rng.choice(list(Tier))))


def test_units() -> None:
    assert WeightedRevolve([1.0] * 5, [24] * 5, memory=10_000 * 24).memory_unit == 24
    assert WeightedRevolve([1.0] * 5, [6, 4, 8, 2, 100], memory=100).memory_unit == 2  # exact gcd
    big = WeightedRevolve([1.0] * 40, [1 << 20] + [(i + 1) * 1001 for i in range(39)], memory=1 << 24)
    assert big.memory_unit > 1001  # coarse: at most 128 units of budget
    _check(big)


def test_one_and_two_steps() -> None:
    one = WeightedRevolve([2.5], [100], memory=100)
    assert [type(a).__name__ for a in one] == ["EndForward", "Adjoint", "End"]
    assert one.forward_cost == 0.0 and one.slots_used == 0 and one.peak_bytes == 0
    two = WeightedRevolve([1.0, 2.0], [100, 100], memory=100)
    assert simulate(two).forward_steps == 1 and two.slots_used == 1


def test_value_semantics() -> None:
    w = WeightedRevolve([1, 2, 3], range(3), memory=2)
    assert w.step_costs == (1.0, 2.0, 3.0) and w.state_bytes == (0, 1, 2) and w.n_steps == 3
    assert w == WeightedRevolve((1.0, 2.0, 3.0), (0, 1, 2), 2)
    assert hash(w) == hash(WeightedRevolve((1.0, 2.0, 3.0), (0, 1, 2), 2))
    assert list(w) == list(w)  # planned once, decoded afresh
    assert repr(w) == "WeightedRevolve(step_costs=(1.0, 2.0, 3.0), state_bytes=(0, 1, 2), memory=2, tier=Tier.GPU)"
    r = dataclasses.replace(w, memory=3)
    assert r.memory == 3 and r.n_steps == 3
    _check(r)


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (([], [], 0), {}, ValueError, "len"),
        (([1.0, 1.0], [1], 1), {}, ValueError, "len"),
        (([0.0, 1.0], [1, 1], 1), {}, ValueError, r"step_costs\[0\]"),
        (([1.0, float("nan")], [1, 1], 1), {}, ValueError, r"step_costs\[1\]"),
        (([1.0, float("inf")], [1, 1], 1), {}, ValueError, r"step_costs\[1\]"),
        (([True, 1.0], [1, 1], 1), {}, TypeError, r"step_costs\[0\]"),
        (([1.0, "2"], [1, 1], 1), {}, TypeError, r"step_costs\[1\]"),
        (([1.0, 1.0], [1, -1], 1), {}, ValueError, r"state_bytes\[1\]"),
        (([1.0, 1.0], [1, 1.5], 1), {}, TypeError, r"state_bytes\[1\]"),
        (([1.0, 1.0], [1, 1], 1.0), {}, TypeError, "memory"),
        (([1.0, 1.0], [10, 1], 9), {}, ValueError, "memory >= 10"),
        ((iter([1.0]), [1], 1), {}, TypeError, "step_costs"),
        (([1.0], "a", 1), {}, TypeError, "state_bytes"),
        (([1.0], [1], 1), {"tier": "gpu"}, TypeError, "Tier"),
    ],
)
def test_bad_input(args: tuple[object, ...], kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match="^torchckpt: ") as info:
        WeightedRevolve(*args, **kwargs)  # type: ignore[arg-type]
    assert info.match(match)


# -- planning time (NOTE [ Weighted reversal ] Rule 6) --------------------------------------------------
def _plan_seconds(w: WeightedRevolve) -> float:
    t = time.perf_counter()
    w.pack()
    return time.perf_counter() - t


def test_planning_time() -> None:
    # Measured on the dev machine: n=32 unequal ~0.09 s, n=64 equal ~0.1 s, n=64 unequal ~0.8 s.
    rng = random.Random(0)
    n = 32
    costs = [rng.uniform(0.5, 3.0) for _ in range(n)]
    sizes = [rng.randint(1, 1000) * 1024 for _ in range(n)]
    w = WeightedRevolve(costs, sizes, memory=sum(sizes) // 4)
    assert _plan_seconds(w) < 2.0
    assert w.memory_unit > 1024  # the coarse unit: the budget is ~128 units
    _check(w)
    eq = WeightedRevolve([1.0] * 64, [8] * 64, memory=8 * 10)
    assert _plan_seconds(eq) < 3.0
    assert simulate(eq).forward_steps == optimal_forward_steps(64, 10)
    n = 64
    costs = [rng.uniform(0.5, 3.0) for _ in range(n)]
    sizes = [rng.randint(1, 1000) * 1024 for _ in range(n)]
    assert _plan_seconds(WeightedRevolve(costs, sizes, memory=sum(sizes) // 4)) < 10.0
