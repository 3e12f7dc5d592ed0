"""prefetch_from_trace on synthetic traces (NOTE [ Prefetch from a recorded trace ]), and the
runtime replaying them: a CPU Store driven with plain uint8 tensors must do what the dry run says.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchckpt
from ckpt_models import cpu_store
from torchckpt.schedules.trace import prefetch_from_trace
from torchckpt.schedules.trace import PACK, RELEASE, UNPACK

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
Trace = list[tuple[int, int, int]]


def lifo(sizes: Sequence[int]) -> Trace:
    """Forward packs every entry; backward unpacks and releases them in reverse."""
    t = [(PACK, i, n) for i, n in enumerate(sizes)]
    for i in reversed(range(len(sizes))):
        t += [(UNPACK, i, 0), (RELEASE, i, 0)]
    return t


@st.composite
def lifo_case(draw: st.DrawFn) -> tuple[Trace, int]:
    sizes = draw(st.lists(st.integers(1, 4096), min_size=1, max_size=40))
    top2 = sum(sorted(sizes)[-2:])
    budget = draw(st.integers(top2, top2 + sum(sizes)))
    return lifo(sizes), budget


@st.composite
def training_case(draw: st.DrawFn) -> tuple[Trace, int]:
    """Backward nodes unpack 1-3 entries, sometimes one shared with the next node, then release."""
    n = draw(st.integers(1, 30))
    sizes = draw(st.lists(st.integers(1, 4096), min_size=n, max_size=n))
    t: Trace = [(PACK, i, s) for i, s in enumerate(sizes)]
    i = n - 1
    carry: int | None = None
    while i >= 0:
        g = draw(st.integers(1, 3))
        group = list(range(i, max(-1, i - g), -1))
        i -= len(group)
        use = ([carry] if carry is not None else []) + group
        t += [(UNPACK, j, 0) for j in use]
        share = i >= 0 and draw(st.booleans())
        carry = group[-1] if share else None
        t += [(RELEASE, j, 0) for j in use if j != carry]
    if carry is not None:
        t += [(UNPACK, carry, 0), (RELEASE, carry, 0)]
    budget = draw(st.integers(0, 2 * sum(sizes)))
    return t, budget


@st.composite
def reuse_case(draw: st.DrawFn) -> tuple[Trace, int]:
    """LIFO, but some entries are also used early in backward (a residual or shared input):
    after that use they sit in the cache, unpinned, until their last use far later."""
    n = draw(st.integers(2, 30))
    sizes = draw(st.lists(st.integers(1, 4096), min_size=n, max_size=n))
    extra: dict[int, list[int]] = {}  # backward slot of entry s -> entries also used there
    for j in range(n - 1):
        if draw(st.booleans()):
            extra.setdefault(draw(st.integers(j + 1, n - 1)), []).append(j)
    t: Trace = [(PACK, i, sz) for i, sz in enumerate(sizes)]
    for i in reversed(range(n)):
        t += [(UNPACK, j, 0) for j in extra.get(i, [])]
        t += [(UNPACK, i, 0), (RELEASE, i, 0)]
    budget = draw(st.integers(max(sizes), 2 * sum(sizes)))
    return t, budget


CASES = st.one_of(lifo_case(), training_case(), reuse_case())


def unpack_order(trace: Sequence[tuple[int, int, int]]) -> list[int]:
    return [i for kind, i, _ in trace if kind == UNPACK]


class Step:
    """What one replayed step did: the store's counters plus two the store does not count."""

    def __init__(self, stats: torchckpt.store.Stats, loads: int, wasted: int) -> None:
        self.stats = stats
        self.loads = loads  # host-to-device copies: prefetches and loads on demand
        self.wasted = wasted  # prefetched entries whose GPU copy was dropped before their use


def store_replay(trace: Trace, budget: int, steps: int = 2) -> list[Step]:
    """Drive a CPU Store's pack/unpack/release with uint8 tensors; what each step did."""
    store = cpu_store(budget)
    count = {"loads": 0, "wasted": 0}
    load, drop_gpu = store._load, store._drop_gpu

    def counting_load(e):  # type: ignore[no-untyped-def]
        count["loads"] += 1
        return load(e)

    def checking_drop_gpu(e):  # type: ignore[no-untyped-def]
        count["wasted"] += bool(e.prefetched)
        return drop_gpu(e)

    store._load, store._drop_gpu = counting_load, checking_drop_gpu  # type: ignore[method-assign]
    out = []
    g = torch.Generator().manual_seed(0)
    prev = store.stats()
    for _ in range(steps):
        count.update(loads=0, wasted=0)
        data: dict[int, torch.Tensor] = {}
        handles: dict[int, object] = {}
        for kind, i, n in trace:
            if kind == PACK:
                data[i] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
                handles[i] = store.pack(data[i])
            elif kind == UNPACK:
                assert torch.equal(store.unpack(handles[i]), data[i])
            else:
                del handles[i]
        assert not handles
        s = store.stats()
        delta = torchckpt.store.Stats(
            cache_hits=s.cache_hits - prev.cache_hits,
            prefetch_hits=s.prefetch_hits - prev.prefetch_hits,
            misses=s.misses - prev.misses,
            offloaded=s.offloaded - prev.offloaded,
            evictions=s.evictions - prev.evictions,
            plan_divergences=s.plan_divergences - prev.plan_divergences,
            loaded_bytes=s.loaded_bytes - prev.loaded_bytes,
            gpu_peak_bytes=s.gpu_peak_bytes,
            host=s.host,
        )
        out.append(Step(delta, count["loads"], count["wasted"]))
        prev = s
    assert store.plan is not None and store.plan.trace == tuple(trace)
    return out


REPLAY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the dry run -----------------------------------------------------------------------------
def test_docstring_example() -> None:
    p = prefetch_from_trace(lifo([10, 10, 10]), budget_bytes=20)
    # Entry 0 is evicted by the third pack (so it is written to host); after UNPACK 2 (position 3)
    # entry 1 is resident and pinned; after RELEASE 2 (position 4) entry 0 fits and is prefetched.
    assert p.misses == 0 and p.cache_hits == 2 and p.prefetch_hits == 1
    assert p.actions == {3: (1,), 4: (0,)} and p.writes == frozenset({0})
    assert p.pack_sizes == (10, 10, 10) and p.unpack_ids == (2, 1, 0)


def test_budget_zero_loads_everything_on_demand() -> None:
    p = prefetch_from_trace(lifo([8, 16, 4]), budget_bytes=0)
    assert p.misses == 3 and p.cache_hits == 0 and p.prefetch_hits == 0 and p.actions == {}


def test_everything_fits_no_prefetch_needed() -> None:
    p = prefetch_from_trace(lifo([8, 16, 4]), budget_bytes=1000)
    assert p.cache_hits == 3 and p.misses == 0 and p.prefetch_hits == 0 and p.peak_bytes == 28


@SETTINGS
@given(lifo_case())
def test_lifo_no_misses_when_two_largest_fit(case: tuple[Trace, int]) -> None:
    trace, budget = case
    plan = prefetch_from_trace(trace, budget)
    assert plan.misses == 0
    assert plan.cache_hits + plan.prefetch_hits == len(unpack_order(trace))


@SETTINGS
@given(CASES)
def test_predicted_peak_within_budget(case: tuple[Trace, int]) -> None:
    # "the budget bounds what torchckpt holds": no entry alone exceeds it, so neither may the peak.
    trace, budget = case
    if max(n for kind, _, n in trace if kind == PACK) > budget:
        return
    plan = prefetch_from_trace(trace, budget)
    assert plan.peak_bytes <= budget, f"predicted peak {plan.peak_bytes} > budget {budget}"


def test_predicted_peak_within_budget_minimal() -> None:
    plan = prefetch_from_trace(lifo([10, 10, 10]), budget_bytes=20)
    assert plan.peak_bytes <= 20, plan.peak_bytes


@SETTINGS
@given(CASES)
def test_prefetches_in_order_of_use(case: tuple[Trace, int]) -> None:
    # NOTE [ Prefetch from a recorded trace ] Rule 3: after each event the walk schedules the next unpacks one by one,
    # never skipping one; an eviction it asks for (~v) makes room from an entry whose next use comes later.
    trace, budget = case
    plan = prefetch_from_trace(trace, budget)
    order = unpack_order(trace)
    seen = [0]  # seen[pos + 1]: unpacks at positions <= pos
    for kind, _, _ in trace:
        seen.append(seen[-1] + (kind == UNPACK))
    p = 0
    for pos in sorted(plan.actions):
        assert trace[pos][0] != PACK and seen[pos + 1] > 0, "actions start after the first unpack"
        evicted: list[int] = []
        for j in plan.actions[pos]:
            if j < 0:
                evicted.append(~j)
                continue
            p = max(p, seen[pos + 1])  # the next unpack not yet reached
            assert p < len(order) and order[p] == j, f"event {pos} schedules {j}, next use is {order[p:p + 1]}"
            for v in evicted:
                assert v in order[p + 1 :], f"event {pos} evicts {v}, used before {j} or never again"
                assert v in plan.writes
            evicted = []
            p += 1
        assert not evicted, "an eviction that made room for nothing"


def test_writes_are_the_entries_the_dry_run_evicts() -> None:
    # NOTE [ Prefetch from a recorded trace ] Rule 5: only entries evicted at some point need a host copy.
    assert prefetch_from_trace(lifo([8, 8, 8]), budget_bytes=1000).writes == frozenset()
    assert prefetch_from_trace(lifo([8, 8, 8]), budget_bytes=0).writes == frozenset({0, 1, 2})
    assert prefetch_from_trace(lifo([8, 8, 8]), budget_bytes=16).writes == frozenset({0})


# -- the runtime follows the dry run ---------------------------------------------------------
@REPLAY
@given(lifo_case())
def test_store_lifo_replay_no_misses_after_step_one(case: tuple[Trace, int]) -> None:
    trace, budget = case
    first, second = store_replay(trace, budget)
    plan = prefetch_from_trace(trace, budget)
    assert second.stats.misses == 0 and second.stats.plan_divergences == 0
    assert (second.stats.cache_hits, second.stats.prefetch_hits) == (plan.cache_hits, plan.prefetch_hits)
    assert first.stats.prefetch_hits == 0


@REPLAY
@given(CASES)
def test_store_runtime_hits_equal_dry_run(case: tuple[Trace, int]) -> None:
    # NOTE [ Prefetch from a recorded trace ] Rule 4: "Because both use the same cache rules, the runtime's hits are the
    # dry run's hits."
    trace, budget = case
    _, second = store_replay(trace, budget)
    plan = prefetch_from_trace(trace, budget)
    s = second.stats
    assert s.plan_divergences == 0
    assert (s.cache_hits, s.prefetch_hits, s.misses) == (plan.cache_hits, plan.prefetch_hits, plan.misses)
    assert s.host.in_use_bytes == 0
    # Write-back (NOTE [ Prefetch from a recorded trace ] Rule 5): on plan, exactly the entries the dry run evicts are
    # copied to host.
    assert s.offloaded == len(plan.writes)


@REPLAY
@given(CASES)
def test_prefetched_entry_never_evicted_before_use(case: tuple[Trace, int]) -> None:
    trace, budget = case
    _, second = store_replay(trace, budget)
    assert second.wasted == 0, "a prefetched entry left the GPU cache before its use"
    # every host-to-device copy that was not a load on demand served a prefetch hit
    assert second.loads - second.stats.misses == second.stats.prefetch_hits


def test_store_step_one_matches_planless_dry_run() -> None:
    # Step 1 has no plan: its hits are what the dry run counts before any prefetch.
    trace = lifo([512, 256, 1024, 128, 512, 64])
    first, second = store_replay(trace, 1024 + 512)
    assert first.stats.misses > 0 and first.stats.prefetch_hits == 0 and first.loads == first.stats.misses
    assert second.stats.misses == 0 and second.stats.prefetch_hits > 0


def test_lookahead_bounds_the_walk() -> None:
    trace = lifo([4] * 20)
    p = prefetch_from_trace(trace, budget_bytes=1000, lookahead=3)
    assert all(len(v) <= 3 for v in p.actions.values())
