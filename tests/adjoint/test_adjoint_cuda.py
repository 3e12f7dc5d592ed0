"""CUDA: adjoint loops with real streams, events, pinned memory and deliberately late copies.

Every test is marked ``cuda`` and skips without a GPU (tests/conftest.py). Gradients are compared
with plain unrolled autograd bit for bit; run_schedule's stress test delays the snapshot store's
prefetch and offload streams at random (``torch.cuda._sleep`` queued before each copy) so that
any missing event wait shows up as an adjoint step seeing a state other than the forward's.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torchckpt
from torchckpt import SnapshotStore, Store, checkpointed_loop, run_schedule
from torchckpt.memory import HostPool
from torchckpt.schedules import Multistage, Restore, Revolve, Schedule, Tier, Uniform, ZCut, plan_prefetch

pytestmark = pytest.mark.cuda

MAX_SLEEP = int(2e6)  # cycles, about a millisecond


def pinned_pool() -> HostPool:
    return HostPool(capacity_bytes=1 << 30, chunk_bytes=32 << 20, pin=True)


def host_in_use(pool: HostPool) -> int:
    """Host bytes in use once every copy has finished and parked blocks are reclaimed."""
    torch.cuda.synchronize()
    pool.free(pool.alloc(1))
    return pool.stats().in_use_bytes


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[random.Random]:
    """Queue a random sleep on the prefetch / offload stream ahead of every copy the store starts."""
    rng = random.Random(1234)
    fill, to_host = SnapshotStore._fill, SnapshotStore._to_host

    def slow_fill(self: SnapshotStore, s: int, n: int) -> Any:
        with torch.cuda.stream(self._mover.prefetch):
            torch.cuda._sleep(rng.randrange(MAX_SLEEP))
        return fill(self, s, n)

    def slow_to_host(self: SnapshotStore, dst: torch.Tensor, src: torch.Tensor, *args: Any) -> Any:
        with torch.cuda.stream(self._mover.offload):
            torch.cuda._sleep(rng.randrange(MAX_SLEEP))
        return to_host(self, dst, src, *args)

    monkeypatch.setattr(SnapshotStore, "_fill", slow_fill)
    monkeypatch.setattr(SnapshotStore, "_to_host", slow_to_host)
    yield rng


def lap3(u: torch.Tensor) -> torch.Tensor:
    out = -6 * u
    for d in (-3, -2, -1):
        out = out + torch.roll(u, 1, d) + torch.roll(u, -1, d)
    return out


def wave_step(c: torch.Tensor) -> Any:
    """Second-order leapfrog on (u_t, u_{t-1}); ``c`` (velocity^2 dt^2 / h^2) is used once per step."""

    def step(s: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        u, u_prev = s
        return 2 * u - u_prev + c * lap3(u), u

    return step


def pulse(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = torch.linspace(-1, 1, d, device="cuda")
    z, y, x = torch.meshgrid(r, r, r, indexing="ij")
    return torch.exp(-20 * (x**2 + y**2 + z**2)) + 0.01 * torch.randn(d, d, d, device="cuda", generator=g)


# -- checkpointed_loop: gradients identical to plain autograd on CUDA -------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize("kind", ["revolve-host", "zcut", "multistage", "revolve-host-no-prefetch"])
def test_wave_gradients_match_plain(kind: str, slots: int, slow_copies: random.Random) -> None:
    n, d = 24, 64
    c = (0.05 + 0.1 * torch.rand(d, d, d, device="cuda")).requires_grad_()
    u0 = pulse(d, 0).requires_grad_()
    up0 = torch.zeros(d, d, d, device="cuda")  # does not require grad
    sched: Schedule = {
        "revolve-host": Revolve(n, min(5, n), tier=Tier.HOST),
        "revolve-host-no-prefetch": Revolve(n, min(5, n), tier=Tier.HOST),
        "zcut": ZCut(n, tier=Tier.HOST),
        "multistage": Multistage(n, gpu_slots=1, host_slots=3),
    }[kind]
    step = wave_step(c)

    s: Any = (u0, up0)
    for _ in range(n):
        s = step(s)
    ref = s
    g_ref = torch.autograd.grad((ref[0] ** 2).sum(), [u0, c])
    del s

    pool = pinned_pool()
    out = checkpointed_loop(step, (u0, up0), n, schedule=sched, store=Store("cuda", host=pool), slots=slots,
                            prefetch=kind != "revolve-host-no-prefetch", params=[c])
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    g = torch.autograd.grad((out[0] ** 2).sum(), [u0, c])
    for name, a, b in zip(["u0", "c"], g, g_ref):
        assert torch.equal(a, b), f"{name}: max abs diff {(a - b).abs().max().item()}"
    assert host_in_use(pool) == 0


# -- checkpointed_scan: traces out, a source in, on CUDA with late copies --------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["revolve-host", "multistage"])
def test_wave_scan_traces_and_gradients_match_plain(kind: str, slow_copies: random.Random) -> None:
    """NOTE [ Checkpointed loop ] Rule 4 on the device: receiver traces as ys, a source wavelet as xs (with its
    gradient), the velocity read from the step's closure; bit for bit against the plain unrolled loop."""
    n, d = 20, 48
    c = (0.05 + 0.1 * torch.rand(d, d, d, device="cuda")).requires_grad_()
    wavelet = torch.randn(n, device="cuda").requires_grad_()
    u0 = torch.zeros(d, d, d, device="cuda")
    src = torch.zeros(d, d, d, device="cuda")
    src[d // 2, d // 2, d // 2] = 1.0
    sched: Schedule = {"revolve-host": Revolve(n, 4, tier=Tier.HOST),
                       "multistage": Multistage(n, gpu_slots=1, host_slots=3)}[kind]

    def step(s: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor) -> tuple[Any, torch.Tensor]:
        u, u_prev = s
        nxt = 2 * u - u_prev + c * lap3(u) + w * src
        return (nxt, u), nxt[2, :, ::4]

    s: Any = (u0, u0.clone())
    traces = []
    for k in range(n):
        s, y = step(s, wavelet[k])
        traces.append(y)
    ref = torch.stack(traces)
    weights = torch.randn(ref.shape, device="cuda")
    g_ref = torch.autograd.grad((ref * weights).sum(), [c, wavelet])
    del s, traces

    pool = pinned_pool()
    _, got = torchckpt.checkpointed_scan(step, (u0, u0.clone()), wavelet, schedule=sched,
                                         store=Store("cuda", host=pool), slots=2)
    assert torch.equal(got, ref)
    g = torch.autograd.grad((got * weights).sum(), [c, wavelet])
    for name, a, b in zip(["c", "wavelet"], g, g_ref):
        assert torch.equal(a, b), f"{name}: max abs diff {(a - b).abs().max().item()}"
    assert host_in_use(pool) == 0


# -- run_schedule: every adjoint step sees the forward's state, with late copies ---------------------
class Wave:
    """A hand-written adjoint loop's state on the GPU; checksums are written on the device, read once."""

    def __init__(self, n: int, d: int, seed: int, rng: random.Random | None = None) -> None:
        self.n, self.rng = n, rng
        self.c = 0.05 + 0.1 * torch.rand(d, d, d, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        self.u, self.up = pulse(d, seed), torch.zeros(d, d, d, device="cuda")
        self.u0 = self.u.clone()
        w = torch.Generator("cuda").manual_seed(seed + 1)
        self.weights = torch.randint(1, 2**31 - 1, (2, d**3), device="cuda", generator=w)
        self.sums = torch.zeros(n, dtype=torch.int64, device="cuda")
        self.order: list[int] = []
        self.at = 0  # step of the current state, tracked on the host

    def checksum(self) -> torch.Tensor:
        bits = torch.stack([self.u, self.up]).view(torch.int32).reshape(2, -1).long()
        return (bits * self.weights).sum()

    def jitter(self) -> None:
        if self.rng is not None:
            torch.cuda._sleep(self.rng.randrange(MAX_SLEEP // 10))

    def step(self) -> None:
        self.u, self.up = 2 * self.u - self.up + self.c * lap3(self.u), self.u

    def reference(self) -> torch.Tensor:
        u, up = self.u, self.up
        self.u, self.up = self.u0.clone(), torch.zeros_like(self.u0)
        ref = torch.zeros(self.n, dtype=torch.int64, device="cuda")
        for k in range(self.n):
            ref[k] = self.checksum()
            self.step()
        self.u, self.up = u, up
        return ref

    # run_schedule callbacks
    def forward(self, n0: int, n1: int) -> None:
        assert self.at == n0
        self.jitter()
        for _ in range(n0, n1):
            self.step()
        self.at = n1

    def save(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.at == n
        return self.u, self.up

    def restore(self, n: int, tensors: list[torch.Tensor]) -> None:
        self.jitter()
        self.u, self.up = tensors[0].clone(), tensors[1].clone()
        self.at = n

    def backward(self, n: int) -> None:
        assert self.at == n
        self.sums[n] = self.checksum()
        self.jitter()
        self.u = self.u * 0.5  # an adjoint step's own work; the state is undefined afterwards
        self.order.append(n)
        self.at = -1

    def run(self, schedule: Any, **kw: Any) -> torchckpt.store.SnapshotStats:
        return run_schedule(schedule, forward=self.forward, save=self.save, restore=self.restore,
                            backward=self.backward, **kw)


def stress_schedules(n: int) -> list[Schedule]:
    return [Revolve(n, min(5, n), tier=Tier.HOST), Revolve(n, min(2, n), tier=Tier.HOST), Uniform(n, min(4, n), tier=Tier.HOST),
            ZCut(n, tier=Tier.HOST), Multistage(n, gpu_slots=2, host_slots=3)]


@pytest.mark.cuda
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_run_schedule_stress_late_copies(slots: int, prefetch: bool, slow_copies: random.Random) -> None:
    n, d = 40, 48
    pool = pinned_pool()
    for seed in range(2):
        for sched in stress_schedules(n):
            w = Wave(n, d, seed, rng=slow_copies)
            ref = w.reference()
            snaps = SnapshotStore("cuda", slots=slots, host=pool)
            st = w.run(sched, store=snaps, slots=slots, prefetch=prefetch)
            assert w.order == list(range(n - 1, -1, -1)), sched
            bad = (w.sums != ref).nonzero().flatten().tolist()  # the one device-to-host read of the run
            assert not bad, f"{sched}, slots={slots}, prefetch={prefetch}: adjoint steps {bad} saw a wrong state"
            host = sum(isinstance(a, Restore) and a.tier is not Tier.GPU for a in sched)
            assert st.hits + st.misses == host
            if prefetch:
                assert st.misses == 0 and st.hit_rate == 1.0, (sched, slots, st)
            snaps.close()
    assert host_in_use(pool) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("slots", [2, 3, 4])
def test_prefetch_stats_no_misses(slots: int) -> None:
    n, d = 30, 32
    pool = pinned_pool()
    for sched in stress_schedules(n):
        w = Wave(n, d, 0)
        ref = w.reference()
        snaps = SnapshotStore("cuda", slots=slots, host=pool)
        st = w.run(sched, store=snaps, slots=slots, prefetch=True)
        assert torch.equal(w.sums, ref)
        plan = plan_prefetch(sched, slots)
        assert st.misses == 0 and st.hit_rate == 1.0, (sched, st)
        assert st.hits == sum(isinstance(a, Restore) and a.tier is not Tier.GPU for a in sched)
        assert st.prefetches == plan.copies
        assert st.late_wait_s >= 0 and st.miss_wait_s == 0
        snaps.close()
    assert host_in_use(pool) == 0


# -- memory across runs ---------------------------------------------------------------------------
@pytest.mark.cuda
def test_pinned_memory_flat_across_runs() -> None:
    """One HostPool for many loops: its pinned memory is reserved by the first and only reused after."""
    n, d = 30, 48
    pool = pinned_pool()
    store = Store("cuda", host=pool)
    seen = []
    for rep in range(5):
        sched = [Revolve(n, 4, tier=Tier.HOST), ZCut(n, tier=Tier.HOST)][rep % 2]
        w = Wave(n, d, rep)
        ref = w.reference()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        w.run(sched, store=store, slots=2)
        assert torch.equal(w.sums, ref)
        assert host_in_use(pool) == 0
        del w
        assert torch.cuda.memory_allocated() <= before
        st = pool.stats()
        seen.append((st.pinned_bytes, st.reserved_bytes, st.chunk_allocations, st.pageable_fallbacks))
    assert seen[0][0] > 0 and seen[0][3] == 0
    assert all(s == seen[1] for s in seen[1:]), seen
    assert seen[1][0] <= 2 * seen[0][0], seen  # the second schedule may need one more chunk, never more per run


@pytest.mark.cuda
def test_pinned_memory_flat_across_checkpointed_loops() -> None:
    n, d = 16, 48
    pool = pinned_pool()
    store = Store("cuda", host=pool)
    c = (0.05 + 0.1 * torch.rand(d, d, d, device="cuda")).requires_grad_()
    seen = []
    for rep in range(4):
        u0 = pulse(d, rep).requires_grad_()
        out = checkpointed_loop(wave_step(c), (u0, torch.zeros_like(u0)), n,
                                schedule=Revolve(n, 4, tier=Tier.HOST), store=store, slots=2, params=[c])
        (out[0] ** 2).sum().backward()
        assert host_in_use(pool) == 0
        st = pool.stats()
        seen.append((st.pinned_bytes, st.chunk_allocations))
    assert seen[0][0] > 0 and all(s == seen[0] for s in seen), seen
