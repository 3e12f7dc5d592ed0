"""Peer spill planning (NOTE [ Peer spill ]): the min-time max-flow split against a brute-force optimum."""
from __future__ import annotations

import itertools
import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchckpt.schedules.spill import greedy_spill, plan_spill, spill_time

G = 1e9


def _valid(s, overflow, spare) -> None:
    n = len(overflow)
    for i in range(n):
        assert s.to_host[i] + sum(s.to_peer[i]) == pytest.approx(overflow[i], rel=1e-6, abs=1.0)
        assert s.to_peer[i][i] == 0
    for j in range(n):
        assert sum(s.to_peer[i][j] for i in range(n)) <= spare[j] * (1 + 1e-9) + 1.0


def _brute(overflow, spare, host, peer) -> float:
    """The best split on a grid: each GPU's overflow in k parts over its destinations (host and linked peers)."""
    k = 12 if len(overflow) == 2 else 5
    n = len(overflow)
    dests = [[None] + [j for j in range(n) if j != i and peer[i][j] > 0] for i in range(n)]
    per_gpu = []
    for i in range(n):
        opts = []
        for parts in itertools.product(range(k + 1), repeat=len(dests[i])):
            if sum(parts) == k:
                opts.append(parts)
        per_gpu.append(opts)
    best = float("inf")
    for choice in itertools.product(*per_gpu):
        to_host = [0.0] * n
        to_peer = [[0.0] * n for _ in range(n)]
        for i, parts in enumerate(choice):
            for d, p in zip(dests[i], parts):
                x = overflow[i] * p / k
                if d is None:
                    to_host[i] += x
                else:
                    to_peer[i][d] += x
        if all(sum(to_peer[i][j] for i in range(n)) <= spare[j] + 1e-6 for j in range(n)):
            best = min(best, spill_time(to_host, to_peer, host, peer))
    return best


@st.composite
def instances(draw):
    n = draw(st.integers(2, 3))
    overflow = [draw(st.sampled_from([0, 1, 2, 4, 8])) * G for _ in range(n)]
    spare = [draw(st.sampled_from([0, 1, 3, 6])) * G for _ in range(n)]
    host = [draw(st.sampled_from([25, 50])) * G for _ in range(n)]
    peer = [[0.0 if i == j else draw(st.sampled_from([0, 50, 150, 300])) * G for j in range(n)] for i in range(n)]
    return overflow, spare, host, peer


@settings(max_examples=60, deadline=None)
@given(instances())
def test_max_flow_is_at_least_as_good_as_any_grid_split(inst) -> None:
    overflow, spare, host, peer = inst
    s = plan_spill(overflow, spare, host, peer)
    _valid(s, overflow, spare)
    assert s.time == pytest.approx(spill_time(s.to_host, s.to_peer, host, peer))
    assert s.time <= _brute(overflow, spare, host, peer) * (1 + 2e-3) + 1e-12
    g = greedy_spill(overflow, spare, host, peer)
    _valid(g, overflow, spare)
    assert s.time <= g.time * (1 + 2e-3) + 1e-12  # the greedy split is never better
    assert s.time <= max(o / h for o, h in zip(overflow, host)) * (1 + 1e-9)  # nor is everything to host


def test_max_flow_beats_greedy_where_the_paper_says() -> None:
    """One GPU's overflow is best split between its host link and its peer, not sent to the fastest link alone."""
    s = plan_spill([8 * G, 0], [0, 8 * G], [50 * G, 50 * G], [[0, 150 * G], [150 * G, 0]])
    g = greedy_spill([8 * G, 0], [0, 8 * G], [50 * G, 50 * G], [[0, 150 * G], [150 * G, 0]])
    assert s.time == pytest.approx(0.04, rel=2e-3)  # 8 GB over 200 GB/s of links
    assert g.time == pytest.approx(8 / 150, rel=1e-9)


def test_planning_8_gpus_is_fast() -> None:
    import random

    rnd = random.Random(0)
    n = 8
    times = []
    for _ in range(20):
        ov = [rnd.choice([0, rnd.uniform(1, 20)]) * G for _ in range(n)]
        sp = [rnd.uniform(0, 10) * G if o == 0 else 0 for o in ov]
        host = [rnd.uniform(20, 55) * G for _ in range(n)]
        peer = [[0 if i == j else rnd.uniform(50, 300) * G for j in range(n)] for i in range(n)]
        t = time.perf_counter()
        s = plan_spill(ov, sp, host, peer)
        times.append(time.perf_counter() - t)
        _valid(s, ov, sp)
    assert statistics.median(times) < 5e-3, f"median {statistics.median(times) * 1e3:.2f} ms"


def test_bad_input_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="torchckpt: spill planning needs one overflow"):
        plan_spill([1.0], [1.0, 2.0], [1.0], [[0.0]])
    with pytest.raises(ValueError, match="host bandwidths > 0"):
        plan_spill([1.0], [0.0], [0.0], [[0.0]])


def test_nothing_to_move() -> None:
    assert plan_spill([0, 0], [1, 1], [1, 1], [[0, 1], [1, 0]]).time == 0
