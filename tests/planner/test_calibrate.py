"""The mechanisms' measured costs in the step model (NOTE [ Mechanism costs ]) and the profile's robust times
(NOTE [ Profiling step ] Rule 9), on the CPU with injected measurements."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from chain_nets import D, Net, fixed_profile
from torchckpt.planner import Link, Plan, predict, profile
from torchckpt.planner.calibrate import (
    EVERY_OTHER, HOST_ALL, KEEP_ALL, KEEP_OPS_ALL, MEASURED, OFFLOAD_ALL, PARTS_FLOOR, RECOMPUTE_ALL, REENTRANT_ALL, calibrate,
    floor_policy, measure_policies, offload_policy, parts_floor, reentrant_faster, revolve_policy,
)
from torchckpt.planner.costs import KEEP, RECOMPUTE, REENTRANT, Decision, StepCosts, chain_states, through_reentrant
from torchckpt.planner.optimize import search, simple_policies
from torchckpt.planner.verify import _Profiled
from torchckpt.planner.profiling import Profile



@pytest.fixture(scope="module")
def prof() -> Profile:
    return fixed_profile(Net(6))


def _chain(prof: Profile) -> StepCosts:
    return prof.chain(Link(1e6, 1e6))  # a link too slow to offload over: plans keep and recompute


def test_calibrated_policies_predict_what_they_measured(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rules 2-6: after calibration the four measured policies predict their measured step
    (and, for the three recomputations, their measured peak); the other plans pay each block's measured cost. (A link
    fast enough that no copy back is waited for: time a copy stalls on is not the mechanism's.)"""
    chain = prof.chain(Link(1e10, 1e10))
    policies = simple_policies(chain)
    plans = dict(policies)
    before = {name: predict(chain, plans[name]) for name in MEASURED if name in plans}  # Net has matmuls: no KEEP_TOP_ALL
    rc, sel, host = (before[k].peak_bytes for k in (RECOMPUTE_ALL, KEEP_OPS_ALL, HOST_ALL))
    measured = {KEEP_ALL: (before[KEEP_ALL].peak_bytes, before[KEEP_ALL].step_s + 4e-3),
                RECOMPUTE_ALL: (rc - rc // 20, before[RECOMPUTE_ALL].step_s + 9e-3),
                KEEP_OPS_ALL: (sel + sel // 25, before[KEEP_OPS_ALL].step_s + 30e-3),
                HOST_ALL: (host + host // 10, before[HOST_ALL].step_s + 20e-3)}
    cal = calibrate(chain, policies, measured)
    for name in measured:
        got = predict(cal, plans[name])
        assert got.step_s == pytest.approx(measured[name][1], abs=1e-12), name
    for name in (RECOMPUTE_ALL, KEEP_OPS_ALL, HOST_ALL):  # the peaks within the tolerance of NOTE [ Mechanism costs ] Rule 3
        assert abs(predict(cal, plans[name]).peak_bytes - measured[name][0]) <= measured[name][0] // 1000, name
    assert cal.rec_bytes < 0 < cal.keep_rec_bytes and cal.host_rec_bytes > 0
    # Rule 5: what Recompute(store=...) cost beyond Rules 2-3, evenly over the blocks that sent their inputs
    assert len({b.host_rec_s for b in cal.blocks}) == 1 and cal.blocks[0].host_rec_s > 0
    n = len(chain.blocks)
    assert cal.other_bwd_s == pytest.approx(chain.other_bwd_s + 4e-3)
    # Rule 3: Recompute()'s extra 9 ms less what Rule 2 already added (4 ms), spread over the identical blocks
    assert [b.rec_s for b in cal.blocks] == pytest.approx([5e-3 / n] * n)
    assert sum(b.keep_rec_s for b in cal.blocks) == pytest.approx(30e-3 - 4e-3)
    mixed = tuple(RECOMPUTE if i % 3 == 0 else KEEP for i in range(n))  # a plan that was not measured
    assert predict(cal, mixed).step_s - predict(chain, mixed).step_s == pytest.approx(
        4e-3 + sum(cal.blocks[i].rec_s for i in range(0, n, 3)))


def test_the_cost_is_spread_by_tensors_and_by_ops(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rules 3-4: Recompute()'s cost in proportion to the tensors each block saves, that of
    Recompute(save=...) to its keepable ops."""
    chain = _chain(prof)
    blocks = list(chain.blocks)
    blocks[0] = dataclasses.replace(blocks[0], saved=blocks[0].saved + (0,) * len(blocks[0].saved),
                                    ops=blocks[0].ops * 2)  # twice the tensors and ops, nothing else changed
    chain = dataclasses.replace(chain, blocks=tuple(blocks))
    policies = simple_policies(chain)
    plans = dict(policies)
    measured = {name: (None, predict(chain, plans[name]).step_s + 7e-3) for name in (RECOMPUTE_ALL, KEEP_OPS_ALL)}
    cal = calibrate(chain, policies, measured)
    assert cal.blocks[0].rec_s == pytest.approx(2 * cal.blocks[1].rec_s)
    assert cal.blocks[0].keep_rec_s == pytest.approx(2 * cal.blocks[1].keep_rec_s)
    assert cal.rec_bytes == cal.keep_rec_bytes == 0  # no peak measured: the bytes stay the model's


def test_a_costly_dispatch_mode_moves_the_search_off_kept_ops(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 6: where Recompute(save=...) measured dear (its Python per op), the search's plan
    for a budget that took it before keeps no op's output; where it measured as the model priced it, it stays."""
    chain = _chain(prof)
    found = search(chain)
    budget = next(b for b in sorted(p.peak_bytes for _, p in found.plans) if any(d.keep for d in found.best(b)[0]))
    policies = simple_policies(chain)
    plans = dict(policies)
    sel = predict(chain, plans[KEEP_OPS_ALL])
    cheap = calibrate(chain, policies, {KEEP_OPS_ALL: (sel.peak_bytes, sel.step_s)})
    assert any(d.keep for d in search(cheap).best(budget)[0])
    dear = calibrate(chain, policies, {KEEP_OPS_ALL: (sel.peak_bytes, sel.step_s + 0.5)})
    assert not any(d.keep for d in search(dear).best(budget)[0])


def test_measure_policies_measures_the_four_in_order_and_leaves_out_what_did_not_run(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 1: keep everything, Recompute(), Recompute(save=...), Recompute(store=...) and
    Recompute(reentrant=True), each once; one that could not run (``None``: out of memory) is left out, and its terms
    stay 0."""
    chain = _chain(prof)
    policies = simple_policies(chain)
    calls: list[str] = []

    def step(name: str, plan: tuple[Decision, ...]) -> tuple[int, float] | None:
        calls.append(name)
        assert plan == dict(policies)[name]
        return None if name == RECOMPUTE_ALL else (1 << 30, 1.0)

    got = measure_policies(policies, step)
    assert calls == [n for n in MEASURED if n in dict(policies)]
    assert set(got) == {KEEP_ALL, KEEP_OPS_ALL, HOST_ALL, REENTRANT_ALL}
    cal = calibrate(chain, policies, got)
    assert all(b.rec_s == 0.0 for b in cal.blocks) and cal.rec_bytes == 0


def test_measure_policies_in_rounds_interleaves_them_and_takes_the_median_of_rounds(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 1: in rounds, every policy once per round (the two recomputations' rounds first),
    each policy's time the median of its rounds' and its largest peak; one that fails in a later round is left out;
    the others take the faster recomputation's form as it measured over all its rounds."""
    chain = _chain(prof)
    policies = simple_policies(chain)
    by_name = {**dict(policies), OFFLOAD_ALL: offload_policy(chain)}  # NOTE [ Mechanism costs ] Rule 14's, measured last
    calls: list[tuple[str, tuple[Decision, ...]]] = []
    # Recompute(): 1.0, 3.0, 1.2 (median 1.2); reentrant: 0.9, 2.0, 2.5 (median 2.0): after round 1 reentrant looked faster
    times = {RECOMPUTE_ALL: [1.0, 3.0, 1.2], REENTRANT_ALL: [0.9, 2.0, 2.5], KEEP_ALL: [0.5, 0.7, 0.6]}

    def step(name: str, plan: tuple[Decision, ...]) -> tuple[int, float] | None:
        r = sum(1 for n, _ in calls if n == name)
        calls.append((name, plan))
        if name == HOST_ALL and r == 1:
            return None  # out of memory in its second round
        return (100 + r, times[name][r]) if name in times else (200 - r, 1.5 + r)

    got = measure_policies(policies, step, chain, rounds=3)
    first = [n for n in MEASURED if n in by_name][:3]
    assert first == [KEEP_ALL, RECOMPUTE_ALL, REENTRANT_ALL]
    assert [n for n, _ in calls[:9]] == first * 3
    rest = [n for n, _ in calls[9:]]
    once = list(dict.fromkeys(rest))
    assert HOST_ALL in once and len(once) >= 3 and once[-1] == OFFLOAD_ALL
    assert rest == once + once + [n for n in once if n != HOST_ALL]  # round by round; HOST_ALL failed in round 2
    assert got[RECOMPUTE_ALL] == (102, 1.2) and got[REENTRANT_ALL] == (102, 2.0) and got[KEEP_ALL] == (102, 0.6)
    assert HOST_ALL not in got
    assert all(got[n] == (200, 2.5) for n in set(rest) - {HOST_ALL})
    # Recompute() measured faster over its rounds: the rest keep their plain form
    assert all(plan == by_name[n] for n, plan in calls[9:])
    assert not reentrant_faster(got)
    with pytest.raises(ValueError, match="rounds"):
        measure_policies(policies, step, chain, rounds=0)


def test_verification_reuses_what_was_measured(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 6: a plan measured before (while calibrating, or for another budget) is not run
    again; its figures are taken."""
    calls: list[str] = []

    def step(p: Plan) -> tuple[int, float]:
        calls.append(p.simple)
        return p.peak_bytes, 2.0

    chain = _chain(prof)
    every = dict(simple_policies(chain))[RECOMPUTE_ALL]
    fast = min(predict(chain, d).step_s for _, d in simple_policies(chain)) / 2  # the fastest simple policy measured
    planner = _Profiled(prof, Link(1e6, 1e6), None, step, chain, {every: (predict(chain, every).peak_bytes, fast)})
    budget = predict(chain, every).peak_bytes * 10 // 9
    p = planner.plan(budget)
    assert RECOMPUTE_ALL not in calls and p.simple == RECOMPUTE_ALL and p.measured_step_time == fast
    n = len(calls)
    planner.plan(budget + 1)
    assert len(calls) == n  # the same plans again: every one of them measured before


def test_every_plan_measured_is_kept_as_a_trial_with_its_decisions(prof: Profile) -> None:
    """``_Profiled.trials``: each plan the step function measured, in order, with the decisions it was made from and
    what it measured; a plan taken from what was measured before adds none (it did not run again)."""
    from torchckpt.planner.trials import trials_from_records, trials_to_records
    from torchckpt.planner.verify import _decisions

    ran: list[Plan] = []

    def step(p: Plan) -> tuple[int, float]:
        ran.append(p)
        return p.peak_bytes, 1.0 + len(ran)

    chain = _chain(prof)
    every = dict(simple_policies(chain))[RECOMPUTE_ALL]
    planner = _Profiled(prof, Link(1e6, 1e6), None, step, chain, {})
    budget = predict(chain, every).peak_bytes * 10 // 9
    planner.plan(budget)
    assert ran and [t.what for t in planner.trials] == ["verification"] * len(ran)
    assert [(t.decisions, t.peak_bytes, t.step_s) for t in planner.trials] == [
        (_decisions(p), p.peak_bytes, 2.0 + k) for k, p in enumerate(ran)]
    n = len(planner.trials)
    planner.plan(budget + 1)
    assert len(planner.trials) == len(ran) >= n
    assert trials_from_records(trials_to_records(planner.trials)) == planner.trials


def test_identical_blocks_share_the_median_of_their_times(prof: Profile) -> None:
    """NOTE [ Profiling step ] Rule 9: blocks of one kind with the same bytes and ops get their group's median forward,
    backward and op times; a block of another kind keeps its own."""
    n = len(prof.names)
    fwd = tuple(1e-3 * (i + 1) for i in range(n))
    bwd = tuple(2e-3 * (n - i) for i in range(n))
    ops = tuple(tuple(dataclasses.replace(o, seconds=(i + 1) * 1e-4) for o in b) for i, b in enumerate(prof.ops))
    varied = dataclasses.replace(prof, fwd_s=fwd, bwd_s=bwd, ops=ops)
    blocks = varied.blocks()
    assert [b.fwd_s for b in blocks] == pytest.approx([sum(fwd[2:4]) / 2] * n)
    assert [b.bwd_s for b in blocks] == pytest.approx([sum(bwd[2:4]) / 2] * n)
    assert len({b.ops for b in blocks}) == 1
    other = dataclasses.replace(varied, kinds=varied.kinds[:-1] + ("another",)).blocks()
    assert other[-1].fwd_s == fwd[-1] and other[-1].bwd_s == bwd[-1]
    assert {b.fwd_s for b in other[:-1]} == {fwd[2]}  # the median of the five others


@pytest.mark.parametrize("repeats", [1, 3])
def test_the_profile_measures_repeats_steps_and_op_timing_forwards(repeats: int) -> None:
    """NOTE [ Profiling step ] Rule 9: the warm-up step, the recorded step, ``repeats`` timed steps and ``repeats``
    op-timing forwards run each block's forward."""
    torch.manual_seed(1)
    m = Net(2)
    runs = []
    m.h[0].register_forward_hook(lambda *a: runs.append(1))
    profile(m, (torch.randn(2, 8, D),), {}, repeats=repeats)
    assert len(runs) == 2 + 2 * repeats


def test_keep_everything_faster_than_profiled_takes_time_off_outside_the_blocks_then_inside(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 2: a plain step measured faster than the profile's times (which its hooks slowed)
    takes the difference off the time outside the blocks, and then off the blocks' own, proportionally."""
    chain = _chain(prof)
    policies = simple_policies(chain)
    keep = dict(policies)[KEEP_ALL]
    p = predict(chain, keep).step_s
    outside = chain.other_fwd_s + chain.other_bwd_s
    little = calibrate(chain, policies, {KEEP_ALL: (None, p - outside / 2)})
    assert little.blocks == chain.blocks and little.other_fwd_s + little.other_bwd_s == pytest.approx(outside / 2)
    much = calibrate(chain, policies, {KEEP_ALL: (None, p / 2)})
    assert much.other_fwd_s == much.other_bwd_s == 0.0
    assert predict(much, keep).step_s == pytest.approx(p / 2)
    f = much.blocks[0].fwd_s / chain.blocks[0].fwd_s
    assert 0 < f < 1 and all(b.bwd_s == pytest.approx(c.bwd_s * f) for b, c in zip(much.blocks, chain.blocks))


def test_revolve_measured_beyond_its_prediction_moves_every_revolve_plan(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 8: the Revolve plan with the fewest snapshots within 1.5 x Recompute()'s step is
    measured after the others; what it peaked beyond its prediction is held through a Revolve plan's backward, so it predicts its
    measured peak, and every Revolve plan's peak moves by as much, up or down."""
    chain = _chain(prof)
    policies = simple_policies(chain)
    plans = dict(policies)
    name = revolve_policy(chain, policies)
    assert name is not None and name.startswith("checkpoint_chain")
    limit = 1.5 * predict(chain, plans[RECOMPUTE_ALL]).step_s
    revolves = [(predict(chain, d).peak_bytes, n) for n, d in policies if d[0].revolve
                and predict(chain, d).step_s <= limit]
    assert min(revolves)[1] == name
    calls: list[str] = []

    def step(n: str, plan: tuple[Decision, ...]) -> tuple[int, float]:
        calls.append(n)
        return predict(chain, plan).peak_bytes + (3 << 20 if n == name else 0), 1.0

    got = measure_policies(policies, step, chain)
    other = next(n for n in plans if n.startswith(EVERY_OTHER))
    floor = floor_policy(chain, policies)  # six blocks: the fewest snapshots are Rule 8's (NOTE [ Mechanism costs ] Rule 10)
    assert floor is None and 16 > len(chain.blocks)
    assert calls == [n for n in MEASURED if n in plans] + [name, other, OFFLOAD_ALL]
    chain16 = _chain(fixed_profile(Net(16)))
    calls.clear()
    measure_policies(simple_policies(chain16), lambda n, p: calls.append(n), chain16)  # type: ignore[func-returns-value]
    floor = floor_policy(chain16, simple_policies(chain16))
    assert floor is not None and calls[-4:-2] == [revolve_policy(chain16, simple_policies(chain16)), floor]
    cal = calibrate(chain, {n: plans[n] for n in (name,)}.items(), {name: got[name]})
    assert cal.revolve_bytes == 3 << 20
    assert abs(predict(cal, plans[name]).peak_bytes - got[name][0]) <= got[name][0] // 1000
    for _, d in policies:  # every Revolve plan's peak moves by as much (its backward holds it); no other plan's
        assert predict(cal, d).peak_bytes == predict(chain, d).peak_bytes + (cal.revolve_bytes if d[0].revolve else 0)
    below = predict(chain, plans[name]).peak_bytes - (1 << 10)  # under it, while its peak stays in the backward
    lower = calibrate(chain, policies, {name: (below, 1.0)})
    assert lower.revolve_bytes < 0 and abs(predict(lower, plans[name]).peak_bytes - below) <= below // 1000


def test_the_floor_measured_makes_revolve_linear_in_snapshot_memory(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 10: the Revolve plan with the fewest snapshots is measured too; what it peaked
    beyond its prediction is Rule 8's term at its snapshot memory, linear in between: both measured plans then predict
    what they measured, a Revolve plan between them lies between, one above Rule 8's moves by Rule 8's term alone;
    Rule 8's term alone under-predicts the floor's plan."""
    chain = _chain(fixed_profile(Net(16)))  # 16 blocks: Rule 8's plan has 2 snapshots, the floor's 1
    policies = simple_policies(chain)
    plans = dict(policies)
    rule8, floor = revolve_policy(chain, policies), floor_policy(chain, policies)
    assert rule8 is not None and floor is not None
    revolves = sorted((d[0].revolve, n) for n, d in policies if d[0].revolve)
    assert revolves[0][1] == floor and plans[floor][0].revolve < plans[rule8][0].revolve
    up = 3 << 20  # Rule 8's plan peaks 3 MiB over its prediction, the floor's 40 MiB over
    measured = {rule8: (predict(chain, plans[rule8]).peak_bytes + up, 1.0),
                floor: (predict(chain, plans[floor]).peak_bytes + (40 << 20), 1.0)}
    cal = calibrate(chain, policies, measured)
    assert cal.revolve_slope < 0 and cal.revolve_at == plans[rule8][0].revolve
    for n in (rule8, floor):
        assert abs(predict(cal, plans[n]).peak_bytes - measured[n][0]) <= measured[n][0] // 1000
    lo, hi = plans[floor][0].revolve, plans[rule8][0].revolve
    for m, n in revolves:
        moved = predict(cal, plans[n]).peak_bytes - predict(chain, plans[n]).peak_bytes
        if m > hi:
            assert abs(moved - cal.revolve_bytes) <= 1
        elif lo < m < hi:
            assert cal.revolve_bytes < moved < (40 << 20)
    only8 = calibrate(chain, policies, {rule8: measured[rule8]})  # without the floor's measurement: Rule 8 alone
    assert only8.revolve_slope == 0.0
    assert predict(only8, plans[floor]).peak_bytes < measured[floor][0] - (30 << 20)  # which under-predicts the floor's


def test_every_other_block_measured_prices_recomputations_after_a_kept_block(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 9: what every other block Recompute() measured beyond its prediction is spread
    over the blocks by their tensors and added to a recomputation whose next block is kept: that plan then predicts
    its measured step, every block Recompute() still predicts its own, and a plan recomputing two neighbours pays it
    for the second of them only (the first's next block is recomputed)."""
    chain = _chain(prof)
    policies = simple_policies(chain)
    plans = dict(policies)
    other = next(n for n in plans if n.startswith(EVERY_OTHER))
    every = predict(chain, plans[RECOMPUTE_ALL]).step_s
    alt = predict(chain, plans[other]).step_s
    cal = calibrate(chain, policies, {RECOMPUTE_ALL: (None, every), other: (None, alt - 3e-3)})
    n = len(chain.blocks)
    assert [b.alone_s for b in cal.blocks] == pytest.approx([-3e-3 / (n // 2)] * n)  # identical blocks, n/2 alone
    assert predict(cal, plans[other]).step_s == pytest.approx(alt - 3e-3)
    assert predict(cal, plans[RECOMPUTE_ALL]).step_s == pytest.approx(every)
    pair = (RECOMPUTE, RECOMPUTE) + (KEEP,) * (n - 2)
    assert predict(cal, pair).step_s - predict(chain, pair).step_s == pytest.approx(cal.blocks[1].alone_s)


def test_revolve_rebuilds_take_both_measured_plans_times() -> None:
    """NOTE [ Mechanism costs ] Rule 11: what the Revolve plan with the fewest snapshots took beyond its prediction, as
    a fraction of its rebuilds' predicted time, scales the rebuilds of every Revolve plan at or below its memory; what
    Rule 8's plan took the same way those at or above its memory; between them the fraction is linear in the memory.
    Both measured plans then predict their measured steps, and no plan without Revolve moves. Without Rule 8's
    measurement the floor's fraction holds everywhere (the rule's first form)."""
    chain = _chain(fixed_profile(Net(16)))
    policies = simple_policies(chain)
    plans = dict(policies)
    rule8, floor = revolve_policy(chain, policies), floor_policy(chain, policies)
    assert rule8 is not None and floor is not None
    lo, hi = plans[floor][0].revolve, plans[rule8][0].revolve
    before = {n: predict(chain, d) for n, d in policies}
    rebuild = {n: sum(chain_states(chain, plans[n][0].revolve).extra_s) for n in (rule8, floor)}
    assert rebuild[floor] > rebuild[rule8] > 0
    measured = {rule8: (before[rule8].peak_bytes, before[rule8].step_s + 0.5 * rebuild[rule8]),
                floor: (before[floor].peak_bytes, before[floor].step_s + rebuild[floor])}  # the rebuilds: 1.5x, 2x
    cal = calibrate(chain, policies, measured)
    assert cal.revolve_scale == pytest.approx(1.0) and cal.revolve_scale_at == pytest.approx(0.5)
    for n in (rule8, floor):
        assert predict(cal, plans[n]).step_s == pytest.approx(measured[n][1])
    assert cal.rebuild_scale(lo // 2) == pytest.approx(1.0) and cal.rebuild_scale(2 * hi) == pytest.approx(0.5)
    assert cal.rebuild_scale((lo + hi) // 2) == pytest.approx(0.75, rel=1e-3)
    moved = {n: predict(cal, d).step_s - before[n].step_s for n, d in policies}
    assert all(moved[n] == pytest.approx(0.0) for n, d in policies if not d[0].revolve)
    assert all(moved[n] > 0 for n, d in policies if d[0].revolve)
    only_floor = calibrate(chain, policies, {floor: measured[floor]})
    assert only_floor.revolve_scale_at is None and only_floor.rebuild_scale(2 * hi) == pytest.approx(1.0)
    slow = calibrate(chain, policies, {floor: (measured[floor][0], before[floor].step_s - 100 * rebuild[floor])})
    assert slow.revolve_scale == -0.9  # never below: a rebuild costs something


def test_sending_inputs_to_host_measured_faster_than_recompute_takes_nothing_off_the_blocks(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 5: where every block Recompute(store=...) measured faster than every block
    Recompute() (after Rule 3), its term is below 0 and counts as 0: sending inputs does not make a recomputation
    cheaper, so no plan sending some blocks' inputs is predicted under the same plan recomputing them on the device
    (the first form took the difference off those blocks' recomputation, and every mixed plan was predicted under
    what it measured); the policy itself is then predicted at the model's copies and Recompute()'s cost."""
    chain = prof.chain(Link(1e10, 1e10))
    policies = simple_policies(chain)
    plans = dict(policies)
    rec = predict(chain, plans[RECOMPUTE_ALL]).step_s
    measured = {RECOMPUTE_ALL: (None, rec * 1.5), HOST_ALL: (None, rec * 1.4)}
    cal = calibrate(chain, policies, measured)
    assert all(b.host_rec_s < 0 for b in cal.blocks if b.input_bytes)
    assert predict(cal, plans[RECOMPUTE_ALL]).step_s == pytest.approx(rec * 1.5, rel=1e-6)
    zero = dataclasses.replace(cal, blocks=tuple(dataclasses.replace(b, host_rec_s=0.0) for b in cal.blocks))
    assert predict(cal, plans[HOST_ALL]).step_s == pytest.approx(predict(zero, plans[HOST_ALL]).step_s, rel=1e-12)
    assert predict(cal, plans[HOST_ALL]).step_s > rec * 1.4
    n = len(chain.blocks)
    host = plans[HOST_ALL]
    mixed = tuple(host[i] if i % 2 == 0 else RECOMPUTE for i in range(n))  # every other block sends its inputs
    assert predict(cal, mixed).step_s >= predict(cal, plans[RECOMPUTE_ALL]).step_s - 1e-12


@pytest.mark.parametrize("link", [1e10, 3e6])
def test_sending_inputs_measured_slower_predicts_what_it_measured_though_a_stall_absorbs_time(prof: Profile,
                                                                                             link: float) -> None:
    """NOTE [ Mechanism costs ] Rules 5 and 16: every block Recompute(store=...) measured 30% over its prediction; the
    term put in the sending blocks' forward makes the policy predict what it measured. Over a fast link that is the
    excess itself; over a slow one the time added to each forward lets the copies that stalled it run beside it (the
    stall shrinks), so the step rises by less than the time added and the term is solved larger than the excess (on
    an H100, ResNet-152's policy: the excess alone left it predicted 9% under what it measured)."""
    chain = prof.chain(Link(link, link))
    plans = dict(simple_policies(chain))
    p = predict(chain, plans[HOST_ALL])
    measured = p.step_s * 1.3
    cal = calibrate(chain, simple_policies(chain), {HOST_ALL: (None, measured)})
    q = predict(cal, plans[HOST_ALL])
    assert q.step_s == pytest.approx(measured, rel=1e-4)
    term = sum(b.host_rec_s for b in cal.blocks)
    assert all(b.host_rec_s > 0 for b, d in zip(cal.blocks, plans[HOST_ALL]) if d.host)
    if link > 1e9:
        assert p.stall_s < 0.01 * p.step_s and term == pytest.approx(measured - p.step_s, rel=1e-6)
    else:
        assert p.stall_s > 0.2 * p.step_s and q.stall_s < p.stall_s and term > 1.5 * (measured - p.step_s)


@pytest.mark.parametrize("excess_mib", [96, -48])
def test_the_floor_in_parts_measured_predicts_what_it_measured(excess_mib: int) -> None:
    """NOTE [ Mechanism costs ] Rule 12: the search's floor recomputes blocks in parts; measured ``excess_mib`` over
    (or under) its prediction, it predicts what it measured after calibration, every plan with a block in parts moves,
    plans with none keep their peaks, and the search's floor moves with it."""
    from test_optimize import _chain as parts_chain

    chain = parts_chain(6, parts=True)
    policies = simple_policies(chain)
    plan = parts_floor(chain)
    assert plan is not None and any(d.parts for d in plan)
    before = predict(chain, plan).peak_bytes
    measured = before + excess_mib * (1 << 20)
    cal = calibrate(chain, policies, {PARTS_FLOOR: (measured, 0.0)})
    assert cal.parts_bytes == excess_mib * (1 << 20)
    assert predict(cal, plan).peak_bytes == measured
    whole = [d for d, _ in search(chain).plans if not any(x.parts for x in d)]
    assert whole and all(predict(cal, d).peak_bytes == predict(chain, d).peak_bytes for d in whole)
    assert search(cal).floor <= measured and (search(cal).floor > search(chain).floor) == (excess_mib > 0)
    assert calibrate(chain, policies, {}).parts_bytes == 0  # not measured: the model alone


def test_the_parts_term_is_lowered_only_where_a_block_in_parts_holds_the_peak() -> None:
    """NOTE [ Mechanism costs ] Rule 12: a floor whose predicted peak lies at a block recomputed whole (or in the
    forward) and that measured under its prediction leaves the term at 0: lowering it would change no prediction of
    that plan, only every other plan's in parts."""
    from test_optimize import _chain as parts_chain

    chain = parts_chain(6, parts=True)
    plan = parts_floor(chain)
    assert plan is not None
    whole = tuple(dataclasses.replace(d, parts=()) if i == len(plan) - 1 else d for i, d in enumerate(plan))
    p = predict(chain, whole)
    assert p.at == f"backward {len(plan) - 1}"  # the last block, now whole, holds the peak
    from torchckpt.planner.calibrate import calibrate_parts

    assert calibrate_parts(chain, whole, p.peak_bytes - (64 << 20), 1).parts_bytes == 0


@pytest.mark.parametrize("excess_mib", [300, 100])
def test_a_floor_predicted_to_peak_in_its_forward_that_measured_far_more_raises_its_backwards(excess_mib: int) -> None:
    """NOTE [ Mechanism costs ] Rule 15: the floor in parts is predicted to peak in its forward (1.2 GiB saved outside
    the blocks), where the parts term does not act; measured 300 MiB (6%) over, the term rises to the least value at
    which the plan predicts its measured peak in a backward, and the search's floor rises with it; 100 MiB (2%) over,
    within what the forward's own prediction may miss, the term stays 0 (no backward is raised to meet a forward)."""
    from test_optimize import _chain as parts_chain

    chain = dataclasses.replace(parts_chain(6, parts=True), other_saved_bytes=1200 << 20)
    plan = parts_floor(chain)
    assert plan is not None and any(d.parts for d in plan)
    p = predict(chain, plan)
    assert p.at.startswith("forward")
    measured = p.peak_bytes + (excess_mib << 20)
    cal = calibrate(chain, simple_policies(chain), {PARTS_FLOOR: (measured, 0.0)})
    if excess_mib == 100:
        assert cal.parts_bytes == 0 and search(cal).floor == search(chain).floor
        return
    q = predict(cal, plan)
    assert q.at.startswith("backward") and abs(q.peak_bytes - measured) <= measured // 1000
    lower = dataclasses.replace(cal, parts_bytes=cal.parts_bytes - (2 * measured) // 1000)
    assert predict(lower, plan).peak_bytes < measured - measured // 1000  # the least such term, not any
    assert search(cal).floor > search(chain).floor
    whole = [d for d, _ in search(chain).plans if not any(x.parts for x in d)]
    assert whole and all(predict(cal, d).peak_bytes == predict(chain, d).peak_bytes for d in whole)


def _reentrant_measured(chain: StepCosts, policies: list[tuple[str, tuple[Decision, ...]]], faster: bool
                        ) -> tuple[dict[str, tuple[int, float]], dict[str, tuple[Decision, ...]]]:
    """``measure_policies`` on ``chain`` where every block Recompute(reentrant=True) measures 2 ms over its prediction
    and every block Recompute() 10 ms over (``faster``) or 1 ms (not): what it measured, and the plan each step got."""
    plans = {**dict(policies), OFFLOAD_ALL: offload_policy(chain)}  # NOTE [ Mechanism costs ] Rule 14's too
    got: dict[str, tuple[Decision, ...]] = {}

    def step(name: str, plan: tuple[Decision, ...]) -> tuple[int, float]:
        got[name] = plan
        p = predict(chain, plan)
        extra = {RECOMPUTE_ALL: 10e-3 if faster else 1e-3, REENTRANT_ALL: 2e-3}.get(name, 0.0)
        return p.peak_bytes, p.step_s + extra

    measured = measure_policies(policies, step, chain)
    assert set(got) == set(measured) and set(plans) >= set(got)
    return measured, got


def test_reentrant_measured_faster_gives_every_plan_a_reentrant_twin(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 13: every block Recompute(reentrant=True) measured faster than every block
    Recompute(): the policies measured after them ran with whole-block recomputations reentrant; each mechanism's
    time and bytes are calibrated on its own measurement, so both policies predict what they measured (the floor
    stays Recompute()'s where reentrant holds more); the search records each plan and its twin with whole blocks
    recomputed reentrant (blocks that keep ops, in parts, by Revolve or with inputs on host keep their own mechanism),
    and where both fit the twin is the faster."""
    chain = _chain(prof)
    policies = simple_policies(chain)
    plans = dict(policies)
    measured, got = _reentrant_measured(chain, policies, faster=True)
    n = len(chain.blocks)
    rc = predict(chain, plans[RECOMPUTE_ALL]).peak_bytes
    measured[RECOMPUTE_ALL] = (rc - rc // 50, measured[RECOMPUTE_ALL][1])  # reentrant holds more than Recompute()
    measured[REENTRANT_ALL] = (rc + rc // 50, measured[REENTRANT_ALL][1])
    other = next(n for n in got if n.startswith(EVERY_OTHER))
    assert got[other] == through_reentrant(plans[other]) != plans[other]  # measured after Rule 13 decided
    assert got[RECOMPUTE_ALL] == plans[RECOMPUTE_ALL] and not any(d.reentrant for d in got[RECOMPUTE_ALL])
    assert got[KEEP_OPS_ALL] == plans[KEEP_OPS_ALL]  # kept ops: Recompute(save=...) stays
    cal = calibrate(chain, policies, measured)
    assert cal.reentrant and cal.reent_bytes > cal.rec_bytes
    for name, plan in ((RECOMPUTE_ALL, plans[RECOMPUTE_ALL]), (REENTRANT_ALL, (REENTRANT,) * n)):
        p = predict(cal, plan)
        assert p.step_s == pytest.approx(measured[name][1], abs=1e-12), name
        assert abs(p.peak_bytes - measured[name][0]) <= measured[name][0] // 1000, name
    assert predict(cal, got[other]).step_s == pytest.approx(measured[other][1], abs=1e-12)
    found = search(cal)
    recorded = {plan for plan, _ in found.plans}
    twins = [plan for plan in recorded if through_reentrant(plan) != plan]
    assert twins and all(through_reentrant(plan) in recorded for plan in twins)
    assert not any(d.reentrant for plan in recorded for d in plan if d.keep or d.parts or d.revolve or d.host)
    assert found.floor <= predict(cal, plans[RECOMPUTE_ALL]).peak_bytes < predict(cal, (REENTRANT,) * n).peak_bytes
    roomy = predict(cal, (REENTRANT,) * n).peak_bytes + 1
    best, _ = found.best(roomy)
    assert any(d.reentrant for d in best) and through_reentrant(best) == best
    names = [name for name, _, _ in found.simple]
    assert REENTRANT_ALL in names and RECOMPUTE_ALL in names
    assert any(name.startswith("every other block Recompute(reentrant=True) (") for name in names)


def test_reentrant_measured_slower_leaves_every_plan_as_it_was(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 13: where Recompute() measured faster, nothing is reentrant but the simple policy
    of that name, and Rule 3 calibrates on Recompute()'s measurement."""
    chain = _chain(prof)
    policies = simple_policies(chain)
    plans = {**dict(policies), OFFLOAD_ALL: offload_policy(chain)}
    measured, got = _reentrant_measured(chain, policies, faster=False)
    assert all(got[name] == plans[name] for name in got)
    cal = calibrate(chain, policies, measured)
    assert not cal.reentrant
    assert predict(cal, plans[RECOMPUTE_ALL]).step_s == pytest.approx(measured[RECOMPUTE_ALL][1], abs=1e-12)
    found = search(cal)
    assert [plan for plan, _ in found.plans if any(d.reentrant for d in plan)] == [plans[REENTRANT_ALL]]


def test_through_reentrant_changes_whole_block_recomputations_only() -> None:
    """NOTE [ Mechanism costs ] Rule 13: reentrant takes no kept ops, parts, Revolve or store."""
    others = (KEEP, Decision("recompute", keep=(1,)), Decision("recompute", parts=(2,)),
              Decision("recompute", revolve=1 << 20), Decision("recompute", host=True), Decision("offload", (0,)))
    assert through_reentrant(others) == others
    assert through_reentrant((RECOMPUTE, KEEP, RECOMPUTE)) == (REENTRANT, KEEP, REENTRANT)


def test_reentrant_that_could_not_run_leaves_no_plan_reentrant(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 13: every block Recompute(reentrant=True) measured and could not run (its step gave
    ``None``) where Recompute() ran: no plan of the search, simple policies included, recomputes through it."""
    chain = _chain(prof)
    policies = simple_policies(chain)
    assert REENTRANT_ALL in dict(policies)
    measured = measure_policies(policies, lambda name, plan: None if name == REENTRANT_ALL else (1 << 20, 1.0), chain)
    assert REENTRANT_ALL not in measured and RECOMPUTE_ALL in measured
    cal = calibrate(chain, policies, measured)
    assert not cal.reentrant_runs and not cal.reentrant
    found = search(cal)
    assert not any(d.reentrant for plan, _ in found.plans for d in plan)
    assert REENTRANT_ALL not in [name for name, _, _ in found.simple]
    assert calibrate(chain, policies, {}).reentrant_runs  # nothing measured (the CPU): nothing known against it


def test_offloads_measured_price_every_offload_by_its_tensors(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 14: every block sending its smallest saved tensor is measured last; what it took
    beyond its prediction, per tensor saved, is each block's ``off_s``: that policy then predicts what it measured, a
    plan offloading in one block pays that block's share in its forward, a plan offloading nothing pays none, and a
    policy measured faster than its prediction takes nothing off (not below the copies' own time)."""
    chain = prof.chain(Link(1e10, 1e10))
    blocks = list(chain.blocks)
    blocks[0] = dataclasses.replace(blocks[0], saved=blocks[0].saved + (0,) * len(blocks[0].saved), same=())  # twice the tensors
    chain = dataclasses.replace(chain, blocks=tuple(blocks))
    off = offload_policy(chain)
    assert off is not None and all(d.mode == "offload" and d.offload and not d.compress for d in off)
    for b, d in zip(chain.blocks, off):  # the smallest storage it saves, nothing larger
        assert min(b.saved[k] for k in d.offload if b.saved[k]) == min(n for n in b.saved if n > 0)
    policies = simple_policies(chain)
    calls: list[str] = []

    def step(name: str, plan: tuple[Decision, ...]) -> tuple[int, float]:
        calls.append(name)
        return 1 << 30, predict(chain, plan).step_s + (12e-3 if name == OFFLOAD_ALL else 0.0)

    measured = measure_policies(policies, step, chain)
    assert calls[-1] == OFFLOAD_ALL and calls.count(OFFLOAD_ALL) == 1
    cal = calibrate(chain, policies, measured)
    assert predict(cal, off).step_s == pytest.approx(measured[OFFLOAD_ALL][1], rel=1e-9)
    assert cal.blocks[0].off_s == pytest.approx(2 * cal.blocks[1].off_s)
    assert sum(b.off_s for b in cal.blocks) == pytest.approx(12e-3)
    n = len(chain.blocks)
    one = (off[2],) + (KEEP,) * (n - 1)
    assert predict(cal, one).step_s - predict(chain, one).step_s == pytest.approx(cal.blocks[0].off_s)
    for name, plan in policies:  # no simple policy offloads a block's own tensors: none of them moves
        assert predict(cal, plan).step_s == pytest.approx(predict(chain, plan).step_s, rel=1e-9), name
    cheap = calibrate(chain, policies, {OFFLOAD_ALL: (None, predict(chain, off).step_s - 5e-3)})
    assert all(b.off_s < 0 for b in cheap.blocks)
    assert predict(cheap, off).step_s == pytest.approx(predict(chain, off).step_s, rel=1e-9)
    assert offload_policy(dataclasses.replace(chain, blocks=tuple(
        dataclasses.replace(b, saved=()) for b in chain.blocks))) is None  # nothing saved: nothing to offload


def test_dear_offloads_move_the_search_off_them(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 14 in the search: at a budget whose plan offloaded, offloads measured dear give a
    plan that offloads nothing (it recomputes instead); measured as the model priced them, the plan stays."""
    chain = prof.chain(Link(1e10, 1e10))
    found = search(chain)
    budget = next(b for b in sorted(p.peak_bytes for _, p in found.plans)
                  if any(d.mode == "offload" for d in found.best(b)[0]))
    policies = simple_policies(chain)
    off = offload_policy(chain)
    assert off is not None
    base = predict(chain, off).step_s
    same = calibrate(chain, policies, {OFFLOAD_ALL: (None, base)})
    assert search(same).best(budget)[0] == found.best(budget)[0]
    dear = calibrate(chain, policies, {OFFLOAD_ALL: (None, base + 10 * base)})
    assert not any(d.mode == "offload" for d in search(dear).best(budget)[0])


def test_the_offload_policy_sends_every_position_of_the_smallest_storage(prof: Profile) -> None:
    """NOTE [ Mechanism costs ] Rule 14's policy with NOTE [ Plan search ] Rule 1: where the block's smallest storage is
    saved at two positions (a view saved after its base, counted once), both go; a block that saves nothing keeps."""
    chain = _chain(prof)
    b0 = chain.blocks[0]
    saved = (4096, 0, 64, 0)  # position 3 is a view of position 2's storage (its bytes counted there)
    blocks = (dataclasses.replace(b0, saved=saved, same=(0, 1, 2, 2), shared=()),
              dataclasses.replace(b0, saved=(), same=(), shared=())) + chain.blocks[2:]
    policy = offload_policy(dataclasses.replace(chain, blocks=blocks))
    assert policy is not None
    assert policy[0] == Decision("offload", (2, 3)) and policy[1] == KEEP
