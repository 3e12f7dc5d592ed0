"""NOTE [ Tier bandwidths ] Rule 4: the host link is timed only after its copies have kept it busy a while, so a link
caught slow (an H100's PCIe link measured at half its rate after one warm-up round trip) does not become the figure
every planned copy is priced at."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from torchckpt.memory.bandwidth import _WARM_S, _warmed, host_link


def _link(slow_s: float, slow: float = 2.0, fast: float = 1.0) -> tuple[list[int], Callable[[], tuple[float, float]]]:
    """A round trip that takes ``slow`` seconds each way until ``slow_s`` seconds of copies have run, then ``fast``;
    and a list counting the calls."""
    calls = [0]
    spent = [0.0]

    def round_trip() -> tuple[float, float]:
        calls[0] += 1
        t = slow if spent[0] < slow_s else fast
        spent[0] += 2 * t
        return t, t

    return calls, round_trip


def test_the_timed_copies_come_after_a_slow_start() -> None:
    _, rt = _link(slow_s=10.0)
    out, back = _warmed(rt, reps=5, warm_s=12.0)
    assert out == back == [1.0] * 5
    _, rt1 = _link(slow_s=10.0)
    out1, _ = _warmed(rt1, reps=5, warm_s=1e-9)
    assert out1[0] == 2.0  # one warm-up round trip, as before the rule: the slow start is timed


def test_the_warm_up_runs_at_least_once_and_at_most_its_bound() -> None:
    calls, rt = _link(slow_s=0.0)
    _warmed(rt, reps=3, warm_s=0.0)
    assert calls[0] == 1 + 3
    calls2, rt2 = _link(slow_s=1e9)
    out, _ = _warmed(rt2, reps=3, warm_s=1e12, most=7)
    assert calls2[0] == 7 + 3 and out == [2.0] * 3  # a link slow throughout is measured slow


def test_the_warm_up_is_a_quarter_second_of_copies() -> None:
    assert _WARM_S == pytest.approx(0.25)
    it: Iterator[tuple[float, float]] = iter([(0.01, 0.01)] * 1000)
    n = [0]

    def rt() -> tuple[float, float]:
        n[0] += 1
        return next(it)

    _warmed(rt, reps=2)
    assert n[0] == 13 + 2  # 13 round trips of 20 ms reach 0.25 s


def test_the_cpu_measurement_still_gives_rates() -> None:
    d2h, h2d = host_link(torch.device("cpu"), pinned=False, nbytes=1 << 20)
    assert d2h > 0 and h2d > 0
