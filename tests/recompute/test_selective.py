"""Recompute(save=...): selective recomputation whose kept outputs go through the store (NOTE [ Selective recompute ])."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import torchckpt
from torchckpt import Recompute, Store
from torchckpt._errors import CheckpointError
from torchckpt.recompute.selective import keepable

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default}


class Attn(nn.Module):
    def __init__(self, d: int = 32, h: int = 4, p: float = 0.2) -> None:
        super().__init__()
        self.h = h
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, self.h, d // self.h).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


def _grads(f, m: nn.Module, x: torch.Tensor, seed: int = 7) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return list(torch.autograd.grad(f(x).square().sum(), [x, *m.parameters()]))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


ATTENTION = {getattr(aten, n).default for n in ("_scaled_dot_product_flash_attention_for_cpu",
                                                "_scaled_dot_product_efficient_attention",
                                                "_scaled_dot_product_flash_attention") if hasattr(aten, n)}


@pytest.mark.parametrize("store", [None, "resident", "evicted"])
@pytest.mark.parametrize("save", [MATMULS, MATMULS | ATTENTION, frozenset()])
def test_gradients_equal_plain_autograd(store: str | None, save: frozenset) -> None:
    torch.manual_seed(0)
    m = Attn()
    x = torch.randn(2, 16, 32, requires_grad=True)
    ref = _grads(m, m, x)
    st = None if store is None else Store(device="cpu", min_bytes=0, gpu_bytes=0 if store == "evicted" else 1 << 30)
    wrapped = torchckpt.api.run
    got = _grads(lambda y: wrapped(Recompute(save=save, store=st), m, y, module=m), m, x)
    assert _same(ref, got)
    if store == "evicted" and save:
        assert st is not None and st.stats().offloaded > 0  # the kept outputs went through the store


def test_same_gradients_as_torch_sac() -> None:
    torch.manual_seed(0)
    m = Attn()
    x = torch.randn(2, 16, 32, requires_grad=True)
    ops = sorted(MATMULS | ATTENTION, key=str)
    sac = _grads(lambda y: torch_checkpoint(m, y, use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, ops)), m, x)
    ours = _grads(lambda y: torchckpt.api.run(Recompute(save=ops), m, y, module=m), m, x)
    assert _same(sac, ours)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.n[str(func)] = self.n.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def _addmm_calls(policy: Recompute | None) -> int:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with _Count() as c:
        y = m(x) if policy is None else torchckpt.api.run(policy, m, x, module=m)
        y.sum().backward()
    return c.n.get("aten.addmm.default", 0)


def test_kept_ops_are_not_run_again() -> None:
    plain = _addmm_calls(None)
    assert _addmm_calls(Recompute()) > plain  # recomputed (up to the last tensor backward needs)
    assert _addmm_calls(Recompute(save={aten.addmm.default})) == plain  # handed back instead


def test_positions_name_the_same_ops_in_both_runs() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    seen: list[str] = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Names():
        m(x)
    positions = {i for i, n in enumerate(seen) if n == "aten.addmm.default"}
    assert len(positions) == 2
    ref = _grads(m, m, x)
    got = _grads(lambda y: torchckpt.api.run(Recompute(save=positions), m, y, module=m), m, x)
    assert _same(ref, got)


@pytest.mark.parametrize("cell", [nn.GRUCell, nn.LSTMCell])
def test_every_op_can_be_named(cell: type) -> None:
    """NOTE [ Selective recompute ] Rules 2 and 4: in-place ops are never kept, and outputs written later (dropout's
    empty_like that bernoulli_ fills; the RNN cells' matmul outputs, split with unsafe_chunk and written with no version
    bump) are dropped."""
    torch.manual_seed(0)
    m = nn.ModuleList([nn.Linear(16, 16), nn.Dropout(0.5), cell(16, 16)])

    def f(x: torch.Tensor) -> torch.Tensor:
        h = m[2](m[1](m[0](x)))
        return h[0] if isinstance(h, tuple) else h

    x = torch.randn(4, 16, requires_grad=True)
    ref = _grads(f, m, x)
    got = _grads(lambda y: torchckpt.api.run(Recompute(save=set(range(200))), f, y, module=m), m, x)
    assert _same(ref, got)


def test_a_kept_output_written_in_place_after_the_block_raises() -> None:
    """NOTE [ Selective recompute ] Rule 3: a kept matmul output that the block returns, modified by the caller before
    backward: a clear error (plain autograd raises too: GELU saved it), never a wrong gradient."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = lin1(x)
        return h, lin2(F.gelu(h))

    x = torch.randn(4, 16, requires_grad=True)
    h, y = f(x)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    h, y = torchckpt.api.run(Recompute(save={aten.addmm.default}), f, x)
    h.mul_(2)
    with pytest.raises(CheckpointError, match="modified in place.*leave that op out of save"):
        y.sum().backward()


def test_a_second_backward_raises() -> None:
    m = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    y = torchckpt.api.run(Recompute(save={aten.addmm.default}), m, x, module=m).sum()
    y.backward(retain_graph=True)
    with pytest.raises(CheckpointError, match="second backward"):
        y.backward()


@pytest.mark.parametrize("bad", ["mm", [aten.mm], [-1], [True], 3])
def test_save_is_checked(bad: object) -> None:
    with pytest.raises(TypeError, match=r"torchckpt: Recompute\(save=...\)"):
        Recompute(save=bad)  # type: ignore[arg-type]


def test_save_accepts_ops_and_positions() -> None:
    assert Recompute(save=[aten.mm.default, 3]).save == frozenset({aten.mm.default, 3})
    assert Recompute().save is None


def test_random_ops_are_never_kept() -> None:
    """NOTE [ Selective recompute ] Rule 2: keeping the first of two random ops would shift what the second draws in the
    recomputation."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def f(x: torch.Tensor) -> torch.Tensor:
        a = torch.native_dropout(lin1(x), 0.5, True)[0]
        return torch.tanh(torch.native_dropout(lin2(a), 0.5, True)[0])

    seen: list[str] = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func is not aten.detach.default:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 16, requires_grad=True)
    with torch.no_grad(), Names():
        f(x)
    first = seen.index("aten.native_dropout.default")
    torch.manual_seed(1)
    ref = torch.autograd.grad(f(x).sum(), [x, lin1.weight, lin2.weight])
    for save in ({first}, {aten.native_dropout.default}, set(range(len(seen)))):
        torch.manual_seed(1)
        got = torch.autograd.grad(torchckpt.api.run(Recompute(save=save), f, x).sum(), [x, lin1.weight, lin2.weight])
        assert _same(list(ref), list(got)), save


def _attention_calls(p: float, save: frozenset | None) -> tuple[int, bool]:
    """How many attention kernels a forward and backward ran, and whether the gradients were plain autograd's."""
    torch.manual_seed(0)
    m = Attn(p=0.3)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def f(y: torch.Tensor) -> torch.Tensor:  # attention with dropout_p=p, then the block's own dropout
        b, s, d = y.shape
        q, k, v = m.qkv(m.ln(y)).view(b, s, 3, m.h, d // m.h).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p)
        return m.drop(m.proj(a.transpose(1, 2).reshape(b, s, d)))

    def grads(g) -> list[torch.Tensor]:  # noqa: ANN001
        torch.manual_seed(7)
        return list(torch.autograd.grad(g(x).square().sum(), [x, m.qkv.weight, m.proj.weight]))

    ref = grads(f)
    with _Count() as c:
        got = grads(lambda y: torchckpt.api.run(Recompute(save=save), f, y))
    return sum(n for k, n in c.n.items() if "attention" in k and "backward" not in k), _same(ref, got)


def test_attention_without_dropout_is_kept() -> None:
    """NOTE [ Selective recompute ] Rule 2: an attention kernel's schema is seeded (for its dropout); with dropout_p=0
    it draws nothing, so it is kept, and the dropout after it draws the forward's mask again; with dropout_p>0 it runs again."""
    assert _attention_calls(0.0, None) == (2, True)  # forward, recomputation
    assert _attention_calls(0.0, ATTENTION) == (1, True)  # handed back
    op = aten._scaled_dot_product_flash_attention_for_cpu.default  # with dropout the CPU runs no fused kernel:
    q = torch.randn(1, 2, 8, 16)  # ask the rule itself
    out = op(q, q, q)
    assert keepable(op, (q, q, q), {}, out) and keepable(op, (q, q, q, 0.0), {}, out)
    assert not keepable(op, (q, q, q, 0.25), {}, out) and not keepable(op, (q, q, q), {"dropout_p": 0.25}, out)


def test_kept_outputs_are_compressed_with_recompute_codec() -> None:
    """Recompute(codec=...) compresses the kept outputs only: exact with a lossless codec, close with a lossy one
    (whose error the recomputation carries on), and the inputs go as the store sends them."""
    from torchckpt.codecs import Identity, TritonQuant
    from torchckpt.memory import HostPool

    torch.manual_seed(0)
    m = Attn(p=0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    ref = _grads(m, m, x)
    for codec, exact in ((Identity(), True), (TritonQuant(bits=8, mode="rel", bound=1e-2), False)):
        st = Store(device="cpu", min_bytes=0, gpu_bytes=0, host=HostPool(chunk_bytes=1 << 20, pin=False))
        got = _grads(lambda y: torchckpt.api.run(Recompute(save=MATMULS, store=st, codec=codec), m, y, module=m), m, x)
        stats = st.stats()
        assert stats.compressed == 4  # the four addmm outputs, not the block's input
        if exact:
            assert _same(ref, got)
        else:
            assert not _same(ref, got)
            assert all(torch.allclose(a, b, rtol=0.1, atol=0.05 * a.abs().max().item()) for a, b in zip(ref, got))


@pytest.mark.parametrize("kw, match", [
    ({"codec": "q4"}, "expects a torchckpt.codecs.Codec"),
    ({"codec_only": True}, "pass both"),
])
def test_recompute_codec_is_checked(kw: dict, match: str) -> None:
    from torchckpt.codecs import Identity

    args = {"codec": Identity()} if kw.pop("codec_only", False) else {**kw, "save": MATMULS, "store": Store(device="cpu")}
    with pytest.raises((TypeError, ValueError), match=match):
        Recompute(**args)
