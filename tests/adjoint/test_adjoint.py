"""checkpointed_loop, run_schedule and auto_schedule on the CPU (NOTE [ Checkpointed loop ], NOTE [ Executor ]).

Gradients are compared with plain unrolled autograd bit for bit (``torch.equal``), for every
schedule, with the snapshot store simulated on the CPU (NOTE [ Snapshot store ] Rule 6).
"""
from __future__ import annotations

import copy
import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_flatten

import torchckpt
from ckpt_models import small_pool
from torchckpt import CheckpointError, SnapshotStore, Store, checkpointed_loop, run_schedule
from torchckpt.adjoint import AutoSchedule, auto_schedule
from torchckpt.store import SnapshotStats
from torchckpt.schedules import (
    Adjoint, Free, Multistage, Prefetch, Restore, Revolve, Save, Schedule, Tier, Uniform, ZCut, simulate,
)

DTYPES = [torch.float64, torch.float32]
SCHEDULES = ["revolve-gpu", "revolve-host", "uniform", "zcut", "multistage", "auto", "auto-host"]
STEPS = [1, 2, 5, 12]
CACHE = [(1, False), (1, True), (2, False), (2, True), (3, True), (4, False), (4, True)]


def cpu_store(**kw: Any) -> Store:
    return Store("cpu", host=small_pool(), **kw)


def host_in_use(pool: torchckpt.memory.HostPool) -> int:
    """Host bytes in use once parked blocks are reclaimed (a 1-byte alloc/free reclaims them)."""
    pool.free(pool.alloc(1))
    return pool.stats().in_use_bytes


def make_schedule(name: str, n: int, state_bytes: int, slots: int) -> tuple[Schedule | str, Store]:
    """A schedule for ``n`` steps and the store to run it with."""
    if name == "auto":  # room on the GPU tier for everything: Revolve(n, n, GPU)
        return AutoSchedule(), cpu_store()
    if name == "auto-host":  # one GPU snapshot beyond the cache slots: Multistage over GPU and host
        return AutoSchedule(), cpu_store(gpu_bytes=(slots + 1) * state_bytes)
    sched: Schedule = {
        "revolve-gpu": lambda: Revolve(n, min(3, n)),
        "revolve-host": lambda: Revolve(n, min(3, n), tier=Tier.HOST),
        "uniform": lambda: Uniform(n, min(3, n), tier=Tier.HOST),
        "zcut": lambda: ZCut(n, tier=Tier.HOST),
        "multistage": lambda: Multistage(n, gpu_slots=1, host_slots=2),
    }[name]()
    return sched, cpu_store()


def unrolled(step: Callable[[Any], Any], state: Any, n: int) -> Any:
    for _ in range(n):
        state = step(state)
    return state


def assert_same(a: Any, b: Any) -> None:
    fa, sa = tree_flatten(a)
    fb, sb = tree_flatten(b)
    assert sa == sb
    for x, y in zip(fa, fb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.detach(), y.detach()), f"max abs diff {(x.detach() - y.detach()).abs().max().item()}"


def grads_of(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
    need = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad(loss, need, allow_unused=True))
    return [next(got) if t.requires_grad else None for t in leaves]


def assert_same_grads(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"leaf {i}: {x} vs {y}"
            continue
        assert torch.equal(x, y), f"leaf {i}: max abs diff {(x - y).abs().max().item()}"


def check_against_plain(
    step: Callable[[Any], Any],
    state: Any,
    n: int,
    loss: Callable[[Any], torch.Tensor],
    leaves: list[torch.Tensor],
    *,
    schedule: Schedule | str,
    store: Store,
    slots: int,
    prefetch: bool,
    params: list[torch.Tensor] | None = None,
) -> None:
    """Forward output and gradients of ``checkpointed_loop`` equal the plain loop's exactly."""
    ref = unrolled(step, state, n)
    g_ref = grads_of(loss(ref), leaves)
    out = checkpointed_loop(step, state, n, schedule=schedule, store=store, slots=slots, prefetch=prefetch,
                            params=params)
    assert_same(out, ref)
    assert_same_grads(grads_of(loss(out), leaves), g_ref)
    assert host_in_use(store.host) == 0


# -- steps -----------------------------------------------------------------------------------
def wave_step(c: torch.Tensor) -> Callable[[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """Second-order leapfrog u_{t+1} = 2u_t - u_{t-1} + c * lap(u_t): state (u_t, u_{t-1})."""

    def step(s: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        u, u_prev = s
        lap = torch.roll(u, 1, -1) + torch.roll(u, -1, -1) + torch.roll(u, 1, -2) + torch.roll(u, -1, -2) - 4 * u
        return 2 * u - u_prev + c * lap, u

    return step


class Damped(nn.Module):
    """A dict-state step ({"x", "v", "t"}): parameters found by checkpointed_loop, one use each per step."""

    def __init__(self, d: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=dtype)
        self.damp = nn.Parameter(torch.full((d,), 0.9, dtype=dtype))
        self.frozen = nn.Parameter(torch.ones(d, dtype=dtype), requires_grad=False)

    def forward(self, s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        v = self.damp * s["v"] + 0.1 * torch.tanh(self.lin(s["x"]))
        return {"x": s["x"] + 0.1 * v * self.frozen, "v": v, "t": s["t"] + 1}


# -- checkpointed_loop: gradients identical to plain autograd -----------------------------------
@pytest.mark.parametrize("slots,prefetch", CACHE)
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wave_tuple_state(dtype: torch.dtype, name: str, n: int, slots: int, prefetch: bool) -> None:
    """(u, u_prev) with u_prev not requiring grad; the loss ignores the second output."""
    c = (0.05 + 0.1 * torch.rand(6, 7, dtype=dtype)).requires_grad_()
    u0 = torch.randn(6, 7, dtype=dtype, requires_grad=True)
    up0 = torch.zeros(6, 7, dtype=dtype)  # does not require grad
    sched, store = make_schedule(name, n, 2 * u0.numel() * u0.element_size(), slots)
    check_against_plain(
        wave_step(c), (u0, up0), n, lambda s: (s[0] ** 2).sum(), [u0, up0, c],
        schedule=sched, store=store, slots=slots, prefetch=prefetch, params=[c],
    )


@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_state_explicit_params(dtype: torch.dtype, name: str, n: int) -> None:
    w = torch.linspace(0.5, 1.5, 9, dtype=dtype).requires_grad_()
    b = torch.tensor(0.1, dtype=dtype, requires_grad=True)
    frozen = torch.tensor(2.0, dtype=dtype)  # in params, but needs no gradient
    x0 = torch.randn(9, dtype=dtype, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 0.2 * torch.sin(w * x) - b * frozen

    sched, store = make_schedule(name, n, x0.numel() * x0.element_size(), 2)
    check_against_plain(step, x0, n, lambda x: (x.exp() * torch.arange(9, dtype=dtype)).sum(), [x0, w, b, frozen],
                        schedule=sched, store=store, slots=2, prefetch=True, params=[w, b, frozen])


@pytest.mark.parametrize("slots,prefetch", [(1, False), (2, True), (3, False), (4, True)])
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dict_state_module_step(dtype: torch.dtype, name: str, n: int, slots: int, prefetch: bool) -> None:
    """Parameters of an nn.Module step are found without params=; an int leaf rides along."""
    torch.manual_seed(1)
    ref_step = Damped(5, dtype)
    step = copy.deepcopy(ref_step)
    x0 = torch.randn(3, 5, dtype=dtype, requires_grad=True)
    v0 = torch.randn(3, 5, dtype=dtype)  # does not require grad
    state = {"x": x0, "v": v0, "t": torch.tensor(0)}
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())

    def loss(s: dict[str, torch.Tensor]) -> torch.Tensor:
        return (s["x"] ** 2).sum() + s["v"].sum() * 0.5

    ref = unrolled(ref_step, state, n)
    loss(ref).backward()
    g_x0 = x0.grad
    x0.grad = None
    sched, store = make_schedule(name, n, state_bytes, slots)
    out = checkpointed_loop(step, state, n, schedule=sched, store=store, slots=slots, prefetch=prefetch)
    assert_same(out, ref)
    assert int(out["t"]) == n and not out["t"].requires_grad
    loss(out).backward()
    assert torch.equal(x0.grad, g_x0) and v0.grad is None
    for (name_, p), q in zip(step.named_parameters(), ref_step.parameters()):
        assert (p.grad is None) == (q.grad is None), name_
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name_
    assert step.frozen.grad is None and step.lin.weight.grad is not None
    assert host_in_use(store.host) == 0


def test_unused_output_gives_none_grad() -> None:
    """A leaf that requires grad but reaches the loss through no output: .grad stays None, as in plain autograd.

    (Autograd hands the Function zeros for the unused output unless grads are not materialized.)
    """
    x0 = torch.randn(4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, dtype=torch.float64, requires_grad=True)  # passes through untouched

    def step(s: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cos(s[0]), s[1]

    unrolled(step, (x0, k), 6)[0].sum().backward()
    g_ref, x0.grad = x0.grad, None
    assert k.grad is None
    for sched in (Revolve(6, 2, tier=Tier.HOST), ZCut(6, tier=Tier.HOST)):
        out = checkpointed_loop(step, (x0, k), 6, schedule=sched, store=cpu_store(), slots=2)
        out[0].sum().backward()
        assert torch.equal(x0.grad, g_ref)
        assert k.grad is None, f"plain autograd leaves k.grad None, checkpointed_loop gave {k.grad}"
        x0.grad = None


def twice_used_param() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]:
    w = torch.linspace(0.7, 1.1, 16, dtype=torch.float64).requires_grad_()
    x0 = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    return (lambda x: torch.sin(w * x) + w * x.cos()), w, x0


def test_param_used_twice_per_step_close() -> None:
    """NOTE [ Checkpointed loop ] Rule 2: a parameter used twice in a step: the same value up to rounding."""
    step, w, x0 = twice_used_param()
    ref = unrolled(step, x0, 13)
    g_ref = torch.autograd.grad(ref.sum(), [x0, w])
    out = checkpointed_loop(step, x0, 13, schedule=Revolve(13, 3), store=cpu_store(), params=[w])
    assert torch.equal(out, ref)
    g = torch.autograd.grad(out.sum(), [x0, w])
    assert torch.equal(g[0], g_ref[0])
    torch.testing.assert_close(g[1], g_ref[1], rtol=1e-14, atol=0)


def test_param_used_twice_per_step_bit_exact() -> None:
    """NOTE [ Checkpointed loop ] Rule 2: the running sum seeds each step's accumulation."""
    step, w, x0 = twice_used_param()
    check_against_plain(step, x0, 13, lambda x: x.sum(), [x0, w], schedule=Revolve(13, 3), store=cpu_store(),
                        slots=2, prefetch=True, params=[w])


def test_backward_twice_is_right_or_refused() -> None:
    """A second backward (retain_graph=True) must give the same gradient or raise; never a wrong one."""
    x0 = torch.ones(4, dtype=torch.float64, requires_grad=True)
    y = checkpointed_loop(lambda x: x * 1.5, x0, 3, schedule=Revolve(3, 2), store=cpu_store())
    (g1,) = torch.autograd.grad(y.sum(), x0, retain_graph=True)
    assert torch.equal(g1, torch.full((4,), 1.5**3, dtype=torch.float64))
    try:
        (g2,) = torch.autograd.grad(y.sum(), x0)
    except CheckpointError:
        return
    assert torch.equal(g2, g1), f"second backward gave {g2.tolist()}, expected {g1.tolist()}"


@pytest.mark.parametrize("mode", ["backward", "no-backward", "no_grad"])
def test_host_snapshots_released(mode: str) -> None:
    """Snapshots a loop saved to the host pool go back to it: after backward, and also when none runs."""
    store = cpu_store()
    x0 = torch.ones(64, requires_grad=True)
    with torch.set_grad_enabled(mode != "no_grad"):  # one cache slot: snapshots are written back to host
        y = checkpointed_loop(lambda x: x * 1.1, x0, 10, schedule=Revolve(10, 3, tier=Tier.HOST), store=store,
                              slots=1)
    assert store.host.stats().in_use_bytes > 0 or mode == "no_grad"
    assert y.requires_grad == (mode != "no_grad")
    if mode == "backward":
        y.sum().backward()
    del y
    gc.collect()
    assert host_in_use(store.host) == 0


def test_run_schedule_closes_its_own_store_when_a_callback_raises() -> None:
    """``run_schedule`` with a ``Store`` makes a snapshot store of its own: when a callback raises mid-run, that
    store's host blocks go back to the pool at once, with the garbage collector off (the traceback still held)."""
    store = cpu_store()
    x = [torch.ones(64)]
    calls = []

    def backward(n: int) -> None:
        calls.append(n)
        if len(calls) == 3:
            raise RuntimeError("the user's adjoint step failed")

    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="adjoint step failed") as info:
            run_schedule(Revolve(10, 3, tier=Tier.HOST), forward=lambda a, b: x.__setitem__(0, x[0] * 1.1),
                         save=lambda n: x[0], restore=lambda n, t: x.__setitem__(0, t[0].clone()),
                         backward=backward, store=store, slots=1)
        assert info.value is not None
        assert host_in_use(store.host) == 0
    finally:
        gc.enable()


@settings(max_examples=int(os.environ.get("TORCHCKPT_FUZZ_EXAMPLES", "500")) // 5, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["revolve", "zcut", "uniform", "multistage"]), n=st.integers(2, 24),
       snaps=st.integers(1, 6), slots=st.integers(1, 3), where=st.sampled_from(["forward", "save", "restore", "backward"]),
       at=st.integers(1, 30), own=st.booleans())
def test_a_callback_raising_anywhere_leaves_no_host_block(kind: str, n: int, snaps: int, slots: int, where: str,
                                                          at: int, own: bool) -> None:
    """Fuzz (the bug of the test above): a random schedule whose ``where`` callback raises at its ``at``-th call; the
    host pool is back to empty at once (garbage collector off) when ``run_schedule`` made the store (``own``), and
    once the caller closes the ``SnapshotStore`` it passed."""
    sched = {"revolve": lambda: Revolve(n, min(snaps, n), tier=Tier.HOST), "zcut": lambda: ZCut(n, tier=Tier.HOST),
             "uniform": lambda: Uniform(n, min(snaps, n), tier=Tier.HOST),
             "multistage": lambda: Multistage(n, gpu_slots=1, host_slots=min(snaps, n))}[kind]()
    pool = small_pool()
    store: Store | SnapshotStore = Store("cpu", host=pool) if own else SnapshotStore("cpu", slots=slots, host=pool)
    x = [torch.ones(64)]
    calls = {"forward": 0, "save": 0, "restore": 0, "backward": 0}

    def hit(name: str) -> None:
        calls[name] += 1
        if name == where and calls[name] == at:
            raise RuntimeError("boom")

    def forward(a: int, b: int) -> None:
        hit("forward")
        x[0] = x[0] + (b - a)

    def save(k: int) -> torch.Tensor:
        hit("save")
        return x[0]

    def restore(k: int, t: list[torch.Tensor]) -> None:
        hit("restore")
        x[0] = t[0].clone()

    gc.disable()
    try:
        try:
            run_schedule(sched, forward=forward, save=save, restore=restore, backward=lambda k: hit("backward"),
                         store=store, slots=slots)
        except RuntimeError as e:
            assert str(e) == "boom"
        if isinstance(store, SnapshotStore):
            store.close()
        assert host_in_use(pool) == 0
    finally:
        gc.enable()


def test_default_store_and_auto_schedule() -> None:
    """store=None uses the default CPU store; schedule=AutoSchedule() is the default."""
    x0 = torch.randn(5, dtype=torch.float64, requires_grad=True)
    step = torch.tanh
    ref = unrolled(step, x0, 7)
    (g_ref,) = torch.autograd.grad(ref.sum(), x0)
    out = checkpointed_loop(step, x0, 7)
    assert torch.equal(out, ref)
    (g,) = torch.autograd.grad(out.sum(), x0)
    assert torch.equal(g, g_ref)


@pytest.mark.parametrize("schedule", [Revolve(13, 3, tier=Tier.HOST), AutoSchedule()])
def test_loop_takes_a_snapshot_store_and_leaves_it_open(schedule: object) -> None:
    """checkpointed_loop(store=SnapshotStore(...)): the caller's store is used as it is, keeps no snapshot
    afterwards and serves the next loop; gradients equal the unrolled loop's."""
    pool = torchckpt.memory.HostPool(capacity_bytes=64 << 20, chunk_bytes=1 << 20, pin=False)
    snaps = SnapshotStore("cpu", slots=2, host=pool)
    w = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(w * x)

    for _ in range(2):
        x0 = torch.randn(7, dtype=torch.float64, requires_grad=True)
        ref = unrolled(step, x0, 13)
        g_ref = torch.autograd.grad(ref.sum(), [x0, w])
        out = checkpointed_loop(step, x0, 13, schedule=schedule, store=snaps)  # type: ignore[arg-type]
        assert torch.equal(out, ref)
        g = torch.autograd.grad(out.sum(), [x0, w])
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
        assert snaps.stats().host_saves > 0 and host_in_use(pool) == 0  # every snapshot freed, store still open
    snaps.close()


@pytest.mark.parametrize("old,new", [("auto", AutoSchedule()), (Revolve, AutoSchedule()), (Uniform, AutoSchedule(kind=Uniform))])
def test_auto_shorthands_warn_and_mean_auto(old: object, new: AutoSchedule) -> None:
    """The string "auto" and the classes Revolve/Uniform still work, as AutoSchedule values, with a DeprecationWarning."""
    x0 = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with pytest.warns(DeprecationWarning, match="torchckpt.adjoint.AutoSchedule"):
        a = checkpointed_loop(torch.tanh, x0, 9, schedule=old, store=cpu_store())  # type: ignore[arg-type]
    b = checkpointed_loop(torch.tanh, x0, 9, schedule=new, store=cpu_store())
    assert torch.equal(torch.autograd.grad(a.sum(), x0)[0], torch.autograd.grad(b.sum(), x0)[0])


def test_auto_is_a_value() -> None:
    assert AutoSchedule() == AutoSchedule(kind=Revolve, margin=0.25) and hash(AutoSchedule()) == hash(AutoSchedule())
    with pytest.raises(TypeError, match="^torchckpt: AutoSchedule\\(kind=...\\) takes Revolve or Uniform"):
        AutoSchedule(kind=int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^torchckpt: AutoSchedule\\(margin=...\\)"):
        AutoSchedule(margin=-1)


# -- checkpointed_loop: bad arguments ---------------------------------------------------------
def test_bogus_schedule_name() -> None:
    with pytest.raises(ValueError, match="^torchckpt:.*'bogus'"):
        checkpointed_loop(torch.sin, torch.ones(2, requires_grad=True), 3, schedule="bogus", store=cpu_store())


@pytest.mark.parametrize("sched", [Revolve(5, 2), ZCut(4), Uniform(6, 2, tier=Tier.HOST), Multistage(2, 1, 1)])
def test_schedule_for_wrong_n(sched: Schedule) -> None:
    with pytest.raises(ValueError, match="^torchckpt:.*n_steps=3"):
        checkpointed_loop(torch.sin, torch.ones(2, requires_grad=True), 3, schedule=sched, store=cpu_store())


@pytest.mark.parametrize("n", [0, -2, 2.0, "3"])
def test_bad_n_steps(n: object) -> None:
    with pytest.raises(ValueError, match="^torchckpt: n_steps"):
        checkpointed_loop(torch.sin, torch.ones(2, requires_grad=True), n, store=cpu_store())  # type: ignore[arg-type]


@pytest.mark.parametrize("state", [1.0, [], {}, ("u", torch.ones(2)), [torch.ones(2), 3], None])
def test_non_tensor_state(state: object) -> None:
    with pytest.raises(TypeError, match="^torchckpt: state"):
        checkpointed_loop(lambda s: s, state, 3, store=cpu_store())


def test_step_changing_structure() -> None:
    with pytest.raises(CheckpointError, match="^torchckpt: step must return"):
        checkpointed_loop(lambda s: (s[0], s[1], s[0]), (torch.ones(2), torch.ones(2)), 3,
                          schedule=Revolve(3, 2), store=cpu_store())


# -- auto_schedule -------------------------------------------------------------------------------
def test_auto_everything_on_gpu() -> None:
    s = auto_schedule(10, 100, gpu_bytes=100 * (10 + 4), host_bytes=1 << 30, slots=4)
    assert s == Revolve(10, 10, tier=Tier.GPU)
    assert simulate(s).forward_steps == 9  # nothing recomputed


def test_auto_gpu_only_when_no_host() -> None:
    assert auto_schedule(10, 100, gpu_bytes=100 * (3 + 4), host_bytes=0, slots=4) == Revolve(10, 3, tier=Tier.GPU)


def test_auto_multistage_when_host_needed() -> None:
    s = auto_schedule(10, 100, gpu_bytes=100 * (2 + 2), host_bytes=100 * 3 + 99, slots=2)
    assert isinstance(s, Multistage) and (s.gpu_slots, s.host_slots) == (2, 3)
    s = auto_schedule(10, 100, gpu_bytes=100 * 2, host_bytes=1 << 30, slots=2)
    assert isinstance(s, Multistage) and (s.gpu_slots, s.host_slots) == (0, 10)
    assert simulate(s).forward_steps == 9


@pytest.mark.parametrize("gpu", [0, 99, 100 * 4, 100 * 5 - 1])
def test_auto_nothing_fits(gpu: int) -> None:
    with pytest.raises(CheckpointError, match="^torchckpt: no room"):
        auto_schedule(10, 100, gpu_bytes=gpu, host_bytes=99, slots=4)


@pytest.mark.parametrize("nbytes", [0, -1])
def test_auto_bad_snapshot_bytes(nbytes: int) -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        auto_schedule(10, nbytes, gpu_bytes=1 << 20, host_bytes=1 << 20)


def test_auto_in_checkpointed_loop_with_no_room() -> None:
    store = Store("cpu", gpu_bytes=0, host=torchckpt.memory.HostPool(capacity_bytes=0, chunk_bytes=1 << 20, pin=False))
    with pytest.raises(CheckpointError, match="^torchckpt:"):
        checkpointed_loop(torch.sin, torch.ones(2, requires_grad=True), 3, store=store)


# -- run_schedule --------------------------------------------------------------------------------
class Recurrence:
    """x_{n+1} = A x_n + b on a (float64 vector, int64 counter) state, driven by run_schedule's callbacks."""

    def __init__(self, d: int = 6) -> None:
        g = torch.Generator().manual_seed(5)
        self.a = torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5
        self.b = torch.randn(d, generator=g, dtype=torch.float64)
        self.x0 = torch.randn(d, generator=g, dtype=torch.float64)
        self.x, self.t = self.x0.clone(), torch.tensor(0)
        self.seen: list[tuple[int, torch.Tensor, int]] = []  # (adjoint n, x, counter)
        self.restored: list[tuple[int, list[torch.Tensor]]] = []
        self.ended = 0

    def step(self) -> None:
        self.x = self.a @ self.x + self.b
        self.t = self.t + 1

    def reference(self, n: int) -> list[torch.Tensor]:
        x, out = self.x0.clone(), []
        for _ in range(n):
            out.append(x)
            x = self.a @ x + self.b
        return out

    def forward(self, n0: int, n1: int) -> None:
        assert int(self.t) == n0, f"forward({n0}, {n1}) from state {int(self.t)}"
        for _ in range(n0, n1):
            self.step()

    def save(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert int(self.t) == n
        return self.x, self.t

    def restore(self, n: int, tensors: list[torch.Tensor]) -> None:
        self.restored.append((n, [t.clone() for t in tensors]))
        self.x, self.t = tensors[0].clone(), tensors[1].clone()

    def backward(self, n: int) -> None:
        self.seen.append((n, self.x.clone(), int(self.t)))
        self.x = torch.full_like(self.x, float("nan"))  # the current state is undefined after an adjoint
        self.t = torch.tensor(-1)

    def end_forward(self) -> None:
        self.ended += 1

    def run(self, schedule: Any, **kw: Any) -> SnapshotStats:
        return run_schedule(schedule, forward=self.forward, save=self.save, restore=self.restore,
                            backward=self.backward, end_forward=self.end_forward, **kw)


def run_schedules(n: int) -> list[Schedule]:
    return [Revolve(n, min(3, n)), Revolve(n, min(3, n), tier=Tier.HOST), Revolve(n, 1, tier=Tier.HOST),
            Uniform(n, min(2, n), tier=Tier.HOST), Uniform(n, min(4, n)), ZCut(n, tier=Tier.HOST), Multistage(n, gpu_slots=1, host_slots=3),
            Multistage(n, gpu_slots=0, host_slots=2)]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 9, 23])
def test_run_schedule_adjoint_sees_state_n(n: int, slots: int, prefetch: bool) -> None:
    for sched in run_schedules(n):
        rec = Recurrence()
        snaps = SnapshotStore("cpu", slots=slots, host=small_pool())
        st = rec.run(sched, store=snaps, slots=slots, prefetch=prefetch)
        ref = rec.reference(n)
        assert [s[0] for s in rec.seen] == list(range(n - 1, -1, -1)), sched
        for m, x, t in rec.seen:
            assert t == m and torch.equal(x, ref[m]), (sched, m)
        for m, tensors in rec.restored:
            assert torch.equal(tensors[0], ref[m]) and int(tensors[1]) == m, (sched, m)
        assert rec.ended == 1
        acts = list(sched)
        assert isinstance(st, SnapshotStats)
        assert st.saves == sum(isinstance(a, Save) for a in acts)
        assert st.restores == sum(isinstance(a, Restore) for a in acts) == len(rec.restored)
        host_restores = sum(isinstance(a, Restore) and a.tier is not Tier.GPU for a in acts)
        assert st.host_saves == sum(isinstance(a, Save) and a.tier is not Tier.GPU for a in acts)
        assert st.hits + st.misses == host_restores
        if prefetch:
            assert st.misses == 0 and st.hit_rate == 1.0
        assert host_in_use(snaps.host) == 0


@pytest.mark.parametrize("kind", ["none", "store", "snapshot-store"])
def test_run_schedule_store_argument(kind: str) -> None:
    """store=None makes a store on the state's device; a Store lends its host pool (released at the end)."""
    pool = small_pool()
    store = {"none": None, "store": Store("cpu", host=pool),
             "snapshot-store": SnapshotStore("cpu", slots=2, host=pool)}[kind]
    rec = Recurrence()
    st = rec.run(Revolve(12, 3, tier=Tier.HOST), store=store, slots=2)
    ref = rec.reference(12)
    assert all(torch.equal(x, ref[m]) for m, x, _ in rec.seen) and len(rec.seen) == 12
    assert st.host_saves > 0 and st.misses == 0
    if kind != "none":
        assert pool.stats().chunk_allocations == 1
    assert host_in_use(pool) == 0


def test_run_schedule_gpu_tier_only_saves_nothing_to_host() -> None:
    rec = Recurrence()
    st = rec.run(Revolve(10, 3), store=SnapshotStore("cpu", slots=2, host=small_pool()))
    assert st.host_saves == 0 and st.hits == st.misses == 0 and st.bytes_to_host == 0


def test_run_schedule_without_saves_returns_empty_stats() -> None:
    rec = Recurrence()
    st = rec.run(Revolve(1, 1))
    assert st == SnapshotStats() and [s[0] for s in rec.seen] == [0]


def test_run_schedule_progress(capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recurrence()
    rec.run(Revolve(20, 3, tier=Tier.HOST), store=Store("cpu", host=small_pool()), progress=True)
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert cap.out == ""
    assert 1 <= len(lines) <= 11 and all(line.startswith("torchckpt: adjoint ") for line in lines)
    assert lines[-1].startswith("torchckpt: adjoint 20/20 steps")
    rec = Recurrence()
    rec.run(Revolve(20, 3, tier=Tier.HOST), store=Store("cpu", host=small_pool()))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("tier", [Tier.HOST, Tier.GPU])
def test_run_schedule_restore_before_save(tier: Tier, prefetch: bool) -> None:
    rec = Recurrence()
    with pytest.raises(CheckpointError, match="^torchckpt:"):
        rec.run([Restore(0, tier), Adjoint(0)], store=Store("cpu", host=small_pool()), prefetch=prefetch)
    with pytest.raises(CheckpointError, match="^torchckpt:"):
        rec.run([Save(0, tier), Restore(1, tier), Adjoint(1)], store=Store("cpu", host=small_pool()), prefetch=prefetch)


def test_run_schedule_restore_after_free() -> None:
    rec = Recurrence()
    with pytest.raises(CheckpointError, match="^torchckpt:"):
        rec.run([Save(0, Tier.HOST), Free(0, Tier.HOST), Restore(0, Tier.HOST)],
                store=SnapshotStore("cpu", slots=2, host=small_pool()), prefetch=False)


def test_run_schedule_prefetch_of_unsaved() -> None:
    rec = Recurrence()
    with pytest.raises(CheckpointError, match="^torchckpt:"):
        rec.run([Save(0, Tier.HOST), Prefetch(3, Tier.HOST, Tier.GPU)],
                store=SnapshotStore("cpu", slots=2, host=small_pool()), prefetch=False)


def test_run_schedule_unknown_action() -> None:
    rec = Recurrence()
    with pytest.raises(TypeError, match="^torchckpt: unknown schedule action"):
        rec.run([Save(0), "Advance(0, 1)"], store=SnapshotStore("cpu", slots=2, host=small_pool()), prefetch=False)


def test_run_schedule_without_a_store_reuses_one_host_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_schedule given no store takes the process's shared pool (shared_host_pool) instead of
    touching and registering new host memory every call; TORCHCKPT_SHARED_POOL=0 gives each call
    its own. (checkpointed_loop without a store uses default_store's pool, shared already.)"""
    from torchckpt.memory import release_shared_host_pools, shared_host_pool
    from torchckpt.store.lend import lend_snapshot_store

    release_shared_host_pools()
    cpu = torch.device("cpu")
    a, b = lend_snapshot_store(None, cpu, 2)[0], lend_snapshot_store(None, cpu, 2)[0]
    assert a.host is b.host is shared_host_pool(pin=False)
    a.close()
    b.close()
    monkeypatch.setenv("TORCHCKPT_SHARED_POOL", "0")
    c = lend_snapshot_store(None, cpu, 2)[0]
    assert c.host is not shared_host_pool(pin=False)
    c.close()
    monkeypatch.delenv("TORCHCKPT_SHARED_POOL")
    pool = shared_host_pool(pin=False)
    release_shared_host_pools()
    assert shared_host_pool(pin=False) is not pool
