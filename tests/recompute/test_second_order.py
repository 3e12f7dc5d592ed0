"""Second orders through recomputed blocks (NOTE [ Reentrant recompute ] Rule 7), drawn by hypothesis: random
blocks of elementwise nonlinearities, products and a matmul, inputs computed by a layer before them (passed once
or twice); the Hessian-vector product ``d/dx <grad_x L, v>`` through the block under ``Recompute()`` and
``Recompute(reentrant=True)`` against plain autograd's. ``Recompute()`` replays the forward's own graph: the
first order bit for bit, the second within rounding; reentrant's second order sums in another order: within
rounding too. Before Rule 7, reentrant lost every term through the block's nonlinearity."""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchckpt
from torchckpt import Recompute

UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "softplus": nn.functional.softplus, "sin": torch.sin,
    "square": torch.square, "gelu": nn.functional.gelu,
}


class Block(nn.Module):
    def __init__(self, ops: list[tuple[str, int]], d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=torch.float64)
        self.ops = ops

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = self.lin(a)
        for name, mix in self.ops:
            h = UNARY[name](h)
            if mix == 1:
                h = h * b
            elif mix == 2:
                h = h + b.tanh() * h
        return h


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(sorted(UNARY)), st.integers(0, 2)), min_size=1, max_size=4),
       twice=st.booleans(), reentrant=st.booleans(), seed=st.integers(0, 2**16))
def test_hessian_vector_products_through_recomputed_blocks(ops: list[tuple[str, int]], twice: bool, reentrant: bool,
                                                           seed: int) -> None:
    torch.manual_seed(seed)
    d = 6
    pre, blk = nn.Linear(d, d, dtype=torch.float64), Block(ops, d)
    rpre, rblk = copy.deepcopy(pre), copy.deepcopy(blk)
    torchckpt.checkpoint(blk, policy=Recompute(reentrant=reentrant))
    x = torch.randn(3, d, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, d, dtype=torch.float64)

    def run(p: nn.Module, b: nn.Module) -> list[torch.Tensor | None]:
        h = p(x)
        out = b(h, h) if twice else b(h, y)
        gx, gw = torch.autograd.grad(out.square().sum(), (x, b.lin.weight), create_graph=True)
        second = torch.autograd.grad((gx * v).sum() + gw.sum(), (x, y, p.weight, b.lin.weight), allow_unused=True)
        return [gx.detach(), gw.detach(), *second]

    got, want = run(pre, blk), run(rpre, rblk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the first order bit for bit
    for a, r in zip(got[2:], want[2:], strict=True):
        if a is None or r is None:  # y unused when the input is passed twice
            assert a is None and r is None or (a is None and not r.abs().any()) or (r is None and not a.abs().any())
            continue
        assert torch.allclose(a, r, rtol=1e-9, atol=1e-11), (ops, twice, reentrant, (a - r).abs().max())
