"""NOTE [ Applying a plan ] Rule 4: a plan's measured steps, more of them while their times spread."""
from __future__ import annotations

import itertools

from torchckpt.planner.verify import _VERIFY_MOST, measured_steps, more_steps


def steps(times: list[float]) -> tuple[list[float], object]:
    ran: list[float] = []
    it = itertools.cycle(times)

    def one() -> tuple[int, float]:
        t = next(it)
        ran.append(t)
        return int(t * 1000), t

    return ran, one


def test_steady_steps_are_measured_three_times() -> None:
    ran, one = steps([0.081, 0.082, 0.0815])
    assert measured_steps(one, 3) == (82, 0.0815)
    assert len(ran) == 3


def test_steps_that_spread_are_measured_up_to_the_most_and_the_median_counts() -> None:
    # ConvNeXt-B's every block Recompute() on an H100 host, eight steps in a row (benchmarks/policy_drift.py)
    ran, one = steps([0.132, 0.136, 0.195, 0.192, 0.126, 0.127, 0.130, 0.195, 0.131])
    peak, t = measured_steps(one, 3)
    assert len(ran) == _VERIFY_MOST == 9
    assert t == sorted(ran)[4] == 0.132 and peak == 195
    assert more_steps(ran[:3], 3) and not more_steps(ran, 3)


def test_more_steps_stop_once_the_times_agree_and_never_for_one_step_or_ranks_together() -> None:
    ran, one = steps([0.100, 0.130, 0.101, 0.102])
    measured_steps(one, 3)
    assert len(ran) == 9  # the spread stays over 10% once seen: the median of nine
    ran, one = steps([0.100, 0.130])
    measured_steps(one, 1)
    assert len(ran) == 1  # a plan measured for its peak alone
    ran, one = steps([0.100, 0.130, 0.101])
    measured_steps(one, 3, alone=False)
    assert len(ran) == 3  # ranks planning together run the same steps
    assert not more_steps([0.100, 0.105, 0.109], 3) and more_steps([0.100, 0.105, 0.111], 3)
