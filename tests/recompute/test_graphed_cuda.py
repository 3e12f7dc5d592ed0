"""NOTE [ Graphed recompute ] on a GPU: blocks recomputed by replaying CUDA graphs give plain autograd's gradients and
buffers bit for bit over several steps (capture at the second backward, replays after); what a graph cannot serve
(random draws, tensors read from outside the call, a synchronisation, a second order, more signatures than kept)
recomputes eagerly, with the same bits, and says why; ``clear()`` gives the pool back."""
from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import assert_same_buffers, assert_same_grads, assert_same_records, grads
from torchckpt import Recompute
from torchckpt.recompute import graphed

pytestmark = pytest.mark.cuda
GRAPHED = Recompute(graphed=True)


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    graphed.clear()
    try:
        yield
    finally:
        graphed.clear()
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


class Bottleneck(nn.Module):
    """ResNet's block: convolutions, batch norm in training (running statistics written), ReLU, a residual."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c // 4, 1, bias=False), nn.BatchNorm2d(c // 4)
        self.c2, self.b2 = nn.Conv2d(c // 4, c // 4, 3, padding=1, bias=False), nn.BatchNorm2d(c // 4)
        self.c3, self.b3 = nn.Conv2d(c // 4, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b1(self.c1(x)).relu()
        y = self.b2(self.c2(y)).relu()
        return (self.b3(self.c3(y)) + x).relu()


def _net(blocks: int = 4, c: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), *[Bottleneck(c) for _ in range(blocks)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)).cuda().to(memory_format=torch.channels_last)


def _train(model: nn.Module, xs: list[torch.Tensor], bf16: bool = False) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for i, x in enumerate(xs):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(10 + i)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x).float().square().mean()
        loss.backward()
        out.append((loss.detach().clone(), grads(model)))
        opt.step()
    return out


def _graphed_twin(model: nn.Module, first: int, end: int | None = None) -> nn.Module:
    """``model``'s plain twin (a deep copy), then ``model``'s children ``first`` to ``end`` under ``GRAPHED``."""
    ref = copy.deepcopy(model)
    for b in list(model.children())[first:end]:
        torchckpt.checkpoint(b, policy=GRAPHED)
    return ref


def _both(model: nn.Module, ref: nn.Module, x: torch.Tensor, seed: int | None = None,
          draw: bool = False) -> list[Any]:
    """One step of ``model`` and of its plain twin ``ref`` on ``x`` (from ``seed`` when given): each one's gradients,
    with the device generator's next draw after the step where ``draw``."""
    out = []
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        if seed is not None:
            torch.manual_seed(seed)
        m(x).square().mean().backward()
        out.append((grads(m), torch.rand(4, device="cuda")) if draw else grads(m))
    return out


@pytest.mark.parametrize("bf16", [False, True])
def test_bottlenecks_replay_with_plain_bits_and_buffers(bf16: bool) -> None:
    model = _net()
    ref = _graphed_twin(model, 1, 5)
    xs = [torch.randn(8, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last) for _ in range(4)]
    assert_same_records(_train(model, xs, bf16), _train(ref, xs, bf16))
    assert_same_buffers(model, ref)
    st = graphed.stats()
    # step 1 eager, step 2 captures each block (the first block's input needs no grad: its own signature), 3-4 replay
    assert st["captures"] == 4 and st["replays"] == 4 * 3, st
    assert graphed.pool_bytes() > 0


def test_the_comparison_is_live() -> None:
    """Replays that left the gradients one ulp off (after the captures, which compare them bit for bit too) fail
    the comparison above."""
    model = _net(blocks=2)
    ref = _graphed_twin(model, 1, 3)
    xs = [torch.randn(4, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last) for _ in range(3)]
    assert_same_records(_train(model, xs[:2]), _train(ref, xs[:2]))  # eager, then the captures
    assert graphed.stats()["captures"] == 2
    replay = graphed._Entry.replay

    def off(self: Any, *a: Any) -> Any:
        return [None if g is None else g * (1 + torch.finfo(g.dtype).eps) for g in replay(self, *a)]

    graphed._Entry.replay = off  # type: ignore[method-assign]
    try:
        with pytest.raises(AssertionError):
            assert_same_records(_train(model, xs[2:]), _train(ref, xs[2:]))
    finally:
        graphed._Entry.replay = replay  # type: ignore[method-assign]


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)).tanh() + x


class Outside(nn.Module):
    """Reads a tensor that is neither an argument, a parameter nor a buffer (replaced each step)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = torch.ones(16, device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).tanh() * self.scale + x


class Syncs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * float(y.abs().max().item() > 0) + x


def test_dropout_replays_the_forwards_masks() -> None:
    """NOTE [ Graphed recompute ] Rule 8: blocks that draw replay with the forward's generator state: plain autograd's
    bits over four steps, and the step's RNG stream as plain autograd leaves it (the next draw equal)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Noisy(), Noisy()).cuda()
    ref = _graphed_twin(model, 1)
    for i in range(4):
        got = _both(model, ref, torch.randn(8, 16, device="cuda"), seed=i, draw=True)
        assert_same_grads(got[0][0], got[1][0])
        assert torch.equal(got[0][1], got[1][1]), f"step {i}: the RNG stream after backward"
    st = graphed.stats()
    assert st["captures"] == 2 and st["replays"] == 2 * 3, st


def test_dropout_without_the_forwards_state_runs_eagerly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Noisy(), Noisy()).cuda()
    for b in list(model)[1:]:
        torchckpt.checkpoint(b, policy=Recompute(graphed=True, preserve_rng_state=False))
    for _ in range(3):
        model(torch.randn(8, 16, device="cuda")).square().mean().backward()
    st = graphed.stats()
    assert st.get("captures", 0) == 0 and any("without the forward's generator state" in k for k in st), st


@pytest.mark.parametrize(("block", "reason"), [(Outside, "reads tensors outside"), (Syncs, "synchronises")])
def test_what_a_graph_cannot_serve_runs_eagerly(block: type[nn.Module], reason: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), block(), block()).cuda()
    ref = _graphed_twin(model, 1)
    xs = [torch.randn(8, 16, device="cuda") for _ in range(4)]
    got, want = [], []
    for i, x in enumerate(xs):
        for m, out in ((model, got), (ref, want)):
            if isinstance(m[1], Outside):
                for b in list(m)[1:]:
                    b.scale = torch.full((16,), 1.0 + i, device="cuda")  # a new tensor each step
            m.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            m(x).square().mean().backward()
            out.append(grads(m))
    for a, b in zip(got, want, strict=True):
        assert_same_grads(a, b)
    st = graphed.stats()
    assert st.get("replays", 0) == 0, st
    assert any(reason in k and v == 2 for k, v in st.items()), st  # each block's signature, once


def test_a_failed_capture_turns_captures_off_and_leaves_the_process_working(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error inside the capture (after Rule 3's checks passed): the step's gradients are the eager ones, a warning
    says captures are off, and the allocator and the RNG work as before (NOTE [ Graphed recompute ] Rule 7)."""
    model = _net(blocks=2)
    ref = _graphed_twin(model, 1, 3)
    run = graphed._run

    def failing(*a: Any, rng: bool) -> Any:
        if not rng:  # inside the capture
            raise RuntimeError("injected")
        return run(*a, rng=rng)

    monkeypatch.setattr(graphed, "_run", failing)
    xs = [torch.randn(4, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last) for _ in range(3)]
    with pytest.warns(RuntimeWarning, match="captures? failed"):
        got = _train(model, xs)
    assert_same_records(got, _train(ref, xs))
    st = graphed.stats()
    assert st.get("captures", 0) == 0 and sum(v for k, v in st.items() if "injected" in k) == 1, st
    torch.randn(1000, device="cuda").sum().item()  # the generator and the allocator as before
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = torch.empty(1 << 20, device="cuda").fill_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    assert y.sum().item() == float(1 << 20)
    graphed.clear()  # captures tried again, and they work
    monkeypatch.setattr(graphed, "_run", run)
    model = _net(blocks=2)
    ref = _graphed_twin(model, 1, 3)
    assert_same_records(_train(model, xs), _train(ref, xs))
    assert graphed.stats()["captures"] == 2, graphed.stats()


def test_a_tensor_held_outside_read_through_a_view_runs_eagerly() -> None:
    """transformers' hook hands ``partial(layer.__call__, **kwargs)`` over, the rotary tables bound in it, new each
    step, and read through views: a graph would read the capture's tables (a wrong gradient on the H100 before
    views were told apart from new memory). Here a plain attribute, replaced each step, read through a view."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).cuda()
    ref = copy.deepcopy(lin)
    bound = _Bound(lin, torch.ones(16, device="cuda"))
    torchckpt.checkpoint(bound, policy=GRAPHED)
    for step in range(4):
        x = torch.randn(8, 16, device="cuda", requires_grad=True)
        bound.cos = torch.full((16,), 1.0 + step, device="cuda")
        gx, gw = torch.autograd.grad(bound(x).square().sum(), (x, lin.weight))
        want = ref(x).tanh() * bound.cos.unsqueeze(0)
        rx, rw = torch.autograd.grad(want.square().sum(), (x, ref.weight))
        assert torch.equal(gx, rx) and torch.equal(gw, rw), f"step {step}"
    st = graphed.stats()
    assert st.get("captures", 0) == 0 and any("reads tensors outside" in k for k in st), st


class _Bound(nn.Module):
    """A module whose forward reads a tensor held as a plain attribute through a view (the bound table)."""

    def __init__(self, lin: nn.Module, cos: torch.Tensor) -> None:
        super().__init__()
        self.lin, self.cos = lin, cos

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).tanh() * self.cos.unsqueeze(0)


class Running(nn.Module):
    """Reads a buffer, then writes it in place (its version moves): the guard puts its forward-start value back
    around each recomputation, from a copy made at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale.clone()
        self.scale.mul_(1.5)
        return y.tanh() + x


def test_a_block_writing_its_buffers_runs_eagerly() -> None:
    """NOTE [ Graphed recompute ] Rule 3: a replay would put back the capture's copy of the buffer, not this step's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Running(), Running()).cuda()
    ref = _graphed_twin(model, 1)
    for _ in range(4):
        got = _both(model, ref, torch.randn(8, 16, device="cuda"))
        assert_same_grads(got[0], got[1])
        assert_same_buffers(model, ref)
    st = graphed.stats()
    assert st.get("captures", 0) == 0 and any("writes buffers" in k for k in st), st


def test_second_order_as_plain_within_rounding() -> None:
    """A backward with create_graph runs eagerly (NOTE [ Graphed recompute ] Rule 6); the second order's own pass
    through the node (grad mode off) may replay."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh())).cuda()
    ref = copy.deepcopy(model)
    torchckpt.checkpoint(model[1], policy=GRAPHED)
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    for _ in range(3):
        (g,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        (gr,) = torch.autograd.grad(ref(x).square().sum(), x, create_graph=True)
        assert torch.equal(g, gr)
        (h,) = torch.autograd.grad(g.sum(), x)
        (hr,) = torch.autograd.grad(gr.sum(), x)
        assert torch.allclose(h, hr, rtol=1e-5, atol=1e-6)  # NOTE [ Reentrant recompute ] Rule 7: within rounding


def test_signatures_past_the_limit_run_eagerly_with_a_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU())).cuda()
    ref = copy.deepcopy(model)
    torchckpt.checkpoint(model[1], policy=GRAPHED)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in [2, 3, 4, 5, 6, 2, 3, 4, 5, 6, 2, 3]:  # six batch sizes, each twice or more
            x = torch.randn(n, 8, device="cuda")
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                m(x).square().mean().backward()
            assert_same_grads(grads(model), grads(ref))
    st = graphed.stats()
    assert st["captures"] == graphed.MAX_KEYS and st["eager_keys"] > 0, st
    assert any("more than" in str(w.message) for w in seen)


def test_a_graph_dropped_after_its_capture_leaves_the_pool_working(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first graph of the pool fails Rule 3's comparison after its capture and is not used; later captures
    into the same pool work (torch's allocator asserted when the pool had died with that graph)."""
    model = _net(blocks=3)
    ref = _graphed_twin(model, 1, 4)
    real = torch.equal
    calls = [0]

    def first_differs(a: torch.Tensor, b: torch.Tensor) -> bool:
        calls[0] += 1
        return False if calls[0] == 1 else real(a, b)

    xs = [torch.randn(4, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last) for _ in range(4)]
    assert_same_records(_train(model, xs[:1]), _train(ref, xs[:1]))  # eager
    monkeypatch.setattr(torch, "equal", first_differs)
    _train(model, xs[1:2])  # captures: the first (in backward order) fails a check after its capture
    monkeypatch.setattr(torch, "equal", real)
    _train(ref, xs[1:2])
    assert_same_records(_train(model, xs[2:]), _train(ref, xs[2:]))
    st = graphed.stats()
    assert st["captures"] == 3 and sum(v for k, v in st.items() if k.startswith("eager:")) == 1, st
    assert st["replays"] == 3 + 2 * 2, st


def test_captures_after_every_graph_went_with_its_module() -> None:
    """Models freed (their graphs with them), then new ones captured: a new pool (torch's allocator asserted at a
    capture into the pool that had died with its last graph)."""
    xs = [torch.randn(4, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last) for _ in range(3)]
    for _ in range(3):
        model = _net(blocks=2)
        ref = _graphed_twin(model, 1, 3)
        assert_same_records(_train(model, xs), _train(ref, xs))
        del model, ref
        gc.collect()
    st = graphed.stats()
    assert st["captures"] == 6 and not any(k.startswith("eager:") for k in st), st
    torch.rand(4, device="cuda").sum().item()


def test_clear_gives_the_pool_back() -> None:
    model = _net(blocks=2)
    for b in list(model)[1:3]:
        torchckpt.checkpoint(b, policy=GRAPHED)
    xs = [torch.randn(4, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last) for _ in range(3)]
    _train(model, xs)
    assert graphed.pool_bytes() > 0
    ids = {tuple(d.pool) for d in graphed._DEVICES.values()}
    graphed.clear()
    gc.collect()
    torch.cuda.empty_cache()
    left = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) in ids]
    assert not left, left
