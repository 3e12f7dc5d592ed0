"""The drivers restore in place (NOTE [ Snapshot store ] Rule 11, NOTE [ Checkpointed loop ] Rule 6), on the CPU.

``run_schedule(restore_into=...)``: the snapshot is written into the user's state tensors (their
storage kept), with one copy fewer per restored tensor than ``restore=`` and the same results bit for
bit. ``checkpointed_loop`` / ``checkpointed_scan``: every restore writes into fresh tensors the loop
passes as ``out``, and those are what the next step reads; gradients are bit-identical to the old path
(views cloned, or a codec's fresh tensors) for lossless and lossy codecs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_models import small_pool
from torchckpt.adjoint import checkpointed_loop, checkpointed_scan, run_schedule
from torchckpt.codecs import Codec, Identity, TritonQuant
from torchckpt.schedules import Multistage, Revolve, Tier, ZCut
from torchckpt.store import SnapshotStore, Store

N = 24
CODECS = [None, Identity(), TritonQuant(bits=8, mode="abs", bound=1e-3)]


def _schedules() -> list[Any]:
    return [Revolve(N, 4, tier=Tier.HOST), Revolve(N, 3, tier=Tier.GPU), ZCut(N, tier=Tier.HOST),
            Multistage(N, gpu_slots=2, host_slots=3)]


class _Wave:
    """A leapfrog toy with two in-place state buffers, as the RTM of examples/wave.py keeps them."""

    def __init__(self) -> None:
        self.u = torch.linspace(0, 1, 4096)
        self.v = torch.zeros(4096)
        self.log: list[tuple[int, torch.Tensor]] = []
        self.ptrs = (self.u.data_ptr(), self.v.data_ptr())

    def forward(self, n0: int, n1: int) -> None:
        for _ in range(n0, n1):
            self.v.add_(torch.sin(self.u * 1.3), alpha=0.1)
            self.u.add_(self.v, alpha=0.1)

    def save(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.u, self.v

    def restore(self, n: int, t: list[torch.Tensor]) -> None:
        self.u.copy_(t[0])
        self.v.copy_(t[1])

    def backward(self, n: int) -> None:
        assert (self.u.data_ptr(), self.v.data_ptr()) == self.ptrs  # the state stays in its own buffers
        self.log.append((n, self.u + self.v))


def _run(schedule: Any, codec: Codec | None, into: bool, restore: bool = True) -> tuple[_Wave, Any]:
    w = _Wave()
    snaps = SnapshotStore("cpu", slots=2, host=small_pool(), codec=codec)
    kw: dict[str, Any] = {"restore_into": w.save} if into else {}
    if restore:
        kw["restore"] = w.restore
    st = run_schedule(schedule, forward=w.forward, save=w.save, backward=w.backward, store=snaps, **kw)
    snaps.close()
    return w, st


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("k", range(4))
def test_run_schedule_restore_into_is_bit_identical(codec: Codec | None, k: int) -> None:
    sched = _schedules()[k]
    ref, st_ref = _run(sched, codec, into=False)
    got, st = _run(sched, codec, into=True, restore=False)
    assert [n for n, _ in got.log] == list(range(N - 1, -1, -1)) == [n for n, _ in ref.log]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got.log, ref.log))
    assert (st.restores, st.hits, st.misses) == (st_ref.restores, st_ref.hits, st_ref.misses) and st.restores > 0


class _Copies(TorchDispatchMode):
    """Counts copies (``copy_``) of state-sized tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ == "copy_" and args[0].numel() == 4096:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("codec", [None, Identity()], ids=repr)
def test_run_schedule_restore_into_saves_one_copy_per_restored_tensor(codec: Codec | None) -> None:
    """Without a codec each restored tensor is copied once either way (``restore=``: views, then the callback's
    copy; ``restore_into``: the store's copy into the state); with Identity, ``restore_into``'s decode is the only
    copy, where ``restore=`` decodes into a fresh tensor and the callback copies it: one copy more per tensor."""
    sched = Revolve(N, 4, tier=Tier.HOST)
    counts = []
    for into in (False, True):
        with _Copies() as c:
            _, st = _run(sched, codec, into=into, restore=not into)
        counts.append((c.n, st.restores))
    (plain, restores), (inplace, restores2) = counts
    assert restores == restores2 > 0
    assert plain - inplace == (2 * restores if codec is not None else 0)


def test_run_schedule_restore_into_then_restore() -> None:
    """Both given: ``restore`` gets the state's own tensors once the snapshot is in them."""
    w = _Wave()
    seen: list[bool] = []

    def restore(n: int, t: list[torch.Tensor]) -> None:
        seen.append(t[0] is w.u and t[1] is w.v)

    snaps = SnapshotStore("cpu", slots=2, host=small_pool())
    run_schedule(Revolve(N, 4, tier=Tier.HOST), forward=w.forward, save=w.save, backward=w.backward, store=snaps,
                 restore_into=w.save, restore=restore)
    assert seen and all(seen)


def test_run_schedule_restore_into_errors() -> None:
    w = _Wave()
    base: dict[str, Any] = dict(forward=w.forward, save=w.save, backward=w.backward)
    with pytest.raises(TypeError, match="run_schedule needs restore=... .* or restore_into=..."):
        run_schedule(Revolve(N, 4), **base)
    with pytest.raises(TypeError, match="run_schedule\\(restore_into=...\\) expects a callable"):
        run_schedule(Revolve(N, 4), restore_into=3, **base)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="run_schedule's restore_into\\(\\d+\\) must return a tensor"):
        run_schedule(Revolve(N, 4, tier=Tier.HOST), restore_into=lambda n: None, **base)
    with pytest.raises(ValueError, match="needs a list of one tensor per tensor of the snapshot"):
        run_schedule(Revolve(N, 4, tier=Tier.HOST), restore_into=lambda n: w.u, **base)


# -- checkpointed_loop / checkpointed_scan --------------------------------------------------------
def _old_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore before Rule 11: views cloned (or, with a codec, its fresh tensors), ``out`` unused."""
    orig = SnapshotStore.restore

    def restore(self: SnapshotStore, n: int, tier: Tier, out: Any = None) -> list[torch.Tensor]:
        got = orig(self, n, tier)
        x = list(got) if self.codec is not None else [v.clone() for v in got]
        self.after_use()
        return x

    monkeypatch.setattr(SnapshotStore, "restore", restore)


def _loop_grads(codec: Codec | None, schedule: Any, scan: bool) -> list[torch.Tensor]:
    torch.manual_seed(7)
    w = torch.tensor(0.8, requires_grad=True)
    u0 = torch.randn(512, requires_grad=True)
    v0 = torch.randn(512, requires_grad=True)
    store = Store("cpu", min_bytes=0, host=small_pool(), codec=codec)
    if scan:
        xs = torch.randn(N, 512, requires_grad=True)

        def sstep(c: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> tuple[Any, torch.Tensor]:
            u, v = c
            v = v + 0.1 * torch.tanh(w * u + x)
            return (u + 0.1 * v, v), u.sum()

        (u, v), ys = checkpointed_scan(sstep, (u0, v0), xs, schedule=schedule, store=store)
        (u.square().sum() + v.sum() + ys.square().sum()).backward()
        return [w.grad, u0.grad, v0.grad, xs.grad]  # type: ignore[list-item]

    def step(c: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        u, v = c
        v = v + 0.1 * torch.tanh(w * u)
        return u + 0.1 * v, v

    u, v = checkpointed_loop(step, (u0, v0), N, schedule=schedule, store=store)
    (u.square().sum() + v.sum()).backward()
    return [w.grad, u0.grad, v0.grad]  # type: ignore[list-item]


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("k", range(4))
def test_loop_gradients_bit_identical_to_the_old_restore(codec: Codec | None, k: int, scan: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    new = _loop_grads(codec, _schedules()[k], scan)
    with monkeypatch.context() as m:
        _old_restore(m)
        old = _loop_grads(codec, _schedules()[k], scan)
    assert all(torch.equal(a, b) for a, b in zip(new, old))


def test_loop_step_reads_the_tensors_the_restore_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Checkpointed loop ] Rule 6: each restore gets fresh ``out`` tensors, and the next step reads
    exactly them (no copy between); none of them is a tensor an earlier state held."""
    orig = SnapshotStore.restore
    outs: list[list[int]] = []

    def restore(self: SnapshotStore, n: int, tier: Tier, out: Any = None) -> list[torch.Tensor]:
        assert out is not None
        got = orig(self, n, tier, out=out)
        outs.append([t.data_ptr() for t in got])
        return got

    monkeypatch.setattr(SnapshotStore, "restore", restore)
    reads: list[list[int]] = []
    w = torch.tensor(0.8, requires_grad=True)

    def step(c: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        reads.append([t.data_ptr() for t in c])
        u, v = c
        v = v + 0.1 * torch.tanh(w * u)
        return u + 0.1 * v, v

    reads_at: list[int] = []
    orig_step: Callable[..., Any] = step

    def counted(c: Any) -> Any:
        reads_at.append(len(outs))
        return orig_step(c)

    u, v = checkpointed_loop(counted, (torch.randn(64, requires_grad=True), torch.randn(64)), N,
                             schedule=Revolve(N, 3, tier=Tier.HOST), store=Store("cpu", min_bytes=0, host=small_pool()))
    (u.sum() + v.sum()).backward()
    assert len(outs) > 3
    # the first step after each restore reads that restore's tensors
    for i, ptrs in enumerate(outs, 1):
        first = reads_at.index(i)
        assert reads[first] == ptrs
