"""The plan search on synthetic costs (NOTE [ Step model ], NOTE [ Plan search ]): no torch needed."""
from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchckpt.planner.costs import KEEP, RECOMPUTE, Block, StepCosts, CodecCost, Decision, Link, predict
from torchckpt.planner.costs import balanced_parts, device_bytes, host_bytes, materialised_bytes, part_bytes
from torchckpt.planner.optimize import PlanError, ladder, search
from torchckpt.planner.rebuild import states
from torchckpt.schedules import optimal_forward_steps

MiB = 1 << 20


@st.composite
def chains(draw: st.DrawFn) -> StepCosts:
    n = draw(st.integers(1, 7))
    blocks = []
    for i in range(n):
        saved = tuple(draw(st.lists(st.integers(0, 64), min_size=1, max_size=5)))
        fwd = draw(st.floats(1e-4, 1e-2))
        at = tuple(sorted(draw(st.floats(0, 1)) * fwd for _ in saved)) if draw(st.booleans()) else ()
        cuts = tuple(c for c in range(1, len(saved)) if draw(st.booleans())) if at else ()
        blocks.append(Block(f"b{i}", fwd, draw(st.floats(1e-4, 2e-2)),
                            draw(st.integers(0, 8)) * MiB, tuple(s * MiB for s in saved),
                            bwd_bytes=draw(st.integers(0, 32)) * MiB, saved_at=at, cuts=cuts))
    codec = draw(st.sampled_from([None, CodecCost("q4", 3.8, 5e11, 5e11, True, "test bound")]))
    link = Link(draw(st.floats(1e9, 1e11)), draw(st.floats(1e9, 1e11)))
    peak_none = draw(st.integers(0, 512)) * MiB + sum(b.saved_bytes for b in blocks)
    return StepCosts.calibrated(blocks, peak_none, draw(st.integers(0, 16)) * MiB, draw(st.floats(0, 1e-2)),
                            draw(st.floats(0, 1e-2)), link, codec)


@settings(max_examples=150, deadline=None)
@given(chains(), st.lists(st.floats(0, 1.2), min_size=1, max_size=8))
def test_budget_is_respected_and_time_never_rises_with_it(chain: StepCosts, fracs: list[float]) -> None:
    found = search(chain)
    none = found.plans[0][1]
    assert found.plans[0][0] == (KEEP,) * len(chain.blocks)
    lo, hi = found.floor, none.peak_bytes
    times = []
    for f in sorted(fracs):
        budget = int(lo + (hi - lo) * f) if f <= 1 else int(hi * f)
        if budget < lo:
            with pytest.raises(PlanError, match="lowest peak"):
                found.best(budget)
            continue
        plan, pred = found.best(budget)
        assert pred.peak_bytes <= budget
        assert predict(chain, plan) == pred  # the recorded prediction is the plan's
        times.append(pred.step_s)
    assert all(b <= a + 1e-12 for a, b in zip(times, times[1:])), times


@settings(max_examples=100, deadline=None)
@given(chains())
def test_a_budget_at_the_no_checkpointing_peak_keeps_everything(chain: StepCosts) -> None:
    found = search(chain)
    none = found.plans[0][1]
    plan, pred = found.best(none.peak_bytes)
    assert plan == (KEEP,) * len(chain.blocks)
    assert pred.stall_s == 0 and pred.recompute_s == 0


@settings(max_examples=100, deadline=None)
@given(chains(), st.integers(0, 1 << 30))
def test_keep_everything_peaks_at_the_measured_peak(chain: StepCosts, extra: int) -> None:
    """NOTE [ Step model ] Rule 4: the calibration reproduces the measured peak whenever it can."""
    bare = dataclasses.replace(chain, fixed_bytes=0)
    floor = predict(bare, [KEEP] * len(chain.blocks)).peak_bytes
    c = StepCosts.calibrated(chain.blocks, floor + extra, chain.other_saved_bytes, chain.other_fwd_s, chain.other_bwd_s,
                         chain.link, chain.codec)
    p = predict(c, [KEEP] * len(chain.blocks))
    assert p.peak_bytes == floor + extra
    assert p.step_s == pytest.approx(chain.other_fwd_s + chain.other_bwd_s + sum(b.fwd_s + b.bwd_s for b in chain.blocks))


def _chain(n: int, link: float = 25e9, codec: CodecCost | None = None, parts: bool = False) -> StepCosts:
    saved = (128 * MiB,) * 4 + (64 * MiB,) * 4 + (32 * MiB,) * 4 + (16 * MiB,) * 4
    at = tuple(3.1e-3 * (k + 1) / len(saved) for k in range(len(saved)))
    blocks = [Block(f"h.{i}", 3.1e-3, 6.9e-3, 32 * MiB, saved, "blk", bwd_bytes=400 * MiB if parts else 0,
                    saved_at=at if parts else (), cuts=tuple(range(1, len(saved))) if parts else ()) for i in range(n)]
    return StepCosts.calibrated(blocks, (4 << 30) + sum(b.saved_bytes for b in blocks), 100 * MiB, 2e-3, 4e-3,
                            Link(link, link), codec)


def test_recompute_costs_a_forward_and_offload_hides_behind_compute() -> None:
    ch = _chain(4)
    keep = predict(ch, [KEEP] * 4)
    rec = predict(ch, [RECOMPUTE] + [KEEP] * 3)
    assert rec.recompute_s == pytest.approx(3.1e-3) and rec.step_s == pytest.approx(keep.step_s + 3.1e-3)
    small = Decision("offload", (15,))  # 16 MiB of the first block: hidden behind three blocks' compute
    off = predict(ch, [small] + [KEEP] * 3)
    assert off.stall_s == 0 and off.step_s == pytest.approx(keep.step_s)
    assert off.peak_bytes == keep.peak_bytes  # the store's cache holds it: one offload alone frees nothing
    assert predict(ch, [small] + [KEEP] * 3, cache=False).peak_bytes == keep.peak_bytes - 16 * MiB
    many = predict(ch, [small] * 3 + [KEEP])  # three: the cache holds two of them
    assert many.peak_bytes == keep.peak_bytes - 16 * MiB
    last = predict(ch, [KEEP] * 3 + [Decision("offload", tuple(range(16)))])  # the last block: nothing to hide it
    assert last.stall_s > 0


def test_ladder_orders_options_bydevice_bytes() -> None:
    b = _chain(1).blocks[0]
    opts = ladder(b, compress=True)
    assert opts[0] == KEEP and RECOMPUTE in opts and Decision("recompute", host=True) in opts
    held = [device_bytes(b, o) for o in opts]
    assert held == sorted(held, reverse=True) and held[0] > held[1]
    offs = [o for o in opts if o.mode == "offload"]
    assert {o.compress for o in offs} == {False, True}
    kept = [b.saved_bytes - sum(b.saved[k] for k in o.offload) for o in offs if not o.compress]
    assert kept == sorted(kept, reverse=True) and kept[-1] == 0


def test_plan_error_names_the_floor() -> None:
    found = search(_chain(8))
    with pytest.raises(PlanError) as e:
        found.best(found.floor - 1)
    assert f"pass budget >= {found.floor}" in str(e.value)
    assert str(e.value).startswith("torchckpt:")


def test_planning_32_blocks_takes_under_2_seconds() -> None:
    ch = _chain(32, codec=CodecCost("q4", 3.8, 1e12, 1e12, True, "b"), parts=True)
    t = time.perf_counter()
    found = search(ch)
    dt = time.perf_counter() - t
    assert dt < 2.0, f"{dt:.2f} s"
    assert len(found.plans) > 32


def test_decision_rejects_bad_modes() -> None:
    with pytest.raises(ValueError, match="torchckpt:"):
        Decision("swap")
    with pytest.raises(ValueError, match="only Decision"):
        Decision("keep", (1,))


def test_selective_recompute_keeps_time_for_bytes() -> None:
    """NOTE [ Step model ] Rule 2b: keeping the matmul-like ops costs their bytes and saves their time."""
    ops = ((3, 64 * MiB, 2e-3), (7, 64 * MiB, 0.5e-3), (9, 256 * MiB, 0.2e-3))  # (position, bytes, seconds)
    b = Block("b", 3.1e-3, 6.9e-3, 32 * MiB, (256 * MiB,) * 4, bwd_bytes=0, ops=ops)
    ch = StepCosts.calibrated([b] * 3, 4 << 30, 0, 0.0, 0.0, Link(25e9, 25e9))
    sel = [d for d in ladder(b, compress=False) if d.keep]
    assert Decision("recompute", keep=(3,)) in sel  # the most time per byte first
    full = predict(ch, [RECOMPUTE] * 3)
    part = predict(ch, [Decision("recompute", keep=(3,))] * 3)
    assert part.recompute_s == pytest.approx(full.recompute_s - 3 * 2e-3)
    assert part.peak_bytes > full.peak_bytes
    # On the host (NOTE [ Step model ] Rule 2b): nothing stays on the device; the inputs and the kept output cross the
    # link, the recomputation still skips the kept op, and the peak is below keeping it on the device.
    host = Decision("recompute", host=True, keep=(3,))
    assert host in sel
    assert device_bytes(b, host) == 0 and host_bytes(b, host) == 32 * MiB + 64 * MiB
    moved = predict(ch, [host] * 3)
    assert moved.recompute_s == pytest.approx(part.recompute_s)
    assert moved.d2h_bytes == 3 * 96 * MiB
    assert moved.peak_bytes < part.peak_bytes
    # Compressed (a codec on the chain): only the kept output is squeezed, and its codec time is paid both ways.
    codec = CodecCost("q", ratio=4.0, compress=1e12, decompress=1e12, lossy=True)
    chc = StepCosts.calibrated([b] * 3, 4 << 30, 0, 0.0, 0.0, Link(25e9, 25e9), codec)
    squeezed = Decision("recompute", host=True, keep=(3,), compress=True)
    assert squeezed in ladder(b, compress=True) and squeezed not in ladder(b, compress=False)
    small = predict(chc, [squeezed] * 3)
    assert small.d2h_bytes == 3 * (32 * MiB + 16 * MiB)
    assert small.recompute_s == pytest.approx(moved.recompute_s + 3 * 64 * MiB / 1e12)
    with pytest.raises(ValueError, match="compress=True takes"):
        Decision("recompute", keep=(3,), compress=True)


def test_backward_calibrated_on_its_own_when_measured() -> None:
    """NOTE [ Step model ] Rule 4: the forward's end holds the loss's temporaries, gone by the blocks' backward. With
    the allocation at each block's backward start measured, keeping everything still predicts the measured peak, and
    recomputing everything predicts less than the forward's calibration alone would."""
    blocks = [Block(f"b{i}", 1e-3, 2e-3, 8 * MiB, (64 * MiB,) * 2, bwd_bytes=32 * MiB) for i in range(4)]
    link = Link(25e9, 25e9)
    transient = 256 * MiB  # at the forward's end only
    peak_none = transient + 4 * 128 * MiB
    grads = 16 * MiB  # held through the backward
    bwd_start = [grads + 128 * MiB * (i + 1) for i in range(4)]  # saved bytes of blocks 0..i, plus the gradients
    plain = StepCosts.calibrated(blocks, peak_none, 0, 0.0, 0.0, link)
    both = StepCosts.calibrated(blocks, peak_none, 0, 0.0, 0.0, link, bwd_start=bwd_start)
    assert both.bwd_fixed_bytes == grads and plain.bwd_fixed_bytes is None
    assert predict(both, [KEEP] * 4).peak_bytes == predict(plain, [KEEP] * 4).peak_bytes == peak_none
    rec_plain, rec_both = predict(plain, [RECOMPUTE] * 4), predict(both, [RECOMPUTE] * 4)
    assert rec_both.peak_bytes < rec_plain.peak_bytes
    assert rec_both.peak_bytes >= grads + 3 * 8 * MiB + 128 * MiB + 32 * MiB  # inputs, one block, its gradients


def test_backward_fixed_bytes_are_each_blocks_own() -> None:
    """NOTE [ Step model ] Rule 6: each block's backward allocates its parameters' gradients, which stay, so what no
    decision changes grows as the backward goes. Each block's backward sees its own: keeping every block predicts the
    measured peak (the most of them, the first block's, put every gradient at the last block's backward: 712 MiB
    against 576), and a plan keeping only the last block peaks at the first block's backward, under the others'
    gradients (the most of them said 352 MiB, at the last block's backward, where none is allocated yet)."""
    n, grads = 4, 64 * MiB
    blocks = [Block(f"b{i}", 1e-3, 2e-3, 8 * MiB, (64 * MiB,) * 2, bwd_bytes=8 * MiB) for i in range(n)]
    bwd_start = [128 * MiB * (i + 1) + grads * (n - 1 - i) for i in range(n)]  # saved bytes of blocks 0..i, gradients
    peak_none = n * 128 * MiB + 64 * MiB  # the loss's temporaries at the forward's end
    chain = StepCosts.calibrated(blocks, peak_none, 0, 0.0, 0.0, Link(25e9, 25e9), bwd_start=bwd_start)
    assert [chain.bwd_fixed(i) for i in range(n)] == [grads * (n - 1 - i) for i in range(n)]
    assert predict(chain, [KEEP] * n).peak_bytes == peak_none
    last = predict(chain, [RECOMPUTE] * (n - 1) + [KEEP])
    assert (last.peak_bytes, last.at) == (3 * grads + 128 * MiB + 8 * MiB, "backward 0")


def test_op_times_lose_the_timer_gap_not_a_share() -> None:
    """NOTE [ Profiling step ] Rule 5: each op timed alone carries the same launch gap; taking it off every op (none
    below zero) leaves a matmul's time nearly whole, where scaling by the forward would shrink it by the same share."""
    from torchckpt.planner.op_timing import less_gaps

    timed = [1.0e-3] + [30e-6] * 10 + [5e-6] * 5  # one matmul, ten small ops, five views; 1.325 ms in all
    got = less_gaps(timed, 1.1e-3)  # the block's forward: 1.1 ms
    assert sum(got) == pytest.approx(1.1e-3, rel=1e-9)
    assert min(got) >= 0 and got[-1] == 0.0  # views: nothing left
    gap = timed[0] - got[0]
    assert gap == pytest.approx(timed[1] - got[1]) and 5e-6 < gap < 30e-6
    assert got[0] > 0.97e-3 > timed[0] * 1.1 / 1.325  # proportional scaling would give 0.83 ms
    assert less_gaps(timed, 2e-3) == timed  # a forward longer than the ops: nothing to take off


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=0, max_size=8), st.integers(1, 4), st.data())
def test_balanced_parts_is_the_smallest_largest_part(saved: list[int], k: int, data: st.DataObject) -> None:
    """NOTE [ Step model ] Rule 2c: against every way of cutting ``saved`` into at most ``k`` parts at the allowed
    positions, with the fewest parts that reach it."""
    import itertools

    allowed = data.draw(st.none() | st.lists(st.integers(1, max(1, len(saved) - 1)), unique=True))
    ok = range(1, len(saved)) if allowed is None else sorted(c for c in allowed if 0 < c < len(saved))
    cuts = balanced_parts(saved, k, allowed)
    assert list(cuts) == sorted(set(cuts)) and set(cuts) <= set(ok) and len(cuts) < max(k, 1)
    options = [c for j in range(0, max(1, k)) for c in itertools.combinations(ok, j)]
    best = min(max(part_bytes(saved, c)) for c in options)
    assert max(part_bytes(saved, cuts)) == best
    assert len(cuts) == min(len(c) for c in options if max(part_bytes(saved, c)) == best)


def test_recompute_in_parts_holds_one_part_and_pays_the_earlier_parts_forward() -> None:
    ch = _chain(4, parts=True)
    b = ch.blocks[0]
    cuts = balanced_parts(b.saved, 2)
    assert max(part_bytes(b.saved, cuts)) < b.saved_bytes
    whole = predict(ch, [RECOMPUTE] * 4)
    parts = Decision("recompute", parts=cuts)
    split = predict(ch, [parts] * 4)
    held = max(part_bytes(b.saved, cuts)) + b.input_bytes
    assert materialised_bytes(b, parts) == max(held, b.saved_bytes - b.bwd_bytes)
    assert whole.at.startswith("backward") and split.peak_bytes == whole.peak_bytes - (
        b.saved_bytes - materialised_bytes(b, parts)) < whole.peak_bytes
    assert split.recompute_s == pytest.approx(whole.recompute_s + 4 * b.saved_at[cuts[0] - 1])
    assert parts in ladder(b, compress=False) and Decision("recompute", host=True, parts=cuts) in ladder(b, False)
    found = search(ch)
    no_parts = dataclasses.replace(ch, blocks=tuple(dataclasses.replace(x, saved_at=()) for x in ch.blocks))
    assert found.floor < search(no_parts).floor  # parts reach lower
    plan, _ = found.best(found.floor)
    assert all(d.parts for d in plan)
    with pytest.raises(ValueError, match="increasing"):
        Decision("recompute", parts=(3, 3))
    with pytest.raises(ValueError, match="only Decision"):
        Decision("keep", parts=(1,))


def test_revolve_over_the_chain_reaches_below_keeping_every_input_on_the_device() -> None:
    """NOTE [ Plan search ] Rule 6, NOTE [ Step model ] Rule 5."""
    n, fwd = 16, 3.1e-3
    ch = _chain(n, parts=True)
    found = search(ch)
    revolve = [(d, p) for d, p in found.plans if d[0].revolve]
    assert revolve and all(len({x.revolve for x in d}) == 1 and all(x.mode == "recompute" for x in d) for d, _ in revolve)
    local = [p.peak_bytes for d, p in found.plans
             if not d[0].revolve and not any(host_bytes(b, x) for b, x in zip(ch.blocks, d))]
    assert min(p.peak_bytes for _, p in revolve) < min(local)
    assert found.best(min(p.peak_bytes for _, p in revolve), "local")[0][0].revolve  # only Revolve fits there
    whole = sorted((d[0].revolve, p) for d, p in revolve if not d[0].parts)
    assert [p.peak_bytes for _, p in whole] == sorted(p.peak_bytes for _, p in whole)  # more snapshots, more memory
    assert [p.step_s for _, p in whole] == sorted((p.step_s for _, p in whole), reverse=True)  # and never slower
    for memory, p in whole:
        s = memory // (32 * MiB)
        again = optimal_forward_steps(n, s) - (n - 1)  # Revolve's count less its forward sweep (the model's calls)
        assert p.recompute_s == pytest.approx(n * fwd + again * fwd)
    with pytest.raises(ValueError, match="every block of a plan has the same"):
        predict(ch, [Decision("recompute", revolve=32 * MiB)] + [Decision("recompute", revolve=64 * MiB)] * (n - 1))
    with pytest.raises(ValueError, match="revolve=...\\) takes Decision\\(mode='recompute'\\) without host"):
        Decision("recompute", host=True, revolve=MiB)


def test_revolve_states_follow_the_schedule() -> None:
    st_ = states([1.0] * 8, [10] * 8, 30)  # Revolve(8, 3)
    assert st_.advances == optimal_forward_steps(8, 3) - 7
    assert sum(st_.extra_s) == st_.advances
    assert max(st_.fwd) == 40  # three snapshots and the last block's input
    assert all(b <= 30 for b in st_.bwd)


def test_revolve_over_blocks_of_unequal_inputs_uses_the_weighted_schedule() -> None:
    from torchckpt.planner.rebuild import schedule
    from torchckpt.schedules import WeightedRevolve

    sizes = [10, 40, 10, 40, 10, 40, 10, 40]
    sched = schedule([1.0] * 8, sizes, 60)
    assert isinstance(sched, WeightedRevolve) and sched.peak_bytes <= 60
    st_ = states([1.0] * 8, sizes, 60)
    assert st_.advances == sched.forward_steps - 7
    assert all(b <= 60 for b in st_.bwd)


def test_planning_32_blocks_of_unequal_inputs_takes_under_2_seconds() -> None:
    """Revolve over blocks of unequal input size plans each amount of memory with a dynamic program of its own."""
    blocks = [Block(f"h.{i}", 3e-3 * (1 + i % 3), 6e-3, (32 + 16 * (i % 4)) * MiB, (64 * MiB,) * 8, "blk")
              for i in range(32)]
    ch = StepCosts.calibrated(blocks, 8 << 30, 100 * MiB, 2e-3, 4e-3, Link(2e10, 2e10))
    t = time.perf_counter()
    found = search(ch)
    dt = time.perf_counter() - t
    assert dt < 2.0, f"{dt:.2f} s"
    assert any(d[0].revolve for d, _ in found.plans)
