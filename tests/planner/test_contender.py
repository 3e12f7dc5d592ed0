"""NOTE [ Applying a plan ] Rule 10 on the CPU with injected measurements: a plan of another shape predicted within 5%
of the plan is measured too, and where it fits and measured within reach, the two run in turns and the faster is
returned."""
from __future__ import annotations

from typing import Any

import pytest

from chain_nets import Net, fixed_profile
from torchckpt.planner import Link, Plan
from torchckpt.planner import verify
from torchckpt.planner.costs import Decision
from torchckpt.planner.optimize import search
from torchckpt.planner.profiling import Profile
from torchckpt.planner.verify import _decisions, _Profiled


@pytest.fixture(scope="module")
def prof() -> Profile:
    return fixed_profile(Net(8))


def _planner(prof: Profile, times: Any, peaks: Any = None) -> tuple[_Profiled, list[tuple[Decision, ...]], list[str]]:
    """A planner whose steps measure ``times(decisions, plan)`` seconds and ``peaks(...)`` bytes (default: half the
    prediction, so that Rule 4's slack, 10% of budgets this small, plays no part), recording what it measured and
    said."""
    chain = prof.chain(Link(1e6, 1e6))  # a link too slow to offload over: plans keep and recompute
    calls: list[tuple[Decision, ...]] = []
    said: list[str] = []

    def step(p: Plan) -> tuple[int, float]:
        d = _decisions(p)
        calls.append(d)
        return (peaks(d, p) if peaks else p.peak_bytes // 2), times(d, p)

    planner = _Profiled(prof, Link(1e6, 1e6), None, step, chain, {})
    planner.say = said.append
    return planner, calls, said


def _case(planner: _Profiled) -> tuple[int, Plan, tuple[Decision, ...]]:
    """A budget, the search's plan for it (measured as predicted) and the plan of another shape Rule 10 measures
    (identical blocks: recomputing others of them predicts the same step)."""
    found = planner.found
    budget = (found.plans[0][1].peak_bytes + found.floor) // 2
    d, pred = found.best(budget)
    near = sorted((p.step_s, k, e) for k, (e, p) in enumerate(found.plans) if p.peak_bytes <= budget
                  and p.step_s <= pred.step_s * 1.05 and sum(a.mode != b.mode for a, b in zip(e, d)) >= 2)
    assert near, "the fixture has no plan of another shape within 5%"
    best = planner._candidate(d, pred, budget)
    planner.memo[d] = (pred.peak_bytes, pred.step_s)
    return budget, Plan(**{**best.__dict__, "measured_peak_bytes": pred.peak_bytes,
                           "measured_step_time": pred.step_s}), near[0][2]


def test_the_contender_is_measured_and_returned_where_it_could_win(prof: Profile) -> None:
    """Measured 5% faster than the plan: returned, for the turns."""
    holder: list[tuple[Decision, ...]] = []
    planner, calls, _ = _planner(prof, lambda d, p: p.step_time * (0.95 if holder and d == holder[0] else 1.0))
    budget, best, other = _case(planner)
    holder.append(other)
    assert planner._contender(budget, best) == other and calls == [other]
    assert other in planner.memo and other in planner.fresh
    assert planner._contender(budget, best) is None and calls == [other]  # measured before: not again


@pytest.mark.parametrize("why", ["over the budget", "as fast", "not within 5%"])
def test_no_contender_where_it_cannot_win(prof: Profile, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    budget_of: list[int] = []
    planner, calls, _ = _planner(prof, lambda d, p: p.step_time * (0.995 if why == "as fast" else 0.5),
                                 lambda d, p: budget_of[0] if why == "over the budget" else p.peak_bytes // 2)
    budget, best, other = _case(planner)
    budget_of.append(budget)
    if why == "not within 5%":
        monkeypatch.setattr(verify, "_NEAR", -0.5)
    assert planner._contender(budget, best) is None
    assert calls == ([] if why == "not within 5%" else [other])


def test_a_faster_contender_is_raced_and_taken(prof: Profile, monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan``: Rule 10's contender (here a plan of the search that is no simple policy, which Rule 7 would measure
    anyway), measured 20% faster, runs in three turns against the plan and is returned."""
    planner, calls, said = _planner(prof, lambda d, p: p.step_time)
    budget, best, _ = _case(planner)
    planner.memo.clear()
    found = planner.found
    simple = {d for _, d, _ in found.simple}
    other = min((p.step_s, k, d) for k, (d, p) in enumerate(found.plans)
                if p.peak_bytes <= budget and d not in simple and d != _decisions(best))[2]
    planner._step = lambda p: (p.peak_bytes // 2, p.step_time * (0.8 if _decisions(p) == other else 1.0))

    def contender(self: _Profiled, b: int, mine: Plan) -> tuple[Decision, ...]:
        self.step(self._candidate(other, verify.predict(self.found.chain, other), b), other)
        return other

    monkeypatch.setattr(_Profiled, "_contender", contender)
    got = planner.plan(budget)
    assert _decisions(got) == other
    assert any("in 3 turns each" in s and "took another plan of the search" in s for s in said), said
    assert got.turns and got.turns[0].step_time == pytest.approx(got.step_time * 0.8)


def test_no_contender_for_a_plan_that_keeps_every_block(prof: Profile) -> None:
    planner, calls, _ = _planner(prof, lambda d, p: p.step_time * 0.5)
    found = planner.found
    d, pred = found.plans[0]
    assert all(x.mode == "keep" for x in d)
    best = planner._candidate(d, pred, pred.peak_bytes * 2)
    best = Plan(**{**best.__dict__, "measured_peak_bytes": pred.peak_bytes, "measured_step_time": pred.step_s})
    assert planner._contender(pred.peak_bytes * 2, best) is None and calls == []
