"""checkpointed_scan against the plain unrolled loop, bit for bit (NOTE [ Checkpointed loop ] Rule 4).

Each case builds its tensors twice from one seed, runs the step as a plain Python loop (``ys`` stacked with
``torch.stack``) and through ``checkpointed_scan``, and compares the carry, the stacked outputs and the gradients
with respect to the initial carry, ``xs`` and the tensors the step reads from outside.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ckpt_models import small_pool
from torchckpt import CheckpointError, Store, checkpointed_loop, checkpointed_scan
from torchckpt.schedules import Multistage, Revolve, Tier, ZCut

D = torch.float64


def plain_scan(step: Callable[..., Any], init: Any, xs: Any, n: int, index: bool = False) -> tuple[Any, Any]:
    carry, ys = init, []
    for k in range(n):
        x = tree_map(lambda t: t[k], xs) if xs is not None else None
        carry, y = step(carry, x, k) if index else step(carry, x)
        ys.append(y)
    return carry, (tree_map(lambda *ts: torch.stack(ts), *ys) if ys[0] is not None else None)


def loss_of(carry: Any, ys: Any) -> torch.Tensor:
    torch.manual_seed(123)  # the same weights on both sides
    total = torch.zeros((), dtype=D)
    for t in tree_flatten((carry, ys))[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            total = total + (t * torch.randn(t.shape, dtype=t.dtype)).sum()
    return total


def assert_same(a: Any, b: Any) -> None:
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    assert len(fa) == len(fb)
    for i, (x, y) in enumerate(zip(fa, fb)):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), f"leaf {i}: {x!r} vs {y!r}"
            assert x.shape == y.shape and x.dtype == y.dtype, f"leaf {i}"
            assert torch.equal(x, y), f"leaf {i}: max diff {(x - y).abs().max().item()}"
        else:
            assert x == y, f"leaf {i}"


def check(build: Callable[[], tuple[Callable[..., Any], Any, Any, list[torch.Tensor]]], n: int,
          index: bool = False, **kw: Any) -> None:
    """``build()`` -> (step, init, xs, leaves to differentiate): plain and scanned must agree bit for bit."""
    torch.manual_seed(0)
    step, init, xs, leaves = build()
    c_ref, y_ref = plain_scan(step, init, xs, n, index)
    g_ref = torch.autograd.grad(loss_of(c_ref, y_ref), leaves, allow_unused=True)
    torch.manual_seed(0)
    step, init, xs, leaves = build()
    c, y = checkpointed_scan(step, init, xs, length=n if xs is None else None, index=index,
                             store=Store("cpu", host=small_pool()), **kw)
    assert_same((c_ref, y_ref), (c, y))
    g = torch.autograd.grad(loss_of(c, y), leaves, allow_unused=True)
    assert_same([t for t in g_ref], [t for t in g])


def wave(nx: int = 16) -> tuple[Callable[..., Any], Any, Any, list[torch.Tensor]]:
    """A 1D wave equation: the carry is (u_prev, u), xs a source wavelet, y the traces at two receivers."""
    c = (0.3 + 0.1 * torch.rand(nx, dtype=D)).requires_grad_()
    u0 = torch.zeros(nx, dtype=D, requires_grad=True)
    src = torch.randn(12, dtype=D, requires_grad=True)

    def step(carry: tuple[torch.Tensor, torch.Tensor], s: torch.Tensor) -> tuple[Any, torch.Tensor]:
        prev, u = carry
        lap = torch.roll(u, 1) - 2 * u + torch.roll(u, -1)
        nxt = 2 * u - prev + c * c * lap
        nxt = nxt + torch.nn.functional.one_hot(torch.tensor(3), nx).to(D) * s
        return (u, nxt), nxt[[5, 11]]

    return step, (u0, u0 * 1.0), src, [c, u0, src]


@pytest.mark.parametrize("schedule", [None, Revolve(12, 3), Revolve(12, 3, tier=Tier.HOST), ZCut(12, tier=Tier.HOST),
                                      Multistage(12, gpu_slots=1, host_slots=2)], ids=str)
def test_wave_traces_and_gradients_equal_plain_autograd(schedule: Any) -> None:
    kw = {} if schedule is None else {"schedule": schedule}
    check(wave, 12, **kw)


def test_dict_carry_no_xs_and_index() -> None:
    def build() -> tuple[Callable[..., Any], Any, Any, list[torch.Tensor]]:
        w = torch.randn(4, 4, dtype=D, requires_grad=True)
        x0 = torch.randn(4, dtype=D, requires_grad=True)

        def step(carry: dict[str, torch.Tensor], x: None, k: int) -> tuple[dict[str, torch.Tensor], Any]:
            assert x is None and isinstance(k, int)
            h = torch.tanh(w @ carry["h"]) * (1 + 0.1 * k)  # the index as a Python number: no tensor, no sync
            return {"h": h, "acc": carry["acc"] + h.sum()}, {"h": h, "k2": h * k}

        return step, {"h": x0, "acc": torch.zeros((), dtype=D)}, None, [w, x0]

    check(build, 9, index=True, schedule=Revolve(9, 2))


def test_no_outputs_and_length_one() -> None:
    def build() -> tuple[Callable[..., Any], Any, Any, list[torch.Tensor]]:
        w = torch.randn(3, dtype=D, requires_grad=True)
        xs = torch.randn(1, 3, dtype=D, requires_grad=True)
        return (lambda c, x: (torch.sin(c * w + x), None)), torch.ones(3, dtype=D, requires_grad=True), xs, [w, xs]

    check(build, 1)


def test_module_step_and_tuple_xs() -> None:
    def build() -> tuple[Callable[..., Any], Any, Any, list[torch.Tensor]]:
        cell = nn.GRUCell(5, 7).to(D)
        xs = (torch.randn(6, 2, 5, dtype=D, requires_grad=True), torch.randn(6, 2, 7, dtype=D))

        class Step(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.cell = cell

            def forward(self, h: torch.Tensor, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
                h = self.cell(x[0], h) + 0.01 * x[1]
                return h, h.mean(-1)

        h0 = torch.zeros(2, 7, dtype=D, requires_grad=True)
        return Step(), h0, xs, [*cell.parameters(), h0, xs[0]]

    check(build, 6, schedule=Revolve(6, 2, tier=Tier.HOST))


def test_non_tensor_context_passes_through() -> None:
    seen: list[Any] = []

    def build() -> tuple[Callable[..., Any], Any, Any, list[torch.Tensor]]:
        w = torch.tensor(0.7, dtype=D, requires_grad=True)

        def step(carry: tuple[torch.Tensor, dict[str, Any]], x: torch.Tensor) -> tuple[Any, torch.Tensor]:
            u, meta = carry
            seen.append(meta["name"])
            return (torch.sin(w * u + x * meta["gain"]), meta), u.sum()

        meta = {"name": "shot-3", "gain": 0.5, "order": None}
        return step, (torch.ones(4, dtype=D, requires_grad=True), meta), torch.randn(8, 4, dtype=D), [w]

    check(build, 8, schedule=Revolve(8, 2))
    assert set(seen) == {"shot-3"}


def test_scan_without_grad_and_without_anything_to_differentiate() -> None:
    step, init, xs, _ = wave()
    ref_c, ref_y = plain_scan(step, init, xs, 12)
    with torch.no_grad():
        c, y = checkpointed_scan(step, init, xs, store=Store("cpu"))
    assert_same((ref_c, ref_y), (c, y))
    plain_step = lambda u, x: (u * 0.5 + x, u.sum())  # noqa: E731 - nothing requires grad
    u0, xs2 = torch.ones(3), torch.randn(5, 3)
    assert_same(plain_scan(plain_step, u0, xs2, 5), checkpointed_scan(plain_step, u0, xs2, store=Store("cpu")))


def test_the_loop_is_the_scan_without_xs_and_ys() -> None:
    w = torch.tensor(0.9, dtype=D, requires_grad=True)
    x0 = torch.ones(3, dtype=D, requires_grad=True)
    a = checkpointed_loop(lambda x: torch.sin(w * x), x0, 20, schedule=Revolve(20, 3), store=Store("cpu"))
    b, ys = checkpointed_scan(lambda x, _: (torch.sin(w * x), None), x0, length=20, schedule=Revolve(20, 3),
                              store=Store("cpu"))
    assert ys is None and torch.equal(a, b)
    assert all(torch.equal(u, v) for u, v in zip(torch.autograd.grad(a.sum(), [w, x0]),
                                                  torch.autograd.grad(b.sum(), [w, x0])))


@pytest.mark.parametrize("call, match", [
    (lambda: checkpointed_scan(lambda c, x: c, torch.ones(2, requires_grad=True), length=3), "must return a pair"),
    (lambda: checkpointed_scan(lambda c, x: (c[:1], None), torch.ones(2, requires_grad=True), length=3),
     "shapes and dtypes"),
    (lambda: checkpointed_scan(lambda c, x: ((c[0], {"n": c[1]["n"] + 1}), None),
                               (torch.ones(2, requires_grad=True), {"n": 0}), length=3), "non-tensor part"),
    (lambda: checkpointed_scan(lambda c, x: (c, 3), torch.ones(2, requires_grad=True), length=3), "y as a tensor"),
    (lambda: checkpointed_scan(lambda c, x: (c, None), torch.ones(2)), "xs=... .* or length="),
    (lambda: checkpointed_scan(lambda c, x: (c, None), torch.ones(2), (torch.ones(3), torch.ones(4))),
     "share their first dimension"),
    (lambda: checkpointed_scan(lambda c, x: (c, None), torch.ones(2), torch.ones(3, 2), length=4), "length=4"),
    (lambda: checkpointed_scan(lambda c, x: (c, None), {"name": "x"}, length=2), "at least one tensor"),
    (lambda: checkpointed_scan(lambda c, x: (c, None), torch.ones(2), length=3, schedule=Revolve(4, 2)),
     "schedule is for 4 steps"),
])
def test_bad_input_is_refused(call: Callable[[], Any], match: str) -> None:
    with pytest.raises((CheckpointError, TypeError, ValueError), match=match):
        call()


@pytest.mark.parametrize("schedule", [Revolve(7, 2), Revolve(7, 3, tier=Tier.HOST), ZCut(7, tier=Tier.HOST)], ids=str)
def test_one_tensor_in_two_places_of_a_state_stays_one(schedule: Any) -> None:
    """NOTE [ Checkpointed loop ] Rule 5: a step returning ``(v, v)`` (and an initial ``(u0, u0)``): every step sees one
    tensor in two places, also after a restore from a snapshot, as in the plain loop."""
    def build() -> tuple[Callable[..., Any], Any, Any, list[torch.Tensor]]:
        w = torch.randn(3, dtype=D, requires_grad=True)
        u0 = torch.randn(3, dtype=D, requires_grad=True)

        def step(c: tuple[torch.Tensor, torch.Tensor], x: None) -> tuple[Any, torch.Tensor]:
            a, b = c
            v = torch.sin(a * w) + torch.cos(b) * a + b * b
            return (v, v), a * b

        return step, (u0, u0), None, [w, u0]

    def loss_first(carry: Any, ys: Any) -> torch.Tensor:  # the final carry's two places are one tensor: use it once
        torch.manual_seed(5)
        return (carry[0] * torch.randn(3, dtype=D)).sum() + (ys * torch.randn(ys.shape, dtype=D)).sum()

    torch.manual_seed(0)
    step, init, _, leaves = build()
    c_ref, y_ref = plain_scan(step, init, None, 7)
    g_ref = torch.autograd.grad(loss_first(c_ref, y_ref), leaves)
    torch.manual_seed(0)
    step, init, _, leaves = build()
    c, y = checkpointed_scan(step, init, length=7, schedule=schedule, store=Store("cpu", host=small_pool()))
    assert_same(y_ref, y)
    assert all(torch.equal(a, b) for a, b in zip(g_ref, torch.autograd.grad(loss_first(c, y), leaves)))


def test_captured_tensors_returned_as_y() -> None:
    """NOTE [ Checkpointed loop ] Rule 4: captured tensors returned as y leaves as they are, one of them twice and one
    computed before the scan from the other (swapped in recorded steps): values and gradients as the plain loop's."""
    def build() -> tuple[Callable[..., Any], Any, Any, list[torch.Tensor]]:
        w = torch.randn(4, dtype=D, requires_grad=True)
        w2 = w * 2  # read by the step too: a descendant of another captured tensor

        def step(c: torch.Tensor, x: None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            return torch.sin(c * w) + w2, (w, w2, w, c * 1.0)

        return step, torch.randn(4, dtype=D, requires_grad=True), None, [w]

    check(build, 6, schedule=Revolve(6, 2))
