"""Tiny models and helpers shared by the test files (imported as a plain module: tests/ is on sys.path)."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torchckpt


def small_pool() -> torchckpt.memory.HostPool:
    """A host pool with 1 MiB chunks: keeps CPU tests' memory small."""
    return torchckpt.memory.HostPool(capacity_bytes=256 << 20, chunk_bytes=1 << 20, pin=False)


def cpu_store(gpu_bytes: int, min_bytes: int = 0, **kw: Any) -> torchckpt.Store:
    return torchckpt.Store(device="cpu", gpu_bytes=gpu_bytes, min_bytes=min_bytes, host=small_pool(), **kw)


def gate_up_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A fused gate/up projection as in Mixtral's experts: SiLU saves the gate half, the product the up half (two
    nodes, two non-dense halves of one storage: NOTE [ Saved tensor identity ] Rule 2c)."""
    gate, up = (x @ w).chunk(2, dim=-1)
    return (F.silu(gate) * up).square().sum()


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d: int = 32, d_out: int = 8, depth: int = 3) -> None:
        super().__init__()
        dims = [d_in] + [d] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x) if i % 2 == 0 else torch.tanh(x)
        return x


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.b2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, causal SDPA, MLP with dropout."""

    def __init__(self, d: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.fc2(self.drop(F.gelu(self.fc1(self.ln2(x)))))


def make(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A fresh model (seeded) and an input for it."""
    g = torch.Generator().manual_seed(1234)
    if kind == "mlp":
        torch.manual_seed(1)
        return MLP(), torch.randn(4, 16, generator=g)
    if kind == "cnn":
        torch.manual_seed(2)
        return CNN(), torch.randn(2, 3, 8, 8, generator=g)
    if kind == "block":
        torch.manual_seed(3)
        return Block(), torch.randn(2, 8, 32, generator=g)
    raise KeyError(kind)


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def assert_same_grads(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        ga, gb = a[n], b[n]
        if ga is None or gb is None:
            assert ga is None and gb is None, n
            continue
        assert torch.equal(ga, gb), f"{n}: max abs diff {(ga - gb).abs().max().item()}"


def assert_same_records(got: list[tuple[torch.Tensor, dict[str, torch.Tensor | None]]],
                        ref: list[tuple[torch.Tensor, dict[str, torch.Tensor | None]]]) -> None:
    """Step by step, the losses and every parameter's gradient equal bit for bit (``(loss, grads)`` per step)."""
    for i, ((loss, g), (loss_p, g_p)) in enumerate(zip(got, ref, strict=True)):
        assert torch.equal(loss, loss_p), f"step {i}: loss {loss.item()!r} != plain {loss_p.item()!r}"
        try:
            assert_same_grads(g, g_p)
        except AssertionError as err:
            raise AssertionError(f"step {i}: {err}") from None


def assert_same_buffers(a: nn.Module, b: nn.Module) -> None:
    """The modules' buffers (batch norm's running statistics among them) equal bit for bit, name by name."""
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys()
    for n in ba:
        assert torch.equal(ba[n], bb[n]), f"buffer {n} differs"


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for n in sa:
        assert torch.equal(sa[n], sb[n]), n


def step(model: Callable[[torch.Tensor], Any], params: nn.Module, x: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One forward/backward from a fixed seed; the input is a non-leaf so stores see it."""
    params.zero_grad(set_to_none=True)
    xl = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = model(xl * 1.0)
    loss = (out.float() ** 2).mean()
    loss.backward()
    return out.detach(), xl.grad.clone(), grads(params)


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class Echo(torch.autograd.Function):
    """Saves ``a`` and returns it as the gradient of ``x``: the saved tensor as a store gives it back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (a,) = ctx.saved_tensors
        return a.clone(), None


class FakeEvent:
    """Stands in for a CUDA event: done once ``done`` is set; synchronize() completes it."""

    def __init__(self) -> None:
        self.done = False
        self.syncs = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True


def assert_bits_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Same dtype, shape, device and bytes (NaN payloads and signed zeros too)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def replay_snapshots(store: Any, actions: Any, state: Any, flushes: frozenset[int] | None = None,
                     want: Any = None, into: bool = False) -> int:
    """Run a schedule's Save/Restore/Prefetch/Free on a ``SnapshotStore`` with ``state(n)`` as snapshot n; every
    restore must give back ``want(n)`` (default ``state(n)``) bit for bit, as views or, with ``into``, written into
    the caller's tensors (``restore(..., out=...)``). ``flushes``: positions of the Saves that copy to host at once
    (``None``: all; NOTE [ Write-back ]). Returns the number of restores."""
    from torchckpt.schedules import Free, Prefetch, Restore, Save

    want = want if want is not None else state
    restores = 0
    for i, a in enumerate(actions):
        if isinstance(a, Save):
            store.save(a.n, a.tier, state(a.n), flush=flushes is None or i in flushes)
        elif isinstance(a, Restore):
            if into:
                out = [torch.full_like(t, 7.0) for t in want(a.n)]
                assert_bits_equal(store.restore(a.n, a.tier, out=out), want(a.n))
            else:
                assert_bits_equal([t.clone() for t in store.restore(a.n, a.tier)], want(a.n))
                store.after_use()
            restores += 1
        elif isinstance(a, Prefetch):
            store.prefetch(a.n, a.src, a.dst)
        elif isinstance(a, Free):
            store.free(a.n, a.tier)
    return restores
