"""SnapshotStore on device="cpu" (NOTE [ Snapshot store ] Rule 6): round trips, errors, cache statistics.

Schedules are replayed on the store directly, with state n a tensor computed from n, so every
restore is checked against what was saved; hit/miss counts are checked against the dry runs
of NOTE [ Snapshot cache ] (``simulate_cache``) and NOTE [ Prefetch setup ] (``plan_prefetch``).
"""
from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from ckpt_models import assert_bits_equal, replay_snapshots, small_pool
from torchckpt import CheckpointError, SnapshotStore
from torchckpt.memory import HostPool
from torchckpt.schedules import (
    Action, Multistage, Restore, Revolve, Schedule, Tier, Uniform, ZCut, plan_flushes,
    plan_prefetch, simulate_cache,
)


def host_in_use(pool: HostPool) -> int:
    """Host bytes in use once parked blocks are reclaimed (a 1-byte alloc/free reclaims them)."""
    pool.free(pool.alloc(1))
    return pool.stats().in_use_bytes


def mixed(n: int) -> list[torch.Tensor]:
    """State n: tensors of many dtypes and shapes, every bit a function of n."""
    g = torch.Generator().manual_seed(1000 + n)
    f = torch.randn(5, 7, generator=g, dtype=torch.float64)
    return [
        f,
        torch.randn(3, 4, generator=g).t(),  # non-contiguous source
        torch.randn(9, generator=g).to(torch.float16),
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
        torch.randint(-(2**62), 2**62, (4,), generator=g),
        torch.randint(-100, 100, (3, 1), generator=g, dtype=torch.int8),
        torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
        torch.randn(4, generator=g) > 0,
        torch.randn(3, generator=g, dtype=torch.complex64),
        torch.tensor(float(n)),  # 0-d
        torch.tensor([float("nan"), -0.0, float("inf")]) + n,
    ]


def replay(store: SnapshotStore, actions: Iterable[Action], flushes: frozenset[int] | None = None) -> int:
    return replay_snapshots(store, actions, mixed, flushes)


def host_schedules(n: int) -> list[Schedule]:
    return [Revolve(n, min(4, n), tier=Tier.HOST), Uniform(n, min(4, n), tier=Tier.HOST), ZCut(n, tier=Tier.HOST),
            Multistage(n, gpu_slots=2, host_slots=3)]


def host_restores(schedule: Iterable[Action]) -> int:
    return sum(isinstance(a, Restore) and a.tier is not Tier.GPU for a in schedule)


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [1, 2, 4])
@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST, Tier.DISK])
def test_round_trip_bit_exact(tier: Tier, slots: int) -> None:
    s = SnapshotStore("cpu", slots=slots, host=small_pool())
    for n in range(6):  # more snapshots than slots: later restores come back from the host pool
        s.save(n, tier, mixed(n))
    for n in [5, 0, 3, 3, 1, 4, 2, 0]:
        assert_bits_equal([t.clone() for t in s.restore(n, tier)], mixed(n))
        s.after_use()
    st = s.stats()
    assert st.saves == 6 and st.restores == 8
    assert st.host_saves == (0 if tier is Tier.GPU else 6)
    for n in range(6):
        s.free(n, tier)
    assert host_in_use(s.host) == 0


def test_snapshot_is_a_copy() -> None:
    """Changing the state after save leaves the snapshot as it was (both tiers)."""
    s = SnapshotStore("cpu", slots=2, host=small_pool())
    x = torch.arange(6.0)
    s.save(0, Tier.GPU, [x])
    s.save(1, Tier.HOST, [x])
    x.mul_(-1)
    for n, tier in [(0, Tier.GPU), (1, Tier.HOST)]:
        assert torch.equal(s.restore(n, tier)[0], torch.arange(6.0))
        s.after_use()


def test_round_trip_when_every_slot_is_pinned() -> None:
    """NOTE [ Snapshot store ] Rule 4: with every slot pinned a save goes straight to host and a restore copies from host."""
    s = SnapshotStore("cpu", slots=1, host=small_pool())
    s.save(0, Tier.HOST, mixed(0))
    s.prefetch(0, Tier.GPU, Tier.GPU)  # pins the only slot
    s.save(1, Tier.HOST, mixed(1))  # bypasses the cache
    assert_bits_equal([t.clone() for t in s.restore(1, Tier.HOST)], mixed(1))
    s.after_use()
    assert_bits_equal([t.clone() for t in s.restore(0, Tier.HOST)], mixed(0))
    s.after_use()
    st = s.stats()
    assert (st.hits, st.misses, st.host_saves) == (1, 1, 2)
    s.close()
    assert host_in_use(s.host) == 0


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("second", [
    [torch.zeros(5)],  # shape
    [torch.zeros(4, dtype=torch.float64)],  # dtype
    [torch.zeros(4), torch.zeros(4)],  # number of tensors
    [torch.zeros(2, 2)],  # same numel, other shape
])
@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST])
def test_layout_mismatch(tier: Tier, second: list[torch.Tensor]) -> None:
    s = SnapshotStore("cpu", slots=2, host=small_pool())
    s.save(0, tier, [torch.zeros(4)])
    with pytest.raises(ValueError, match="^torchckpt: a SnapshotStore holds snapshots of one layout"):
        s.save(1, tier, second)


def test_empty_and_wrong_device_snapshots() -> None:
    s = SnapshotStore("cpu", slots=2, host=small_pool())
    with pytest.raises(ValueError, match="^torchckpt:"):
        s.save(0, Tier.HOST, [])
    with pytest.raises(ValueError, match="^torchckpt: snapshot tensor on meta"):
        s.save(0, Tier.HOST, [torch.empty(3, device="meta")])


@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST])
def test_restore_never_saved(tier: Tier) -> None:
    s = SnapshotStore("cpu", slots=2, host=small_pool())
    with pytest.raises(CheckpointError, match="^torchckpt: Restore"):
        s.restore(0, tier)
    s.save(0, tier, [torch.ones(3)])
    with pytest.raises(CheckpointError, match="^torchckpt: Restore"):
        s.restore(1, tier)
    s.free(0, tier)
    with pytest.raises(CheckpointError, match="^torchckpt: Restore"):
        s.restore(0, tier)


def test_prefetch_never_saved() -> None:
    s = SnapshotStore("cpu", slots=2, host=small_pool())
    with pytest.raises(CheckpointError, match="^torchckpt: Prefetch"):
        s.prefetch(3, Tier.HOST, Tier.GPU)


@pytest.mark.parametrize("kw", [{"slots": 0}, {"slots": -1}, {"slots": 1.5}, {"device": "meta"}])
def test_bad_construction(kw: dict) -> None:
    args = {"device": "cpu", "slots": 2, **kw}
    with pytest.raises(ValueError, match="^torchckpt:"):
        SnapshotStore(args.pop("device"), host=small_pool(), **args)


# -- statistics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [2, 7, 30])
def test_prefetch_plan_makes_every_host_restore_a_hit(n: int, k: int) -> None:
    """NOTE [ Prefetch setup ] Rule 4, at run time: with plan_prefetch every off-GPU restore hits."""
    for sched in host_schedules(n):
        plan = plan_prefetch(sched, k)
        s = SnapshotStore("cpu", slots=k, host=small_pool())
        assert replay(s, plan) == sum(isinstance(a, Restore) for a in sched)
        st = s.stats()
        assert st.misses == 0 and st.hit_rate == 1.0, (sched, k, st)
        assert st.hits == host_restores(sched)
        assert st.prefetches == plan.copies == simulate_cache(plan, k).copies, (sched, k)
        assert host_in_use(s.host) == 0


@pytest.mark.parametrize("kind", ["revolve", "uniform", "zcut", "multistage"])
def test_misses_without_prefetch_match_simulate_cache(kind: str) -> None:
    """The store and its dry run share one cache model (NOTE [ Snapshot store ], NOTE [ Snapshot cache ])."""
    differ = []
    for n in [2, 7, 30]:
        sched = dict(zip(["revolve", "uniform", "zcut", "multistage"], host_schedules(n)))[kind]
        for k in [1, 2, 3, 4]:
            s = SnapshotStore("cpu", slots=k, host=small_pool())
            replay(s, sched)
            st, dry = s.stats(), simulate_cache(sched, k)
            assert st.prefetches == 0 and st.hits + st.misses == dry.restores
            assert host_in_use(s.host) == 0
            if (st.hits, st.misses) != (dry.hits, dry.misses):
                differ.append(f"{sched} slots={k}: store misses {st.misses}, simulate_cache misses {dry.misses}")
    assert not differ, "\n".join(differ)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_write_back(k: int, prefetch: bool) -> None:
    """Saves that plan_flushes leaves unflushed are written back on eviction: same restores, fewer copies."""
    fewer = 0
    for n in [2, 7, 30]:
        for sched in host_schedules(n):
            acts = list(plan_prefetch(sched, k)) if prefetch else list(sched)
            full = SnapshotStore("cpu", slots=k, host=small_pool())
            replay(full, acts)
            wb = SnapshotStore("cpu", slots=k, host=small_pool())
            replay(wb, acts, plan_flushes(acts, k))  # every restore still bit-exact
            a, b = full.stats(), wb.stats()
            assert (b.hits, b.misses, b.prefetches, b.bytes_to_device) == (a.hits, a.misses, a.prefetches,
                                                                           a.bytes_to_device), (sched, k)
            assert b.bytes_to_host <= a.bytes_to_host, (sched, k)
            fewer += b.bytes_to_host < a.bytes_to_host
            if prefetch:
                assert b.misses == 0
            assert host_in_use(wb.host) == 0
    assert fewer > 0


def test_bytes_moved() -> None:
    """bytes_to_host / bytes_to_device count one snapshot's bytes per copy, the same each way."""
    s = SnapshotStore("cpu", slots=1, host=small_pool())
    state = [torch.zeros(64)]  # 256 bytes: one aligned layout, half a host-pool alignment unit
    s.save(0, Tier.HOST, state)
    s.save(1, Tier.HOST, state)  # evicts 0 from the only slot
    s.restore(0, Tier.HOST)  # a miss: one host-to-device copy
    s.after_use()
    st = s.stats()
    assert st.misses == 1 and st.bytes_to_host == 2 * 256
    assert st.bytes_to_device == 256, f"one 256-byte snapshot loaded, counted {st.bytes_to_device} bytes"


def test_host_pool_empty_after_close() -> None:
    """close() frees every snapshot still held; the pool's chunks stay for the next loop."""
    pool = small_pool()
    s = SnapshotStore("cpu", slots=2, host=pool)
    for n in range(5):
        s.save(n, Tier.HOST, mixed(n))
    s.save(9, Tier.GPU, mixed(9))
    assert pool.stats().in_use_bytes > 0
    s.close()
    assert host_in_use(pool) == 0
    reserved = pool.stats().reserved_bytes
    s2 = SnapshotStore("cpu", slots=2, host=pool)  # a second loop on the same pool reuses its memory
    replay(s2, plan_prefetch(Revolve(20, 4, tier=Tier.HOST), 2))
    s2.close()
    assert host_in_use(pool) == 0 and pool.stats().reserved_bytes == reserved


def test_parked_blocks_are_reclaimed() -> None:
    """A block freed behind a copy still running is parked and counted in use until the copy ends."""

    class Ev:
        done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    pool = small_pool()
    ev = Ev()
    pool.free(pool.alloc(1000), ev)
    assert pool.stats().in_use_bytes > 0
    ev.done = True
    assert host_in_use(pool) == 0
    pool.free(pool.alloc(1000), Ev())
    pool.close()
    assert pool.stats().in_use_bytes == 0
