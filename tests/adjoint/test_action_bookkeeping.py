"""The save path's shortcuts (issue 26, Deliver 2): a slot's views kept between saves, NVTX names built lazily."""
from __future__ import annotations

import pytest
import torch

import torchckpt.store.streams as streams
from torchckpt.adjoint import run_schedule
from torchckpt.memory import HostPool
from torchckpt.schedules import Revolve, Tier, ZCut
from torchckpt.store import SnapshotStore


def _store(slots: int = 1) -> SnapshotStore:
    return SnapshotStore("cpu", slots=slots, host=HostPool(chunk_bytes=1 << 20, pin=False))


def test_kept_views_follow_a_replaced_slot_buffer() -> None:
    """A save writes the slot's current buffer, never one it replaced (a grown slot, NOTE [ Snapshot store ] Rule 9)."""
    s = _store()
    s.save(0, Tier.HOST, [torch.arange(4.0), torch.ones(2)])
    old = s._slots[0]
    s._slots[0] = torch.zeros_like(old)  # what _ensure_room does when a blob outgrows its slot
    s.save(1, Tier.HOST, [torch.arange(4.0) + 10, torch.ones(2) * 3])
    assert not torch.equal(s._slots[0], torch.zeros_like(old))
    got = s.restore(1, Tier.HOST)
    assert torch.equal(got[0], torch.arange(4.0) + 10) and torch.equal(got[1], torch.ones(2) * 3)
    s.after_use()
    s.close()
    assert not s._save_views  # closing lets the slots' memory go


@pytest.mark.parametrize("sched", [Revolve(60, 4, tier=Tier.HOST), ZCut(60, tier=Tier.HOST)], ids=repr)
def test_restores_see_each_save_through_the_kept_views(sched: object) -> None:
    """Every adjoint step sees the state it would see in a plain loop (the slots are written through kept views)."""
    x = [torch.tensor([1.0, -2.0]), torch.tensor([0.5])]
    seen: list[tuple[int, list[float]]] = []

    def forward(n0: int, n1: int) -> None:
        for k in range(n0, n1):
            x[0].mul_(1.01).add_(k)
            x[1].add_(x[0][:1])

    def restore(n: int, t: list[torch.Tensor]) -> None:
        x[0].copy_(t[0])
        x[1].copy_(t[1])

    plain = [x[0].clone(), x[1].clone()]
    states = []
    for k in range(60):
        states.append([*plain[0].tolist(), *plain[1].tolist()])
        plain[0].mul_(1.01).add_(k)
        plain[1].add_(plain[0][:1])
    store = _store(slots=2)
    run_schedule(sched, forward=forward, save=lambda n: x, restore=restore,
                 backward=lambda n: seen.append((n, [*x[0].tolist(), *x[1].tolist()])), store=store)
    assert seen == [(n, states[n]) for n in range(59, -1, -1)]
    store.close()


def test_nvtx_range_formats_its_name_only_when_pushed(monkeypatch: pytest.MonkeyPatch) -> None:
    pushed: list[str] = []
    monkeypatch.setattr(streams, "_NVTX", False)
    assert streams.nvtx_range("torchckpt.save", 3) is streams.nvtx_range("x")  # one shared no-op
    monkeypatch.setattr(streams, "_NVTX", True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: pushed.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append("pop"))
    with streams.nvtx_range("torchckpt.save", 3):
        pushed.append("body")
    with pytest.raises(ValueError), streams.nvtx_range("torchckpt.d2h"):
        raise ValueError
    assert pushed == ["torchckpt.save 3", "body", "pop", "torchckpt.d2h", "pop"]


def test_returned_views_are_fresh_and_read_the_slot() -> None:
    """A restore that returns views returns new view objects of the kept ones (NOTE [ Slot views ] Rule 2): what the
    caller does to them stays off the views the store writes through."""
    s = _store()
    s.save(0, Tier.HOST, [torch.arange(4.0), torch.ones(2)])
    a = s.restore(0, Tier.HOST)
    s.after_use()
    b = s.restore(0, Tier.HOST)
    s.after_use()
    assert a[0] is not b[0] and a[0].data_ptr() == b[0].data_ptr() and torch.equal(a[0], b[0])
    assert a[0].shape == (4,) and a[0].dtype == torch.float32 and a[0].is_contiguous()
    a[0].requires_grad_()  # the caller's view only
    s.save(1, Tier.HOST, [torch.arange(4.0) + 7, torch.zeros(2)])  # into the same slot, through the kept views
    got = s.restore(1, Tier.HOST)
    assert torch.equal(got[0].detach(), torch.arange(4.0) + 7) and not got[0].requires_grad
    s.after_use()
    out = [torch.empty(4), torch.empty(2)]
    assert s.restore(1, Tier.HOST, out=out) is not None and torch.equal(out[1], torch.zeros(2))
    s.close()


def test_one_tensor_state_checks_what_the_step_returns() -> None:
    """A loop over one tensor skips the pytree walk (adjoint/step.py) but raises what the walk's checks raise."""
    from torchckpt import CheckpointError
    from torchckpt.adjoint import checkpointed_loop, checkpointed_scan
    from torchckpt.schedules import Revolve as R

    def loop(step: object) -> torch.Tensor:
        x = torch.ones(3, requires_grad=True)
        return checkpointed_loop(step, x, 4, schedule=R(4, 2), store=_store(2))  # type: ignore[arg-type]

    with pytest.raises(CheckpointError, match="^torchckpt: step must return a state of the same structure"):
        loop(lambda s: (s * 2,))
    with pytest.raises(CheckpointError, match="^torchckpt: step must return a state of the same shapes"):
        loop(lambda s: torch.cat([s, s]))
    w = torch.nn.Parameter(torch.ones(3))
    assert torch.equal(loop(lambda s: s * w), torch.ones(3))  # a Tensor subclass out of the step: the walk
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = checkpointed_loop(lambda s: s * 1.5, x, 5, schedule=R(5, 2), store=_store(2))
    y.sum().backward()
    assert torch.allclose(x.grad, torch.full((2,), 1.5 ** 5))  # type: ignore[arg-type]
    c, ys = checkpointed_scan(lambda s, _: (s + 1, s * 2), torch.zeros(2), None, length=3, store=_store(2))
    assert torch.equal(c, torch.full((2,), 3.0)) and torch.equal(ys, torch.tensor([[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]))
    with pytest.raises(CheckpointError, match="^torchckpt: the carry must keep its structure"):
        checkpointed_scan(lambda s, _: ([s], None), torch.zeros(2), None, length=3, store=_store(2))
