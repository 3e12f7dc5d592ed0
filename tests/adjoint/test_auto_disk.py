"""``AutoSchedule`` over GPU, host and disk (NOTE [ Auto schedule ]), ranked by bandwidth (NOTE [ Tier bandwidths ]), on the CPU.

Schedules are checked by ``simulate``; loops against the plain unrolled loop, bit for bit.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

import torchckpt
from torchckpt import CheckpointError, SnapshotStore, checkpointed_loop
from torchckpt.adjoint import AutoSchedule, auto_schedule
from torchckpt.adjoint import auto as auto_mod
from torchckpt.memory import DiskTier, HostPool, bandwidth
from torchckpt.schedules import Multistage, Tier, optimal_forward_steps, simulate

D = torch.float64
B = 1000  # bytes of one snapshot in the schedule tests


# -- auto_schedule ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "g", "h"), [(10, 2, 7), (10, 0, 9), (10, 9, 0), (50, 10, 40), (2, 0, 1)])
def test_disk_unused_when_gpu_and_host_hold_enough(n: int, g: int, h: int) -> None:
    """NOTE [ Auto schedule ] Rule 2: GPU + host hold n - 1 slots: the disk budget changes nothing."""
    without = auto_schedule(n, B, gpu_bytes=(g + 4) * B, host_bytes=h * B, slots=4)
    with_disk = auto_schedule(n, B, gpu_bytes=(g + 4) * B, host_bytes=h * B, slots=4, disk_bytes=1 << 40)
    assert with_disk == without
    assert simulate(with_disk).saves[Tier.DISK] == 0
    assert simulate(with_disk).forward_steps == n - 1


@pytest.mark.parametrize(("n", "g", "h", "d", "want"), [
    (100, 2, 3, 1000, (2, 0, 97)),  # slots=4: the host's 3 stay free for disk snapshots in flight
    (100, 2, 3, 4, (2, 0, 4)),
    (500, 0, 10, 20, (0, 6, 20)),
    (1000, 4, 10, 10_000, (4, 6, 989)),  # closes the gap to n - 1 slots
    (50, 10, 30, 100, (10, 26, 13)),
    (40, 3, 0, 7, (3, 0, 7)),
    (40, 0, 0, 3, (0, 0, 3)),
    (1, 0, 0, 5, (0, 0, 1)),
])
def test_disk_used_when_short_and_fewer_recomputations(n: int, g: int, h: int, d: int,
                                                       want: tuple[int, int, int]) -> None:
    s = auto_schedule(n, B, gpu_bytes=(g + 4) * B, host_bytes=h * B, slots=4, disk_bytes=d * B + B - 1)
    assert isinstance(s, Multistage) and (s.gpu_slots, s.host_slots, s.disk_slots) == want
    r = simulate(s)  # a valid schedule within every tier's slots
    assert r.peak_snapshots[Tier.DISK] <= want[2] and r.peak_snapshots[Tier.HOST] <= want[1]
    assert r.forward_steps == optimal_forward_steps(n, sum(want))
    if n > 1:
        assert r.saves[Tier.DISK] > 0
    if g + h > 0:  # Revolve over GPU + host alone, same budgets
        alone = auto_schedule(n, B, gpu_bytes=(g + 4) * B, host_bytes=h * B, slots=4)
        assert simulate(alone).saves[Tier.DISK] == 0
        assert r.forward_steps < simulate(alone).forward_steps


@pytest.mark.parametrize(("n", "g", "h", "d"), [(100, 2, 3, 3), (100, 2, 8, 4), (100, 0, 4, 0)])
def test_disk_unused_when_it_adds_no_slot(n: int, g: int, h: int, d: int) -> None:
    """Keeping ``slots`` host snapshots' room for the disk must not lose slots overall."""
    s = auto_schedule(n, B, gpu_bytes=(g + 4) * B, host_bytes=h * B, slots=4, disk_bytes=d * B)
    assert s == auto_schedule(n, B, gpu_bytes=(g + 4) * B, host_bytes=h * B, slots=4)


def test_nothing_fits_anywhere() -> None:
    with pytest.raises(CheckpointError, match=r"^torchckpt: no room .*disk budget 999.*Store\(disk=...\)"):
        auto_schedule(10, B, gpu_bytes=4 * B, host_bytes=999, slots=4, disk_bytes=999)


def test_uniform_never_uses_the_disk() -> None:
    s = auto_schedule(100, B, gpu_bytes=6 * B, host_bytes=3 * B, slots=4, kind=torchckpt.schedules.Uniform,
                      disk_bytes=1 << 30)
    assert simulate(s).saves[Tier.DISK] == 0


@pytest.mark.parametrize(("bw", "ranking"), [
    (None, (Tier.GPU, Tier.HOST, Tier.DISK)),
    ({Tier.HOST: 20e9, Tier.DISK: 2e9}, (Tier.GPU, Tier.HOST, Tier.DISK)),
    ({Tier.HOST: 2e9, Tier.DISK: 2e9}, (Tier.GPU, Tier.HOST, Tier.DISK)),  # ties: host first
    ({Tier.HOST: 1e9, Tier.DISK: 7e9}, (Tier.GPU, Tier.DISK, Tier.HOST)),
])
def test_tiers_ranked_by_bandwidth(bw: Any, ranking: tuple[Tier, ...]) -> None:
    s = auto_schedule(200, B, gpu_bytes=5 * B, host_bytes=4 * B, slots=1, disk_bytes=3 * B, bandwidths=bw)
    assert isinstance(s, Multistage) and s.ranking == ranking
    assert (s.gpu_slots, s.host_slots, s.disk_slots) == (4, 3, 3)
    r = simulate(s)
    fast, slow = ranking[1], ranking[2]
    # Three slots each: the faster off-GPU tier takes the busier ones (NOTE [ Multi-tier Revolve ] Rule 4).
    assert r.saves[fast] + r.restores[fast] > r.saves[slow] + r.restores[slow]


@pytest.mark.parametrize("bad", [{Tier.HOST: 1e9}, {Tier.HOST: 1e9, Tier.DISK: 0}, {Tier.HOST: 1e9, Tier.DISK: True},
                                 [1e9, 1e9], {Tier.HOST: 1.0, Tier.DISK: 1.0, Tier.GPU: 1.0}])
def test_bad_bandwidths(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"^torchckpt: auto_schedule\(bandwidths=...\) must map"):
        auto_schedule(10, B, 0, B, disk_bytes=B, bandwidths=bad)
    with pytest.raises(ValueError, match=r"^torchckpt: AutoSchedule\(bandwidths=...\) must map"):
        AutoSchedule(bandwidths=bad)


def test_auto_value() -> None:
    bw = {Tier.HOST: 3e9, Tier.DISK: 1e9}
    a = AutoSchedule(disk_bytes=10, bandwidths=bw)
    assert a == AutoSchedule(disk_bytes=10, bandwidths=dict(bw)) and hash(a) == hash(AutoSchedule(disk_bytes=10))
    assert a != AutoSchedule(disk_bytes=10, bandwidths={Tier.HOST: 1e9, Tier.DISK: 3e9})
    bw[Tier.DISK] = 9e9  # the caller's dict is copied
    assert a.bandwidths is not None and a.bandwidths[Tier.DISK] == 1e9
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"^torchckpt: AutoSchedule\(disk_bytes=...\)"):
            AutoSchedule(disk_bytes=bad)  # type: ignore[arg-type]


# -- measured bandwidths (NOTE [ Tier bandwidths ]) --------------------------------------------------
def test_bandwidths_measured_once_per_process(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bandwidth, "_host", {})
    monkeypatch.setattr(bandwidth, "_disk", {})
    calls = []
    real = DiskTier.measure_bandwidth

    def counted(self: DiskTier, nbytes: int = 1 << 20) -> tuple[float, float]:
        calls.append(nbytes)
        return real(self, nbytes)

    monkeypatch.setattr(DiskTier, "measure_bandwidth", counted)
    pool = HostPool(chunk_bytes=1 << 20, pin=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with DiskTier(tmp_path / "a", direct=False) as t1, DiskTier(tmp_path / "b", direct=False) as t2:
        bw = bandwidth.tier_bandwidths(torch.device("cpu"), pool, t1, 5000)
        assert bw[Tier.HOST] > bw[Tier.DISK] > 0  # NOTE [ Auto schedule ] Rule 1: the disk path adds the files to the host link
        assert bandwidth.tier_bandwidths(torch.device("cpu"), pool, t2, 1 << 30) == bw  # one file system: cached
        assert calls == [1 << 20]  # clamped to 1 MiB, measured once
        assert t1.files() == [] and t2.files() == []


SNAP = 64 * 512 * 8  # bytes of the loop's state: a 1 MiB host pool holds 4


def loop_case() -> tuple[Any, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 512, generator=g, dtype=D).requires_grad_()
    x0 = torch.randn(64, 512, generator=g, dtype=D).requires_grad_()
    return (lambda x: torch.tanh(x * w) + 0.1 * x.roll(1, 1)), w, x0


def plain_grads(n: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    step, w, x0 = loop_case()
    x = x0
    for _ in range(n):
        x = step(x)
    return x.detach(), torch.autograd.grad(x.square().sum(), [w, x0])


def files_under(root: Any) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


# Disk snapshots in flight pass through host blocks; a burst of them may pass the pool's cap (NOTE [ Auto schedule ]
# Rule 2): pageable blocks, same results, with the pool's one warning.
IN_FLIGHT = "ignore:.*the host pool reached its cap:RuntimeWarning"


@pytest.mark.filterwarnings(IN_FLIGHT)
@pytest.mark.parametrize("given", [None, {Tier.HOST: 1e9, Tier.DISK: 4e9}])
def test_loop_with_auto_over_a_disk_tier_is_bit_exact(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                      given: Any) -> None:
    n = 60
    ref, g_ref = plain_grads(n)
    picked: list[Any] = []
    real = auto_mod.auto_schedule
    measured: list[Any] = []
    real_measure = auto_mod.tier_bandwidths

    def spy(*a: Any, **k: Any) -> Any:
        picked.append(real(*a, **k))
        return picked[-1]

    def spy_measure(*a: Any, **k: Any) -> Any:
        measured.append(real_measure(*a, **k))
        return measured[-1]

    monkeypatch.setattr(auto_mod, "auto_schedule", spy)
    monkeypatch.setattr(auto_mod, "tier_bandwidths", spy_measure)
    step, w, x0 = loop_case()
    pool = HostPool(capacity_bytes=1 << 20, chunk_bytes=1 << 20, pin=False)  # 4 snapshots
    with SnapshotStore("cpu", slots=2, host=pool, disk=tmp_path) as snaps:
        out = checkpointed_loop(step, x0, n, schedule=AutoSchedule(bandwidths=given), store=snaps, slots=2)
        snaps.disk.wait()  # type: ignore[union-attr]  # the forward's writes ended: the backward reads files
        (s,) = picked
        # Two host snapshots, two blocks' room for disk snapshots in flight (NOTE [ Auto schedule ] Rule 2).
        assert isinstance(s, Multistage) and (s.gpu_slots, s.host_slots, s.disk_slots) == (0, 2, n - 3)
        assert len(measured) == (given is None)  # measured only when not given
        if given is not None:
            assert s.ranking == (Tier.GPU, Tier.DISK, Tier.HOST)
        got = torch.autograd.grad(out.square().sum(), [w, x0])
        assert torch.equal(out.detach(), ref)
        assert all(torch.equal(a, b) for a, b in zip(got, g_ref))
        st = snaps.stats()
        assert st.disk is not None and st.disk.writes > 0 and st.disk.reads > 0
        assert files_under(tmp_path) == []
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings(IN_FLIGHT)
def test_loop_with_a_training_store_lends_its_disk(tmp_path: Any) -> None:
    """A ``Store(disk=...)`` lends its disk tier to the loop's snapshot store; ``AutoSchedule`` uses it."""
    n = 30
    ref, g_ref = plain_grads(n)
    step, w, x0 = loop_case()
    pool = HostPool(capacity_bytes=1 << 20, chunk_bytes=1 << 20, pin=False)
    store = torchckpt.Store("cpu", gpu_bytes=0, host=pool, disk=tmp_path)
    out = checkpointed_loop(step, x0, n, schedule=AutoSchedule(bandwidths={Tier.HOST: 2e9, Tier.DISK: 1e9}), store=store,
                            slots=1)
    got = torch.autograd.grad(out.square().sum(), [w, x0])
    assert all(torch.equal(a, b) for a, b in zip(got, g_ref))
    st = store.stats()
    assert st.disk is not None and st.disk.writes > 0  # the loop's snapshots went through the store's tier
    assert files_under(tmp_path) == []
    store.close()
    assert os.listdir(tmp_path) == []


def test_auto_disk_bytes_zero_keeps_off_the_disk(tmp_path: Any) -> None:
    n = 30
    ref, g_ref = plain_grads(n)
    step, w, x0 = loop_case()
    pool = HostPool(capacity_bytes=1 << 20, chunk_bytes=1 << 20, pin=False)
    with SnapshotStore("cpu", slots=2, host=pool, disk=tmp_path) as snaps:
        s = AutoSchedule(disk_bytes=0).resolve(n, SNAP, 0, pool.capacity_bytes, 2, disk=snaps.disk, host=pool)
        assert s == Multistage(n, 0, 4)
        out = checkpointed_loop(step, x0, n, schedule=AutoSchedule(disk_bytes=0), store=snaps, slots=2)
        got = torch.autograd.grad(out.square().sum(), [w, x0])
        assert all(torch.equal(a, b) for a, b in zip(got, g_ref))
        assert snaps.stats().disk.writes == 0  # type: ignore[union-attr]


def test_auto_default_disk_budget_is_half_the_free_space(tmp_path: Any) -> None:
    free = shutil.disk_usage(tmp_path).free
    with DiskTier(tmp_path, direct=False) as tier:
        s = AutoSchedule(bandwidths={Tier.HOST: 2.0, Tier.DISK: 1.0}).resolve(
            10, free // 4, gpu_bytes=0, host_bytes=0, slots=1, disk=tier)
    assert isinstance(s, Multistage) and s.disk_slots in (1, 2, 3)  # half the free space: about 2 snapshots


def test_no_disk_tier_no_disk_slots(tmp_path: Any) -> None:
    a = AutoSchedule(disk_bytes=1 << 30, bandwidths={Tier.HOST: 2.0, Tier.DISK: 1.0})
    assert a.resolve(100, B, 0, 3 * B, 1) == Multistage(100, 0, 3)  # no tier: the budget is not spent
    tier = DiskTier(tmp_path, direct=False)
    assert a.resolve(100, B, 0, 3 * B, 1, disk=tier).disk_slots > 0  # type: ignore[attr-defined]
    tier.close()
    assert a.resolve(100, B, 0, 3 * B, 1, disk=tier) == Multistage(100, 0, 3)  # a closed tier is none
