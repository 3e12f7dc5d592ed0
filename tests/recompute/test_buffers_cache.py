"""NOTE [ Buffers written in a forward ] Rule 5: the walk ``guarded`` keeps per module is found again whenever what it
read changed. Each case changes a model between steps, as a user may, and compares buffers and gradients with plain
autograd bit for bit; each also runs against a deliberately stale walk and must fail there."""
from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.recompute import buffers
from torchckpt.recompute.buffers import BufferGuard, guarded

C = 4


class Block(nn.Module):
    """Batch norm (statistics written by a kernel that moves no version), a buffer written in place and read after,
    a buffer that may be registered later on ``lin`` and written likewise, and room for submodules added later."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.bn = nn.BatchNorm1d(C)
        self.register_buffer("seen", torch.zeros(C))
        self.extra = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.seen.mul_(0.5).add_(x.detach().mean(0))
        y = self.bn(self.lin(x)) * (1 + self.seen)
        scale = self.lin._buffers.get("scale")
        if scale is not None:
            with torch.no_grad():
                scale.add_(1)
            y = y * scale
        for m in self.extra:
            y = m(y)
        return y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.b:
            x = blk(x)
        return x.square().mean()


def _replace_buffer(net: Net, step: int) -> None:
    if step == 1:
        for blk in net.b:
            blk.seen = blk.seen.clone() + 1  # a new tensor in the same slot


def _eval_and_back(net: Net, step: int) -> None:
    net.train(step % 2 == 1)  # evaluation (with grad) first, then training, evaluation, training


def _add_submodule(net: Net, step: int) -> None:
    if step == 1:
        for blk in net.b:
            blk.extra.append(nn.BatchNorm1d(C))


def _add_buffer(net: Net, step: int) -> None:
    if step == 1:
        for blk in net.b:
            blk.lin.register_buffer("scale", torch.ones(C))


def _track_stats(net: Net, step: int) -> None:
    for blk in net.b:
        blk.bn.track_running_stats = step > 0  # batch statistics only, then running ones too


CASES: dict[str, Callable[[Net, int], None]] = {
    "buffer_replaced": _replace_buffer,
    "eval_and_back": _eval_and_back,
    "submodule_added": _add_submodule,
    "buffer_added": _add_buffer,
    "track_running_stats": _track_stats,
}


def _steps(net: Net, x: torch.Tensor, change: Callable[[Net, int], None], steps: int = 4) -> list[list[torch.Tensor]]:
    out = []
    for i in range(steps):
        change(net, i)
        net.zero_grad(set_to_none=True)
        net(x * (1 + i)).backward()
        out.append([p.grad.clone() for p in net.parameters()])
    return out


def _check(case: str) -> None:
    torch.manual_seed(0)
    plain, x = Net(), torch.randn(8, C)
    model = copy.deepcopy(plain)
    for blk in model.b:
        torchckpt.checkpoint(blk, policy=torchckpt.Recompute())
    want, got = _steps(plain, x, CASES[case]), _steps(model, x, CASES[case])
    for (n, a), b in zip(plain.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b), n
    for s, (u, v) in enumerate(zip(want, got, strict=True)):
        assert all(torch.equal(p, q) for p, q in zip(u, v, strict=True)), f"step {s}"


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_changed_between_steps_recomputes_as_plain_autograd(case: str) -> None:
    _check(case)


def _key_blind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk whose key sees no change: found again never (the buffers still read from their slots)."""
    monkeypatch.setattr(buffers, "_key", lambda *args: ())


def _holds_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk kept with the tensors it found, never compared again."""
    first: dict[int, tuple[object, ...]] = {}
    walk = buffers._walk

    def once(module: nn.Module) -> tuple[object, ...]:
        if id(module) not in first:
            first[id(module)] = (module, *walk(module))  # the module kept too: its id stays its own
        return first[id(module)][1:]
    monkeypatch.setattr(buffers, "_walk", once)


# which stale walks each case catches: a key blind to changes still reads a replaced buffer from its slot
STALE = [(case, "holds_first") for case in CASES] + [
    (case, "key_blind") for case in CASES if case != "buffer_replaced"]


@pytest.mark.parametrize(("case", "stale"), STALE)
def test_each_case_fails_with_a_stale_walk(case: str, stale: str, monkeypatch: pytest.MonkeyPatch) -> None:
    {"key_blind": _key_blind, "holds_first": _holds_first}[stale](monkeypatch)
    with pytest.raises(AssertionError):
        _check(case)


def test_the_walk_is_kept_and_found_again_on_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """One walk for calls that change nothing (the cost Rule 5 saves); another after each change."""
    walks: list[nn.Module] = []
    walk = buffers._walk

    def counted(module: nn.Module) -> object:
        walks.append(module)
        return walk(module)
    monkeypatch.setattr(buffers, "_walk", counted)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x
    blk = Block()
    changes = [lambda: None, lambda: None, lambda: blk.eval(), lambda: None, lambda: blk.train(),
               lambda: setattr(blk, "seen", torch.ones(C)), lambda: blk.extra.append(nn.Linear(C, C)),
               lambda: blk.extra[0].register_buffer("b", torch.ones(1)),
               lambda: blk.extra[0].register_buffer("b", None),
               lambda: setattr(blk.bn, "track_running_stats", False), lambda: None]
    expect = [1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 8]
    for change, n in zip(changes, expect, strict=True):
        change()
        g = guarded(fn, blk)
        assert isinstance(g, BufferGuard) and len(walks) == n
        stats = [blk.bn.running_mean, blk.bn.running_var, blk.bn.num_batches_tracked]
        norms = stats if blk.bn.training and blk.bn.track_running_stats else []
        assert [id(d[n]) for d, n in g.norms] == [id(b) for b in norms]
        assert all(d is blk.bn._buffers for d, _ in g.norms)
        assert {id(b) for b in g.buffers} == {id(b) for b in blk.buffers()} - {id(b) for b in norms}


def test_the_walk_keeps_no_module_or_tensor_alive() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x
    blk = Block()
    assert isinstance(guarded(fn, blk), BufferGuard) and id(blk) in buffers._WALKS
    old = weakref.ref(blk.seen)
    blk.seen = torch.ones(C)
    gc.collect()
    assert old() is None
    gone = weakref.ref(blk)
    key = id(blk)
    del blk
    gc.collect()
    assert gone() is None and key not in buffers._WALKS
