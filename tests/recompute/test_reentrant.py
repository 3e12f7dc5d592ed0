"""NOTE [ Reentrant recompute ]: ``Recompute(reentrant=True)`` gives plain autograd's values, gradients and buffers
bit for bit, with arguments and results of any structure, ``torch.autograd.grad`` and second orders; falls back
where no input needs grad; raises where a gradient would be lost; holds no tensor of its own. The zoo's models run it too (tests/test_zoo.py,
``block_recompute_reentrant`` and ``hf_recompute_reentrant``)."""
from __future__ import annotations

import copy
import gc
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import assert_same_grads, cpu_store, grads
from torchckpt import CheckpointError, Recompute

REENTRANT = Recompute(reentrant=True)


class Block(nn.Module):
    """Linear, dropout, batch norm in training (writes its running statistics), GELU: the RNG and a buffer write."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.bn(self.drop(self.lin(x)))) + x


def _steps(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(10 + i)
        loss = model(x).pow(2).mean()
        loss.backward()
        out.append((loss.detach(), grads(model)))
        opt.step()
    return out


@pytest.mark.parametrize("store", [False, True])
def test_blocks_give_plain_autograd_bits_and_buffers(store: bool) -> None:
    """Two SGD steps, dropout drawing the same masks (the RNG restored), inputs on the device or through a store."""
    policy = Recompute(store=cpu_store(gpu_bytes=0), reentrant=True) if store else REENTRANT
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), *[Block() for _ in range(3)], nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    for b in list(model)[1:4]:
        torchckpt.checkpoint(b, policy=policy)
    x = torch.randn(32, 8)  # the first block's input requires grad through the first Linear
    got, want = _steps(model, x), _steps(ref, x)
    for (la, ga), (lb, gb) in zip(got, want):
        assert torch.equal(la, lb)
        assert_same_grads(ga, gb)
    for (n, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), n  # batch norm's statistics moved once a step


def test_arguments_and_results_of_any_structure() -> None:
    """Tensors in keyword arguments and nested containers get their gradients; the result's structure and
    non-tensor leaves are the forward's; integer tensors in the result need no gradient."""
    def f(pair: tuple[torch.Tensor, list[torch.Tensor]], scale: float, *, w: torch.Tensor) -> dict[str, Any]:
        a, (b,) = pair
        return {"y": (a * w).sin() + b, "n": 3, "rest": ((a.exp(), (a > 0).long()), "tag", scale * b.sum())}

    def make() -> list[torch.Tensor]:
        torch.manual_seed(1)
        return [torch.randn(6, requires_grad=True) for _ in range(3)]

    a, b, w = make()
    out = torchckpt.checkpoint(f, (a, [b]), 2.0, w=w, policy=REENTRANT)
    a2, b2, w2 = make()
    ref = f((a2, [b2]), 2.0, w=w2)
    assert out["n"] == 3 and out["rest"][1] == "tag" and out["rest"][0][1].dtype == torch.long
    assert torch.equal(out["rest"][0][1], ref["rest"][0][1]) and not out["rest"][0][1].requires_grad
    for o in (out, ref):
        (o["y"].sum() + o["rest"][0][0].sum() + o["rest"][2]).backward()
    for t, u in ((a, a2), (b, b2), (w, w2)):
        assert t.grad is not None and torch.equal(t.grad, u.grad)


def test_no_argument_needing_grad_still_gives_the_parameters_theirs() -> None:
    """The parameters are the node's inputs (Rule 2): a block on data that needs no grad gets plain autograd's
    gradients (torch's reentrant checkpoint gives none, with a warning)."""
    torch.manual_seed(2)
    block = Block()
    ref = copy.deepcopy(block)
    torchckpt.checkpoint(block, policy=REENTRANT)
    x = torch.randn(8, 16)  # requires no grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _steps(block, x)
    want = _steps(ref, x)
    for (la, ga), (lb, gb) in zip(got, want):
        assert torch.equal(la, lb)
        assert_same_grads(ga, gb)
    assert all(g is not None for g in got[0][1].values())


def test_autograd_grad_inputs_and_second_order_as_plain() -> None:
    """Rule 3: ``torch.autograd.grad`` (no ``.grad`` touched), ``backward(inputs=...)`` and a second order through
    the node give plain autograd's bits (torch's reentrant checkpoint raises on the first two)."""
    torch.manual_seed(3)
    lin = nn.Linear(5, 5)
    ref = copy.deepcopy(lin)
    torchckpt.checkpoint(lin, policy=REENTRANT)
    x = torch.randn(2, 5, requires_grad=True)
    gx, gw = torch.autograd.grad(lin(x).tanh().sum(), (x, lin.weight))
    rx, rw = torch.autograd.grad(ref(x).tanh().sum(), (x, ref.weight))
    assert torch.equal(gx, rx) and torch.equal(gw, rw) and lin.weight.grad is None
    lin(x).tanh().sum().backward(inputs=[lin.bias])
    ref(x).tanh().sum().backward(inputs=[ref.bias])
    assert torch.equal(lin.bias.grad, ref.bias.grad) and lin.weight.grad is None and x.grad is None
    (g2,) = torch.autograd.grad(lin(x).tanh().sum(), x, create_graph=True)
    (r2,) = torch.autograd.grad(ref(x).tanh().sum(), x, create_graph=True)
    assert torch.equal(torch.autograd.grad(g2.sum(), x)[0], torch.autograd.grad(r2.sum(), x)[0])


@pytest.mark.parametrize("twice", [False, True])
def test_second_order_through_a_nonlinear_block_as_plain(twice: bool) -> None:
    """Rule 7: a Hessian-vector product through a block with a nonlinearity inside it, the block's input computed
    by a layer before it (and passed twice: each use's gradient): the first order bit for bit, the second within
    float32 rounding (its graph sums in another order); with detached inputs it differed by 0.22."""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.lin(a).tanh() * b.sigmoid()

    pre, blk = nn.Linear(8, 8), Two()
    rpre, rblk = copy.deepcopy(pre), copy.deepcopy(blk)
    torchckpt.checkpoint(blk, policy=REENTRANT)
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.randn(4, 8, requires_grad=True)

    def run(p: nn.Module, b: nn.Module) -> tuple[torch.Tensor, ...]:
        h = p(x)
        out = b(h, h) if twice else b(h, y)
        g = torch.autograd.grad(out.square().sum(), (x, p.weight, b.lin.weight), create_graph=True)
        return (*g, *torch.autograd.grad(sum(t.sum() for t in g), (x, y, p.weight, b.lin.weight), allow_unused=True))

    got, want = run(pre, blk), run(rpre, rblk)
    for a, r in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, r)
    for a, r in zip(got[3:], want[3:], strict=True):
        assert (a is None and r is None) or torch.allclose(a, r, rtol=1e-5, atol=1e-6), (a - r).abs().max()


def test_autocast_reads_the_input_as_plain_autograd_does() -> None:
    """Rule 8: under bf16 autocast, a block whose input (a previous layer's output) feeds three linears: plain
    autograd casts it once per linear and sums their gradients in float32; a recomputation from a detached leaf
    had autocast cache one cast for all three and summed in bfloat16 (BERT's layers off by up to 1.5e-5)."""
    torch.manual_seed(0)

    class Qkv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return (self.q(h) * self.k(h)).tanh() + self.v(h)

    pre, blk = nn.Linear(32, 32), Qkv()
    rpre, rblk = copy.deepcopy(pre), copy.deepcopy(blk)
    torchckpt.checkpoint(blk, policy=REENTRANT)
    x = torch.randn(16, 32)
    got, want = [], []
    for p, b, out in ((pre, blk, got), (rpre, rblk, want)):
        h = p(x)  # float32, as BERT's embeddings after their layer norm
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = b(h).float().square().sum()
        loss.backward()
        out += [t.grad for t in (*p.parameters(), *b.parameters())]
    for a, r in zip(got, want, strict=True):
        assert torch.equal(a, r), (a - r).abs().max()


@pytest.mark.parametrize("graph", [False, True])
def test_autocast_reads_a_leaf_input_as_plain_autograd_does(graph: bool) -> None:
    """Rule 8, the other side: an input that is a leaf requiring grad (fed straight in) has one cached cast in plain
    autograd; so in the recomputation, with and without ``create_graph`` (Rule 7)."""
    torch.manual_seed(0)
    blk = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])
    ref = copy.deepcopy(blk)

    def f(m: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
        return (m[0](h) * m[1](h)).tanh() + m[2](h)

    x = torch.randn(16, 32, requires_grad=True)
    got, want = [], []
    for m, out, wrap in ((blk, got, True), (ref, want, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torchckpt.api.run(REENTRANT, lambda h, m=m: f(m, h), x, module=m) if wrap else f(m, x)
            loss = y.float().square().sum()
        out += torch.autograd.grad(loss, (x, *m.parameters()), create_graph=graph)
    for a, r in zip(got, want, strict=True):
        assert torch.equal(a, r), (a - r).abs().max()


def test_a_tensor_outside_the_nodes_inputs_raises_rather_than_no_gradient() -> None:
    """Rule 4: a closure's tensor that needs grad would get none: backward raises, naming it."""
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    y = torchckpt.checkpoint(lambda t: (t * w).sin(), x, policy=REENTRANT)
    with pytest.raises(CheckpointError, match=r"neither its arguments nor its module's parameters \(shapes \(4,\)\)"):
        y.sum().backward()


def test_a_recomputation_with_another_structure_raises() -> None:
    calls = []

    def f(x: torch.Tensor) -> Any:
        calls.append(1)
        return x.sin() if len(calls) == 1 else (x.sin(), x.cos())

    x = torch.randn(3, requires_grad=True)
    y = torchckpt.checkpoint(f, x, policy=REENTRANT)
    with pytest.raises(CheckpointError, match="same structure"):
        y.sum().backward()


def test_inputs_go_to_the_store_and_nothing_is_held() -> None:
    """The node's saved arguments go through the store's hooks (Rule 4); the result is the caller's to free."""
    store = cpu_store(gpu_bytes=0)
    x = torch.randn(64, 16, requires_grad=True)
    lin = nn.Linear(16, 16)
    x2, lin2 = x.detach().clone().requires_grad_(), copy.deepcopy(lin)
    torchckpt.checkpoint(lin, policy=Recompute(store=store, reentrant=True))
    y = lin(x)
    z = y * 2.0  # saves no tensor of y
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None
    assert store.stats().packed > 0
    z.sum().backward()
    (lin2(x2) * 2.0).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(lin.weight.grad, lin2.weight.grad)


@pytest.mark.parametrize("kw", [dict(save={torch.ops.aten.mm.default}), dict(parts=(1,)),
                                dict(determinism_check="none"), dict(debug=True)])
def test_settings_that_need_the_non_reentrant_frame_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"^torchckpt: Recompute\(reentrant=True\)"):
        Recompute(reentrant=True, **kw)


def test_reentrant_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="reentrant"):
        Recompute(reentrant="yes")  # type: ignore[arg-type]


def test_every_floating_output_requires_grad() -> None:
    """Rule 6: a floating output computed from tensors that need no grad requires grad through the node (plain
    autograd says it does not); its gradient is zero, the others' are plain autograd's."""
    mask = torch.rand(4)
    x = torch.randn(4, requires_grad=True)
    y, m = torchckpt.checkpoint(lambda t: (t.sin(), mask * 2), x, policy=REENTRANT)
    assert m.requires_grad and torch.equal(m, mask * 2)
    (y.sum() + m.sum()).backward()
    assert torch.equal(x.grad, x.detach().cos())


def test_under_autocast_as_plain() -> None:
    """The recomputation runs under the autocast the forward ran under (``ForwardState``): bf16 on the CPU, bit for bit."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    for b in list(model)[1:3]:
        torchckpt.checkpoint(b, policy=REENTRANT)
    x = torch.randn(16, 8)
    out = []
    for m in (model, ref):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        out.append((loss.detach(), grads(m)))
    assert torch.equal(out[0][0], out[1][0])
    assert_same_grads(out[0][1], out[1][1])


def test_the_nodes_parameters_are_the_modules_needing_grad_each_once() -> None:
    """Rule 2's parameters: ``module.parameters()``'s that require grad, in its order, a shared one once."""
    from torchckpt.recompute.reentrant import _params

    shared = nn.Linear(3, 3)
    m = nn.Sequential(nn.Linear(3, 3), nn.Sequential(shared, nn.ReLU(), shared), nn.LayerNorm(3))
    m[0].bias.requires_grad_(False)
    m.register_parameter("extra", None)
    assert _params(m) == [p for p in m.parameters() if p.requires_grad]
    assert len(_params(m)) == 5  # m[0].weight, shared's two, the norm's two


def test_a_block_returning_its_input_or_taking_one_tensor_twice() -> None:
    x = torch.randn(3, requires_grad=True)
    y, z = torchckpt.checkpoint(lambda t: (t, t.sin()), x, policy=REENTRANT)
    (y * 2 + z).sum().backward()
    x2 = x.detach().requires_grad_()
    (x2 * 2 + x2.sin()).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    x.grad = None
    torchckpt.checkpoint(lambda a, b: a * b, x, x, policy=REENTRANT).sum().backward()
    assert torch.equal(x.grad, x.detach() + x.detach())
