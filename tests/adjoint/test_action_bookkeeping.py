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
